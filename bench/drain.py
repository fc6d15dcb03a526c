#!/usr/bin/env python3
"""`ferry drain` and `ferry upgrade` across lab hosts (issue 33).

Four lab hosts on a 1 Gbit tbf link, an agent on each (mutual TLS, the
embedded registry). For each concurrency C (--concurrency, default 1,2,4),
run by run: 8 VMs x 1 GiB of mixed dirtiness start on ferry-h1 through its
agent (two each of: idle; 256 MiB of random data, then idle; computing and
dirtying 32 MiB/s over 128 MiB; dirtying 128 MiB/s over 256 MiB), settle,
and `ferry drain ferry-h1 --per-host C --in-fleet C` moves them to the other
three hosts; then they are stopped.

Figures per run: the drain's total time; the link's limit, i.e. the bytes
that had to cross (each VM's first round: its memory as its move began) at
the link's rate; their ratio; the VMs' downtimes (p50 and p99 over every VM
of every run of C); bytes sent in all (re-sends of dirtied pages included).

Then, --upgrade-runs times (default: --runs): 8 VMs on ferry-h2 and
`ferry upgrade ferry-h2` (each VM handed to a new VMM process): total time,
the largest downtime of the run (the median over runs is reported), every
VM's downtime, bytes copied.

Results: bench/results/NAME.{json,md,png} (--results, default drain; the plot by
bench/drain_plot.py, when matplotlib is installed).
`--concurrency none` runs only the upgrade; `--agent-env K=V` starts the
agents (and so every VMM) with K=V in their environment, to compare a
setting such as FERRY_HANDOVER_PRIORITY=normal.

Usage: python3 bench/drain.py [--runs 3] [--concurrency 1,2,4] [--vms 8] [--mem 1G]
       [--upgrade-runs N] [--results NAME] [--agent-env K=V]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK_BPS = 1e9
WORKLOADS = [
    ("idle", "idle", 1),
    ("random", "fill:content=worst,mib=256", 1),
    ("dirty32", "compute+dirty:rate=32,wss=128", 1),
    ("dirty128", "dirty:rate=128,wss=256,pattern=random", 1),
]


def op(ferry, registry, *args, timeout=600):
    """`ferry ARGS --registry R --json` as the operator on ferry-h4."""
    out = subprocess.run(benchlib.in_host("ferry-h4", ferry, *args, "--registry", registry, "--json"),
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"ferry {' '.join(args)}: {out.stderr.strip()[-400:]} {out.stdout[-400:]}")
    return json.loads(out.stdout) if out.stdout.strip() else None


def start_agents(ferry, registry, state, hosts, mem, env=None):
    procs = []
    for n in range(1, hosts + 1):
        host = f"ferry-h{n}"
        p = subprocess.Popen(benchlib.in_host(host, ferry, "agent", "--name", host, "--listen", f"10.77.0.{n}:7700",
                                              "--registry", registry, "--mem", mem, "--vcpus", "32",
                                              "--link", "1gbit", "--state-dir", f"{state}/{host}", "--json"),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, **(env or {})})
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent of {host} did not start")
        procs.append(p)
    return procs


def start_vms(ferry, registry, host, count, mem, tag):
    names = []
    for i in range(count):
        kind, workload, vcpus = WORKLOADS[i % len(WORKLOADS)]
        name = f"{tag}-{kind}-{i}"
        op(ferry, registry, "vm", "start", name, "--host", host, "--mem", mem, "--vcpus", str(vcpus),
           "--workload", workload)
        names.append(name)
    return names


def stop_all(ferry, registry):
    listing = op(ferry, registry, "vm", "list") or []
    for h in listing:
        for vm in h.get("host", {}).get("vms", []):
            try:
                op(ferry, registry, "vm", "stop", vm["spec"]["name"])
            except RuntimeError as e:
                print(f"stop {vm['spec']['name']}: {e}", file=sys.stderr)


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--settle", type=float, default=6.0)
    ap.add_argument("--upgrade-runs", type=int, default=None)
    ap.add_argument("--results", default="drain")
    ap.add_argument("--agent-env", action="append", default=[])
    ap.add_argument("--drain-arg", action="append", default=[],
                    help="an extra flag for ferry drain (e.g. --no-safety-net)")
    a = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in a.agent_env)
    concurrency = [] if a.concurrency == "none" else [int(x) for x in a.concurrency.split(",")]
    upgrade_runs = a.runs if a.upgrade_runs is None else a.upgrade_runs
    ferry = os.path.abspath(a.ferry)
    benchlib.lab_up(ferry, 4, "1gbit")
    state = tempfile.mkdtemp(prefix="ferry-drain-bench-")
    registry = f"dir:{state}/registry"
    agents = []
    cells, upgrade, errors = [], None, []
    try:
        agents = start_agents(ferry, registry, state, 4, "12G", env)
        for c in concurrency:
            runs = []
            for r in range(a.runs):
                try:
                    start_vms(ferry, registry, "ferry-h1", a.vms, a.mem, f"c{c}r{r}")
                    time.sleep(a.settle)
                    t = time.time()
                    rep = op(ferry, registry, "drain", "ferry-h1", "--per-host", str(c), "--in-fleet", str(c),
                             *a.drain_arg)
                    wall = time.time() - t
                    moves = rep["moves"]
                    if not all(m["state"] == "done" for m in moves):
                        raise RuntimeError(f"not emptied: {rep}")
                    must = sum(m["first_round_bytes"] or 0 for m in moves)
                    limit = must * 8 / LINK_BPS
                    run = {"secs": rep["secs"], "emptied_s": rep.get("emptied_secs"), "wall_s": wall,
                           "must_move_bytes": must,
                           "handed_over": sum(1 for m in moves if m.get("handed_over")),
                           "sent_bytes": sum(m["bytes"] for m in moves), "limit_s": limit,
                           "standby_bytes": sum(m.get("standby_bytes", 0) for m in moves),
                           "ratio": rep["secs"] / limit if limit else None,
                           "downtimes_ms": [m["downtime_ms"] for m in moves],
                           "postcopy": sum(1 for m in moves if m["postcopy"]),
                           "moves": [{k: m[k] for k in ("vm", "to", "secs", "bytes", "first_round_bytes",
                                                        "downtime_ms", "postcopy")} for m in moves]}
                    for mv, m in zip(run["moves"], moves):
                        mv["handed_over"] = m.get("handed_over", False)
                        mv["standby_bytes"] = m.get("standby_bytes", 0)
                        mv["ready_s"] = m.get("ready_secs")
                    runs.append(run)
                    print(f"concurrency {c} run {r + 1}: {rep['secs']:.1f} s, limit {limit:.1f} s, "
                          f"ratio {run['ratio']:.2f}", file=sys.stderr, flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    errors.append(f"concurrency {c} run {r + 1}: {e}")
                    print(errors[-1], file=sys.stderr, flush=True)
                finally:
                    stop_all(ferry, registry)
            if runs:
                downs = [d for run in runs for d in run["downtimes_ms"]]
                cells.append({
                    "concurrency": c, "runs": runs,
                    "secs": statistics.median(r["secs"] for r in runs),
                    "emptied_s": statistics.median(r["emptied_s"] or r["secs"] for r in runs),
                    "handed_over": sum(r["handed_over"] for r in runs),
                    "limit_s": statistics.median(r["limit_s"] for r in runs),
                    "ratio": statistics.median(r["ratio"] for r in runs),
                    "downtime_p50_ms": pct(downs, 50), "downtime_p99_ms": pct(downs, 99),
                    "sent_gib": statistics.median(r["sent_bytes"] for r in runs) / 2**30,
                    "standby_gib": statistics.median(r.get("standby_bytes", 0) for r in runs) / 2**30,
                    "postcopy": sum(r["postcopy"] for r in runs),
                })
        # Upgrade: every VM of a host handed to a new VMM process.
        ups = []
        for r in range(upgrade_runs):
            try:
                start_vms(ferry, registry, "ferry-h2", a.vms, a.mem, f"up{r}")
                time.sleep(a.settle)
                t = time.time()
                rep = op(ferry, registry, "upgrade", "ferry-h2")
                wall = time.time() - t
                vms = rep["vms"]
                up = {"vms": len(vms), "secs": wall,
                      "max_downtime_ms": max(v["downtime_ms"] or 0 for v in vms),
                      "downtimes_ms": [v["downtime_ms"] for v in vms],
                      "copied_bytes": sum(v["copied_bytes"] for v in vms),
                      "failed": [v for v in vms if v["error"]],
                      # each VM's handover parts, to explain an outlier
                      "handovers": [v.get("handover") for v in vms]}
                ups.append(up)
                print(f"upgrade run {r + 1}: largest downtime {up['max_downtime_ms']:.2f} ms",
                      file=sys.stderr, flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors.append(f"upgrade run {r + 1}: {e}")
            finally:
                stop_all(ferry, registry)
        if ups:
            downs = [d for u in ups for d in u["downtimes_ms"] if d is not None]
            upgrade = {"runs": ups, "vms": ups[0]["vms"],
                       "secs": statistics.median(u["secs"] for u in ups),
                       "max_downtime_ms": statistics.median(u["max_downtime_ms"] for u in ups),
                       "max_downtimes_ms": [u["max_downtime_ms"] for u in ups],
                       "downtime_p50_ms": pct(downs, 50),
                       "copied_bytes": sum(u["copied_bytes"] for u in ups),
                       "failed": [f for u in ups for f in u["failed"]]}
    finally:
        for p in agents:
            p.kill()
            p.wait()
        subprocess.run(["pkill", "-f", state])
        benchlib.sh(ferry, "lab", "down", check=False)
        shutil.rmtree(state, ignore_errors=True)
    out = os.path.join(ROOT, "bench/results")
    command = benchlib.recorded_command("drain.py")
    benchlib.write_json(os.path.join(out, f"{a.results}.json"),
                        {"command": command, "agent_env": env, "cells": cells, "upgrade": upgrade,
                         "errors": errors}, indent=1)
    lines = ["# Draining a host, and upgrading one in place", "",
             f"Command: `{command}` (4 lab hosts on a 1 Gbit tbf link, an agent on each; {a.vms} VMs x {a.mem} "
             "on ferry-h1, two each of: idle, 256 MiB random then idle, compute + dirty 32 MiB/s over 128 MiB, "
             f"dirty 128 MiB/s over 256 MiB; medians of {a.runs})"
             + (f"; agents and VMMs started with {' '.join(a.agent_env)}" if env else "")
             + (f"; drains run with {' '.join(a.drain_arg)}" if a.drain_arg else "") + ".", "",
             "The limit: the bytes that had to cross (each VM's first round) at 1 Gbit/s. Downtime percentiles "
             "over every VM of every run.", "",
             "drain s: until every VM runs whole at its destination; host empty s: until the last move out of "
             "ferry-h1 ended (a source that handed its move to its standby waits for it to finish, as its "
             "backup; the drain then waits for the standby's process to end).", "",
             "| concurrency | drain s | host empty s | limit s | drain / limit | downtime p50 ms | downtime p99 ms | sent GiB | to standbys GiB | finished by postcopy | of them by their standby |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['concurrency']} | {c['secs']:.1f} | {c.get('emptied_s', c['secs']):.1f} | "
                     f"{c['limit_s']:.1f} | {c['ratio']:.2f}x | "
                     f"{c['downtime_p50_ms']:.1f} | {c['downtime_p99_ms']:.1f} | {c['sent_gib']:.2f} | "
                     f"{c.get('standby_gib', 0):.2f} | {c['postcopy']} | {c.get('handed_over', 0)} |")
    if upgrade:
        runs = len(upgrade["runs"])
        lines += ["", f"`ferry upgrade` of {upgrade['vms']} VMs, {runs} runs: {upgrade['secs']:.2f} s in all "
                  f"(median), largest downtime of a run {upgrade['max_downtime_ms']:.2f} ms (median; each run: "
                  f"{', '.join(f'{x:.2f}' for x in upgrade['max_downtimes_ms'])}), downtime p50 over every VM "
                  f"{upgrade['downtime_p50_ms']:.2f} ms, {upgrade['copied_bytes']} bytes of guest memory copied, "
                  f"{len(upgrade['failed'])} failed."]
    lines += benchlib.error_lines(errors)
    if cells or upgrade:
        import drain_plot
        if drain_plot.plot(a.results):
            lines += ["", f"![drain time, downtime and upgrade downtime]({a.results}.png)"]
    benchlib.write_md(os.path.join(out, f"{a.results}.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
