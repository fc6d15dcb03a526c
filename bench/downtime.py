#!/usr/bin/env python3
"""A precopy's downtime and its parts, this build against an earlier one
(--old), alternating run by run on loopback with mutual TLS (the default):

- idle SIZE: an idle VM of each --idle-mem size (a comma list, e.g.
  256M,1G,4G,16G: issue 34 asks for < 1 ms at each, flat);
- random: --fill-mib MiB of random pages in a --mem VM (a few pages left
  for the pause);
- with --busy N, "busy 1G": a 1 GiB VM whose 2 vCPUs compute, moved while
  N other VMs (512 MiB, 2 vCPUs each, computing and dirtying 32 MiB/s) keep
  both cores busy for the whole bench: the pause on a loaded host.

The parts are `ferry migrate --json`'s downtime_parts (pause: parking the
vCPUs, counted since session 40; last round; state; destination: Complete
to Started). Results: bench/results/downtime.{json,md} (--out names others).

Usage: python3 bench/downtime.py [--runs 3] [--old PATH] [--mem 2G] [--fill-mib 1024] [--idle-mem 1G[,4G..]] [--no-random]
       [--no-idle] [--busy N]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import benchlib
import tls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("pause", "last_round", "save_state", "destination")
BUSY = "compute:tasks=1+dirty:rate=32,wss=128,pattern=random"


def start_busy(ferry, env, n):
    """N VMs that keep the cores busy: their processes, and the directory
    of their control sockets."""
    d = tempfile.mkdtemp(prefix="ferry-downtime-busy-")
    return d, [subprocess.Popen([ferry, "run", "--mem", "512M", "--vcpus", "2", "--workload", BUSY, "--quiet",
                                 "--control", os.path.join(d, f"busy{k}.sock"), "--duration", "3600s"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for k in range(n)]


def run_all(a, builds, cases, env):
    """Every case, a.runs times, the builds alternated: (runs, errors)."""
    runs = {c: {b: [] for b in builds} for c in cases}
    errors = []
    for i in range(a.runs):
        for case, (mem, wl) in cases.items():
            for b in benchlib.alternated(builds, i):
                try:
                    dst = ("--prealloc", a.dst_prealloc) if a.dst_prealloc else ()
                    r = tls.migrate_once(builds[b], env, "tls", mem, wl, 1.0, full=True, dst_extra=dst)
                    parts = r.pop("stats")["downtime_parts"]
                    r.update({p: parts.get(p, 0.0) for p in PARTS})
                    runs[case][b].append(r)
                    print(f"run {i + 1} {case} {b}: {r}", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal
                    errors.append(f"run {i + 1} {case} {b}: {e}")
                    print(errors[-1], file=sys.stderr)
    return runs, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--fill-mib", type=int, default=1024)
    ap.add_argument("--idle-mem", default="1G", help="idle VM sizes, a comma list")
    ap.add_argument("--no-random", action="store_true", help="only the idle cases")
    ap.add_argument("--out", default="downtime", help="results name under bench/results/")
    ap.add_argument("--dst-prealloc", help="the destination's --prealloc (default: its default)")
    ap.add_argument("--no-idle", action="store_true", help="no idle cases")
    ap.add_argument("--busy", type=int, default=0, help="VMs keeping the cores busy (adds the busy case)")
    benchlib.add_build_args(ap, ROOT)
    a = ap.parse_args()
    env = benchlib.tls_env(a.ferry, "downtime")
    builds = benchlib.builds_of(a)
    sizes = a.idle_mem.split(",")
    cases = {} if a.no_idle else {("idle" if len(sizes) == 1 else f"idle {s}"): (s, "idle") for s in sizes}
    if not a.no_random:
        cases["random"] = (a.mem, f"fill:content=worst,mib={a.fill_mib}")
    if a.busy:
        cases["busy 1G"] = ("1G", "compute:tasks=2")
    busy_dir, busy = start_busy(a.ferry, env, a.busy)
    try:
        runs, errors = run_all(a, builds, cases, env)
    finally:
        benchlib.reap(*busy, grace=2.0)
        shutil.rmtree(busy_dir, ignore_errors=True)
    res = {c: {b: benchlib.medians(rs) for b, rs in by.items() if rs} for c, by in runs.items()}
    out_dir = os.path.join(ROOT, "bench/results")
    benchlib.write_json(os.path.join(out_dir, f"{a.out}.json"),
                        {"command": benchlib.recorded_command("downtime.py"), "runs": runs,
                         "medians": res, "errors": errors}, indent=1)
    lines = ["# A precopy's downtime and its parts", "",
             f"Command: `{benchlib.recorded_command('downtime.py')}` (loopback, TLS, this machine: "
             f"2 cores, PVM). Medians of {a.runs}; builds alternated run by run. Times in ms; the "
             "pause part (parking the vCPUs) is counted only since session 40."
             + (f" {a.busy} busy VMs ({BUSY}, 512 MiB, 2 vCPUs) ran throughout." if a.busy else ""), "",
             "| case | build | downtime | pause | last round | state | destination | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for b in builds:
            m = res[case].get(b)
            if m:
                each = ", ".join(f"{r['downtime_ms']:.2f}" for r in runs[case][b])
                lines.append(f"| {case} | {b} | {m['downtime_ms']:.2f} | {m['pause']:.2f} | "
                             f"{m['last_round']:.2f} | {m['save_state']:.2f} | "
                             f"{m['destination']:.2f} | {each} |")
    lines += benchlib.error_lines(errors)
    benchlib.write_md(os.path.join(out_dir, f"{a.out}.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
