#!/usr/bin/env python3
"""A VM doing disk I/O on shared NBD storage moved across a shaped lab link
(issue 55, the analysis paper's shared-storage experiment): the guest's disk
throughput before, during and after the move, migration time, downtime.

Per trial, under the lab's lock (/tmp/ferry-lab.lock, flock, taken for that
trial alone so other lab users get in between): `ferry lab up 3
--bandwidth B` (tbf on every host's link, 100 Mbit by default); a sparse
raw image under --dir served by qemu-nbd on ferry-h3 (10.77.0.3:10809,
export `disk`); the VM on ferry-h1 running
`disk:rw=mixed,bs=4k,qd=8,mib=M` on nbd://10.77.0.3:10809/disk, plus, with
--ram-mib R > 0, `memtouch:tasks=1,mib=R,after=migrate` (R MiB of random
data in RAM, untouched until the VM has moved, then each page written once):
the RAM image the move has to carry. Without it the VM's RAM is nearly
empty and a move sends ~0.5 MiB in under 0.1 s, too short to see anything
in. At 100 Mbit, 256 MiB makes precopy's round 0 outlast the engine's 30 s
per-step timeout (those runs fail, and are recorded as failed).
The destination waits on ferry-h2 with the same workload and disk. The
guest's writes to the storage host and the migration stream both leave
ferry-h1 through its shaped link; its reads come back through the storage
host's (also shaped) link.

Once the disk workload has written every block (its `run` phase) and the
RAM is filled, the guest's disk counters (blocks read + written x block
size, `disk_check` in `ferry status --json`: they live in guest RAM, so
they carry on across the move) are sampled every --interval s: --before s on
the source, then `ferry migrate --mode MODE --verify --json` from ferry-h1
while the sampler follows the VM (source until it stops answering, then
the destination), then --after s on the destination. Throughput before /
during / after = blocks moved in that window x 4 KiB / its length; during
is from the last sample before the migrate command's start to the first
after its end. After the move the
destination's `disk_check` must say 0 bad blocks and 0 I/O errors, else the
run is failed (recorded, never left out silently).

Medians of --runs runs per mode (fresh VMs each run).
Results: bench/results/disk-shared.{json,md}.

A mode may carry `ferry migrate` flags: `precopy+own-link` is `--mode
precopy --own-link` (precopy rounds as fast as TCP goes instead of leaving
the link's queue to the VM's own traffic, the default).

Usage: python3 bench/disk_shared.py [--runs 3] [--modes precopy,postcopy,hybrid]
       [--bandwidth 100mbit] [--ram-mib 0,96,256] [--disk-mib 256] [--before 5]
       [--after 5] [--interval 0.2] [--dir /var/tmp] [--lock /tmp/ferry-lab.lock]
       [--append] [--out bench/results/disk-shared]
"""
import argparse
import json
import os
import platform
import subprocess
import tempfile
import threading
import time

import benchlib
from benchlib import LabLock, in_host, reap, sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC, DST, STORE = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2"), ("ferry-h3", "10.77.0.3")
NBD = "nbd://10.77.0.3:10809/disk"
MIB = 1 << 20


def disk_status(ferry, sock):
    """(time, status) of the VM at `sock`, or (time, None) if it does not
    answer or has no disk check."""
    s = benchlib.status(ferry, sock)
    t = time.time()
    if not s or not s.get("disk_check"):
        return t, None
    return t, s


def moved(s):
    """Bytes of guest disk I/O so far: blocks read + written x block size."""
    c = s["disk_check"]
    return (c["blocks_read"] + c["blocks_written"]) * c["block_bytes"]


class Sampler(threading.Thread):
    """Samples the guest's disk counters every `interval` s, from the
    source until it stops answering (or says it is no longer running),
    then from the destination."""

    def __init__(self, ferry, src_sock, dst_sock, interval):
        super().__init__(daemon=True)
        self.ferry, self.socks, self.interval = ferry, [src_sock, dst_sock], interval
        self.samples = []  # (t, "src"|"dst", bytes, ops)
        self.on = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.time()
            if self.on == 0:
                t, s = disk_status(self.ferry, self.socks[0])
                if s is None or s.get("state") != "running":
                    self.on = 1
            if self.on == 1:
                t, s = disk_status(self.ferry, self.socks[1])
                if s is not None and s.get("state") != "running":
                    s = None
            if s is not None:
                self.samples.append((t, "src" if self.on == 0 else "dst", moved(s), s["disk_check"]["ops"]))
            self.stop.wait(max(0.0, self.interval - (time.time() - t0)))


def rate_between(samples, t0, t1):
    """MiB/s of guest disk I/O from the last sample at or before t0 to the
    first at or after t1 (None when the window has no samples on a side)."""
    a = [s for s in samples if s[0] <= t0]
    b = [s for s in samples if s[0] >= t1]
    if not a or not b:
        return None
    a, b = a[-1], b[0]
    return (b[2] - a[2]) / MIB / (b[0] - a[0]) if b[0] > a[0] else None


def wait_nbd(timeout=10):
    deadline = time.time() + timeout
    probe = "import socket; socket.create_connection(('10.77.0.3', 10809), 0.5).close()"
    while sh(*in_host(SRC[0], "python3", "-c", probe), check=False).returncode != 0:
        if time.time() > deadline:
            raise RuntimeError("qemu-nbd on ferry-h3 does not listen within 10 s")
        time.sleep(0.1)


def wait_ready(ferry, sock, vm, want_ram, timeout):
    """Waits until the disk workload is in its run phase (every block
    written once) and the RAM filler, if any, is ready."""
    deadline = time.time() + timeout
    while True:
        s = benchlib.status(ferry, sock)
        c = (s or {}).get("disk_check") or {}
        wls = ((s or {}).get("metrics") or {}).get("workloads") or []
        ram_ok = not want_ram or (len(wls) > 1 and wls[1]["tasks_ready"] >= wls[1]["tasks"])
        if c.get("phase") == "run" and ram_ok:
            return
        if vm.poll() is not None:
            raise RuntimeError(f"the source VMM exited before its workload ran: {vm.stderr.read().strip()[-400:]}")
        if time.time() > deadline:
            raise RuntimeError(f"the workload was not in its run phase after {timeout} s: {c.get('phase')}")
        time.sleep(0.25)


def trial(a, mode, ram_mib, port, tmp):
    """One fresh VM moved once by `mode`; the run's figures (RuntimeError
    with the reason when it failed)."""
    ferry = a.ferry
    image = os.path.join(a.dir, f"ferry-diskshared-{os.getpid()}.img")
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    wl = f"disk:rw=mixed,bs=4k,qd=8,mib={a.disk_mib}"
    if ram_mib:
        wl += f"+memtouch:tasks=1,mib={ram_mib},after=migrate"
    common = ["run", "--mem", a.mem, "--workload", wl, "--disk", NBD, "--quiet", "--duration", "600s"]
    procs = []
    with open(image, "wb") as f:
        f.truncate(a.image_mib * MIB)
    try:
        nbd = subprocess.Popen(in_host(STORE[0], "qemu-nbd", "-f", "raw", "-x", "disk", "--persistent",
                                       "--shared=8", "-b", STORE[1], "-p", "10809", image),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(nbd)
        wait_nbd()
        src = subprocess.Popen(in_host(SRC[0], ferry, *common, "--control", src_sock),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(src)
        benchlib.wait_started([src], [src_sock], 20)
        wait_ready(ferry, src_sock, src, ram_mib > 0, a.fill_timeout)
        to = f"tcp:{DST[1]}:{port}"
        dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", to, "--control", dst_sock),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(dst)
        benchlib.wait_started([dst], [dst_sock], 20)
        time.sleep(0.5)  # past the phase change
        sampler = Sampler(ferry, src_sock, dst_sock, a.interval)
        sampler.start()
        time.sleep(a.before)
        t_mig0 = time.time()
        base, *extra = mode.split("+")  # e.g. precopy+own-link: --mode precopy --own-link
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", to, "--mode", base, *[f"--{x}" for x in extra],
                        "--verify", "--json"), check=False)
        t_mig1 = time.time()
        if m.returncode != 0:
            sampler.stop.set()
            reap(dst, grace=5)
            said = " ".join(dst.stderr.read().split())
            raise RuntimeError(f"ferry migrate --mode {mode} failed after {t_mig1 - t_mig0:.1f} s: "
                               f"{m.stderr.strip()[-600:]}; the destination VMM said: {said[-400:]}")
        stats = json.loads(m.stdout)
        time.sleep(a.after)
        sampler.stop.set()
        sampler.join()
        _, end = disk_status(ferry, dst_sock)
        samples = sampler.samples
        if end is None:
            raise RuntimeError("the destination does not answer after the move")
        c = end["disk_check"]
        t_first = samples[0][0]
        t_last = samples[-1][0]
        before = rate_between(samples, t_first, t_mig0)
        during = rate_between(samples, t_mig0, t_mig1)
        after = rate_between(samples, t_mig1, t_last)
        src_samples = [s for s in samples if s[1] == "src"]
        dst_samples = [s for s in samples if s[1] == "dst"]
        post = stats.get("postcopy") or {}
        run = {
            "mode": mode,
            "ram_mib": ram_mib,
            "before_mib_s": before,
            "during_mib_s": during,
            "after_mib_s": after,
            "during_over_before": during / before if before and during is not None else None,
            "migrate_wall_s": t_mig1 - t_mig0,
            "total_s": stats["total_secs"],
            "downtime_ms": stats["downtime_ms"],
            "bytes_mib": stats["bytes"] / MIB,
            "rounds": len(stats.get("rounds") or []),
            "postcopy_s": post.get("secs", 0.0),
            "verified_pages": stats.get("verified_pages"),
            "bad_blocks": c["bad_blocks"],
            "io_errors": c["io_errors"] + sum(d["io_errors"] for d in end.get("disks", [])),
            "blocks_checked": c["blocks_checked"],
            "last_src_sample_s": (src_samples[-1][0] - t_mig0) if src_samples else None,
            "first_dst_sample_s": (dst_samples[0][0] - t_mig0) if dst_samples else None,
            # (seconds from the migrate command's start, VMM, guest disk bytes so far)
            "series": [(round(t - t_mig0, 3), who, b) for t, who, b, _ in samples],
        }
        if run["bad_blocks"] or run["io_errors"]:
            raise RuntimeError(f"after the move the guest saw {c['bad_blocks']} bad blocks, "
                               f"{run['io_errors']} I/O errors: {json.dumps(run, default=str)[:600]}")
        if before is None or during is None or after is None:
            raise RuntimeError(f"too few samples to measure (before {before}, during {during}, after {after})")
        return run
    finally:
        for sock in (src_sock, dst_sock):
            if os.path.exists(sock):
                sh(ferry, "ctl", sock, "quit", check=False)
        reap(*procs, grace=5)
        if os.path.exists(image):
            os.remove(image)


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="precopy,postcopy,hybrid",
                    help="comma-separated; MODE+FLAG adds --FLAG to ferry migrate (e.g. precopy+own-link)")
    ap.add_argument("--bandwidth", default="100mbit", help="every lab host's link (tbf)")
    ap.add_argument("--ram-mib", default="0,96,256",
                    help="comma-separated: MiB of random data in the VM's RAM (memtouch after=migrate; 0: none)")
    ap.add_argument("--mem", default="512M")
    ap.add_argument("--disk-mib", type=int, default=256, help="the disk workload's region")
    ap.add_argument("--image-mib", type=int, default=512, help="the sparse image's size")
    ap.add_argument("--before", type=float, default=5.0)
    ap.add_argument("--after", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--fill-timeout", type=float, default=180.0)
    ap.add_argument("--dir", default="/var/tmp", help="where the image goes")
    ap.add_argument("--lock", default="/tmp/ferry-lab.lock", help="the lab's lock file ('' for none)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "disk-shared"))
    ap.add_argument("--append", action="store_true",
                    help="keep --out's cells of other RAM sizes / modes (each cell names its command and build)")
    a = ap.parse_args()
    a.ferry = os.path.abspath(a.ferry)
    if os.geteuid() != 0 or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        raise SystemExit("SKIP: needs root (lab namespaces) and /dev/kvm")
    if sh("qemu-nbd", "--version", check=False).returncode != 0:
        raise SystemExit("SKIP: qemu-nbd is not installed (scripts/setup.sh installs qemu-utils)")
    build = sh("git", "-C", ROOT, "describe", "--always", "--dirty", check=False).stdout.strip()
    cmd = "ferry bench disk " + " ".join(benchlib.recorded_command("disk_shared.py").split()[2:])
    cmd = cmd.strip()
    ours = {(int(x), m) for x in a.ram_mib.split(",") for m in a.modes.split(",")}
    kept = []
    if a.append and os.path.exists(a.out + ".json"):
        old = json.load(open(a.out + ".json"))
        kept = [{"command": old.get("command"), "build": old.get("build"), **c} for c in old["cells"]
                if (c["ram_mib"], c["mode"]) not in ours]
    cells = []
    loads = []  # the host's 1-minute load average at each trial's start
    port = 7830
    with tempfile.TemporaryDirectory(prefix="ferry-diskshared-") as tmp:
        for ram in [int(x) for x in a.ram_mib.split(",")]:
            for mode in a.modes.split(","):
                runs, errors = [], []
                for r in range(a.runs):
                    port += 1
                    with LabLock(a.lock):
                        t0 = time.time()
                        loads.append(os.getloadavg()[0])
                        up = sh(a.ferry, "lab", "up", "3", "--bandwidth", a.bandwidth, check=False)
                        try:
                            if up.returncode != 0:
                                raise RuntimeError(f"cannot build the lab: {up.stderr.strip()}")
                            runs.append(trial(a, mode, ram, port, tmp))
                            x = runs[-1]
                            print(f"ram {ram} {mode} run {r}: before {fmt(x['before_mib_s'], '.2f')} during "
                                  f"{fmt(x['during_mib_s'], '.2f')} after {fmt(x['after_mib_s'], '.2f')} MiB/s, "
                                  f"{x['total_s']:.2f} s, downtime {x['downtime_ms']:.1f} ms, "
                                  f"{x['bytes_mib']:.1f} MiB [{time.time() - t0:.0f} s]", flush=True)
                        except Exception as e:  # noqa: BLE001 - recorded, left out of the medians
                            errors.append(f"run {r}: {e}")
                            print(f"ram {ram} {mode} run {r} FAILED: {e}", flush=True)
                        finally:
                            sh(a.ferry, "lab", "down", check=False)
                keys = ["before_mib_s", "during_mib_s", "after_mib_s", "during_over_before", "total_s",
                        "migrate_wall_s", "downtime_ms", "bytes_mib", "postcopy_s", "bad_blocks", "io_errors"]
                med = benchlib.medians(runs, keys) if runs else {}
                cells.append({"ram_mib": ram, "mode": mode, "median": med, "runs": runs, "errors": errors,
                              "command": cmd, "build": build, "load_avg_1m": loads[-a.runs:]})
                write_results(a, kept + cells)  # after each cell: a stopped run keeps what it measured


def write_results(a, cells):
    cells = sorted(cells, key=lambda c: c["ram_mib"])  # (stable: modes stay in their order)
    machine = f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}"
    commands = list(dict.fromkeys((c["command"], c["build"]) for c in cells))
    loads = [x for c in cells for x in c.get("load_avg_1m", [])]
    benchlib.write_json(a.out + ".json", {
        "commands": [{"command": c, "build": b} for c, b in commands], "machine": machine,
        "bandwidth": a.bandwidth, "mem": a.mem,
        "disk_workload": f"disk:rw=mixed,bs=4k,qd=8,mib={a.disk_mib}", "nbd": NBD, "image_mib": a.image_mib,
        "before_s": a.before, "after_s": a.after, "interval_s": a.interval, "cells": cells}, indent=1)
    lines = [
        "# A VM on shared NBD storage moved across a shaped link: its disk throughput before, during, after",
        "",
        *[f"Command: `{c}` (build `{b}`)  " for c, b in commands],
        f"Machine: {machine}; lab link {a.bandwidth} (tbf on every host's link); medians of each cell's runs "
        f"that did not fail; the host's 1-minute load average at the trials' starts: "
        f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} (other work shares these 2 cores).",
        "",
        f"VM: {a.mem} RAM, 1 vCPU, on ferry-h1, `disk:rw=mixed,bs=4k,qd=8,mib={a.disk_mib}` on `{NBD}` "
        f"(qemu-nbd on ferry-h3 serving a {a.image_mib} MiB sparse raw image), plus "
        "`memtouch:tasks=1,mib=R,after=migrate` where R (RAM MiB) > 0: R MiB of random data in RAM for the move "
        "to carry. Destination on ferry-h2 with the same disk. `ferry migrate --mode MODE --verify` from ferry-h1; "
        "the guest's disk writes and the migration stream share ferry-h1's link.",
        "",
        "Guest disk MiB/s = (blocks read + written) x 4 KiB per second, from the guest's own counters "
        f"(`disk_check`, sampled every {a.interval:g} s: the source, then the destination): before = the "
        f"{a.before:g} s before the move, during = from the last sample before `ferry migrate`'s start to the "
        "first after its end (so at least one sampling interval: for a move of ~0.1 s it is mostly the guest around "
        "it), after = the "
        f"{a.after:g} s after it on the destination. Bad blocks / I/O errors: the destination's `disk_check` "
        "after the move (a run with any is failed).",
        "",
        "| RAM MiB | mode | before MiB/s | during MiB/s | after MiB/s | during / before | migration s | "
        "downtime ms | sent MiB | bad blocks | I/O errors | runs ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        ok = f"{len(c['runs'])}/{len(c['runs']) + len(c['errors'])}"
        if not m:
            lines.append(f"| {c['ram_mib']} | {c['mode']} | — | — | — | — | — | — | — | — | — | {ok} |")
            continue
        lines.append(
            f"| {c['ram_mib']} | {c['mode']} | {fmt(m['before_mib_s'], '.2f')} | {fmt(m['during_mib_s'], '.2f')} | "
            f"{fmt(m['after_mib_s'], '.2f')} | {fmt(m['during_over_before'], '.2f')} | {m['total_s']:.2f} | "
            f"{m['downtime_ms']:.1f} | {m['bytes_mib']:.1f} | {m['bad_blocks']:.0f} | {m['io_errors']:.0f} | {ok} |")
    lines += ["", "Each run:", "",
              "| RAM MiB | mode | before | during | after | during / before | migration s | downtime ms | "
              "sent MiB | postcopy s | bad blocks |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for x in c["runs"]:
            lines.append(
                f"| {x['ram_mib']} | {x['mode']} | {fmt(x['before_mib_s'], '.2f')} | {fmt(x['during_mib_s'], '.2f')} | "
                f"{fmt(x['after_mib_s'], '.2f')} | {fmt(x['during_over_before'], '.2f')} | {x['total_s']:.2f} | "
                f"{x['downtime_ms']:.1f} | {x['bytes_mib']:.1f} | {x['postcopy_s']:.2f} | {x['bad_blocks']} |")
    lines += benchlib.failed_runs(cells, lambda c: f"RAM {c['ram_mib']} MiB {c['mode']}")
    benchlib.write_md(a.out + ".md", lines)
    print(f"wrote {a.out}.md ({len(cells)} cells)", flush=True)


if __name__ == "__main__":
    main()
