#!/usr/bin/env python3
"""Guest baseline benchmark: what the test guest does on this machine before any
migration is involved.

  1. boot to first metrics sample (ms from VM creation to the guest's first
     published metrics page), for several RAM sizes;
  2. achieved vs requested dirty rate, from 16 MiB/s up to the maximum;
  3. compute ops/s in the guest (CPL3) vs the same loop as a host process.

Each figure is the median of --runs runs; guest and host compute runs are
interleaved so they see the same machine load. Results go to
bench/results/guest-baseline.{json,md} with the command and machine.

Usage: python3 bench/guest_baseline.py [--runs 3] [--ferry target/release/ferry]
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


def ferry_run(ferry, args):
    out = subprocess.run([ferry, "run", "--json", "--quiet", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"ferry run {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def host_compute(secs):
    exe = os.path.join(ROOT, "target", "compute_host")
    src = os.path.join(ROOT, "guest", "tools", "compute_host.c")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["gcc", "-O2", "-I", os.path.join(ROOT, "guest", "user"), src, "-o", exe], check=True)
    out = subprocess.run([exe, str(secs)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["ops_per_s"]


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each dirty/compute run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "guest-baseline"))
    a = ap.parse_args()
    secs = f"{a.seconds}s"
    res = {"command": " ".join(["python3", "bench/guest_baseline.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "runs": a.runs}

    boot = {}
    for mem in ["512M", "4G"]:
        ms = [ferry_run(a.ferry, ["--mem", mem, "--workload", "idle", "--duration", "200ms"])
              ["boot_to_first_sample_ms"] for _ in range(a.runs)]
        boot[mem] = {"median_ms": statistics.median(ms), "runs_ms": ms}
        print(f"boot {mem}: {boot[mem]['median_ms']:.1f} ms (runs {', '.join(f'{x:.1f}' for x in ms)})")
    res["boot_to_first_sample"] = boot

    dirty = []
    for rate in ["16", "32", "64", "128", "256", "512", "1024", "2048", "max"]:
        got = []
        for _ in range(a.runs):
            s = ferry_run(a.ferry, ["--mem", "1G", "--workload", f"dirty:rate={rate},wss=256,pattern=seq",
                                    "--duration", secs])
            got.append(s["workloads"][0]["rate_per_s"] / 2**20)
        row = {"requested_mib_s": rate, "achieved_mib_s": statistics.median(got), "runs": got}
        dirty.append(row)
        print(f"dirty {rate:>5} MiB/s requested -> {row['achieved_mib_s']:8.1f} MiB/s achieved")
    res["dirty_rate"] = dirty

    guest, host = [], []
    for _ in range(a.runs):
        s = ferry_run(a.ferry, ["--mem", "64M", "--workload", "compute:tasks=1", "--duration", secs])
        guest.append(s["workloads"][0]["rate_per_s"])
        host.append(host_compute(a.seconds))
    res["compute"] = {
        "guest_ops_s": statistics.median(guest), "host_ops_s": statistics.median(host),
        "guest_runs": guest, "host_runs": host,
        "ratio_guest_over_host": statistics.median(g / h for g, h in zip(guest, host)),
    }
    c = res["compute"]
    print(f"compute guest {c['guest_ops_s']:.3e} ops/s, host {c['host_ops_s']:.3e} ops/s, "
          f"ratio {c['ratio_guest_over_host']:.3f}")

    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(a.out + ".md", "w") as f:
        m = res["machine"]
        f.write(f"# Guest baseline\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n")
        f.write(f"Date: {res['date']}  \nMachine: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']} "
                f"(PVM KVM)  \nEach figure: median of {a.runs} runs.\n\n")
        f.write("## Boot to first metrics sample\n\n| RAM | median ms | runs |\n|---|---|---|\n")
        for mem, b in boot.items():
            f.write(f"| {mem} | {b['median_ms']:.1f} | {', '.join(f'{x:.1f}' for x in b['runs_ms'])} |\n")
        f.write("\n## Dirty rate (1 vCPU, wss 256 MiB, seq, random content)\n\n"
                "| requested MiB/s | achieved MiB/s | achieved / requested |\n|---|---|---|\n")
        for r in dirty:
            ratio = "" if r["requested_mib_s"] == "max" else f"{r['achieved_mib_s'] / float(r['requested_mib_s']):.3f}"
            f.write(f"| {r['requested_mib_s']} | {r['achieved_mib_s']:.1f} | {ratio} |\n")
        f.write(f"\n## Compute (integer adds, 1 task)\n\n| where | median ops/s |\n|---|---|\n"
                f"| guest CPL3 | {c['guest_ops_s']:.3e} |\n| host process | {c['host_ops_s']:.3e} |\n\n"
                f"Guest / host (median of per-run ratios): **{c['ratio_guest_over_host']:.3f}**\n")
    print(f"wrote {a.out}.json and {a.out}.md")


if __name__ == "__main__":
    main()
