#!/usr/bin/env python3
"""Postcopy under load (issue 12, bench (b)): a kv VM holding ~500 MiB of
values moves from ferry-h1 to ferry-h2 by postcopy while 128 clients on
ferry-h3 send it requests (`ferry load --out`: every request's send time and
latency). Cells: APF on/off x prefetch 0/8 x added round trip (`ferry lab
delay` on the destination host; this kernel has no netem).

Per run, around the switch (t = 0 at the pause, from the migration's own
clock; the namespaces share the host clock):
- the latency of every request and its 100 ms mean (by send time);
- the baseline: mean latency over the 2 s before the switch;
- the worst 100 ms mean after the switch, and how long until the 100 ms
  mean is back within 1.5x the baseline for 500 ms straight;
- requests completed in the 5 s after the switch (throughput);
- the destination's faults per 100 ms by kind and the guest execution ratio
  (from the migration's fault report).

Cells are medians of --runs runs. Results: bench/results/postcopy-kv.{json,md}
and, when matplotlib is installed, postcopy-kv-<rtt>.png (100 ms mean latency
and execution ratio over time, one line per cell).

Usage: python3 bench/postcopy_kv.py [--runs 2] [--rtts 0,0.15,1] [--keys 480000]
           [--address move|forward]
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST, CLI = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2"), "ferry-h3"
# --address move: the VM's own address, which moves with it (its clients'
# connections too); forward: the source host's, and its VMM forwards.
VM_ADDR = "10.77.0.100"
BIN_S = 0.1
BEFORE_S, AFTER_S = 2.0, 5.0


def workload(keys):
    return f"kv:workers=4,keys={keys},value=1024"


def run_once(ferry, keys, rtt, apf, prefetch, tmp, port, load_s, lead_s, address):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    csv_path = os.path.join(tmp, "requests.csv")
    benchlib.fresh(src_sock, dst_sock, csv_path)
    common = ["run", "--mem", "1G", "--vcpus", "2", "--workload", workload(keys), "--quiet", "--json"]
    listen = f"{DST[1]}:{port}"
    if address == "move":
        svc = f"{VM_ADDR}:{port + 1}"
        src_args = ["--vm-address", VM_ADDR, "--serve", svc]
    else:
        svc = f"{SRC[1]}:{port + 1}"
        src_args = ["--serve", svc]
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{listen}", "--apf", apf,
                                   "--serve", f"{DST[1]}:0", "--control", dst_sock, "--duration", f"{load_s + 5:.0f}s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, *src_args, "--control", src_sock,
                                   "--duration", "300s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = None
    proxy, to = benchlib.start_proxy(ferry, DST[0], listen, rtt)
    try:
        benchlib.wait_for(src_sock, dst_sock, timeout=30)
        load = subprocess.Popen(in_host(CLI, ferry, "load", "--target", svc, "--clients", "128",
                                        "--duration", f"{load_s}s", "--out", csv_path, "--json", "--quiet"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The guest fills its table before it serves; give the clients a
        # steady state before the switch.
        ready = time.time() + 60
        while benchlib.served(ferry, src_sock) == 0:
            if time.time() > ready:
                raise RuntimeError("kv never served")
            time.sleep(0.1)
        time.sleep(lead_s)
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{to}", "--mode", "postcopy",
                        "--prefetch", str(prefetch), "--json"), check=False)
        stats = benchlib.report(m)
        out, err = load.communicate(timeout=load_s + 60)
        summary = json.loads(out)
    finally:
        # SIGTERM: the VMM holding the VM's address takes it off its host.
        benchlib.reap(src, dst, proxy, load, grace=5)
        benchlib.drop_vm_address(VM_ADDR, (SRC[0], DST[0]))
    with open(csv_path) as f:
        reqs = [(int(r["send_us"]) / 1e6, int(r["latency_us"]), r["outcome"]) for r in csv.DictReader(f)]
    p = stats["postcopy"]
    switch = stats["start_unix_s"] + p["switch_at_s"] - summary["start_unix_s"]
    return analyse(reqs, switch, stats, summary)


def analyse(reqs, switch, stats, summary):
    """Latency around the switch (t relative to it), faults and execution ratio."""
    nbins = int((BEFORE_S + AFTER_S) / BIN_S)
    sums, counts = [0.0] * nbins, [0] * nbins
    done_after = 0
    for t, lat, outcome in reqs:
        rel = t - switch
        if outcome == "ok" and 0 <= rel < AFTER_S:
            done_after += 1
        i = int((rel + BEFORE_S) / BIN_S)
        if 0 <= i < nbins and outcome == "ok":
            sums[i] += lat
            counts[i] += 1
    mean = [sums[i] / counts[i] if counts[i] else None for i in range(nbins)]
    before = [reqs_lat for t, reqs_lat, o in reqs if o == "ok" and -BEFORE_S <= t - switch < -0.2]
    baseline = statistics.mean(before) if before else float("nan")
    first_after = int(BEFORE_S / BIN_S)
    after = [m for m in mean[first_after:] if m is not None]
    peak = max(after) if after else float("nan")
    # Back to baseline: the first bin from which 5 bins in a row are within
    # 1.5x the baseline (empty bins, no answers at all, are not).
    recover = None
    for i in range(first_after, nbins - 4):
        window = mean[i:i + 5]
        if all(m is not None and m <= 1.5 * baseline for m in window):
            recover = (i - first_after) * BIN_S
            break
    f = stats["postcopy"]["faults"]
    series = f["series"]
    return {
        "baseline_us": baseline,
        "peak_100ms_us": peak,
        "back_to_baseline_s": recover if recover is not None else AFTER_S,
        "requests_5s_after": done_after,
        "downtime_ms": stats["downtime_ms"],
        "postcopy_s": stats["postcopy"]["secs"],
        "major": f["major"],
        "apf_absorbed": f["apf_absorbed"] or 0,
        "blocked": f["blocked"],
        "p50_fault_us": f["latency_us"]["p50"],
        "p99_fault_us": f["latency_us"]["p99"],
        "min_exec_ratio": min((b["exec_ratio"] for b in series), default=1.0),
        "errors": summary["errors"],
        "wrong_values": summary["wrong_values"],
        "_mean_series_us": mean,
        "_fault_series": [{"t_ms": b["t_ms"], "major": b["major"], "minor": b["minor"], "zero": b["zero"],
                           "async_worker": b["async_worker"], "exec_ratio": b["exec_ratio"]} for b in series],
    }


def plot(out, cells, rtt):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ts = [-BEFORE_S + (i + 0.5) * BIN_S for i in range(int((BEFORE_S + AFTER_S) / BIN_S))]
    for c in cells:
        if c["rtt_ms"] != rtt:
            continue
        r = c["runs"][0]
        label = f"APF {c['apf']}, prefetch {c['prefetch']}"
        ax1.plot(ts, [m / 1e3 if m is not None else float("nan") for m in r["_mean_series_us"]], label=label)
        ax2.plot([b["t_ms"] / 1e3 for b in r["_fault_series"]], [b["exec_ratio"] for b in r["_fault_series"]],
                 label=label)
    ax1.set_ylabel("request latency, 100 ms mean (ms)")
    ax1.set_yscale("log")
    ax1.axvline(0, color="grey", lw=0.5)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("guest execution ratio")
    ax2.set_xlabel("seconds from the switch")
    ax2.set_ylim(0, 1.05)
    fig.suptitle(f"kv under 128 clients, postcopy, added RTT {rtt} ms (first run of each cell)")
    name = f"postcopy-kv-{rtt}ms.png"
    fig.savefig(os.path.join(out, name), dpi=90)
    plt.close(fig)
    return name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rtts", default="0,0.15,1")
    ap.add_argument("--keys", type=int, default=480000, help="1 KiB values: 480000 is ~470 MiB")
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--lead-s", type=float, default=3.0, help="load before the switch")
    ap.add_argument("--address", choices=("move", "forward"), default="move",
                    help="move: the VM has its own address and its clients' connections move with it; "
                         "forward: the source host's address, and the source forwards them")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    benchlib.lab_up(ferry, 3)
    cells = []
    try:
        port = 7900
        with tempfile.TemporaryDirectory() as tmp:
            for rtt in [float(x) for x in a.rtts.split(",")]:
                for apf in ("on", "off"):
                    for prefetch in (0, 8):
                        runs = []
                        for _ in range(a.runs):
                            port += 2
                            runs.append(run_once(ferry, a.keys, rtt, apf, prefetch, tmp, port, a.load_s,
                                                 a.lead_s, a.address))
                        keys = [k for k in runs[0] if not k.startswith("_")]
                        med = benchlib.medians(runs, keys)
                        cell = {"rtt_ms": rtt, "apf": apf, "prefetch": prefetch, "median": med, "runs": runs}
                        cells.append(cell)
                        print(json.dumps({k: cell[k] for k in ("rtt_ms", "apf", "prefetch", "median")}),
                              flush=True)
    finally:
        sh(ferry, "lab", "down", check=False)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("postcopy_kv.py")
    benchlib.write_json(os.path.join(out, "postcopy-kv.json"),
                        {"command": command, "workload": workload(a.keys), "address": a.address, "cells": cells})
    plots = [p for p in (plot(out, cells, r) for r in sorted({c["rtt_ms"] for c in cells})) if p]
    md = os.path.join(out, "postcopy-kv.md")
    lines = [
        "# Postcopy under load: kv latency around the switch",
        "",
        f"Command: `{command}` (medians of {a.runs}; 1 GiB VM, 2 vCPUs, `{workload(a.keys)}`;",
        "128 `ferry load` clients on a third lab host for "
        f"{a.load_s:.0f} s, the switch {a.lead_s:.0f} s after the table is served;",
        "delay added by `ferry lab delay` on the destination host;",
        ("clients reach the VM at its own address, which moves with it (`ferry run --vm-address`))."
         if a.address == "move" else "clients reach the source host, whose VMM forwards them after the switch)."),
        "",
        "Baseline: mean latency over the 2 s before the switch. Back to baseline: the 100 ms mean",
        "stays within 1.5x the baseline for 500 ms (5.0 = not within the 5 s looked at).",
        "",
        "| added RTT | APF | prefetch | baseline µs | worst 100 ms mean µs | back to baseline s | requests in 5 s after | downtime ms | postcopy s | major | absorbed by APF | stopped a vCPU | fault p50 µs | fault p99 µs | min exec ratio | errors | wrong |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['rtt_ms']} ms | {c['apf']} | {c['prefetch']} | {m['baseline_us']:.0f} | {m['peak_100ms_us']:.0f} | "
            f"{m['back_to_baseline_s']:.1f} | {m['requests_5s_after']:.0f} | {m['downtime_ms']:.1f} | "
            f"{m['postcopy_s']:.2f} | {m['major']:.0f} | {m['apf_absorbed']:.0f} | {m['blocked']:.0f} | "
            f"{m['p50_fault_us']:.0f} | {m['p99_fault_us']:.0f} | {m['min_exec_ratio']:.2f} | "
            f"{m['errors']:.0f} | {m['wrong_values']:.0f} |")
    if plots:
        lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in plots) + "."]
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
