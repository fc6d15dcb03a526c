#!/usr/bin/env python3
"""Bulk throughput: how fast precopy's first round moves memory, against what
one plain TCP stream carries on the same path, measured alternately in the
same run (the machines are shared and noisy; compare within a run).

A VM holds --fill-mib MiB of incompressible pages (`fill:content=worst`) and
migrates over loopback, uncompressed, with each bulk stream count of
--streams; the figure is round 0's wire rate. The destination runs with
--prealloc now; once with default settings (default streams; since session
40 a waiting destination preallocates in the background); and once with
--prealloc off (one stream): the first touch of fresh host memory runs at
~0.4-1 GB/s on this machine, so without preallocation the destination's
page faults, not the copy, set the pace.

Results: bench/results/throughput.{json,md}.

With --against OLD_BINARY it compares two builds instead: default settings
only, the two binaries alternated (which goes first flips each pair), each
migration preceded by writing --warm-mib MiB into /dev/shm and freeing it.
This machine is itself a VM: memory its host has not backed lately costs
several times more on first touch, and whichever run came first in a pair
got such memory (results: bench/results/throughput-ab.{json,md}).

Usage: python3 bench/throughput.py [--runs 3] [--mem 2G] [--fill-mib 1536] [--streams 1,2,3]
       python3 bench/throughput.py --against OLD [--ferry NEW] [--runs 8] [--warm-mib 4096]
"""
import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import benchlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tcp_stream(seconds=2.0):
    """(bytes/s, CPU s per GiB) of one loopback TCP stream (1 MiB writes,
    recv_into a reused buffer); CPU is both ends' threads, kernel included."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = [0]

    def rx():
        c, _ = srv.accept()
        buf = bytearray(1 << 20)
        while True:
            n = c.recv_into(buf)
            if not n:
                break
            got[0] += n

    t = threading.Thread(target=rx)
    t.start()
    c = socket.create_connection(srv.getsockname())
    data = bytes(1 << 20)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.time()
    while time.time() - t0 < seconds:
        c.sendall(data)
    c.close()
    t.join()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return got[0] / (time.time() - t0), cpu / (got[0] / 2**30)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def migrate_once(ferry, mem, mib, prealloc, tmp, streams=1, env=None, flags=()):
    """Round 0's rate and the migration's figures; `prealloc` is the
    destination's --prealloc (None: its default), `streams` the source's
    --streams (None: its default); `env` and `flags` carry the security."""
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    port = free_port()
    wl = f"fill:content=worst,mib={mib}"
    common = ["--mem", mem, "--vcpus", "1", "--workload", wl]
    src = subprocess.Popen([ferry, *flags, "run", *common, "--control", src_sock, "--duration", "120s", "-q"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    dst = subprocess.Popen([ferry, *flags, "run", *common, "--incoming", f"tcp:127.0.0.1:{port}", "--control",
                            dst_sock, "--duration", "1s"] + (["--prealloc", prealloc] if prealloc else []),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    # The destination says when it listens (after preallocating, if asked).
    for line in dst.stderr:
        if "waiting for an incoming migration" in line:
            break
    threading.Thread(target=dst.stderr.read, daemon=True).start()
    time.sleep(1.5 + mib / 150)  # fill writes ~150 MiB/s at worst
    streams = ["--streams", str(streams)] if streams else []
    out = subprocess.run([ferry, "migrate", src_sock, "--to", f"tcp:127.0.0.1:{port}", *streams,
                          "--json"], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        benchlib.reap(src, dst)
        sys.exit(f"migration failed: {out.stderr}")
    src.wait(timeout=60)
    dst.wait(timeout=60)
    m = json.loads(out.stdout)
    return m["rounds"][0]["throughput"], m


def cpu_per_gib(m):
    """Both VMMs' migration CPU seconds per GiB on the wire."""
    return (m["source_cpu_s"] + m["destination_cpu_s"]) / (m["bytes"] / 2**30)


def warm(mib):
    """Writes `mib` MiB into a tmpfs file and frees it, so the next run
    allocates memory the host has just backed."""
    if mib <= 0:
        return
    path = "/dev/shm/ferry-bench-warm"
    block = b"\1" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
    os.unlink(path)


def against(a, sec, tmp):
    """Old and new binaries alternated, default settings (see --against)."""
    runs = {"old": [], "new": []}
    cpu = {"old": [], "new": []}
    bins = {"old": a.against, "new": a.ferry}
    for i in range(a.runs):
        for which in (("new", "old") if i % 2 == 0 else ("old", "new")):
            warm(a.warm_mib)
            rate, m = migrate_once(bins[which], a.mem, a.fill_mib, None, tmp, None, **sec)
            runs[which].append(rate)
            cpu[which].append(m["destination_cpu_s"])
        print(f"pair {i + 1}: new {runs['new'][-1] / 2**20:.0f} MiB/s (destination CPU "
              f"{cpu['new'][-1]:.2f} s), old {runs['old'][-1] / 2**20:.0f} ({cpu['old'][-1]:.2f} s)", flush=True)
    med = statistics.median
    res = {"command": benchlib.recorded_command("throughput.py"), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "old": a.against, "new": a.ferry, "warm_mib": a.warm_mib, "mem": a.mem, "fill_mib": a.fill_mib,
           "round0": runs, "destination_cpu_s": cpu,
           "new_wins": sum(n > o for n, o in zip(runs["new"], runs["old"]))}
    out = a.out + "-ab"
    benchlib.write_json(out + ".json", res, indent=2)
    notes = benchlib.kept_notes(out + ".md")
    with open(out + ".md", "w") as f:
        f.write(f"# Bulk throughput, two builds alternated\n\nCommand: `{res['command']}`  \n"
                f"Date: {res['date']}; loopback, {'plaintext' if a.insecure else 'mutual TLS'}, default "
                f"settings; {a.mem} VM holding {a.fill_mib} MiB of incompressible pages; {a.warm_mib} MiB "
                "written to /dev/shm and freed before each migration; which build goes first flips each pair.\n\n"
                "| build | round 0 median MiB/s | runs (MiB/s) | destination CPU s (median) |\n|---|---|---|---|\n"
                + "".join(f"| {w} (`{bins[w]}`) | {med(runs[w]) / 2**20:.0f} | "
                          f"{', '.join(f'{x / 2**20:.0f}' for x in runs[w])} | {med(cpu[w]):.2f} |\n"
                          for w in ("old", "new"))
                + f"\nnew / old: {med(runs['new']) / med(runs['old']):.2f}x by medians; new faster in "
                f"{res['new_wins']} of {a.runs} pairs.\n" + notes)
    print(f"wrote {out}.md and .json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--fill-mib", type=int, default=1536)
    ap.add_argument("--streams", default="1,2,3", help="bulk stream counts to measure (with --prealloc)")
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "throughput"))
    ap.add_argument("--insecure", action="store_true", help="plaintext links (default: mutual TLS, as ferry's)")
    ap.add_argument("--against", metavar="OLD_BINARY", help="compare with this build (see above)")
    ap.add_argument("--warm-mib", type=int, default=4096, help="with --against: MiB written to /dev/shm before each run")
    a = ap.parse_args()
    # Mutual TLS, as by default: a fleet of one host made here.
    flags = ("--insecure",) if a.insecure else ()
    env = dict(os.environ) if a.insecure else benchlib.tls_env(a.ferry, "throughput")
    sec = dict(env=env, flags=flags)
    counts = [int(x) for x in a.streams.split(",")]
    tmp = tempfile.mkdtemp()
    if a.against:
        return against(a, sec, tmp)
    tcp, cold, tcp_cpu, cold_cpu, dflt, dflt_cpu = [], [], [], [], [], []
    pre = {n: [] for n in counts}
    pre_cpu = {n: [] for n in counts}
    for i in range(a.runs):
        rate, cpu = tcp_stream()
        tcp.append(rate)
        tcp_cpu.append(cpu)
        for n in counts:
            rate, m = migrate_once(a.ferry, a.mem, a.fill_mib, "now", tmp, n, **sec)
            pre[n].append(rate)
            pre_cpu[n].append(cpu_per_gib(m))
        rate, m = migrate_once(a.ferry, a.mem, a.fill_mib, None, tmp, None, **sec)
        dflt.append(rate)
        dflt_cpu.append(cpu_per_gib(m))
        rate, m = migrate_once(a.ferry, a.mem, a.fill_mib, "off", tmp, **sec)
        cold.append(rate)
        cold_cpu.append(cpu_per_gib(m))
        print(f"run {i + 1}: tcp {tcp[-1] / 2**20:.0f} MiB/s, round 0 with --prealloc now "
              + ", ".join(f"{n} stream(s) {pre[n][-1] / 2**20:.0f}" for n in counts)
              + f" MiB/s, default settings {dflt[-1] / 2**20:.0f} MiB/s"
              + f", --prealloc off (1 stream) {cold[-1] / 2**20:.0f} MiB/s", flush=True)
    med = statistics.median
    ratio = {n: med(p / t for p, t in zip(pre[n], tcp)) for n in counts}
    cores = os.cpu_count() or 1
    # What 90% of the TCP stream needs: all of the machine's cores busy with
    # nothing but the migration, each GiB may cost at most this much CPU.
    budget = cores / (0.9 * med(tcp) / 2**30)
    res = {"command": benchlib.recorded_command("throughput.py"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mem": a.mem, "fill_mib": a.fill_mib,
           "cores": cores,
           "tcp_stream": tcp, "tcp_cpu_s_per_gib": tcp_cpu,
           "round0_prealloc": {str(n): pre[n] for n in counts},
           "cpu_s_per_gib_prealloc": {str(n): pre_cpu[n] for n in counts},
           "round0_cold": cold, "cpu_s_per_gib_cold": cold_cpu,
           "round0_default": dflt, "cpu_s_per_gib_default": dflt_cpu,
           "ratio_default": med(d / t for d, t in zip(dflt, tcp)),
           "ratio_prealloc": {str(n): ratio[n] for n in counts},
           "ratio_cold": med(c / t for c, t in zip(cold, tcp)),
           "cpu_budget_s_per_gib_for_90pct": budget}
    benchlib.write_json(a.out + ".json", res, indent=2)

    def row(what, xs, r, cpu):
        return (f"| {what} | {med(xs) / 2**20:.0f} | {', '.join(f'{x / 2**20:.0f}' for x in xs)} | {r:.2f} "
                f"| {med(cpu):.2f} |\n")

    notes = benchlib.kept_notes(a.out + ".md")
    with open(a.out + ".md", "w") as f:
        f.write(f"# Bulk throughput\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n"
                f"Date: {res['date']}; loopback, {'plaintext' if a.insecure else 'mutual TLS'}, "
                f"no compression; {a.mem} VM holding {a.fill_mib} MiB of "
                f"incompressible pages; {cores} cores; the measurements alternate, {a.runs} times. "
                "CPU = seconds of CPU per GiB moved, both ends together (the TCP stream's two threads; "
                "the two VMMs' migration threads), kernel time included.\n\n"
                "| what | median MiB/s | runs (MiB/s) | vs TCP stream (median of per-run ratios) | CPU s/GiB |\n"
                "|---|---|---|---|---|\n"
                + row("one plain TCP stream (python, 1 MiB writes)", tcp, 1.0, tcp_cpu)
                + "".join(row(f"precopy round 0, {n} bulk stream(s), destination --prealloc now", pre[n],
                              ratio[n], pre_cpu[n]) for n in counts)
                + row("precopy round 0, default settings", dflt, res["ratio_default"], dflt_cpu)
                + row("precopy round 0, 1 bulk stream, destination --prealloc off", cold, res["ratio_cold"],
                      cold_cpu)
                + f"\n90% of the TCP stream with all {cores} cores on the migration allows at most "
                f"{budget:.2f} CPU s per GiB; the TCP stream alone costs {med(tcp_cpu):.2f}.\n" + notes)
    print(f"wrote {a.out}.md and .json")


if __name__ == "__main__":
    main()
