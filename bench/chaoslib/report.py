"""bench/results/NAME.{json,md}: every trial, and a table per ferry binary."""
import collections
import os
import time

import benchlib

from .common import FAULTS, OPS, OVERLAP_STEPS, OVERLAP_WINDOW, REGISTRY_FAULTS, ROOT


OUTCOMES = ["one-copy", "unsurvivable", "violation", "lost", "paused", "error"]


def table(trials, ops, faults):
    lines = ["| operation | first fault | trials | one copy (verified) | unsurvivable | violation | lost | "
             "paused past bound | harness error | command still running at the cap |", "|---|---|---|---|---|---|---|---|---|---|"]
    for op in ops:
        for fk in faults:
            ts = [t for t in trials if t["op"] == op and t["faults"][0]["kind"] == fk]
            if not ts:
                continue
            c = collections.Counter(t["outcome"] for t in ts)
            ver = sum(1 for t in ts if t["outcome"] == "one-copy" and t.get("verified"))
            lines.append(f"| {op} | {fk} | {len(ts)} | {c['one-copy']} ({ver}) | {c['unsurvivable']} | "
                         f"{c['violation']} | {c['lost']} | {c['paused']} | {c['error']} | {hung(ts)} |")
    c = collections.Counter(t["outcome"] for t in trials)
    ver = sum(1 for t in trials if t["outcome"] == "one-copy" and t.get("verified"))
    lines.append(f"| **all** | | {len(trials)} | {c['one-copy']} ({ver}) | {c['unsurvivable']} | "
                 f"{c['violation']} | {c['lost']} | {c['paused']} | {c['error']} | {hung(trials)} |")
    return lines


def hung(ts):
    return sum(1 for t in ts if any("still ran" in n for n in t.get("notes", [])))


def binary_of(build):
    """The binary part of a run's build ("binary NAME sha256 H built T")."""
    return build.split(", binary ", 1)[1] if ", binary " in build else build or "unknown build"


def op_text(t):
    """A trial's operation, with how it ran when not the default."""
    return (t["op"] + ("" if t.get("fenced") or "fenced" not in t else " (unfenced)")
            + (" (etcd)" if t.get("registry") == "etcd" else "")
            + (f" (replicas {t['opts']['replicas']})" if (t.get("opts") or {}).get("replicas") else ""))


def fault_text(f):
    d = f" {f['dur']}s" if "dur" in f else ""
    return f"{f['kind']} {f['target']} @{f['at']}s{d}"


def write(a, data):
    path = a.out if "/" in a.out else os.path.join(ROOT, "bench/results", a.out)
    trials = data["trials"]
    ops = [o for o in OPS if any(t["op"] == o for t in trials)]
    faults = [f for f in FAULTS + REGISTRY_FAULTS if any(t["faults"][0]["kind"] == f for t in trials)]
    benchlib.write_json(path + ".json", data, indent=1)
    c = collections.Counter(t["outcome"] for t in trials)
    runs = data["runs"]
    lines = ["# Chaos: random faults over ferry's operations, audited by a witness outside ferry", "",
             "Runs (each: its command, build, seed, trials):", ""]
    lines += [f"- `{r['command']}`: build {r['build']}, seed {r['seed']}, {r['trials']} trials, "
              f"bound {r['bound']} s, stops/link faults up to {r['stop_max']} s"
              + ("" if "fenced" not in r else ", fenced" if r["fenced"] else ", unfenced (agents fence theirs)")
              + (", registry: a real etcd per trial (etcd://10.77.0.4:2379 on ferry-h4)" if r.get("registry") == "etcd" else "")
              for r in runs]
    lines += ["", "Witness: guest_time (/proc/PID/stat field 43) of every VMM of the VM, sampled every 10 ms; "
              f"a violation is two processes advancing together in {OVERLAP_STEPS} of {OVERLAP_WINDOW} "
              "consecutive samples. Self-test (two VMMs of one VM on purpose): "
              + ", ".join(f"{'flagged' if s['two_flagged'] else 'NOT flagged'}, one alone "
                          f"{'flagged' if s['one_alone_flagged'] else 'not flagged'}"
                          for s in data["self_tests"]) + ".", "",
             "Trials by operation and first fault (a trial may carry a second, drawn fault), "
             "one table per ferry binary (newest first):", ""]
    builds = collections.OrderedDict()
    for t in trials:
        builds.setdefault(binary_of(t.get("build", "")), []).append(t)
    fenced_all = [t for t in trials if t.get("fenced")]
    if fenced_all:
        fc = collections.Counter(t["outcome"] for t in fenced_all)
        lines += ["### Every fenced trial, all binaries together", "",
                  f"{len(fenced_all)} of {len(trials)} trials ran with ownership fencing "
                  f"({len([b for b, ts in builds.items() if any(t.get('fenced') for t in ts)])} binaries; "
                  "the rest are the runs before it, below).", ""]
        lines += table(fenced_all, ops, faults)
        lines += ["", f"Totals: {len(fenced_all)} fenced trials, {fc['violation']} two-copy violations, "
                  f"{fc['lost']} lost, {fc['paused']} paused past the bound, {fc['unsurvivable']} unsurvivable "
                  f"as documented, {fc['error']} harness errors.", ""]
    for b, ts in reversed(builds.items()):
        c = collections.Counter(t["outcome"] for t in ts)
        fenced = collections.Counter(bool(t.get("fenced")) for t in ts)
        seeds = sorted({t["seed"] for t in ts})
        handed = sum(1 for t in ts if t.get("src_handed"))
        lines += [f"### {b}", "",
                  f"Seeds {', '.join(map(str, seeds))}; "
                  + (f"{fenced[True]} trials fenced (direct operations with --vm-name/--fenced through the "
                     f"trial's registry; agents fence theirs), {fenced[False]} unfenced." if fenced[True]
                     else "before ownership fencing."), ""]
        lines += table(ts, ops, faults)
        lines += ["", f"Totals: {len(ts)} trials, {c['violation']} two-copy violations, {c['lost']} lost, "
                  f"{c['paused']} paused past the bound, {c['unsurvivable']} unsurvivable as documented, "
                  f"{c['error']} harness errors."
                  + (f" A source left paused beside the running destination said it had handed the VM "
                     f"(owner.state = handed) in {handed} trials." if fenced[True] else ""), ""]
    bad = [t for t in trials if t["outcome"] != "one-copy" or t.get("notes")]
    if bad:
        lines += ["Every trial not ending with one running copy, or with notes (replay: `ferry bench chaos --seed S --trial K "
                  "--ops OP`):", "", "| seed | trial | op | faults | outcome | why |", "|---|---|---|---|---|---|"]
        for t in bad:
            lines.append(f"| {t['seed']} | {t['trial']} | {op_text(t)} | {'; '.join(map(fault_text, t['faults']))} | "
                         f"{t['outcome']} | {'; '.join(([t['why']] if t.get('why') else []) + t.get('notes', [])).replace('|', '/')[:400]} |")
        lines.append("")
    benchlib.write_md(path + ".md", lines)
    return lines


def build_of(ferry):
    """The tree's `git describe` and the binary's own identity (a copy
    given by --ferry may be older than the tree)."""
    import hashlib
    d = benchlib.sh("git", "-C", ROOT, "describe", "--always", "--dirty", check=False).stdout.strip()
    h = hashlib.sha256()
    with open(ferry, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(ferry)))
    return f"tree {d}, binary {os.path.basename(ferry)} sha256 {h.hexdigest()[:12]} built {made}"

