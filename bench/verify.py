#!/usr/bin/env python3
"""What --verify adds to a precopy's downtime: the same migration with and
without it, alternating run by run on loopback (TLS, as by default), and
with --old BINARY also the build before, in the same runs.

Since protocol v12 each side hashes every page as it goes and as it lands;
the pause compares only their digests, and the source checks its memory
against what it sent after the VM runs at the destination (`verify after
ms`, outside the downtime). Before, both sides hashed all of memory in the
pause.

- idle: an idle --mem VM (little data to hash).
- filled: --fill-mib MiB of random pages in a --mem VM, then quiet (what
  the old verification hashed in the pause).

Results: bench/results/verify.{json,md}.

Usage: python3 bench/verify.py [--runs 3] [--mem 1G] [--fill-mib 768] [--old PATH]
"""
import argparse
import os
import statistics
import sys

import benchlib
import tls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(ferry, env, mem, workload, verify):
    """One migration; its figures (with the verification's own times)."""
    extra = ("--verify",) if verify else ()
    r = tls.migrate_once(ferry, env, "tls", mem, workload, 1.0, extra, full=True)
    m = r.pop("stats")
    parts = m.get("downtime_parts", {})
    r["verify_part_ms"] = parts.get("verify", 0.0) + parts.get("destination_verify", 0.0)
    r["verify_after_ms"] = m.get("verify_after_ms", 0.0)
    r["verified_pages"] = m.get("verified_pages", 0)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--fill-mib", type=int, default=768)
    benchlib.add_build_args(ap, ROOT)
    a = ap.parse_args()
    env = benchlib.tls_env(a.ferry, "verify")
    builds = benchlib.builds_of(a)
    cases = {
        "idle": "idle",
        "filled": f"fill:content=worst,mib={a.fill_mib}",
    }
    combos = [(b, v) for b in builds for v in (False, True)]
    runs = {c: {f"{b} {'verify' if v else 'plain'}": [] for b, v in combos} for c in cases}
    errors = []
    for i in range(a.runs):
        for case, wl in cases.items():
            # Rotate the order run by run.
            order = combos[i % len(combos):] + combos[:i % len(combos)]
            for b, v in order:
                key = f"{b} {'verify' if v else 'plain'}"
                try:
                    r = one(builds[b], env, a.mem, wl, v)
                    runs[case][key].append(r)
                    print(f"run {i + 1} {case} {key}: {r}", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal
                    errors.append(f"run {i + 1} {case} {key}: {e}")
                    print(errors[-1], file=sys.stderr)
    res = {c: {k: benchlib.medians(rs) for k, rs in by.items() if rs} for c, by in runs.items()}
    out_dir = os.path.join(ROOT, "bench/results")
    benchlib.write_json(os.path.join(out_dir, "verify.json"),
                        {"command": benchlib.recorded_command("verify.py"), "runs": runs,
                         "medians": res, "errors": errors}, indent=1)
    lines = ["# What --verify adds to a precopy's downtime", "",
             f"Command: `{benchlib.recorded_command('verify.py')}` (loopback, TLS, this "
             f"machine: 2 cores, PVM). {a.mem} VM. Medians of {a.runs}; builds and "
             "with/without alternated run by run.", "",
             "| case | build | verify | downtime ms | verify in pause ms | verify after ms | total s |",
             "|---|---|---|---|---|---|---|"]
    for case in cases:
        for b, v in combos:
            key = f"{b} {'verify' if v else 'plain'}"
            m = res[case].get(key)
            if m:
                lines.append(f"| {case} | {b} | {'yes' if v else 'no'} | {m['downtime_ms']:.2f} | "
                             f"{m['verify_part_ms']:.2f} | {m['verify_after_ms']:.1f} | "
                             f"{m['total_s']:.3f} |")
    lines += ["", "Added by --verify (median of each run's own pair, same build):", ""]
    for case in cases:
        for b in builds:
            with_, without = runs[case][f"{b} verify"], runs[case][f"{b} plain"]
            if len(with_) == len(without) == a.runs:
                added = statistics.median(w["downtime_ms"] - p["downtime_ms"]
                                          for w, p in zip(with_, without))
                lines.append(f"- {case}, {b}: {added:+.2f} ms")
    lines += benchlib.error_lines(errors)
    benchlib.write_md(os.path.join(out_dir, "verify.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
