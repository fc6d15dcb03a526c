#!/usr/bin/env python3
"""Postcopy benchmark: postcopy migrations between two lab hosts (network
namespaces, `ferry lab`), with the destination's async page faults on and
off, over the plain link and with added round-trip delay (`ferry lab delay`,
a TCP proxy on the destination host: this kernel has no netem). Two sections
(--sections, default both):

faults: APF x prefetch 0 and 8 x RTT, a dirtying VM. Per cell, the median of
--runs migrations between fresh VMMs: downtime, postcopy time (switch to
every page there), faults (major; absorbed by APF vs blocking a vCPU),
major-fault service time p50/p99 (fault read to page landed) and the lowest
guest execution ratio in a 100 ms window. In the same run, `ferry lab
uffd-cost` measures the bare cost of a local userfaultfd fault on this host:
the floor under any remote fault. Results: bench/results/postcopy.{json,md}.

memtouch: the yabusame paper's memtouch (its sec. 4.1), APF x RTT. The VM
runs `memtouch:tasks=T,mib=M,after=migrate`: each task fills its region with
random data and waits; once all are ready the VM is migrated (postcopy), and
each task reads and writes every page of its region once, timed from the
moment the guest saw the move (the host info page's migration count, set by
the destination before its vCPUs start). Cells: push limit (`ferry migrate
--bandwidth`, which paces the background push but never holds back demand
answers: "none", or e.g. 100M so faults, not the push, bring most pages) x
RTT x APF. Per run: each task's time and their mean; per cell the median
over --runs. Results: bench/results/postcopy-memtouch.{json,md} (--memtouch-out names others).

Needs root (network namespaces), /dev/kvm and userfaultfd. --local runs both
VMMs and the proxy on this host's loopback instead of in the lab (`ferry lab
up` rebuilds the one shared lab, so two users of it on one machine break each
other's runs).

Usage: python3 bench/postcopy.py [--runs 3] [--mem 1G] [--rtts 0,0.15,1]
           [--sections faults,memtouch] [--memtouch-tasks 4] [--memtouch-mib 192]
           [--memtouch-prefetch 8] [--memtouch-push hold,none,100M]
           [--memtouch-vcpus 1] [--priorities realtime,normal] [--local]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2")
LOCAL = (None, "127.0.0.1")


def workload(mem):
    """dirty over half the VM's memory, plus one compute task."""
    mib = int(mem[:-1]) * (1024 if mem[-1] in "gG" else 1)
    return f"dirty:rate=256,wss={mib // 2},pattern=random+compute:tasks=1"


def fault_figures(stats):
    """The postcopy fault figures of one `ferry migrate --json` reply."""
    p = stats["postcopy"]
    f = p["faults"]
    return {
        "downtime_ms": stats["downtime_ms"],
        "postcopy_s": p["secs"],
        "pending_pages": p["pending_pages"],
        "faults": f["faults"],
        "major": f["major"],
        "async_worker": f["async_worker"],
        "apf_absorbed": f["apf_absorbed"] or 0,
        "blocked": f["blocked"],
        "p50_us": f["latency_us"]["p50"],
        "p99_us": f["latency_us"]["p99"],
        "p999_us": f["latency_us"].get("p999", 0.0),
        "min_exec_ratio": min((b["exec_ratio"] for b in f["series"]), default=1.0),
        "prefetched": p["prefetched_pages"],
    }


def priority_env(priority):
    """The VMMs' environment for a fault-path priority: realtime (the
    default) or normal (FERRY_FAULT_PRIORITY=normal)."""
    return {**os.environ, "FERRY_FAULT_PRIORITY": priority}


def migrate_once(ferry, mem, rtt, apf, prefetch, priority, tmp, port):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    env = priority_env(priority)
    common = ["run", "--mem", mem, "--vcpus", "2", "--workload", workload(mem), "--quiet", "--json"]
    listen = f"{DST[1]}:{port}"
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{listen}",
                                   "--apf", apf, "--control", dst_sock, "--duration", "2s"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, "--control", src_sock, "--duration", "120s"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    proxy, to = benchlib.start_proxy(ferry, DST[0], listen, rtt)
    try:
        benchlib.wait_for(src_sock, dst_sock)
        time.sleep(2.5)  # boot, and let dirty fill its working set
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{to}", "--mode", "postcopy",
                        "--prefetch", str(prefetch), "--json"), check=False)
        stats = benchlib.report(m)
        dst.wait(timeout=60)
    finally:
        benchlib.reap(src, dst, proxy)
    return fault_figures(stats)


# `--memtouch-push hold`: the push waits this long after the switch (the
# most ferry allows), so the tasks' pages come by demand alone, as in the
# paper's measurement (its background transfer was off).
HOLD = "20s"


def memtouch_spec(tasks, mib):
    return f"memtouch:tasks={tasks},mib={mib},after=migrate"


def memtouch_once(ferry, a, push, rtt, apf, tmp, port):
    """One postcopy migration of a VM whose memtouch tasks wait for it:
    each task's time to touch its region after the switch, and the
    migration's figures."""
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    spec = memtouch_spec(a.memtouch_tasks, a.memtouch_mib)
    common = ["run", "--mem", a.mem, "--vcpus", str(a.memtouch_vcpus), "--workload", spec, "--quiet", "--json"]
    listen = f"{DST[1]}:{port}"
    # No --duration: the destination ends when every task is done and
    # prints its summary (each finished task's time).
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{listen}",
                                   "--apf", apf, "--control", dst_sock),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, "--control", src_sock, "--duration", "600s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    proxy, to = benchlib.start_proxy(ferry, DST[0], listen, rtt)
    try:
        benchlib.wait_for(src_sock, dst_sock)
        # Every task has filled its region and waits for the move.
        t_fill = time.time()
        deadline = t_fill + 300
        while True:
            r = sh(ferry, "ctl", src_sock, "metrics", check=False)
            if r.returncode == 0:
                w = json.loads(r.stdout)["metrics"]["workloads"][0]
                if w["tasks_ready"] >= a.memtouch_tasks:
                    break
            if time.time() > deadline:
                raise RuntimeError("memtouch tasks never got ready")
            time.sleep(0.2)
        fill_s = time.time() - t_fill
        limit = {"none": [], "hold": ["--push-delay", HOLD]}.get(push, ["--bandwidth", push])
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{to}", "--mode", "postcopy",
                        "--prefetch", str(a.memtouch_prefetch), *limit, "--json"), check=False)
        stats = benchlib.report(m)
        out, _ = dst.communicate(timeout=600)
        summary = json.loads(out)
    finally:
        benchlib.reap(src, dst, proxy)
    w = summary["workloads"][0]
    task_s = [ms / 1e3 for ms in w["finished_task_ms"]]
    if len(task_s) != a.memtouch_tasks or summary["vm"]["apf"] != (apf == "on"):
        raise RuntimeError(f"destination summary does not fit the run: {summary}")
    return {"task_s": task_s, "mean_s": statistics.mean(task_s), "max_s": max(task_s),
            "fill_s": fill_s, **fault_figures(stats)}


def run_memtouch(ferry, a, rtts, port, out):
    """Every cell; the results are written after each (a run cut short
    keeps what it measured)."""
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for push in a.memtouch_push.split(","):
            for rtt in rtts:
                for apf in ("on", "off"):
                    runs = []
                    for _ in range(a.runs):
                        port += 1
                        runs.append(memtouch_once(ferry, a, push, rtt, apf, tmp, port))
                    scalar = [k for k in runs[0] if k != "task_s"]
                    med = benchlib.medians(runs, scalar)
                    # Task i's median over the runs (in the order they finished).
                    med["task_s"] = [statistics.median(sorted(r["task_s"])[i] for r in runs)
                                     for i in range(a.memtouch_tasks)]
                    cell = {"push": push, "rtt_ms": rtt, "apf": apf, "median": med, "runs": runs}
                    cells.append(cell)
                    print(json.dumps({k: cell[k] for k in ("push", "rtt_ms", "apf", "median")}), flush=True)
                    write_memtouch(a, cells, out)
    return cells, port


def write_memtouch(a, cells, out):
    command = benchlib.recorded_command("postcopy.py")
    spec = memtouch_spec(a.memtouch_tasks, a.memtouch_mib)
    benchlib.write_json(os.path.join(out, f"{a.memtouch_out}.json"),
                        {"command": command, "workload": spec, "mem": a.mem, "vcpus": a.memtouch_vcpus,
                         "link": "loopback" if a.local else "lab veth",
                         "prefetch": a.memtouch_prefetch, "push_limits": a.memtouch_push.split(","),
                         "cells": cells}, indent=1)
    md = os.path.join(out, f"{a.memtouch_out}.md")
    lines = [
        "# Postcopy: memtouch after the switch, APF on and off",
        "",
        f"Command: `{command}` (medians of {a.runs}; {a.mem} VM, {a.memtouch_vcpus} vCPU(s), `{spec}`, "
        f"prefetch {a.memtouch_prefetch};",
        ("both VMMs on this host's loopback (--local); " if a.local else "lab hosts (veth); ")
        + "delay added by `ferry lab delay` on the destination side; push: `hold` = `ferry migrate",
        f"--push-delay {HOLD}` (demand paging alone while the tasks run, the paper's setting), `none` = unlimited,",
        "else `--bandwidth`, which paces the background push only). Each task filled its region with",
        "random data before the migration and touches (reads and writes) each page once after it;",
        "its time runs from the first moment a guest task saw the move (host info page) to its end.",
        "Task columns: the fastest to the slowest task of a run, each the median over the runs.",
        "",
        "| push limit | added RTT | APF | " + " | ".join(f"task {i + 1} s" for i in range(a.memtouch_tasks))
        + " | mean s | downtime ms | postcopy s | faults | absorbed by APF | stopped a vCPU | p50 µs | p99 µs | p99.9 µs |",
        "|---|---|---|" + "---|" * a.memtouch_tasks + "---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['push']} | {c['rtt_ms']} ms | {c['apf']} | " + " | ".join(f"{t:.2f}" for t in m["task_s"])
            + f" | {m['mean_s']:.2f} | {m['downtime_ms']:.2f} | {m['postcopy_s']:.2f} | {m['faults']:.0f} | "
            f"{m['apf_absorbed']:.0f} | {m['blocked']:.0f} | {m['p50_us']:.0f} | {m['p99_us']:.0f} | "
            f"{m.get('p999_us', 0):.0f} |")
    lines += [
        "",
        "Mean task time, APF on against off (the paper: 17.6 s off, 9.8 s on, -44%):",
        "",
        "| push limit | added RTT | APF off s | APF on s | on vs off |",
        "|---|---|---|---|---|",
    ]
    for push, rtt in dict.fromkeys((c["push"], c["rtt_ms"]) for c in cells):
        by = {c["apf"]: c["median"]["mean_s"] for c in cells if (c["push"], c["rtt_ms"]) == (push, rtt)}
        if "on" in by and "off" in by:
            lines.append(f"| {push} | {rtt} ms | {by['off']:.2f} | {by['on']:.2f} | "
                         f"{(by['on'] - by['off']) / by['off'] * 100:+.0f}% |")
    benchlib.write_md(md, lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--rtts", default="0,0.15,1")
    ap.add_argument("--sections", default="faults,memtouch",
                    help="comma-separated: faults (APF x prefetch x RTT), memtouch (the paper's memtouch)")
    ap.add_argument("--memtouch-tasks", type=int, default=4)
    ap.add_argument("--memtouch-mib", type=int, default=192, help="MiB per memtouch task")
    ap.add_argument("--memtouch-prefetch", type=int, default=8)
    ap.add_argument("--memtouch-push", default="hold",
                    help="background push: hold (held while the tasks run, the paper's setting), "
                         "none (unlimited) or a limit (ferry migrate --bandwidth, e.g. 100M)")
    ap.add_argument("--memtouch-vcpus", type=int, default=1, help="the paper's VM had 1 vCPU")
    ap.add_argument("--memtouch-out", default="postcopy-memtouch",
                    help="memtouch results name under bench/results/")
    ap.add_argument("--priorities", default="realtime,normal",
                    help="faults section: fault path priorities to compare (realtime, normal)")
    ap.add_argument("--cells", default="on:0,on:8,off:0,off:8",
                    help="faults section: the APF:prefetch cells to run")
    ap.add_argument("--binaries", default="",
                    help="faults section: LABEL=PATH,… ferry binaries compared run by run "
                         "interleaved (e.g. old=…,new=…); default: --ferry alone")
    ap.add_argument("--local", action="store_true",
                    help="VMMs and proxy on 127.0.0.1 in this namespace, no lab")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    if not sections or sections - {"faults", "memtouch"}:
        sys.exit(f"--sections: faults and/or memtouch, not {a.sections}")
    ferry = os.path.abspath(a.ferry)
    rtts = [float(x) for x in a.rtts.split(",")]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    if a.local:
        global SRC, DST
        SRC = DST = LOCAL
        # Lab hosts get their certificates from `ferry lab up`; on loopback
        # the VMMs (and everything started from here) use a one-host fleet.
        os.environ.update(benchlib.tls_env(ferry, "postcopy"))
    else:
        benchlib.lab_up(ferry, 2)
    cells, memtouch_cells = [], []
    try:
        port = 7810
        if "memtouch" in sections:
            memtouch_cells, port = run_memtouch(ferry, a, rtts, port, out)
        if "faults" in sections:
            cells, port = run_faults(ferry, a, rtts, port)
    finally:
        if not a.local:
            sh(ferry, "lab", "down", check=False)
    if memtouch_cells:
        print(f"wrote {os.path.join(out, a.memtouch_out + '.md')}")
    if cells:
        write_faults(a, cells, out)


def binaries_of(a, ferry):
    """The binaries to compare, by label (--binaries old=PATH,new=PATH), or
    just --ferry."""
    if not a.binaries:
        return {"this": ferry}
    out = {}
    for item in a.binaries.split(","):
        label, _, path = item.partition("=")
        if not label or not path:
            sys.exit(f"--binaries: LABEL=PATH[,LABEL=PATH…], not {item!r}")
        out[label] = os.path.abspath(path)
    return out


def run_faults(ferry, a, rtts, port):
    cells = []
    floor = json.loads(sh(ferry, "lab", "uffd-cost").stdout)
    with tempfile.TemporaryDirectory() as tmp:
        wanted = [tuple(c.split(":")) for c in a.cells.split(",")]
        binaries = binaries_of(a, ferry)
        for rtt in rtts:
            for apf in ("on", "off"):
                for prefetch in (0, 8):
                    if (apf, str(prefetch)) not in wanted:
                        continue
                    # Priorities (and binaries) interleaved run by run:
                    # their ratio is taken under the same load.
                    runs = {(b, p): [] for b in binaries for p in a.priorities.split(",")}
                    for _ in range(a.runs):
                        for (b, p) in runs:
                            port += 1
                            runs[(b, p)].append(
                                migrate_once(binaries[b], a.mem, rtt, apf, prefetch, p, tmp, port))
                    for (b, p), rs in runs.items():
                        med = benchlib.medians(rs)
                        cell = {"rtt_ms": rtt, "apf": apf, "prefetch": prefetch, "priority": p,
                                "median": med, "runs": rs}
                        if len(binaries) > 1:
                            cell["binary"] = b
                        cells.append(cell)
                        keys = ("rtt_ms", "apf", "prefetch", "priority", "binary", "median")
                        print(json.dumps({k: cell[k] for k in keys if k in cell}), flush=True)
    return (floor, cells), port


def write_faults(a, result, out):
    floor, cells = result
    command = benchlib.recorded_command("postcopy.py")
    benchlib.write_json(os.path.join(out, "postcopy.json"),
                        {"command": command, "workload": workload(a.mem), "mem": a.mem,
                         "link": "loopback" if a.local else "lab veth",
                         "uffd_floor_us": floor, "cells": cells}, indent=1)
    md = os.path.join(out, "postcopy.md")
    lines = [
        "# Postcopy: faults, APF and prefetch",
        "",
        f"Command: `{command}` (medians of {a.runs}; {a.mem} VM, 2 vCPUs, `{workload(a.mem)}`;",
        ("both VMMs on this host's loopback (--local); " if a.local else "")
        + "delay added by `ferry lab delay` on the destination host).",
        "",
        f"Bare local userfaultfd fault on this host (`ferry lab uffd-cost`, same run): "
        f"p50 {floor['p50']:.0f} µs, p99 {floor['p99']:.0f} µs.",
        "",
        "Fault path priority: `realtime` (the default: the fault, demand and lander threads run",
        "SCHED_FIFO 1) or `normal` (`FERRY_FAULT_PRIORITY=normal`), run by run interleaved.",
        "",
        "| added RTT | APF | prefetch | priority / binary | downtime ms | postcopy s | faults | major | async worker | absorbed by APF | stopped a vCPU | p50 µs | p99 µs | min exec ratio | prefetched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['rtt_ms']} ms | {c['apf']} | {c['prefetch']} | {c.get('priority', 'normal')}"
            + (f" / {c['binary']}" if "binary" in c else "") + " | "
            f"{m['downtime_ms']:.2f} | {m['postcopy_s']:.3f} | "
            f"{m['faults']:.0f} | {m['major']:.0f} | {m['async_worker']:.0f} | {m['apf_absorbed']:.0f} | {m['blocked']:.0f} | {m['p50_us']:.0f} | "
            f"{m['p99_us']:.0f} | {m['min_exec_ratio']:.2f} | {m['prefetched']:.0f} |")
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
