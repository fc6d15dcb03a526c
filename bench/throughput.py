#!/usr/bin/env python3
"""Bulk throughput: how fast precopy's first round moves memory, against what
one plain TCP stream carries on the same path, measured alternately in the
same run (the machines are shared and noisy; compare within a run).

A VM holds --fill-mib MiB of incompressible pages (`fill:content=worst`) and
migrates over loopback with one bulk stream, uncompressed; the figure is
round 0's wire rate. The destination runs with and without --prealloc: the
first touch of fresh host memory runs at ~0.4-1 GB/s on this machine, so
without it the destination's page faults, not the copy, set the pace.

Results: bench/results/throughput.{json,md}.

Usage: python3 bench/throughput.py [--runs 3] [--mem 2G] [--fill-mib 1536]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tcp_stream(seconds=2.0):
    """Bytes/s one loopback TCP stream carries (1 MiB writes, recv_into a reused buffer)."""
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
    t0 = time.time()
    while time.time() - t0 < seconds:
        c.sendall(data)
    c.close()
    t.join()
    return got[0] / (time.time() - t0)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def migrate_once(ferry, mem, mib, prealloc, tmp):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    for p in (src_sock, dst_sock):
        if os.path.exists(p):
            os.unlink(p)
    port = free_port()
    wl = f"fill:content=worst,mib={mib}"
    common = ["--mem", mem, "--vcpus", "1", "--workload", wl]
    src = subprocess.Popen([ferry, "run", *common, "--control", src_sock, "--duration", "120s", "-q"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dst = subprocess.Popen([ferry, "run", *common, "--incoming", f"tcp:127.0.0.1:{port}", "--control", dst_sock,
                            "--duration", "1s"] + (["--prealloc"] if prealloc else []),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # The destination says when it listens (after preallocating, if asked).
    for line in dst.stderr:
        if "waiting for an incoming migration" in line:
            break
    threading.Thread(target=dst.stderr.read, daemon=True).start()
    time.sleep(1.5 + mib / 150)  # fill writes ~150 MiB/s at worst
    out = subprocess.run([ferry, "migrate", src_sock, "--to", f"tcp:127.0.0.1:{port}", "--streams", "1", "--json"],
                         capture_output=True, text=True)
    src.wait(timeout=60)
    dst.wait(timeout=60)
    if out.returncode != 0:
        sys.exit(f"migration failed: {out.stderr}")
    m = json.loads(out.stdout)
    return m["rounds"][0]["throughput"], m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--fill-mib", type=int, default=1536)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "throughput"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    tcp, pre, cold = [], [], []
    for i in range(a.runs):
        tcp.append(tcp_stream())
        pre.append(migrate_once(a.ferry, a.mem, a.fill_mib, True, tmp)[0])
        cold.append(migrate_once(a.ferry, a.mem, a.fill_mib, False, tmp)[0])
        print(f"run {i + 1}: tcp {tcp[-1] / 2**20:.0f} MiB/s, round 0 with --prealloc {pre[-1] / 2**20:.0f} MiB/s, "
              f"without {cold[-1] / 2**20:.0f} MiB/s", flush=True)
    med = statistics.median
    argv = [x for i, x in enumerate(sys.argv[1:]) if x != "--ferry" and (i == 0 or sys.argv[i] != "--ferry")]
    res = {"command": " ".join(["python3", "bench/throughput.py", *argv]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "mem": a.mem, "fill_mib": a.fill_mib,
           "tcp_stream": tcp, "round0_prealloc": pre, "round0_cold": cold,
           "ratio_prealloc": med(p / t for p, t in zip(pre, tcp)), "ratio_cold": med(c / t for c, t in zip(cold, tcp))}
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Bulk throughput\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n"
                f"Date: {res['date']}; loopback, one bulk stream, no compression; {a.mem} VM holding "
                f"{a.fill_mib} MiB of incompressible pages; the three measurements alternate, {a.runs} times.\n\n"
                "| what | median MiB/s | runs (MiB/s) | vs TCP stream (median of per-run ratios) |\n|---|---|---|---|\n"
                f"| one plain TCP stream (python, 1 MiB writes) | {med(tcp) / 2**20:.0f} | "
                f"{', '.join(f'{x / 2**20:.0f}' for x in tcp)} | 1.00 |\n"
                f"| precopy round 0, destination --prealloc | {med(pre) / 2**20:.0f} | "
                f"{', '.join(f'{x / 2**20:.0f}' for x in pre)} | {res['ratio_prealloc']:.2f} |\n"
                f"| precopy round 0, destination cold | {med(cold) / 2**20:.0f} | "
                f"{', '.join(f'{x / 2**20:.0f}' for x in cold)} | {res['ratio_cold']:.2f} |\n")
    print(f"wrote {a.out}.md and .json")


if __name__ == "__main__":
    main()
