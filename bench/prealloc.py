#!/usr/bin/env python3
"""What a destination's RAM populated ahead of the stream gives a precopy
and (since protocol v13, which gives it back at the opening) no longer
costs a postcopy: 1 GiB random in a 2 GiB VM on loopback with mutual TLS,
destination `--prealloc off` and `waiting`, precopy and postcopy, this
build against an earlier one (--old), alternating run by run.

Figures per cell: total time, bulk rate (non-zero bytes moved / total
time), downtime, and the bytes the destination gave back. Results:
bench/results/prealloc.{json,md}.

Usage: python3 bench/prealloc.py [--runs 3] [--old PATH] [--mem 2G] [--fill-mib 1024]
"""
import argparse
import os
import sys

import benchlib
import tls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--fill-mib", type=int, default=1024)
    benchlib.add_build_args(ap, ROOT)
    a = ap.parse_args()
    env = benchlib.tls_env(a.ferry, "prealloc")
    builds = benchlib.builds_of(a)
    wl = f"fill:content=worst,mib={a.fill_mib}"
    cells = [(mode, pre) for mode in ("precopy", "postcopy") for pre in ("off", "waiting")]
    runs = {f"{m} {p}": {b: [] for b in builds} for m, p in cells}
    errors = []
    for i in range(a.runs):
        for mode, pre in cells:
            key = f"{mode} {pre}"
            for b in benchlib.alternated(builds, i):
                try:
                    r = tls.migrate_once(builds[b], env, "tls", a.mem, wl, 1.0, full=True,
                                         extra=("--mode", mode), dst_extra=("--prealloc", pre))
                    m = r.pop("stats")
                    r["rate_mib_s"] = a.fill_mib / r["total_s"]
                    r["released_mib"] = m.get("destination_released_bytes", 0) / 2**20
                    runs[key][b].append(r)
                    print(f"run {i + 1} {key} {b}: {r}", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal
                    errors.append(f"run {i + 1} {key} {b}: {e}")
                    print(errors[-1], file=sys.stderr)
    res = {k: {b: benchlib.medians(rs) for b, rs in by.items() if rs} for k, by in runs.items()}
    out_dir = os.path.join(ROOT, "bench/results")
    command = benchlib.recorded_command("prealloc.py")
    benchlib.write_json(os.path.join(out_dir, "prealloc.json"),
                        {"command": command, "runs": runs, "medians": res, "errors": errors},
                        indent=1)
    lines = ["# The destination's RAM populated ahead: precopy speed, postcopy downtime", "",
             f"Command: `{command}` (loopback, TLS, this machine: 2 cores, PVM). "
             f"{a.fill_mib} MiB random in a {a.mem} VM; medians of {a.runs}; builds alternated "
             "run by run (both ends of a migration run the same build).", "",
             "| mode | dst --prealloc | build | total s | MiB/s | downtime ms | given back MiB | runs (total s / downtime ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, pre in cells:
        key = f"{mode} {pre}"
        for b in builds:
            m = res[key].get(b)
            if m:
                each = ", ".join(f"{r['total_s']:.2f}/{r['downtime_ms']:.1f}" for r in runs[key][b])
                lines.append(f"| {mode} | {pre} | {b} | {m['total_s']:.2f} | {m['rate_mib_s']:.0f} | "
                             f"{m['downtime_ms']:.1f} | {m['released_mib']:.0f} | {each} |")
    lines += benchlib.error_lines(errors)
    benchlib.write_md(os.path.join(out_dir, "prealloc.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
