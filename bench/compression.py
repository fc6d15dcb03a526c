#!/usr/bin/env python3
"""Compression benchmark (the GMigrate paper's tables 1-7, on ferry): live-
migrate VMs between two lab hosts joined by a 1 Gbit link (tbf), with no
compression, each CPU codec and `auto`, with and without the pipeline, and
record migration time, downtime, bytes on the wire and host CPU seconds per
side. Each cell is the median of --runs migrations between fresh VMMs.

VMs: `fill` best / worst / mixed content (--fill-mib MiB of --mem), and a
`dirty` VM rewriting text-like pages. The destination preallocates its RAM
(`ferry run --prealloc`) so what is measured is the migration, not the
first touch of host memory (which runs at ~0.4-1 GB/s on this machine).

Needs root (network namespaces) and /dev/kvm. Results:
bench/results/compression.{json,md}.

Usage: python3 bench/compression.py [--runs 3] [--link 1gbit] [--mem 1G] [--fill-mib 512]
"""
import argparse
import os
import statistics
import subprocess
import tempfile
import time

import benchlib
from benchlib import sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC, DST = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2")
CODECS = ["rle", "xbzrle", "dedup", "lz4", "zstd:1", "zstd:3", "auto"]


def migrate_once(ferry, mem, workload, extra, tmp):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    common = ["--mem", mem, "--vcpus", "1", "--workload", workload, "--quiet"]
    dst = subprocess.Popen(["ip", "netns", "exec", DST[0], ferry, "run", *common, "--prealloc",
                            "--incoming", f"tcp:{DST[1]}:7400", "--control", dst_sock, "--duration", "1s"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    src = subprocess.Popen(["ip", "netns", "exec", SRC[0], ferry, "run", *common, "--control", src_sock,
                            "--duration", "300s"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    benchlib.wait_started((src, dst), (src_sock, dst_sock), timeout=60)
    # Let fill finish (it writes ~150 MiB/s at worst) and dirty reach its working set.
    mib = int(workload.split("mib=")[1]) if "mib=" in workload else 0
    time.sleep(1.5 + mib / 150)
    out = sh("ip", "netns", "exec", SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{DST[1]}:7400",
             "--max-rounds", "15", "--json", *extra, check=False)
    src.wait(timeout=60)
    dst.wait(timeout=60)
    return benchlib.report_or_error(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--fill-mib", type=int, default=512)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--workloads", default="best,worst,mixed,dirty")
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "compression"))
    a = ap.parse_args()
    wl_spec = {
        "best": f"fill:content=best,mib={a.fill_mib}",
        "worst": f"fill:content=worst,mib={a.fill_mib}",
        "mixed": f"fill:content=mixed,mib={a.fill_mib}",
        "dirty": "dirty:rate=64,wss=256,pattern=random,content=text",
    }
    configs = [("none", True)] + [(c, p) for c in a.codecs.split(",") for p in (True, False)]
    rows = []
    tmp = tempfile.mkdtemp()
    benchlib.lab_up(a.ferry, 2, a.link)
    try:
        for wl in a.workloads.split(","):
            for codec, pipe in configs:
                extra = ["--compress", codec] + ([] if pipe else ["--no-pipeline"])
                runs = [migrate_once(a.ferry, a.mem, wl_spec[wl], extra, tmp) for _ in range(a.runs)]
                ok = [r for r in runs if "error" not in r]
                name = codec if codec == "none" else f"{codec}{'' if pipe else ' (no pipe)'}"
                if not ok:
                    print(f"{wl} {name}: failed: {runs[0]['error']}")
                    rows.append({"workload": wl, "codec": codec, "pipeline": pipe, "error": runs[0]["error"]})
                    continue
                med = lambda f: statistics.median(f(r) for r in ok)
                row = {
                    "workload": wl, "codec": codec, "pipeline": pipe, "runs": len(ok),
                    "total_s": med(lambda r: r["total_secs"]),
                    "downtime_ms": med(lambda r: r["downtime_ms"]),
                    "bytes": med(lambda r: r["bytes"]),
                    "src_cpu_s": med(lambda r: r["source_cpu_s"]),
                    "dst_cpu_s": med(lambda r: r["destination_cpu_s"]),
                    "rounds": med(lambda r: len(r["rounds"])),
                    "batches": ok[0]["compression"]["batches"],
                }
                rows.append(row)
                print(f"{wl:6} {name:22} total {row['total_s']:7.3f} s  downtime {row['downtime_ms']:7.2f} ms  "
                      f"{row['bytes'] / 2**20:8.1f} MiB  CPU {row['src_cpu_s']:.2f}/{row['dst_cpu_s']:.2f} s  "
                      f"[{row['batches']}]", flush=True)
    finally:
        sh(a.ferry, "lab", "down", check=False)
    base = {r["workload"]: r["total_s"] for r in rows if r.get("codec") == "none" and "error" not in r}
    for r in rows:
        if "error" not in r and r["workload"] in base:
            r["speedup_vs_none"] = base[r["workload"]] / r["total_s"]
    res = {"command": benchlib.recorded_command("compression.py"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "link": a.link, "mem": a.mem,
           "fill_mib": a.fill_mib, "rows": rows}
    benchlib.write_json(a.out + ".json", res, indent=2)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Compression benchmark\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n"
                f"Date: {res['date']}; {a.mem} VM, 1 vCPU; lab hosts are network namespaces on one 2-core "
                f"machine (PVM KVM) joined by a {a.link} tbf link; the destination preallocates its RAM; "
                f"fill VMs hold {a.fill_mib} MiB of content; dirty = 64 MiB/s of text-like pages over 256 MiB; "
                f"median of {a.runs} runs. Speed-up = none's time / this time.\n\n"
                "| VM | codec | pipeline | total s | speed-up | downtime ms | MiB on wire | CPU s src / dst | batches |\n"
                "|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "error" in r:
                f.write(f"| {r['workload']} | {r['codec']} | {r['pipeline']} | failed: {r['error'][:80]} |||||\n")
                continue
            f.write(f"| {r['workload']} | {r['codec']} | {'yes' if r['pipeline'] else 'no'} | {r['total_s']:.3f} | "
                    f"{r.get('speedup_vs_none', 0):.2f}x | {r['downtime_ms']:.2f} | {r['bytes'] / 2**20:.1f} | "
                    f"{r['src_cpu_s']:.2f} / {r['dst_cpu_s']:.2f} | {r['batches']} |\n")
    print(f"wrote {a.out}.md and .json")


if __name__ == "__main__":
    main()
