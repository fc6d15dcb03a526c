#!/usr/bin/env python3
"""Plots of `ferry bench split`: bench/results/split.png (sort runtime,
migration time and downtime per configuration and budget, medians with the
runs as dots) and, when the chunk sweep ran, bench/results/split-chunks.png
(sort runtime and page-ins against chunk size).

Usage: python3 bench/split_plot.py [NAME]   (NAME: results/NAME.json, default split;
another name plots its main figure as results/NAME.png only)
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def label(c):
    return c["config"] if not c["budget"] else f"{c['config']}\n{c['budget']}"


def bars(ax, cells, key, scale, title, unit):
    cells = [c for c in cells if c["median"].get(key) is not None]
    xs = range(len(cells))
    ax.bar(xs, [c["median"][key] * scale for c in cells], color="#8fb3d9")
    for x, c in zip(xs, cells):
        ax.plot([x] * len(c["runs"]), [r[key] * scale for r in c["runs"]], "k.", ms=4)
    ax.set_xticks(list(xs), [label(c) for c in cells], fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(unit)


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "split"
    path = os.path.join(RESULTS, f"{name}.json")
    cells = [c for c in json.load(open(path))["cells"] if c["median"] and c["chunk_pages"] == 256]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    bars(axes[0], cells, "sort_ms", 1e-3, "sort runtime (guest's measure, across the move)", "s")
    moved = [c for c in cells if c["config"] != "none"]
    bars(axes[1], moved, "total_s", 1.0, "migration time", "s")
    bars(axes[2], moved, "downtime_ms", 1.0, "downtime", "ms")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=110)
    print("wrote", os.path.join(RESULTS, f"{name}.png"))
    if name != "split":
        return
    sweep_path = os.path.join(RESULTS, "split-chunks.json")
    if not os.path.exists(sweep_path):
        return
    sweep = [c for c in json.load(open(sweep_path))["cells"] if c["median"]]
    sweep.sort(key=lambda c: c["chunk_pages"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["chunk_pages"] for c in sweep]
    ax.plot(xs, [c["median"]["sort_ms"] / 1e3 for c in sweep], "o-", label="sort runtime (s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk pages")
    ax.set_ylabel("sort runtime (s)")
    ax2 = ax.twinx()
    ax2.plot(xs, [c["median"]["page_ins"] for c in sweep], "s--", color="#c0504d", label="page-ins")
    ax2.set_ylabel("page-ins (chunks)")
    budget = sweep[0]["budget"] if sweep else ""
    ax.set_title(f"split-clock, main host budget {budget}: chunk size", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "split-chunks.png"), dpi=110)
    print("wrote", os.path.join(RESULTS, "split-chunks.png"))


if __name__ == "__main__":
    main()
