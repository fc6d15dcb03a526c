#!/usr/bin/env python3
"""How much a migration hurts what runs inside (issue 15), after the
degradation-analysis paper: a `compute` VM and a `kv` VM under `ferry load`
(the load runs on a third namespace host, so its traffic and the migration's
share the source's 1 Gbit link, shaped with tbf), each also dirtying memory
at several rates, migrated in every mode.

Every run writes its timeline (`ferry migrate --timeline`); `ferry report
--json` turns it into the figures here: the guest's own throughput (first
workload's counter: adds for compute, requests for kv) per 100 ms, averaged
over the 2 s before the migration and over the migration itself (start to
the source letting go), the downtime, the total time, and for kv the
requests' latency from `ferry load --out`. One report page per VM kind with
the charts of its runs goes to bench/results/degradation/.

Results: bench/results/degradation.{json,md} and degradation-*.png.

Usage: python3 bench/degradation.py [--runs 1] [--rates 0,128,512] [--modes precopy,postcopy,hybrid]
       [--kinds compute,kv] [--extra 'MIGRATE ARGS'] [--out degradation]
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST, CLIENT = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2"), ("ferry-h3", "10.77.0.3")
KV = "kv:workers=2,keys=200000,value=1024"
# compute's own memory is tiny: 384 MiB of random data (filled once at boot)
# gives the migration something to move, as a real guest's memory would.
COMPUTE = "compute:tasks=2+fill:content=worst,mib=384"
# The lead is longer than the VMM's 3 s pre-roll, so the load runs through
# the whole baseline the timeline keeps; the load outlasts the longest moves
# (~21 s: kv dirtying 512 MiB/s by precopy), whose bins would otherwise
# count the clients' end as lost throughput.
LEAD_S, LOAD_S = 4.0, 30.0


def workload(kind, rate):
    base = COMPUTE if kind == "compute" else KV
    return base if rate == 0 else f"{base}+dirty:rate={rate},wss=128,pattern=random,tasks=1"


def run_once(ferry, kind, rate, mode, tmp, port, keep, extra=()):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    wl = workload(kind, rate)
    common = ["run", "--mem", "1G", "--vcpus", "2", "--workload", wl, "--quiet"]
    svc = lambda host: ["--serve", f"{host}:{port + 1000}"] if kind == "kv" else []
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, *svc(DST[1]), "--incoming", f"tcp:{DST[1]}:{port}",
                                   "--control", dst_sock, "--duration", "60s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, *svc(SRC[1]), "--control", src_sock, "--duration", "60s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = None
    timeline = os.path.join(keep, f"{kind}-{rate}-{mode}.jsonl")
    log = os.path.join(keep, f"{kind}-{rate}-{mode}.csv")
    try:
        benchlib.wait_for(src_sock, dst_sock)
        if kind == "kv":
            benchlib.served(ferry, src_sock)
            load = subprocess.Popen(in_host(CLIENT[0], ferry, "load", "--target", f"{SRC[1]}:{port + 1000}",
                                            "--clients", "32", "--duration", f"{LOAD_S}s", "--out", log,
                                            "--json", "--quiet"),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        time.sleep(LEAD_S)
        flags = {"precopy": [], "postcopy": ["--mode", "postcopy"],
                 "hybrid": ["--mode", "hybrid", "--postcopy-after", "3"]}[mode]
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{DST[1]}:{port}", *flags, *extra,
                        "--timeline", timeline, "--json"), check=False)
        if m.returncode != 0:
            raise RuntimeError(m.stderr)
        summary = json.loads(load.communicate(timeout=LOAD_S + 30)[0]) if load else None
    finally:
        benchlib.reap(*(p for p in (load, src, dst) if p))
    rep = sh(ferry, "report", timeline, *(["--load", log] if kind == "kv" else []), "--json",
             "--out", os.path.join(tmp, "report"))
    f = json.loads(rep.stdout)["runs"][0]
    mig = json.loads(m.stdout) if m.stdout.strip() else {}
    post = mig.get("postcopy") or {}
    return {
        # Where the pause went, and for a switch to postcopy what it had to
        # drop, from the migration's own JSON.
        "downtime_parts": mig.get("downtime_parts"),
        "pending_pages": post.get("pending_pages"),
        "dropped_ahead_pages": post.get("dropped_ahead_pages"),
        "total_s": f["total_s"],
        "downtime_ms": f["downtime_ms"],
        "during_vs_before_pct": 100 * f["during_vs_before"] if f["during_vs_before"] is not None else float("nan"),
        "exec_ratio_min": f["exec_ratio_min"] if f["exec_ratio_min"] is not None else float("nan"),
        "latency_p99_ms": f["latency_p99_ms"] if f["latency_p99_ms"] is not None else float("nan"),
        "errors": (summary or {}).get("errors", 0),
        "timeline": timeline,
        "load": log if kind == "kv" else None,
    }


def plot(out, cells, rates, prefix="degradation"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no summary plot", flush=True)
        return []
    made = []
    for kind in ("compute", "kv"):
        fig, ax = plt.subplots(1, 3, figsize=(14, 3.6))
        for mode in sorted({c["mode"] for c in cells}):
            pts = [(c["rate"], c["median"]) for c in cells if c["kind"] == kind and c["mode"] == mode]
            pts.sort()
            xs = [p[0] for p in pts]
            ax[0].plot(xs, [p[1]["during_vs_before_pct"] for p in pts], marker="o", label=mode)
            ax[1].plot(xs, [p[1]["downtime_ms"] for p in pts], marker="o", label=mode)
            ax[2].plot(xs, [p[1]["total_s"] for p in pts], marker="o", label=mode)
        for a, t in zip(ax, ("guest throughput during vs before (%)", "downtime (ms)", "total time (s)")):
            a.set_title(t, fontsize=10)
            a.set_xlabel("guest dirty rate (MiB/s)")
            a.grid(alpha=0.3)
        ax[0].axhline(-15, color="gray", ls="--", lw=0.8)
        ax[0].text(0, -15, " paper: -15% CPU work", fontsize=8, va="bottom", color="gray")
        ax[0].legend(fontsize=8)
        fig.suptitle(f"{kind} VM ({workload(kind, 0)}), 1 GiB, 1 Gbit link")
        fig.tight_layout()
        name = f"{prefix}-{kind}.png"
        fig.savefig(os.path.join(out, name), dpi=90)
        plt.close(fig)
        made.append(name)
    return made


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--rates", default="0,128,512")
    ap.add_argument("--modes", default="precopy,postcopy,hybrid")
    ap.add_argument("--kinds", default="compute,kv")
    ap.add_argument("--extra", default="", help="more `ferry migrate` arguments for every run (e.g. '--bandwidth 100MB/s')")
    ap.add_argument("--out", default="degradation", help="results file name under bench/results/")
    a = ap.parse_args()
    extra = a.extra.split()
    ferry = os.path.abspath(a.ferry)
    rates = [int(r) for r in a.rates.split(",")]
    benchlib.lab_up(ferry, 3, "1gbit")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    pages = os.path.join(out, a.out)
    os.makedirs(pages, exist_ok=True)
    cells = []
    try:
        port = 7800
        with tempfile.TemporaryDirectory() as tmp:
            keep = os.path.join(tmp, "runs")
            os.makedirs(keep)
            for kind in a.kinds.split(","):
                for rate in rates:
                    for mode in a.modes.split(","):
                        runs, errors = [], []
                        for _ in range(a.runs):
                            port += 1
                            try:
                                runs.append(run_once(ferry, kind, rate, mode, tmp, port, keep, extra))
                            except (RuntimeError, subprocess.SubprocessError, ValueError) as e:
                                errors.append(str(e).strip()[:300])
                                print(f"{kind} {rate} {mode}: a run failed: {e}", flush=True)
                        if not runs:
                            continue
                        # (A hybrid that did not switch has no postcopy figures.)
                        nums = [k for k in runs[0] if all(isinstance(r.get(k), (int, float)) for r in runs)]
                        med = benchlib.medians(runs, nums)
                        cell = {"kind": kind, "rate": rate, "mode": mode, "workload": workload(kind, rate),
                                "median": med, "runs": runs, "errors": errors}
                        cells.append(cell)
                        print(json.dumps({k: cell[k] for k in ("kind", "rate", "mode", "median")}), flush=True)
            # One report page per VM kind: its first run of every cell.
            for kind in a.kinds.split(","):
                mine = [c["runs"][0] for c in cells if c["kind"] == kind]
                if not mine:
                    continue
                args = [r["timeline"] for r in mine]
                if kind == "kv":
                    for r in mine:
                        args += ["--load", r["load"]]
                d = os.path.join(pages, kind)
                shutil.rmtree(d, ignore_errors=True)
                sh(ferry, "report", *args, "--out", d, "--title", f"ferry degradation study: {kind} VM")
    finally:
        sh(ferry, "lab", "down", check=False)
    plots = plot(out, cells, rates, a.out)
    command = benchlib.recorded_command("degradation.py")
    for c in cells:
        for r in c["runs"]:
            r["timeline"] = os.path.basename(r["timeline"])
            r["load"] = r["load"] and os.path.basename(r["load"])
    benchlib.write_json(os.path.join(out, f"{a.out}.json"), {"command": command, "cells": cells}, indent=1)
    md = os.path.join(out, f"{a.out}.md")
    lines = [
        "# Degradation during migration: guest throughput, downtime and total time vs dirty rate",
        "",
        f"Command: `{command}` (medians of {a.runs}; 1 GiB VM, 2 vCPUs; lab link shaped to 1 Gbit with tbf;",
        f"kv under `ferry load` with 32 clients on a third host, its traffic sharing the source's link).",
        "",
        "Throughput: the guest's first workload counter (compute: adds; kv: requests answered) per 100 ms,",
        "averaged over the migration (start to the source letting go) against the 2-3 s before it, from",
        "each run's timeline (`ferry report --json`). Lowest exec ratio: the worst 100 ms of vCPU time",
        "during the migration (0 while paused, less throttle and postcopy fault waits).",
        "",
        "| VM | dirty MiB/s | mode | total s | downtime ms | throughput during vs before | lowest exec ratio | request p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['kind']} | {c['rate']} | {c['mode']} | {m['total_s']:.2f} | {m['downtime_ms']:.1f} | "
            f"{m['during_vs_before_pct']:+.1f}% | {m['exec_ratio_min']:.2f} | "
            f"{m['latency_p99_ms']:.1f} | {m['errors']:.0f} |")
    lines += ["", *[f"![{p}]({p})" for p in plots]]
    lines += ["", f"Report pages (charts per run): `{a.out}/compute/index.html`, `{a.out}/kv/index.html`."]
    lines += benchlib.failed_runs(cells, lambda c: f"{c['kind']} {c['rate']} {c['mode']}")
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
