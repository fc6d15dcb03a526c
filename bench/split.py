#!/usr/bin/env python3
"""Split migration (issue 14), the S-memV paper's experiments scaled to this
machine. A VM running `sort` (a radix sort of --sort-mib MiB of random keys,
which works on twice that) moves from ferry-h1 to ferry-h2 --lead seconds after
its start, to a destination that holds only a budget of its memory (each of --budgets):

- enough: a plain precopy to a destination with room for all of it (the
  reference for migration time and downtime);
- split-clock / split-aging: `--mode split` with the main host holding
  the budget, the rest on two memory servers on ferry-h3, chunks ranked by
  the source's access history (--access-period, on by default like
  `ferry run`; 0: off, chunks in address order); the main host pages by
  clock or aging either way;
- swap: a plain precopy to a destination VMM held to the budget (plus
  --overhead for the VMM itself) by a v1 memory cgroup, with swap on a file
  (the paper's "virtual memory" baseline);
- none: the same VM never migrated (the sort's own runtime).

Per run: migration time and downtime, the sort's runtime (the guest's own
measure of its task, start to end, across the move) and page-ins (split:
the pager's chunks paged in; swap: pswpin pages from /proc/vmstat). Every
source runs with the same --access-period.
`--chunks` adds a chunk-size sweep of split-clock. Cells are medians of
--runs. Results: bench/results/split.{json,md}.

Usage: python3 bench/split.py [--runs 3] [--mem 512M] [--sort-mib 96]
       [--budgets 256M,160M] [--chunks 1,16,64,256,512]
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host, sh

SRC, DST, SUB = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2"), ("ferry-h3", "10.77.0.3")
CGROUP = "/sys/fs/cgroup/memory/ferry-split-bench"
SWAPFILE = "/var/tmp/ferry-split-bench.swap"


def size_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def pswpin():
    for line in open("/proc/vmstat"):
        if line.startswith("pswpin "):
            return int(line.split()[1])
    return 0


def swap_setup(limit, swap_bytes):
    """A swap file and a memory cgroup held to `limit` bytes. Its OOM killer
    is off, so a VMM the kernel cannot reclaim for fast enough waits for
    swap rather than dying (with it on, every 256 MiB run of a 512 MiB VM
    was killed while the migration wrote the VM's memory)."""
    if os.path.exists(SWAPFILE) and os.path.getsize(SWAPFILE) < swap_bytes:
        sh("swapoff", SWAPFILE, check=False)
        os.unlink(SWAPFILE)
    if not os.path.exists(SWAPFILE):
        sh("fallocate", "-l", str(swap_bytes), SWAPFILE)
        os.chmod(SWAPFILE, 0o600)
        sh("mkswap", SWAPFILE)
    sh("swapon", SWAPFILE, check=False)
    os.makedirs(CGROUP, exist_ok=True)
    with open(os.path.join(CGROUP, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    for knob, value in (("memory.oom_control", "1"), ("memory.swappiness", "100")):
        try:
            with open(os.path.join(CGROUP, knob), "w") as f:
                f.write(value)
        except OSError as e:
            print(f"warning: cannot set {knob}: {e}", flush=True)


def swap_teardown():
    sh("swapoff", SWAPFILE, check=False)
    if os.path.exists(SWAPFILE):
        os.unlink(SWAPFILE)
    if os.path.isdir(CGROUP):
        try:
            os.rmdir(CGROUP)
        except OSError:
            pass


def sort_ms(summary):
    """The sort task's runtime (ms) from a VMM's run summary, or None."""
    for w in summary.get("workloads", []):
        if w["spec"].startswith("sort") and w.get("result") == "ok" and w.get("finished_task_ms"):
            return w["finished_task_ms"][0]
    return None


def ended_when_sorted(ferry, proc, sock, a):
    """The VMM's summary (stdout) once its sort has finished. With a fill
    task beside it the VMM would run on forever: it is asked to quit as
    soon as its status shows the sort done."""
    deadline = time.time() + a.timeout
    while a.fill_mib and proc.poll() is None and time.time() < deadline:
        st = sh(ferry, "status", sock, "--json", "--metrics", check=False)
        try:
            w = [w for w in json.loads(st.stdout)["metrics"]["workloads"] if w["spec"].startswith("sort")][0]
            if w["tasks"] > 0 and w["tasks_done"] >= w["tasks"]:
                sh(ferry, "ctl", sock, "quit", check=False)
                break
        except (ValueError, KeyError, IndexError, TypeError):
            pass  # not up yet, or moving
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=max(1, deadline - time.time()))
    return out


def memservers(ferry, ports):
    procs = [subprocess.Popen(in_host(SUB[0], ferry, "memserver", "--listen", f"tcp:{SUB[1]}:{p}",
                                      "--capacity", "2G", "--no-registry"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    time.sleep(0.5)
    return procs


def run_once(ferry, a, config, chunk, budget, tmp, port):
    """One VM, one configuration; returns the run's figures."""
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    workload = f"sort:mib={a.sort_mib}"
    if a.fill_mib:
        workload += f"+fill:content=worst,mib={a.fill_mib}"
    common = ["run", "--mem", a.mem, "--workload", workload, "--quiet", "--json"]
    # No --duration: a VMM ends when its sort has finished (or, the
    # source, once migrated). Never migrated, it tracks nothing: the
    # reference is the sort alone, so tracking's cost counts against the rest.
    tracking = ["--access-period", str(0 if config == "none" else a.access_period),
                "--access-share", str(a.access_share), "--access-grain", str(a.access_grain)]
    src_cmd = in_host(SRC[0], ferry, *common, "--control", src_sock, *tracking,
                      *(["--prealloc"] if a.prealloc else []))
    procs, servers = [], []
    try:
        if config == "none":
            src = subprocess.Popen(src_cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(src)
            out = ended_when_sorted(ferry, src, src_sock, a)
            ms = sort_ms(json.loads(out))
            if ms is None:
                raise RuntimeError("the sort did not finish")
            return {"sort_ms": ms}
        to = f"tcp:{DST[1]}:{port}"
        dst_cmd = [*common, "--incoming", to, "--control", dst_sock, "--apf", a.apf]
        if config == "swap":
            # Into the cgroup before entering the lab host (whose /sys does
            # not show the cgroup tree); the VMM inherits it.
            wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$0" "$@"',
                       *in_host(DST[0], ferry, *dst_cmd)]
            dst = subprocess.Popen(wrapped, stdout=subprocess.PIPE,
                                   stderr=open(os.path.join(tmp, "dst.err"), "w"), text=True)
        else:
            dst = subprocess.Popen(in_host(DST[0], ferry, *dst_cmd), stdout=subprocess.PIPE,
                                   stderr=open(os.path.join(tmp, "dst.err"), "w"), text=True)
        procs.append(dst)
        if config.startswith("split"):
            # Up before the source starts: every config moves the sort
            # --lead seconds after its start.
            servers = memservers(ferry, (port + 1000, port + 2000))
        src = subprocess.Popen(src_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(src)
        flags = []
        if config.startswith("split"):
            flags = ["--mode", "split", "--sub", f"tcp:{SUB[1]}:{port + 1000},tcp:{SUB[1]}:{port + 2000}",
                     "--main-budget", budget, "--chunk-pages", str(chunk),
                     "--rank", config.split("-")[1]]
        benchlib.wait_for(src_sock, dst_sock)
        time.sleep(a.lead)
        swapped0 = pswpin()
        m = sh(*in_host(SRC[0], ferry, "migrate", src_sock, "--to", to, *flags, "--json"), check=False)
        stats = benchlib.report(m, lambda err: err.strip()[-300:])
        if a.dump:
            open(os.path.join(a.dump, f"{config}-{budget}-{chunk}-migrate.json"), "w").write(m.stdout)
        out = ended_when_sorted(ferry, dst, dst_sock, a)
        if not out.strip():
            err = open(os.path.join(tmp, "dst.err")).read().strip()
            raise RuntimeError(f"the destination VMM ended without a summary: {err[-300:]}")
        summary = json.loads(out)
        if a.dump:
            open(os.path.join(a.dump, f"{config}-{budget}-{chunk}-destination.json"), "w").write(out)
            open(os.path.join(a.dump, f"{config}-{budget}-{chunk}-destination.err"), "w").write(
                open(os.path.join(tmp, "dst.err")).read())
        ms = sort_ms(summary)
        if ms is None:
            raise RuntimeError(f"the sort did not finish within {a.timeout} s")
        pager = summary.get("split") or {}
        return {
            "total_s": stats["total_secs"],
            "downtime_ms": stats["downtime_ms"],
            "sort_ms": ms,
            "page_ins": pager.get("page_ins", 0) if config.startswith("split") else pswpin() - swapped0,
            "page_outs": pager.get("page_outs", 0),
        }
    finally:
        benchlib.reap(*procs, *servers)


def cell(ferry, a, config, chunk, budget, tmp, port):
    runs, errors = [], []
    for _ in range(a.runs):
        port[0] += 1
        try:
            runs.append(run_once(ferry, a, config, chunk, budget, tmp, port[0]))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            errors.append(str(e).strip())
            print(f"{config} chunk {chunk}: a run failed: {e}", flush=True)
    med = benchlib.medians(runs) if runs else {}
    c = {"config": config, "budget": budget, "chunk_pages": chunk, "median": med, "runs": runs,
         "errors": errors}
    print(json.dumps({k: c[k] for k in ("config", "budget", "chunk_pages", "median")}), flush=True)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem", default="512M")
    ap.add_argument("--sort-mib", type=int, default=192)
    ap.add_argument("--budgets", default="384M,256M", help="the destination's memory, one set of cells each")
    ap.add_argument("--overhead", default="32M", help="the swap destination's VMM beside guest memory")
    ap.add_argument("--lead", type=float, default=0.5, help="seconds the sort runs before the move")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--access-period", type=int, default=1000,
                    help="the source's access tracking (ms; 0: off, split ranks chunks in address order)")
    ap.add_argument("--access-share", type=int, default=8,
                    help="the source samples 1/N of its pages per period")
    ap.add_argument("--access-grain", type=int, default=64,
                    help="the source's pages per sampled fault")
    ap.add_argument("--prealloc", action="store_true",
                    help="the source allocates guest RAM before boot (the fill then writes at memory speed)")
    ap.add_argument("--fill-mib", type=int, default=0,
                    help="a second task fills this much guest memory with random data and leaves it be "
                         "(the paper filled its VM's memory before the sort)")
    ap.add_argument("--swap-size", default="2G", help="the swap file")
    ap.add_argument("--dump", default="", help="a folder for each run's migration JSON and destination summary (the last run of a cell wins)")
    ap.add_argument("--apf", default="on", choices=["on", "off"],
                    help="async page faults for the destination's guest")
    ap.add_argument("--chunks", default="", help="chunk sizes (pages) to sweep with split-clock")
    ap.add_argument("--configs", default="none,enough,split-clock,split-aging,swap")
    ap.add_argument("--out", default="split", help="results/OUT.{json,md}")
    a = ap.parse_args()
    ferry = os.path.abspath(a.ferry)
    benchlib.lab_up(ferry, 3)
    configs = [c for c in a.configs.split(",") if c]
    budgets = a.budgets.split(",")
    cells = []
    port = [7800]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for config in [c for c in configs if c in ("none", "enough")]:
                cells.append(cell(ferry, a, config, 256, "", tmp, port))
            for budget in budgets:
                if "swap" in configs:
                    swap_setup(size_bytes(budget) + size_bytes(a.overhead), size_bytes(a.swap_size))
                for config in [c for c in configs if c not in ("none", "enough")]:
                    cells.append(cell(ferry, a, config, 256, budget, tmp, port))
            for chunk in [int(c) for c in a.chunks.split(",") if c]:
                cells.append(cell(ferry, a, "split-clock", chunk, budgets[-1], tmp, port))
    finally:
        swap_teardown()
        sh(ferry, "lab", "down", check=False)
    write(a, cells)


def write(a, cells):
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    command = benchlib.recorded_command("split.py")
    benchlib.write_json(os.path.join(out, f"{a.out}.json"), {"command": command, "cells": cells}, indent=1)
    md = os.path.join(out, f"{a.out}.md")
    base = {c["config"]: c["median"] for c in cells if c["budget"] == ""}
    none_ms = base.get("none", {}).get("sort_ms")
    enough = base.get("enough", {})
    lines = [
        "# Split migration against enough memory and swap",
        "",
        f"Command: `{command}` (medians of {a.runs}; a {a.mem} VM, 1 vCPU, running `sort:mib={a.sort_mib}`",
        f"(it works on {2 * a.sort_mib} MiB)"
        + (f" beside a task that fills {a.fill_mib} MiB with random data and leaves it be" if a.fill_mib else "")
        + f", moved {a.lead:g} s after its start from ferry-h1 to ferry-h2;",
        "the destination holds `budget` of its memory: split puts the rest on two memory servers on ferry-h3,",
        f"swap is a v1 memory cgroup of the budget + {a.overhead} with swap on a file, its OOM killer off). Sources track",
        f"accesses with --access-period {a.access_period} --access-share {a.access_share} --access-grain {a.access_grain}"
        + (" and preallocate their RAM" if a.prealloc else "") + " (0: off), except `none`, which",
        "never moves and tracks nothing. Sort runtime: the guest's own measure of its task, across the move.",
        "",
        "| config | budget | chunk pages | migration s | vs enough | downtime ms | vs enough | sort s | sort vs enough | sort vs none | page-ins |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["median"]
        if not m:
            continue
        tot, down = m.get("total_s"), m.get("downtime_ms")
        vs_t = f"{(tot / enough['total_s'] - 1) * 100:+.0f}%" if tot and enough.get("total_s") else ""
        vs_d = f"{down - enough['downtime_ms']:+.1f} ms" if down is not None and enough.get("downtime_ms") is not None else ""
        slow = f"{(m['sort_ms'] / none_ms - 1) * 100:+.0f}%" if none_ms else ""
        slow_e = f"{(m['sort_ms'] / enough['sort_ms'] - 1) * 100:+.0f}%" if enough.get("sort_ms") else ""
        lines.append(
            f"| {c['config']} | {c['budget'] or 'all'} | {c['chunk_pages']} | {'' if tot is None else f'{tot:.3f}'} | {vs_t} | "
            f"{'' if down is None else f'{down:.1f}'} | {vs_d} | {m['sort_ms'] / 1e3:.2f} | {slow_e} | {slow} | "
            f"{m.get('page_ins', '')} |")
    lines += benchlib.failed_runs(cells, lambda c: f"{c['config']} {c['budget']} chunk {c['chunk_pages']}")
    benchlib.write_md(md, lines)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
