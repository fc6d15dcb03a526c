#!/usr/bin/env python3
"""What access tracking (issue 14: the source's LRU history for split
migration) costs a running guest, per way of seeing writes.

For each workload, the same VM runs with tracking off, with
`--access-writes sample` (the default: sampled userfaultfd MINOR faults see
reads and writes) and with `--access-writes log` (KVM's dirty log as well),
all at --period ms. Runs of one workload are interleaved (off, sample, log,
off, ...) so they see the same machine load; cells are medians of --runs.

- sort: the guest's radix sort of --sort-mib MiB (it works on twice that);
  the figure is its own runtime.
- dirty+compute: a task rewriting 64 MiB at 64 MiB/s next to a compute
  task, for --secs; the figure is the compute task's ops/s.

Also recorded: the tracker's own figures (faults, arm time, pages armed).
Results: bench/results/access.{json,md}.

Usage: python3 bench/access.py [--runs 3] [--period 1000]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import benchlib

CONFIGS = [("off", []), ("sample", ["--access-writes", "sample"]), ("log", ["--access-writes", "log"])]


def run(ferry, mem, workload, secs, period, extra):
    args = [ferry, "run", "--json", "--quiet", "--mem", mem, "--workload", workload]
    if secs:
        args += ["--duration", f"{secs}s"]
    args += ["--access-period", str(period if extra else 0), *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--period", type=int, default=1000)
    ap.add_argument("--sort-mib", type=int, default=192)
    ap.add_argument("--secs", type=int, default=6)
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--out", default="access")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    workloads = [
        ("sort", "512M", f"sort:mib={a.sort_mib}", 0, "sort s",
         lambda d: d["workloads"][0]["finished_task_ms"][0] / 1e3, False),
        ("dirty+compute", "512M", "compute:tasks=1+dirty:rate=64,wss=64,tasks=1", a.secs, "compute Mops/s",
         lambda d: d["workloads"][0]["rate_per_s"] / 1e6, True),
    ]
    cells = []
    for name, mem, workload, secs, unit, figure, higher_better in workloads:
        got = {c: [] for c, _ in CONFIGS}
        tracker = {c: [] for c, _ in CONFIGS}
        for r in range(a.runs):
            for c, extra in CONFIGS:
                d = run(ferry, mem, workload, secs, a.period, extra)
                got[c].append(figure(d))
                tracker[c].append(d.get("access") or {})
                print(f"{name} run {r + 1} {c}: {got[c][-1]:.3f} {unit}", flush=True)
        base = statistics.median(got["off"])
        for c, _ in CONFIGS:
            med = statistics.median(got[c])
            cost = (base / med - 1) if higher_better else (med / base - 1)
            acc = tracker[c]
            pick = lambda k: statistics.median([t.get(k, 0) for t in acc]) if acc and acc[0] else None
            cells.append({
                "workload": name, "mem": mem, "spec": workload, "config": c, "unit": unit,
                "runs": got[c], "median": med, "cost_pct": 100 * cost,
                "minor_faults": pick("minor_faults_total"), "arm_us_mean": pick("arm_us_mean"),
                "pages_armed_per_arm": pick("pages_armed_per_arm"), "tracked_s": pick("tracked_s"),
            })
    res = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    cmd = benchlib.recorded_command("access.py")
    benchlib.write_json(os.path.join(res, f"{a.out}.json"), {"command": cmd, "period_ms": a.period, "cells": cells},
                        indent=1)
    md_path = os.path.join(res, f"{a.out}.md")
    lines = [
        "# What access tracking costs a running guest",
        "",
        f"Command: `{cmd}` (medians of {a.runs}, runs interleaved; 1 vCPU; period {a.period} ms,",
        "share 8, grain 64 pages: the defaults). Cost: slowdown of the figure against tracking off.",
        "",
        "| workload | tracking | figure | median | cost | MINOR faults | pages armed / period | arm µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        f = lambda v, fmt: "" if v is None else fmt.format(v)
        lines.append(
            f"| {c['workload']} | {c['config']} | {c['unit']} | {c['median']:.3f} | {c['cost_pct']:+.1f}% | "
            f"{f(c['minor_faults'], '{:.0f}')} | {f(c['pages_armed_per_arm'], '{:.0f}')} | {f(c['arm_us_mean'], '{:.0f}')} |")
    benchlib.write_md(md_path, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
