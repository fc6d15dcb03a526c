#!/usr/bin/env python3
"""What mutual TLS costs a migration: the same precopy with TLS (a fleet
made here with `ferry pki`) and with --insecure, alternating run by run on
loopback (the machines are shared and noisy: compare within a run).

- random: --fill-mib MiB of incompressible pages (fill:content=worst) in a
  --mem VM, the issue's "1 GiB random in a 2 GiB VM"; total migration time
  and downtime.
- idle: an idle --idle-mem VM; downtime.
- postcopy: a dirtying 1G VM moved by postcopy (prefetch 0): the demand
  faults' service time p50 and p99 (fault read to page landed), where TLS
  adds a sealed request and a sealed answer to every fault.

Both VMMs of a run use the same security. Results: bench/results/tls.{json,md}.

Usage: python3 bench/tls.py [--runs 3] [--mem 2G] [--fill-mib 1024] [--idle-mem 1G]
"""
import argparse
import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile
import time

import benchlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def mem_mib(mem):
    """MiB in a --mem size such as 2G or 512M."""
    return int(mem[:-1]) * (1024 if mem[-1] in "Gg" else 1)


def warm_memory(mib):
    """Writes and frees `mib` MiB of shared memory (what a VM's RAM is).
    This machine is itself a guest (PVM): a page its kernel has never
    handed out costs the host a fault on first touch, so a VM pair that
    came after a smaller one ran 0.4-1.2 s slower whichever its security.
    Written first, the pages the pair gets are ones the host has backed.
    Never more than the host has free less 2 GiB (a 16 GiB pair asks for
    more than the host has: filling it stalled the whole machine)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(l.split()[1]) for l in f if l.startswith("MemAvailable:")) // 1024
        mib = max(0, min(mib, avail - 2048))
    except (OSError, StopIteration, ValueError):
        pass
    path = "/dev/shm/ferry-tls-bench-warm"
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}",
                        "status=none"], check=False)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def migrate_once(ferry, env, security, mem, workload, settle, extra=(), full=False, dst_extra=(),
                 old_dst=None):
    """One source and destination on loopback, migrated once: the
    `ferry migrate --json` figures (with `full`, all of them as "stats").
    `dst_extra` goes to the destination's `ferry run`; `old_dst` runs the
    destination with another build."""
    # The page cache of earlier builds makes whichever VM pair comes first
    # reclaim it (0.5-0.7 s for 2 x 2 GiB here); dropped before each, as
    # root, so both modes start from the same free memory.
    if os.geteuid() == 0:
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    warm_memory(3 * mem_mib(mem))
    d = tempfile.mkdtemp(prefix="ferry-tls-bench-")
    src, dst = os.path.join(d, "src.sock"), os.path.join(d, "dst.sock")
    port = free_port()
    flags = ["--insecure"] if security == "plaintext" else []
    common = [ferry, *flags, "run", "--mem", mem, "--vcpus", "2", "--workload", workload, "--quiet"]
    s = subprocess.Popen(common + ["--control", src, "--duration", "300s"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dst_common = [old_dst or ferry, *common[1:]]
    t = subprocess.Popen(dst_common + ["--control", dst, "--duration", "5s",
                                       "--incoming", f"tcp:127.0.0.1:{port}", *dst_extra], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        benchlib.wait_for(src, dst)
        # A fill is waited for until it is done (a fixed pause let the
        # first migration of a pair start while the guest still filled, on
        # a slow day), then the settle.
        deadline = time.time() + 120
        while workload.startswith("fill") and time.time() < deadline:
            st = benchlib.status(ferry, src) or {}
            ws = (st.get("metrics") or {}).get("workloads") or []
            if ws and all(w["tasks_done"] >= w["tasks"] for w in ws if w["spec"].startswith("fill")):
                break
            time.sleep(0.2)
        # A destination that preallocates its RAM while it waits is given
        # the time to finish; a migration that started before that ended
        # would pay the rest of the first touches, whichever its security.
        while time.time() < deadline:
            pre = (benchlib.status(ferry, dst) or {}).get("preallocated") or {}
            if not pre.get("running"):
                break
            time.sleep(0.2)
        time.sleep(settle)
        out = subprocess.run([ferry, "migrate", src, "--to", f"tcp:127.0.0.1:{port}",
                              "--json", "--no-timeline", *extra],
                             env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip()[-300:])
        m = json.loads(out.stdout)
        r = {"total_s": m["total_secs"], "downtime_ms": m["downtime_ms"],
             "cpu_s": m["source_cpu_s"] + m["destination_cpu_s"]}
        if m.get("postcopy"):
            lat = m["postcopy"]["faults"]["latency_us"]
            r.update(p50_us=lat["p50"], p99_us=lat["p99"], faults=m["postcopy"]["faults"]["faults"])
        if full:
            r["stats"] = m
        return r
    finally:
        benchlib.reap(s, t, grace=2.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--fill-mib", type=int, default=1024)
    ap.add_argument("--idle-mem", default="1G")
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    a = ap.parse_args()
    env = benchlib.tls_env(a.ferry, "tls")
    cases = {
        "random": (a.mem, f"fill:content=worst,mib={a.fill_mib}", 1.0, ()),
        "idle": (a.idle_mem, "idle", 1.0, ()),
        "postcopy": ("1G", "dirty:rate=256,wss=512,pattern=random+compute:tasks=1", 2.5,
                     ("--mode", "postcopy", "--prefetch", "0")),
    }
    runs = {c: {"tls": [], "plaintext": []} for c in cases}
    errors = []
    for i in range(a.runs):
        for case, (mem, wl, settle, extra) in cases.items():
            # Alternate which goes first, run by run.
            order = ["tls", "plaintext"] if i % 2 == 0 else ["plaintext", "tls"]
            for sec in order:
                try:
                    r = migrate_once(a.ferry, env, sec, mem, wl, settle, extra)
                    runs[case][sec].append(r)
                    print(f"run {i + 1} {case} {sec}: {r}", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a failed run is recorded, not fatal
                    errors.append(f"run {i + 1} {case} {sec}: {e}")
                    print(errors[-1], file=sys.stderr)
    res = {}
    for case in cases:
        res[case] = {sec: benchlib.medians(rs) for sec, rs in runs[case].items() if rs}
    out_dir = os.path.join(ROOT, "bench/results")
    benchlib.write_json(os.path.join(out_dir, "tls.json"),
                        {"command": benchlib.recorded_command("tls.py"), "runs": runs,
                         "medians": res, "errors": errors}, indent=1)
    lines = ["# Mutual TLS against plaintext, same run, alternating", "",
             f"Command: `{benchlib.recorded_command('tls.py')}` (loopback, this machine: 2 cores, PVM).",
             f"Medians of {a.runs}.", "",
             "| case | security | total s | CPU s | downtime ms | fault p50 µs | fault p99 µs |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda m, k: f"{m[k]:.0f}" if k in m else "–"  # noqa: E731
    for case in cases:
        for sec in ("plaintext", "tls"):
            m = res[case].get(sec)
            if m:
                lines.append(f"| {case} | {sec} | {m['total_s']:.3f} | {m['cpu_s']:.2f} | "
                             f"{m['downtime_ms']:.2f} | {fmt(m, 'p50_us')} | {fmt(m, 'p99_us')} |")
        if "tls" in res[case] and "plaintext" in res[case]:
            t, p = res[case]["tls"], res[case]["plaintext"]
            ratio = lambda k: (f"{t[k] / max(p[k], 1e-9):.2f}x" if k in t and k in p else "–")  # noqa: E731
            lines.append(f"| {case} | TLS / plaintext | {t['total_s'] / p['total_s']:.3f}x | "
                         f"{ratio('cpu_s')} | {ratio('downtime_ms')} | {ratio('p50_us')} | "
                         f"{ratio('p99_us')} |")
            # Each run's pair ran back to back: the median of their ratios
            # is less moved by the machine's drift over the whole bench.
            pairs = [tr["total_s"] / pr["total_s"]
                     for tr, pr in zip(runs[case]["tls"], runs[case]["plaintext"])]
            if len(pairs) == a.runs:
                lines.append(f"| {case} | TLS / plaintext, median of run pairs | "
                             f"{statistics.median(pairs):.3f}x | | | | |")
    lines += benchlib.error_lines(errors)
    benchlib.write_md(os.path.join(out_dir, "tls.md"), lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
