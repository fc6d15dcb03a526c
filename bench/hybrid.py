#!/usr/bin/env python3
"""Hybrid against precopy with auto-converge (issue 12): a 1 GiB VM with 2
vCPUs dirtying a 128 MiB working set at 256 and 1024 MiB/s moves over the
1 Gbit lab link (tbf), where precopy needs many throttled rounds. Hybrid
runs --postcopy-after rounds of precopy, then switches to postcopy.

Per run: total time, downtime, and the guest's throughput during the move:
the dirty workload's bytes written from the migration's start to its end
(source counter before, destination counter right after), per second, beside
its rate over the second before the move (the same run).

Cells are medians of --runs runs. Results: bench/results/hybrid.{json,md}.

Usage: python3 bench/hybrid.py [--runs 3] [--rates 256,1024] [--postcopy-after 3]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2")


def progress(ferry, sock):
    """(seconds, bytes the dirty workload wrote so far) from the VM's counters."""
    s = benchlib.status(ferry, sock)
    try:
        return time.time(), s["metrics"]["workloads"][0]["progress"]
    except (KeyError, IndexError, TypeError):
        return time.time(), None


def migrate_once(ferry, workload, mode, after, tmp, port):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    common = ["run", "--mem", "1G", "--vcpus", "2", "--workload", workload, "--quiet", "--json"]
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{DST[1]}:{port}",
                                   "--control", dst_sock, "--duration", "5s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, "--control", src_sock, "--duration", "120s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        benchlib.wait_for(src_sock, dst_sock)
        time.sleep(1.5)  # the working set is touched once
        t0, p0 = progress(ferry, src_sock)
        time.sleep(1.0)
        t1, p1 = progress(ferry, src_sock)
        flags = ["--mode", "precopy", "--max-rounds", "15"] if mode == "precopy" else \
            ["--mode", "hybrid", "--postcopy-after", after]
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{DST[1]}:{port}", *flags, "--json"),
               check=False)
        t2, p2 = progress(ferry, dst_sock)
        stats = benchlib.report(m)
    finally:
        benchlib.reap(src, dst)
    before = (p1 - p0) / (t1 - t0)
    # From the migration's start (just after t1) to the destination's counter read.
    during = (p2 - p1) / (t2 - t1) if p2 is not None else float("nan")
    post = stats.get("postcopy") or {}
    return {
        "total_s": stats["total_secs"],
        "downtime_ms": stats["downtime_ms"],
        "rounds": len(stats["rounds"]),
        "switched": 1 if post else 0,
        "postcopy_s": post.get("secs", 0.0),
        "max_throttle_pct": max((r["throttle_pct"] for r in stats["rounds"]), default=0),
        "guest_mib_s_before": before / 2**20,
        "guest_mib_s_during": during / 2**20,
        "bytes_mib": stats["bytes"] / 2**20,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rates", default="256,1024")
    ap.add_argument("--postcopy-after", default="3")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    benchlib.lab_up(ferry, 2, "1gbit")
    cells = []
    try:
        port = 7700
        with tempfile.TemporaryDirectory() as tmp:
            for rate in a.rates.split(","):
                wl = f"dirty:rate={rate},wss=128,pattern=random"
                for mode in ("precopy", "hybrid"):
                    runs, errors = [], []
                    for _ in range(a.runs):
                        port += 1
                        try:
                            runs.append(migrate_once(ferry, wl, mode, a.postcopy_after, tmp, port))
                        except RuntimeError as e:
                            errors.append(str(e).strip())
                            print(f"{wl} {mode}: a run failed: {e}", flush=True)
                    if not runs:
                        continue
                    med = benchlib.medians(runs)
                    cell = {"workload": wl, "mode": mode, "median": med, "runs": runs, "errors": errors}
                    cells.append(cell)
                    print(json.dumps({k: cell[k] for k in ("workload", "mode", "median")}), flush=True)
    finally:
        sh(ferry, "lab", "down", check=False)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("hybrid.py")
    benchlib.write_json(os.path.join(out, "hybrid.json"),
                        {"command": command, "postcopy_after": a.postcopy_after, "cells": cells}, indent=1)
    md = os.path.join(out, "hybrid.md")
    lines = [
        "# Hybrid against precopy with auto-converge, 1 Gbit link",
        "",
        f"Command: `{command}` (medians of {a.runs}; 1 GiB VM, 2 vCPUs; lab link shaped to 1 Gbit with tbf;",
        f"precopy with auto-converge and --max-rounds 15; hybrid with --postcopy-after {a.postcopy_after}).",
        "",
        "Guest throughput: the dirty workload's MiB/s written, over the second before the move and from",
        "the migration's start to its end (source counter, then the destination's).",
        "",
        "| workload | mode | total s | downtime ms | rounds | postcopy s | max throttle % | guest MiB/s before | guest MiB/s during | sent MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| `{c['workload']}` | {c['mode']} | {m['total_s']:.2f} | {m['downtime_ms']:.1f} | {m['rounds']:.0f} | "
            f"{m['postcopy_s']:.2f} | {m['max_throttle_pct']:.0f} | {m['guest_mib_s_before']:.0f} | "
            f"{m['guest_mib_s_during']:.0f} | {m['bytes_mib']:.0f} |")
    lines += benchlib.failed_runs(cells, lambda c: f"`{c['workload']}` {c['mode']}")
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
