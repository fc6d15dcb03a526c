"""Faults (kills, stops, link faults, a host's death) and each trial's
schedule, drawn from its seed."""
import collections
import math
import os
import random
import signal
import threading
import time

import benchlib
from benchlib import in_host

from .common import HOST_TARGETS, HOSTS, PROC_TARGETS, REGISTRY_HOST, SPLIT_OPS, WINDOW


def procs_in_host(host):
    """Every pid whose network namespace is lab host `host`'s."""
    try:
        st = os.stat(f"/run/netns/{host}")
    except OSError:
        return []
    out = []
    for x in os.listdir("/proc"):
        if not x.isdigit():
            continue
        try:
            s = os.stat(f"/proc/{x}/ns/net")
        except OSError:
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            out.append(int(x))
    return out


def host_index(h):
    return h[1:]


def tc(ns, *args):
    return benchlib.sh("ip", "netns", "exec", ns, "tc", *args, check=False)


def link_ends(h):
    """(namespace, device) of both ends of host `h`'s veth."""
    return [(HOSTS[h], "eth0"), ("ferry-sw", f"fh{host_index(h)}")]


def shape(h, *qdisc):
    for ns, dev in link_ends(h):
        tc(ns, "qdisc", "replace", "dev", dev, "root", *qdisc)


def unshape(h):
    for ns, dev in link_ends(h):
        tc(ns, "qdisc", "del", "dev", dev, "root")


BLACKHOLE = ("tbf", "rate", "8kbit", "burst", "200", "latency", "1ms")  # burst < one packet: all dropped
SLOW = ("tbf", "rate", "2mbit", "burst", "16kb", "latency", "200ms")


def signal_all(pids, sig):
    """Sends `sig` to every pid of `pids` still alive."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Faults(threading.Thread):
    """Runs a trial's fault schedule: each fault at its offset from `t0`;
    records what each did and when (monotonic)."""

    def __init__(self, schedule, trial):
        super().__init__(daemon=True)
        self.schedule, self.trial = schedule, trial
        self.log = []
        self.ended = threading.Event()
        self.shaped = collections.defaultdict(list)  # host -> qdiscs in force, latest last
        self.cuts = collections.Counter()  # host -> cuts in force
        self.t0 = None

    def pids_of(self, target):
        tr = self.trial
        if target in ("new", "dst", "src") and target not in tr.procs:
            # a VMM the harness did not start (a handover's new one, an agent's)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                new = [p["pid"] for p in tr.witness.of_vm(tr.vm) if p["role"] == target and p["gone"] is None]
                if new:
                    return new
                time.sleep(0.005)
            return []
        p = tr.procs.get("mem0" if target == "mem" else target)  # mem: the first memory server
        return [p.pid] if p and p.poll() is None else []

    def run(self):
        restores = []
        try:
            for f in sorted(self.schedule, key=lambda f: f["at"]):
                delay = self.t0 + f["at"] - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                restores.append(self.fire(f))
            for r in sorted((r for r in restores if r), key=lambda r: r[0]):
                delay = r[0] - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                r[1]()
        except Exception as e:  # noqa: BLE001 - recorded, the trial goes on
            self.log.append({"error": repr(e)})
        finally:
            self.ended.set()

    def note(self, f, **kw):
        self.log.append({"kind": f["kind"], "target": f["target"], "t": time.monotonic(), **kw})

    def fire(self, f):
        kind, target, dur = f["kind"], f["target"], f.get("dur", 0)
        if kind in ("kill", "stop"):
            pids = self.pids_of(target)
            sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
            signal_all(pids, sig)
            self.note(f, pids=pids)
            if kind == "stop" and pids:
                def cont(pids=pids):
                    signal_all(pids, signal.SIGCONT)
                    self.note({"kind": "cont", "target": target}, pids=pids)
                return (time.monotonic() + dur, cont)
            return None
        if kind in ("registry-stop", "registry-kill"):
            # The registry itself (--registry etcd): stopped (SIGCONT after
            # the drawn time) or killed (restarted on its data dir after it).
            pids = self.pids_of("etcd")
            signal_all(pids, signal.SIGSTOP if kind == "registry-stop" else signal.SIGKILL)
            self.note(f, pids=pids)

            def back(pids=pids):
                if kind == "registry-stop":
                    signal_all(pids, signal.SIGCONT)
                    self.note({"kind": "cont", "target": target}, pids=pids)
                elif pids and self.trial.procs["etcd"].poll() is not None:  # not restarted already
                    self.trial.procs["etcd"].wait()
                    pid = self.trial.etcd_start()
                    self.note({"kind": "restart", "target": target}, pids=[pid])
            return (time.monotonic() + dur, back)
        if kind == "host":
            shape(target, *BLACKHOLE)  # a dead host answers nothing
            self.shaped[target].insert(0, BLACKHOLE)  # for good
            pids = procs_in_host(HOSTS[target])
            signal_all(pids, signal.SIGKILL)
            self.note(f, pids=pids)
            return None
        # Link faults of one host may overlap: each ends only its own part.
        if kind == "cut":
            benchlib.sh(*in_host(HOSTS[target], "ip", "link", "set", "eth0", "down"), check=False)
            self.cuts[target] += 1
            self.note(f)

            def mend():
                self.cuts[target] -= 1
                if self.cuts[target] == 0:
                    benchlib.sh(*in_host(HOSTS[target], "ip", "link", "set", "eth0", "up"), check=False)
                self.note({"kind": "restore", "target": target}, of="cut")
            return (time.monotonic() + dur, mend)
        if kind in ("blackhole", "slow"):
            q = BLACKHOLE if kind == "blackhole" else SLOW
            shape(target, *q)
            self.shaped[target].append(q)
            self.note(f)

            def unshaped():
                self.shaped[target].remove(q)
                if self.shaped[target]:
                    shape(target, *self.shaped[target][-1])
                else:
                    unshape(target)
                self.note({"kind": "restore", "target": target}, of=kind)
            return (time.monotonic() + dur, unshaped)
        raise ValueError(f"unknown fault {kind}")


# ---------------------------------------------------------------- schedule

def schedule_of(seed, k, ops, faults, stop_max, registry="dir"):
    """Trial k's operation, options and faults, from random.Random(f"{seed}:{k}").
    The operation and the first fault's kind go round the lists (so every
    operation x fault cell fills evenly); the rest is drawn. With an etcd
    registry, link faults may hit the registry's host too (a dir: trial's
    draws are as they were before etcd)."""
    rng = random.Random(f"{seed}:{k}")
    # Every (operation, first fault) pair once per len(ops) x len(faults)
    # trials, the operations in turn and the faults varied from the start.
    cell = k % (len(ops) * len(faults))
    op = ops[cell % len(ops)]
    first = faults[(cell // len(ops) + cell % len(ops)) % len(faults)]
    kinds = [first] + ([rng.choice(faults)] if rng.random() < 0.3 else [])
    sched = []
    for kind in kinds:
        if kind in ("kill", "stop"):
            target = rng.choice(PROC_TARGETS[op])
        elif kind.startswith("registry-"):
            target = "etcd"
        elif registry == "etcd" and kind != "host":
            target = rng.choice(HOST_TARGETS[op] + [REGISTRY_HOST])
        else:
            target = rng.choice(HOST_TARGETS[op])
        if op == "handover" and kind in ("cut", "blackhole", "slow") and target != REGISTRY_HOST:
            target = "h1"
        f = {"kind": kind, "target": target, "at": round(rng.uniform(0, WINDOW[op]), 3)}
        if kind in ("stop", "cut", "blackhole", "slow", "registry-stop", "registry-kill"):
            # log-uniform in [0.5, stop_max] s
            f["dur"] = round(math.exp(rng.uniform(math.log(0.5), math.log(stop_max))), 2)
        sched.append(f)
    opts = {}
    if op == "postcopy-net":
        opts["net_finishes"] = rng.random() < 0.5
    if op in SPLIT_OPS:
        opts["replicas"] = 2 if rng.random() < 0.5 else 1
    return {"op": op, "faults": sched, "opts": opts}

