#!/usr/bin/env python3
"""Postcopy benchmark: postcopy migrations between two lab hosts (network
namespaces, `ferry lab`), with the destination's async page faults on and
off, prefetch 0 and 8, over the plain link and with added round-trip delay
(`ferry lab delay`, a TCP proxy on the destination host: this kernel has no
netem).

Per cell, the median of --runs migrations between fresh VMMs: downtime,
postcopy time (switch to every page there), faults (major; absorbed by APF
vs blocking a vCPU), major-fault service time p50/p99 (fault read to page
landed) and the lowest guest execution ratio in a 100 ms window. In the same
run, `ferry lab uffd-cost` measures the bare cost of a local userfaultfd
fault on this host: the floor under any remote fault.

Needs root (network namespaces), /dev/kvm and userfaultfd. Results:
bench/results/postcopy.{json,md}.

Usage: python3 bench/postcopy.py [--runs 3] [--mem 1G] [--rtts 0,0.15,1]
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

SRC, DST = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2")


def workload(mem):
    """dirty over half the VM's memory, plus one compute task."""
    mib = int(mem[:-1]) * (1024 if mem[-1] in "gG" else 1)
    return f"dirty:rate=256,wss={mib // 2},pattern=random+compute:tasks=1"


def sh(*args, check=True, **kw):
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def in_host(host, *args):
    return ["ip", "netns", "exec", host, *args]


def migrate_once(ferry, mem, rtt, apf, prefetch, tmp, port):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    for p in (src_sock, dst_sock):
        if os.path.exists(p):
            os.unlink(p)
    common = ["run", "--mem", mem, "--vcpus", "2", "--workload", workload(mem), "--quiet", "--json"]
    listen = f"{DST[1]}:{port}"
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{listen}",
                                   "--apf", apf, "--control", dst_sock, "--duration", "2s"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, "--control", src_sock, "--duration", "120s"),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proxy = None
    to = listen
    if rtt > 0:
        proxy = subprocess.Popen(in_host(DST[0], ferry, "lab", "delay", "--listen", f"{DST[1]}:0",
                                         "--to", listen, "--rtt-ms", str(rtt)),
                                 stdout=subprocess.PIPE, text=True)
        to = proxy.stdout.readline().strip()
    try:
        deadline = time.time() + 20
        while not (os.path.exists(src_sock) and os.path.exists(dst_sock)):
            if time.time() > deadline:
                raise RuntimeError("VMMs did not start")
            time.sleep(0.05)
        time.sleep(2.5)  # boot, and let dirty fill its working set
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{to}", "--mode", "postcopy",
                        "--prefetch", str(prefetch), "--json"), check=False)
        if m.returncode != 0:
            raise RuntimeError(m.stderr)
        stats = json.loads(m.stdout)
        dst.wait(timeout=60)
    finally:
        for p in (src, dst, proxy):
            if p and p.poll() is None:
                p.kill()
                p.wait()
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
        "min_exec_ratio": min((b["exec_ratio"] for b in f["series"]), default=1.0),
        "prefetched": p["prefetched_pages"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--rtts", default="0,0.15,1")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    up = sh(ferry, "lab", "up", "2", check=False)
    if up.returncode != 0:
        sys.exit(f"cannot build the lab: {up.stderr}")
    cells = []
    try:
        floor = json.loads(sh(ferry, "lab", "uffd-cost").stdout)
        port = 7810
        with tempfile.TemporaryDirectory() as tmp:
            for rtt in [float(x) for x in a.rtts.split(",")]:
                for apf in ("on", "off"):
                    for prefetch in (0, 8):
                        runs = []
                        for _ in range(a.runs):
                            port += 1
                            runs.append(migrate_once(ferry, a.mem, rtt, apf, prefetch, tmp, port))
                        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                        cell = {"rtt_ms": rtt, "apf": apf, "prefetch": prefetch, "median": med, "runs": runs}
                        cells.append(cell)
                        print(json.dumps({k: cell[k] for k in ("rtt_ms", "apf", "prefetch", "median")}),
                              flush=True)
    finally:
        sh(ferry, "lab", "down", check=False)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("postcopy.py")
    with open(os.path.join(out, "postcopy.json"), "w") as f:
        json.dump({"command": command, "workload": workload(a.mem), "mem": a.mem,
                   "uffd_floor_us": floor, "cells": cells}, f, indent=1)
    md = os.path.join(out, "postcopy.md")
    notes = benchlib.kept_notes(md)
    lines = [
        "# Postcopy: faults, APF and prefetch",
        "",
        f"Command: `{command}` (medians of {a.runs}; {a.mem} VM, 2 vCPUs, `{workload(a.mem)}`;",
        "delay added by `ferry lab delay` on the destination host).",
        "",
        f"Bare local userfaultfd fault on this host (`ferry lab uffd-cost`, same run): "
        f"p50 {floor['p50']:.0f} µs, p99 {floor['p99']:.0f} µs.",
        "",
        "| added RTT | APF | prefetch | downtime ms | postcopy s | faults | major | async worker | absorbed by APF | stopped a vCPU | p50 µs | p99 µs | min exec ratio | prefetched |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['rtt_ms']} ms | {c['apf']} | {c['prefetch']} | {m['downtime_ms']:.2f} | {m['postcopy_s']:.3f} | "
            f"{m['faults']:.0f} | {m['major']:.0f} | {m['async_worker']:.0f} | {m['apf_absorbed']:.0f} | {m['blocked']:.0f} | {m['p50_us']:.0f} | "
            f"{m['p99_us']:.0f} | {m['min_exec_ratio']:.2f} | {m['prefetched']:.0f} |")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n" + notes)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
