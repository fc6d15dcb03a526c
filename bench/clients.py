#!/usr/bin/env python3
"""Clients that follow their VM (issue 16): a 1 GiB kv VM
(kv:workers=8,keys=480000,value=1024) on ferry-h1 under `ferry load` with
128 clients on ferry-h3 migrates by precopy (no --verify, default settings)
to ferry-h2. Configurations:

- before: the ferry built before issue 16 (--before PATH): the service on
  the source host's address, and the source forwards every client after
  the switch;
- forward: this ferry, same set-up (no VM address: the forwarder fallback);
- move: this ferry with --vm-address 10.77.0.100: the address and every
  connection move with the VM (TCP_REPAIR) and the source exits;
- move-tight: the same with `ferry migrate --downtime-ms 2` (precopy
  iterates until the last round fits 2 ms instead of 10);
- move-raw: move with `ferry migrate --compress none` (what the default
  `auto` policy's codec choices cost or bring here).

Per run: downtime and its parts (from the migration's own report),
requests/s in the 5 s before the pause and in the 5 s after the
destination's Started (by send time, from `ferry load --out`), the worst
request latency from 0.1 s before the pause to 1 s after, client errors,
wrong values and reconnects, and whether the source VMM exited within 3 s.
Cells are medians of --runs runs. Results: bench/results/clients.{json,md}.

A run of some configurations keeps the other configurations' cells in the
results file.

With --old PATH, every configuration also runs with that earlier build,
alternating with this one run by run; its cells are named CONFIG@old.

Usage: python3 bench/clients.py [--runs 5] [--before PATH] [--old PATH] [--configs before,forward,move,move-tight]
"""
import argparse
import csv
import json
import os
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST, CLI = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2"), "ferry-h3"
VM_ADDR = "10.77.0.100"
WORKLOAD = "kv:workers=8,keys=480000,value=1024"
WINDOW_S = 5.0
PARTS = ("pause", "last_round", "save_state", "verify", "clients", "destination")


def drop_vm_address():
    benchlib.drop_vm_address(VM_ADDR, (SRC[0], DST[0]))


def once(ferry, config, tmp, port, lead_s=7.0, load_s=16):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    csv_path = os.path.join(tmp, "requests.csv")
    benchlib.fresh(src_sock, dst_sock, csv_path)
    common = ["run", "--mem", "1G", "--vcpus", "2", "--workload", WORKLOAD, "--quiet", "--json"]
    listen = f"{DST[1]}:{port}"
    if config.startswith("move"):
        svc = f"{VM_ADDR}:{port + 1}"
        src_args = ["--vm-address", VM_ADDR, "--serve", svc]
    else:
        svc = f"{SRC[1]}:{port + 1}"
        src_args = ["--serve", svc]
    dst = subprocess.Popen(in_host(DST[0], ferry, *common, "--incoming", f"tcp:{listen}", "--serve", f"{DST[1]}:0",
                                   "--control", dst_sock, "--duration", f"{load_s + 10}s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    src = subprocess.Popen(in_host(SRC[0], ferry, *common, *src_args, "--control", src_sock, "--duration", "300s"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load = None
    try:
        benchlib.wait_for(src_sock, dst_sock, timeout=30)
        load = subprocess.Popen(in_host(CLI, ferry, "load", "--target", svc, "--clients", "128",
                                        "--duration", f"{load_s}s", "--out", csv_path, "--json", "--quiet"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = time.time() + 60
        while benchlib.served(ferry, src_sock) < 1000:
            if time.time() > ready:
                raise RuntimeError("kv never served")
            time.sleep(0.1)
        time.sleep(lead_s)
        tight = {"move-tight": ["--downtime-ms", "2"],
                 "move-raw": ["--compress", "none"]}.get(config, [])
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{listen}", "--json", *tight), check=False)
        stats = benchlib.report(m, str.strip)
        try:
            src.wait(timeout=3)
            exited = True
        except subprocess.TimeoutExpired:
            exited = False
        out, _ = load.communicate(timeout=load_s + 60)
        summary = json.loads(out)
    finally:
        # SIGTERM: the VMM holding the VM's address takes it off its host.
        benchlib.reap(src, dst, load, grace=5)
        drop_vm_address()
    with open(csv_path) as f:
        reqs = [(int(r["send_us"]) / 1e6, int(r["latency_us"])) for r in csv.DictReader(f)]
    end = stats["start_unix_s"] + stats["total_secs"] - summary["start_unix_s"]
    pause = end - stats["downtime_ms"] / 1e3
    before = sum(1 for t, _ in reqs if pause - WINDOW_S <= t < pause)
    after = sum(1 for t, _ in reqs if end <= t < end + WINDOW_S)
    worst = max((lat for t, lat in reqs if pause - 0.1 <= t < pause + 1.0), default=0)
    parts = stats["downtime_parts"]
    clients = stats.get("clients") or {}
    return {
        "downtime_ms": stats["downtime_ms"],
        **{f"{k}_ms": parts.get(k, 0.0) for k in PARTS},
        "total_s": stats["total_secs"],
        "rps_before": before / WINDOW_S,
        "rps_after": after / WINDOW_S,
        "rps_change_pct": 100.0 * (after - before) / max(before, 1),
        "worst_latency_ms": worst / 1e3,
        "errors": summary["errors"],
        "wrong_values": summary["wrong_values"],
        "reconnects": summary.get("reconnects", 0),
        "moved_connections": clients.get("connections", 0) if clients.get("moved") else 0,
        "source_exited": 1 if exited else 0,
    }


def main():
    ap = argparse.ArgumentParser()
    benchlib.add_build_args(ap, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--before", help="a ferry binary built before issue 16 (for the 'before' configuration)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--configs", default="before,forward,move,move-tight")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    configs = [c for c in a.configs.split(",") if c != "before" or a.before]
    if a.before and not os.path.exists(a.before):
        raise SystemExit(f"--before {a.before}: no such binary")
    sh(ferry, "lab", "up", "3")
    cells = []
    port = 7600
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for config in configs:
                # With --old, each run takes both builds, in alternating order;
                # the old build's cell is named CONFIG@old.
                builds = {"new": os.path.abspath(a.before)} if config == "before" else \
                    {k: os.path.abspath(v) for k, v in benchlib.builds_of(a).items()}
                runs = {k: [] for k in builds}
                errors = {k: [] for k in builds}
                for i in range(a.runs):
                    for label in benchlib.alternated(builds, i):
                        port += 2
                        try:
                            runs[label].append(once(builds[label], config, tmp, port))
                        except (RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                            errors[label].append(str(e)[-300:])
                            print(f"{config} ({label}): a run failed: {e}", flush=True)
                for label in builds:
                    if not runs[label]:
                        continue
                    name = config if label == "new" else f"{config}@{label}"
                    med = benchlib.medians(runs[label])
                    cells.append({"config": name, "median": med, "runs": runs[label], "errors": errors[label]})
                    print(json.dumps({"config": name, "median": med}), flush=True)
    finally:
        sh(ferry, "lab", "down", check=False)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("clients.py")
    for c in cells:
        c["command"] = command
    path = os.path.join(out, "clients.json")
    if os.path.exists(path):
        # Keep the cells of configurations not run this time.
        done = {c["config"] for c in cells}
        old = json.load(open(path))
        kept = [c for c in old.get("cells", []) if c["config"] not in done]
        for c in kept:
            c.setdefault("command", old.get("command", "?"))
        order = ["before", "forward", "move", "move-tight", "move-raw"]
        base = lambda c: c["config"].split("@")[0]
        cells = sorted(kept + cells, key=lambda c: (order.index(base(c)) if base(c) in order else 99, c["config"]))
    benchlib.write_json(path, {"workload": WORKLOAD, "cells": cells}, indent=1)
    md = os.path.join(out, "clients.md")
    commands = ", ".join(sorted({"`" + c["command"] + "`" for c in cells if "command" in c}))
    lines = [
        "# Clients that follow their VM: downtime and throughput under 128 clients",
        "",
        f"Commands: {commands}",
        f"(medians of {a.runs} runs per configuration; 1 GiB `{WORKLOAD}`, 2 vCPUs, ferry-h1 to ferry-h2 by",
        "precopy without --verify, default settings unless the configuration says; 128 `ferry load` clients",
        "on ferry-h3). `before` is the ferry of commit 10d9b65 (`cargo build --release` there).",
        "",
        "Downtime parts (ms) are the migration's own: pause (stop the readers or drain the ring, park the",
        "vCPUs, flush answers), last round, state, clients (checkpoint and send the connections), destination",
        "(Complete to Started: restore, connections, vCPUs). req/s: requests sent in the 5 s before the pause",
        "and the 5 s after Started. Worst: the slowest request sent from 0.1 s before the pause to 1 s after.",
        "",
        "| config | downtime ms | pause | last round | state | clients | destination | req/s before | req/s after | change | worst ms | errors | wrong | reconnects | moved | source exited |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        lines.append(
            f"| {c['config']} | {m['downtime_ms']:.2f} | {m['pause_ms']:.2f} | {m['last_round_ms']:.2f} | "
            f"{m['save_state_ms']:.2f} | {m['clients_ms']:.2f} | {m['destination_ms']:.2f} | "
            f"{m['rps_before']:.0f} | {m['rps_after']:.0f} | {m['rps_change_pct']:+.1f}% | {m['worst_latency_ms']:.1f} | "
            f"{m['errors']:.0f} | {m['wrong_values']:.0f} | {m['reconnects']:.0f} | {m['moved_connections']:.0f} | "
            f"{sum(r['source_exited'] for r in c['runs'])}/{len(c['runs'])} |")
    lines += benchlib.failed_runs(cells, lambda c: c["config"])
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
