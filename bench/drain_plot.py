#!/usr/bin/env python3
"""Plot of `ferry bench drain`: bench/results/NAME.png from NAME.json.

Three panels: each concurrency's drain time (runs as dots, the median as a
bar) against the link's limit and 1.2x it; the downtime p50 and p99 over
every moved VM per concurrency; each upgrade run's largest downtime against
the 5 ms goal.

Usage: python3 bench/drain_plot.py [NAME]   (default drain)
"""
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def plot(name):
    """Writes results/NAME.png; returns its path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no drain plot", file=sys.stderr)
        return None
    data = json.load(open(os.path.join(RESULTS, f"{name}.json")))
    cells, upgrade = data.get("cells") or [], data.get("upgrade")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))

    ax = axes[0]
    xs = range(len(cells))
    ax.bar(xs, [c["secs"] for c in cells], color="#8fb3d9", label="drain (median)")
    for x, c in zip(xs, cells):
        ax.plot([x] * len(c["runs"]), [r["secs"] for r in c["runs"]], "k.", ms=5)
    if cells:
        limit = sorted(c["limit_s"] for c in cells)[len(cells) // 2]
        ax.axhline(limit, color="#444", lw=1, label=f"link's limit ({limit:.1f} s)")
        ax.axhline(1.2 * limit, color="#c44", lw=1, ls="--", label="1.2x the limit (goal)")
    ax.set_xticks(list(xs), [f"{c['concurrency']} at once" for c in cells])
    ax.set_ylabel("s")
    ax.set_title("drain of the host: total time", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[1]
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [c["downtime_p50_ms"] for c in cells], w, label="p50",
           color="#8fb3d9")
    ax.bar([x + w / 2 for x in xs], [c["downtime_p99_ms"] for c in cells], w, label="p99",
           color="#d99a8f")
    ax.set_xticks(list(xs), [f"{c['concurrency']} at once" for c in cells])
    ax.set_ylabel("ms")
    ax.set_title("drain: downtime over every moved VM", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[2]
    if upgrade:
        runs = upgrade["max_downtimes_ms"]
        ax.plot(range(1, len(runs) + 1), runs, "o", color="#4a7ab0", label="largest of the run")
        ax.axhline(5.0, color="#c44", lw=1, ls="--", label="goal: < 5 ms")
        ax.set_xticks(range(1, len(runs) + 1))
        ax.set_xlabel("upgrade run")
        ax.set_ylim(0, max(6.0, max(runs) * 1.15))
        ax.legend(fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(f"ferry upgrade of {upgrade['vms'] if upgrade else '-'} VMs: largest downtime",
                 fontsize=9)
    fig.tight_layout()
    path = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    p = plot(sys.argv[1] if len(sys.argv) > 1 else "drain")
    if p:
        print("wrote", p)
