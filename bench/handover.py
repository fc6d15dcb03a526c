#!/usr/bin/env python3
"""Zero-copy handover against precopy over loopback (issue 13), same run.

For each VM size (256 MiB to 16 GiB) and workload (idle, with nearly no
memory in use; resident, filled with min(half the RAM, 4 GiB) of data and
then idle; dirtying at 1 GiB/s over min(1 GiB, half the RAM)): boot a VM, hand it over to a new VMM
process (`ferry handover`), then live-migrate the same VM from that process
to a destination on this host over TCP loopback (`ferry migrate`, precopy,
default settings). Per move: downtime, total time, bytes of guest memory
copied, host CPU seconds, and how much host memory the move allocated:
the growth of Shmem in /proc/meminfo (guest RAM is memfds, so a copy shows
up there; a handover maps the same pages and should add nothing).

Cells are medians of --runs runs. Results: bench/results/handover.{json,md}.

Usage: python3 bench/handover.py [--runs 3] [--sizes 256M,1G,4G,16G]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import benchlib
from benchlib import sh


def shmem_bytes():
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def mib(size):
    n, unit = int(size[:-1]), size[-1].upper()
    return n * {"M": 1, "G": 1024}[unit]


def wait_progress(ferry, sock, above, timeout=60):
    """Waits until the workload counter passes `above` (the dirty workload
    has touched its working set once)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = benchlib.status(ferry, sock)
        if s:
            ws = s["metrics"]["workloads"]
            if not ws or ws[0]["progress"] > above:
                return
        time.sleep(0.1)
    raise RuntimeError("the workload did not start")


def wait_done(ferry, sock, timeout=120):
    """Waits until every task of the workload is done (fill has filled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = benchlib.status(ferry, sock)
        if s and all(w["tasks"] > 0 and w["tasks_done"] == w["tasks"] for w in s["metrics"]["workloads"]):
            return
        time.sleep(0.2)
    raise RuntimeError("the workload did not finish filling")


def once(ferry, size, workload, tmp, port):
    sock, dst_sock = os.path.join(tmp, "vm.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(sock, dst_sock)
    common = ["run", "--mem", size, "--workload", workload, "--quiet", "--json"]
    src = subprocess.Popen([ferry, *common, "--control", sock, "--duration", "300s"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dst = None
    try:
        benchlib.wait_for(sock)
        if "wss=" in workload:
            wait_progress(ferry, sock, int(workload.split("wss=")[1]) << 20)
        elif workload.startswith("fill"):
            wait_done(ferry, sock)
        else:
            wait_progress(ferry, sock, -1)
        time.sleep(0.5)
        m0 = shmem_bytes()
        h = sh(ferry, "handover", sock, "--json", check=False)
        m1 = shmem_bytes()
        ho = benchlib.report(h, lambda err: f"handover: {err.strip()}")
        time.sleep(0.5)
        dst = subprocess.Popen([ferry, *common, "--incoming", f"tcp:127.0.0.1:{port}",
                                "--control", dst_sock, "--duration", "3s"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        benchlib.wait_for(dst_sock)
        time.sleep(0.3)
        m2 = shmem_bytes()
        mg = sh(ferry, "migrate", sock, "--to", f"tcp:127.0.0.1:{port}", "--json", check=False)
        m3 = shmem_bytes()
        pc = benchlib.report(mg, lambda err: f"precopy: {err.strip()}")
    finally:
        # The VM may live in the handover's new process: end it by its socket.
        sh(ferry, "ctl", sock, "quit", check=False)
        sh(ferry, "ctl", dst_sock, "quit", check=False)
        benchlib.reap(src)
        if dst:
            try:
                dst.wait(timeout=10)
            except subprocess.TimeoutExpired:
                benchlib.reap(dst)
    return {
        "handover": {
            "downtime_ms": ho["downtime_ms"],
            "total_ms": ho["total_ms"],
            "build_ms": ho["build_ms"],
            "copied_bytes": ho["memory_bytes_copied"],
            "socket_bytes": ho["socket_bytes"],
            "shmem_growth_mib": (m1 - m0) / 2**20,
            "cpu_s": ho["source_cpu_s"] + ho["destination_cpu_s"],
        },
        "precopy": {
            "downtime_ms": pc["downtime_ms"],
            "total_ms": pc["total_secs"] * 1e3,
            "copied_bytes": pc["bytes"],
            "rounds": len(pc["rounds"]),
            "shmem_growth_mib": (m3 - m2) / 2**20,
            "cpu_s": pc["source_cpu_s"] + pc["destination_cpu_s"],
        },
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="256M,1G,4G,16G")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    cells = []
    port = 7800
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            wss = min(1024, mib(size) // 2)
            fill = min(mib(size) // 2, 4096)
            for workload in ("idle", f"fill:mib={fill}", f"dirty:rate=1024,wss={wss}"):
                runs, errors = [], []
                for _ in range(a.runs):
                    port += 1
                    try:
                        runs.append(once(ferry, size, workload, tmp, port))
                    except (RuntimeError, ValueError, KeyError) as e:
                        errors.append(str(e))
                        print(f"{size} {workload}: a run failed: {e}", flush=True)
                if not runs:
                    continue
                med = {how: benchlib.medians([r[how] for r in runs]) for how in runs[0]}
                cell = {"size": size, "workload": workload, "median": med, "runs": runs, "errors": errors}
                cells.append(cell)
                print(json.dumps({k: cell[k] for k in ("size", "workload", "median")}), flush=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("handover.py")
    benchlib.write_json(os.path.join(out, "handover.json"), {"command": command, "cells": cells}, indent=1)
    md = os.path.join(out, "handover.md")
    lines = [
        "# Zero-copy handover beside precopy over loopback",
        "",
        f"Command: `{command}` (medians of {a.runs}; 1 vCPU; the same VM is handed over, then migrated",
        "from its new process to a destination on this host over TCP loopback, default precopy settings).",
        "",
        "Copied: guest memory bytes that crossed a socket. Shmem +: growth of Shmem in /proc/meminfo across",
        "the move (guest RAM is memfds: a copy allocates there). CPU: host CPU seconds of both VMMs' move",
        "work (handover: the old VMM's handover thread and the new process from exec to running the VM;",
        "precopy: both sides' migration threads).",
        "",
        "| size | workload | move | downtime ms | total ms | copied MiB | Shmem + MiB | CPU ms | speedup (total) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        h, p = c["median"]["handover"], c["median"]["precopy"]
        for name, m in (("handover", h), ("precopy", p)):
            r = p['total_ms'] / h['total_ms']
            speed = (f"{r:.0f}x" if r >= 10 else f"{r:.2f}x") if name == "handover" else ""
            lines.append(
                f"| {c['size']} | `{c['workload']}` | {name} | {m['downtime_ms']:.2f} | {m['total_ms']:.1f} | "
                f"{m['copied_bytes'] / 2**20:.1f} | {m['shmem_growth_mib']:.0f} | {m['cpu_s'] * 1e3:.1f} | {speed} |")
    lines += benchlib.failed_runs(cells, lambda c: f"{c['size']} `{c['workload']}`")
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
