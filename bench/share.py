#!/usr/bin/env python3
"""Pages shared across VMs moving to one host (issue 34 item 8, protocol
v14): 4 VMs on lab host ferry-h1 hold the same data set (`fill`, seeded
alike; 512 MiB random each, in 768 MiB VMs) and move one after another to
ferry-h2 by precopy with --verify, over mutual TLS, as a drain would.

Configurations:
- separate: the destinations run without --share-pages (every VM sends
  all of its pages);
- shared: the destinations run with --share-pages, so each one after the
  first takes the pages the VMs already moved there hold from them.

Per run: bytes on the wire summed over the 4 moves, each move's bytes,
pages sent as references and missed, total time and downtime. Cells are
medians of --runs runs; the configurations alternate run by run. The
figure the issue asks for: shared bytes / separate bytes (goal <= 0.3).
Results: bench/results/share.{json,md}.

Usage: python3 bench/share.py [--runs 3] [--vms 4] [--mib 512] [--bandwidth 1gbit] [--out share]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import in_host, sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC, DST = "ferry-h1", ("ferry-h2", "10.77.0.2")


def filled(ferry, sock, mib):
    """True once the VM at `sock` has filled its data set."""
    st = benchlib.status(ferry, sock)
    try:
        return st["metrics"]["workloads"][0]["progress"] >= mib << 20
    except (TypeError, KeyError, IndexError):
        return False


def once(ferry, config, tmp, vms, mib, port):
    """Moves `vms` VMs one after another; returns the run's figures."""
    mem = f"{mib + 256}M"
    wl = f"fill:content=worst,mib={mib}"
    common = ["run", "--mem", mem, "--vcpus", "1", "--workload", wl, "--quiet", "--duration", "300s"]
    share = ["--share-pages"] if config == "shared" else []
    srcs, dsts, procs = [], [], []
    try:
        for i in range(vms):
            s, d = os.path.join(tmp, f"src{i}.sock"), os.path.join(tmp, f"dst{i}.sock")
            benchlib.fresh(s, d)
            procs.append(subprocess.Popen(in_host(SRC, ferry, *common, "--control", s),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            procs.append(subprocess.Popen(
                in_host(DST[0], ferry, *common, *share, "--control", d,
                        "--incoming", f"tcp:{DST[1]}:{port + i}"),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            srcs.append(s)
            dsts.append(d)
        benchlib.wait_started(procs, srcs + dsts, timeout=60)
        deadline = time.time() + 120
        while not all(filled(ferry, s, mib) for s in srcs):
            if time.time() > deadline:
                raise RuntimeError("the sources never filled their data sets")
            time.sleep(0.2)
        moves = []
        for i, s in enumerate(srcs):
            m = sh(*in_host(SRC, ferry, "migrate", s, "--to", f"tcp:{DST[1]}:{port + i}",
                            "--verify", "--json"), check=False)
            stats = benchlib.report(m, lambda err, i=i: f"move {i + 1}: {err.strip()[-300:]}")
            if stats["verified_pages"] == 0:
                raise RuntimeError(f"move {i + 1} did not verify")
            moves.append({
                "bytes": stats["bytes"],
                "shared_pages": stats.get("shared_pages", 0),
                "shared_missed": stats.get("shared_missed", 0),
                "total_s": stats["total_secs"],
                "downtime_ms": stats["downtime_ms"],
            })
    finally:
        benchlib.reap(*procs, grace=2)
    return {
        "bytes_mib": sum(m["bytes"] for m in moves) / 2**20,
        "first_mib": moves[0]["bytes"] / 2**20,
        "later_mib": sum(m["bytes"] for m in moves[1:]) / max(len(moves) - 1, 1) / 2**20,
        "shared_pages": sum(m["shared_pages"] for m in moves),
        "shared_missed": sum(m["shared_missed"] for m in moves),
        "total_s": sum(m["total_s"] for m in moves),
        "downtime_ms": max(m["downtime_ms"] for m in moves),
        "moves": moves,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vms", type=int, default=4)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--bandwidth", help="the lab link's rate (e.g. 1gbit, as a drain across hosts sees); default: unlimited")
    ap.add_argument("--out", default="share", help="results file name under bench/results/")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    benchlib.lab_up(ferry, 2, a.bandwidth)
    configs = ("separate", "shared")
    runs = {c: [] for c in configs}
    errors = []
    port = 7800
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(a.runs):
                for c in benchlib.alternated(configs, i):
                    port += a.vms
                    try:
                        r = once(ferry, c, tmp, a.vms, a.mib, port)
                        runs[c].append(r)
                        print(f"run {i + 1} {c}: {r['bytes_mib']:.1f} MiB, "
                              f"{r['shared_pages']} shared, {r['total_s']:.2f} s", file=sys.stderr)
                    except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                        errors.append(f"run {i + 1} {c}: {e}")
                        print(errors[-1], file=sys.stderr)
    finally:
        sh(ferry, "lab", "down", check=False)
    keys = ["bytes_mib", "first_mib", "later_mib", "shared_pages", "shared_missed", "total_s", "downtime_ms"]
    med = {c: benchlib.medians(rs, keys) for c, rs in runs.items() if rs}
    ratio = med["shared"]["bytes_mib"] / med["separate"]["bytes_mib"] if len(med) == 2 else None
    out_dir = os.path.join(ROOT, "bench/results")
    command = benchlib.recorded_command("share.py")
    benchlib.write_json(os.path.join(out_dir, f"{a.out}.json"),
                        {"command": command, "runs": runs, "medians": med, "ratio": ratio,
                         "errors": errors}, indent=1)
    lines = ["# Pages shared across VMs moving to one host (protocol v14)", "",
             f"Command: `{command}` (lab hosts ferry-h1 to ferry-h2, link {a.bandwidth or 'unlimited (veth)'}, "
             "mutual TLS, this machine: 2 cores). "
             f"{a.vms} VMs of {a.mib + 256} MiB each holding the same {a.mib} MiB of random data move one "
             f"after another by precopy with --verify; medians of {a.runs} runs, the configurations "
             "alternating run by run. `separate`: destinations without --share-pages; `shared`: with it.", "",
             "| config | MiB on the wire (all moves) | first move MiB | each later move MiB | pages sent by reference | missed | time s (all moves) | largest downtime ms |",
             "|---|---|---|---|---|---|---|---|"]
    for c in configs:
        m = med.get(c)
        if m:
            lines.append(f"| {c} | {m['bytes_mib']:.1f} | {m['first_mib']:.1f} | {m['later_mib']:.1f} | "
                         f"{m['shared_pages']:.0f} | {m['shared_missed']:.0f} | {m['total_s']:.2f} | "
                         f"{m['downtime_ms']:.2f} |")
    if ratio is not None:
        lines += ["", f"Bytes of the shared moves against the separate ones: **{ratio:.3f}** "
                      "(issue 34's goal: <= 0.3)."]
    lines += benchlib.error_lines(errors)
    benchlib.write_md(os.path.join(out_dir, f"{a.out}.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
