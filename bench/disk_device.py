#!/usr/bin/env python3
"""The virtio-blk device's hot path alone (docs/disks.md): 4 KiB random
reads and writes through the device, driven by the guest's disk workload,
against the same I/O done by a host process on the same image file
(guest/tools/disk_host.c: the same block size, region, queue depth as
threads, O_DIRECT as the device uses it).

Through the device: a VM runs `disk:rw=MODE,bs=4k,qd=QD,mib=MIB` on the
image; once its workload is in its random phase (randread writes every
block first), requests completed and their summed latency are sampled from
`ferry status` twice, --secs apart: IOPS = requests / wall seconds, latency
= the guest's submit-to-completion time (TSC). The host process runs as
long. Device and host alternate (each run reverses the order); figures
are medians of --runs. Results: bench/results/disk-device.{json,md}.

Usage: python3 bench/disk_device.py [--runs 3] [--secs 5] [--mib 256]
       [--qd 1,4,16] [--modes randread,randwrite] [--dir /var/tmp]
       [--ferry target/release/ferry]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

from benchlib import alternated, medians, recorded_command, reap, sh, status, write_json, write_md

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_tool():
    import tempfile
    exe = os.path.join(tempfile.gettempdir(), f"ferry-disk_host-{os.getuid()}")
    src = os.path.join(ROOT, "guest", "tools", "disk_host.c")
    if not os.path.exists(exe) or os.path.getmtime(exe) < os.path.getmtime(src):
        subprocess.run(["gcc", "-O2", "-pthread", src, "-o", exe], check=True)
    return exe


def device_run(a, image, mode, qd):
    sock = os.path.join(a.dir, f"ferry-diskbench-{os.getpid()}.sock")
    spec = f"disk:rw={mode},bs=4k,qd={qd},mib={a.mib}"
    vm = subprocess.Popen([a.ferry, "--insecure", "run", "--quiet", "--mem", "512M", "--workload", spec,
                           "--disk", image, "--control", sock, "--duration", "600s"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            s = status(a.ferry, sock)
            c = (s or {}).get("disk_check") or {}
            if c.get("phase") == "run" and c.get("ops", 0) > 0:
                break
            if vm.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the VM did not reach its random phase: {vm.stderr.read() if vm.poll() is not None else c}")
            time.sleep(0.1)
        time.sleep(0.5)  # past the phase change
        c0, t0 = status(a.ferry, sock)["disk_check"], time.time()
        time.sleep(a.secs)
        s1 = status(a.ferry, sock)
        c1, t1 = s1["disk_check"], time.time()
        ops = c1["ops"] - c0["ops"]
        tsc_khz = s1["tsc_khz"]
        lat = (c1["lat_tsc_sum"] - c0["lat_tsc_sum"]) / max(ops, 1) / tsc_khz * 1000.0
        if c1["bad_blocks"] or c1["io_errors"]:
            raise RuntimeError(f"the guest saw bad blocks or I/O errors: {c1}")
        return {"iops": ops / (t1 - t0), "latency_us_mean": lat, "direct": s1["disks"][0]["direct_io"]}
    finally:
        sh(a.ferry, "ctl", sock, "quit", check=False)
        reap(vm, grace=5)


def host_run(a, image, mode, qd):
    out = sh(host_tool(), image, mode, "4096", str(qd), str(a.mib << 20), str(a.secs)).stdout
    r = json.loads(out)
    return {"iops": r["iops"], "latency_us_mean": r["latency_us_mean"], "direct": r["direct"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--secs", type=float, default=5.0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--qd", default="1,4,16")
    ap.add_argument("--modes", default="randread,randwrite")
    ap.add_argument("--dir", default="/var/tmp", help="where the image goes (its file system is measured)")
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "disk-device"))
    a = ap.parse_args()
    image = os.path.join(a.dir, f"ferry-diskbench-{os.getpid()}.img")
    if os.path.exists(image):
        os.remove(image)
    with open(image, "wb") as f:
        f.truncate((a.mib + 64) << 20)
    cells = []
    try:
        for mode in a.modes.split(","):
            for qd in [int(q) for q in a.qd.split(",")]:
                runs = {"device": [], "host": []}
                errors = []
                for r in range(a.runs):
                    for who in alternated(["device", "host"], r):
                        try:
                            runs[who].append((device_run if who == "device" else host_run)(a, image, mode, qd))
                        except Exception as e:  # noqa: BLE001 - recorded, left out of the medians
                            errors.append(f"{who} run {r}: {e}")
                m = {w: medians(v, ["iops", "latency_us_mean"]) for w, v in runs.items() if v}
                cell = {"mode": mode, "qd": qd, "runs": runs, "medians": m, "errors": errors}
                if "device" in m and "host" in m:
                    cell["ratio"] = m["device"]["iops"] / m["host"]["iops"]
                cells.append(cell)
                print(json.dumps({k: cell[k] for k in ("mode", "qd", "medians")} | {"ratio": cell.get("ratio")}),
                      file=sys.stderr)
    finally:
        os.remove(image)
    machine = f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}"
    cmd = recorded_command("disk_device.py")
    write_json(a.out + ".json", {"command": cmd, "machine": machine, "image_dir": a.dir, "mib": a.mib,
                                 "secs": a.secs, "cells": cells}, indent=1)
    direct = all(r["direct"] for c in cells for v in c["runs"].values() for r in v)
    lines = [
        "# virtio-blk device hot path: 4 KiB random I/O through the device vs a host process",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine}; image in {a.dir} ({'O_DIRECT' if direct else 'buffered'} both ways), "
        f"{a.mib} MiB region, {a.secs:g} s per run, medians of {a.runs} alternated runs.",
        "",
        "Device: the guest's `disk` workload (one CPL3 task, qd requests in flight, a QueueNotify MMIO exit per "
        "batch unless the device says NO_NOTIFY, completions polled) through ferry's virtio-blk device (4 I/O threads, pread/pwrite). "
        "Host: `guest/tools/disk_host.c`, qd threads each with one pread/pwrite in flight, on the same file.",
        "",
        "| mode | qd | device IOPS | host IOPS | device / host | device latency µs | host latency µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        d, h = c["medians"].get("device", {}), c["medians"].get("host", {})
        ratio = f"{c['ratio']:.2f}" if "ratio" in c else "—"
        lines.append(f"| {c['mode']} | {c['qd']} | {d.get('iops', 0):.0f} | {h.get('iops', 0):.0f} | {ratio} | "
                     f"{d.get('latency_us_mean', 0):.0f} | {h.get('latency_us_mean', 0):.0f} |")
    errors = [f"{c['mode']} qd={c['qd']}: {e}" for c in cells for e in c["errors"]]
    if errors:
        lines += ["", "Failed runs (left out of the medians):", ""] + [f"- {e}" for e in errors]
    write_md(a.out + ".md", lines)


if __name__ == "__main__":
    main()
