#!/usr/bin/env python3
"""kv service baseline: requests/s and p50/p99 latency of the guest's kv workload
for 1, 8 and 64 clients with 1 and 2 vCPUs, plus the device-only latency (ECHO,
answered by the VMM's service device without the guest) and the guest round
trip with no work (NOP), all measured the same way by `ferry load`.

Each cell is the median of --runs runs of --seconds each, against a fresh VM
(kv:workers=4,keys=65536,value=1024: a 65 MiB table) per vCPU count.
Results: bench/results/kv-baseline.{json,md}.

Usage: python3 bench/kv_baseline.py [--runs 3] [--seconds 3]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = "kv:workers=4,keys=65536,value=1024"


def start_vm(ferry, vcpus):
    p = subprocess.Popen([ferry, "run", "--mem", "512M", "--vcpus", str(vcpus), "--workload", WORKLOAD,
                          "--serve", "127.0.0.1:0", "--duration", "1h"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if line.startswith("ferry: service device listening on "):
            return p, line.split()[-1]
    sys.exit("ferry run did not print its service address")


def load(ferry, addr, clients, secs, op):
    out = subprocess.run([ferry, "load", "--target", addr, "--clients", str(clients), "--duration", f"{secs}s",
                          "--op", op, "--json", "--quiet"], capture_output=True, text=True)
    if not out.stdout:
        sys.exit(f"ferry load failed: {out.stderr}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kv-baseline"))
    a = ap.parse_args()
    rows = []
    for vcpus in [1, 2]:
        vm, addr = start_vm(a.ferry, vcpus)
        try:
            load(a.ferry, addr, 1, 1, "mixed")  # wait for the table and warm up
            cases = [("echo", 1), ("nop", 1), ("mixed", 1), ("mixed", 8), ("mixed", 64)]
            for op, clients in cases:
                runs = [load(a.ferry, addr, clients, a.seconds, op) for _ in range(a.runs)]
                row = {
                    "vcpus": vcpus, "op": op, "clients": clients,
                    "rps": statistics.median(r["throughput_rps"] for r in runs),
                    "p50_us": statistics.median(r["latency_us"]["p50"] for r in runs),
                    "p99_us": statistics.median(r["latency_us"]["p99"] for r in runs),
                    "errors": sum(r["errors"] for r in runs),
                    "wrong_values": sum(r["wrong_values"] for r in runs),
                }
                rows.append(row)
                print(f"{vcpus} vCPU {op:5} {clients:3} clients: {row['rps']:9.0f} req/s  "
                      f"p50 {row['p50_us']:6.0f} us  p99 {row['p99_us']:6.0f} us  "
                      f"errors {row['errors']} wrong {row['wrong_values']}")
        finally:
            vm.terminate()
            vm.wait()
    res = {"command": " ".join(["python3", "bench/kv_baseline.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "kernel": platform.release(),
           "cores": os.cpu_count(), "workload": WORKLOAD, "runs": a.runs, "seconds": a.seconds, "rows": rows}
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(a.out + ".md", "w") as f:
        f.write(f"# kv service baseline\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n"
                f"Date: {res['date']}, {res['cores']} cores, kernel {res['kernel']} (PVM KVM)  \n"
                f"Guest: 512 MiB, `{WORKLOAD}`; closed-loop clients on the same host (loopback TCP).  \n"
                f"Each cell: median of {a.runs} runs of {a.seconds:g} s.\n\n"
                "`echo` is answered by the VMM's service device alone (the device's own latency: TCP, "
                "reader and writer threads); `nop` goes through the ring to a guest worker that does no "
                "work; `mixed` is 90% GET / 10% SET of 1 KiB values, every answer verified.\n\n"
                "| vCPUs | op | clients | req/s | p50 us | p99 us | errors | wrong |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['vcpus']} | {r['op']} | {r['clients']} | {r['rps']:.0f} | {r['p50_us']:.0f} | "
                    f"{r['p99_us']:.0f} | {r['errors']} | {r['wrong_values']} |\n")
    print(f"wrote {a.out}.json and {a.out}.md")


if __name__ == "__main__":
    main()
