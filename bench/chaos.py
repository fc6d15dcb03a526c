#!/usr/bin/env python3
"""The chaos harness (issue 54 item 2): random fault schedules over ferry's
operations between lab hosts, each trial audited by a witness outside ferry.

One trial = one operation on a fresh lab (`ferry lab up 3`: ferry-h1 the
source, ferry-h2 the destination, ferry-h3 the standby's host) with one or
two faults injected at random moments of it:

  operations  precopy, postcopy, hybrid (`ferry migrate --verify` from h1 to
              h2), handover (`ferry handover --verify` on h1), postcopy-net
              (postcopy with the safety net's standby on h3)
  faults      kill (SIGKILL), stop (SIGSTOP, SIGCONT after 0.5-60 s) of the
              source VMM, the destination VMM (a handover's new VMM), the
              command (`ferry migrate` / `ferry handover`), the standby;
              cut (the host's eth0 down), blackhole (every packet to and from
              the host dropped: tbf with a burst below one packet on both
              ends of its veth), slow (tbf 2 mbit on both ends), each for
              0.5-60 s; host (every process in the host's namespace
              SIGKILLed at once, its link blackholed for good)

The witness: a thread samples /proc/PID/stat field 43 (guest_time: time the
kernel accounted to the process's vCPUs in guest mode, in clock ticks)
every 10 ms for every VMM process of each VM's lineage (the VMMs the
harness started, identified by their --control path; a handover's new VMM
by its parent or by the control socket it holds). The VMs run a compute
task, so a running copy's guest_time moves every tick. Two processes of one
VM both advancing in 3 of any 10 consecutive sampling intervals is a
two-copy violation (a normal switch costs one shared interval; two copies
running together for ~30 ms or more are caught). A self-test starts two
VMMs of one VM on purpose and must be flagged (and one alone must not).

After the faults end (SIGCONT sent, links restored) the harness waits for
the command to end, acts as the documented operator once (`ferry migrate
--resume` of a postcopy paused on a broken link), then audits for at most
--bound seconds: which processes of the VM advance guest_time, and that
the running one's workload counter advances (`ferry status`). Outcomes per
VM: one-copy (exactly one running; "verified" when `ferry migrate --json`
reported every page verified), unsurvivable (not running, and the faults
include a case the docs name: a process holding the only copy killed -- the
source before the switch, the destination or a handover's new VMM after
it started the VM -- or the source of a postcopy without a safety net
killed after the switch), violation (two copies ran at once, or run at the
end), paused (no copy runs, one is paused past the bound), lost (no process
of the VM left), error (the harness failed).

Fencing (docs/safety.md): by default a direct operation's source runs with
`--vm-name chaos-vm --registry dir:<the trial's registry>` and its
destination with `--fenced --registry <the same>` (`--unfenced`: neither;
agents fence their VMs themselves, under the fleet name). The audit reads
each live VMM's `owner` (ferry status) and the registry's record
(records/owners%2F<name>): a running copy that is not the record's holder
is noted; a source paused beside the running destination that says
owner.state = handed is fine; when no copy runs and the record names a
dead holder, the trial is "unsurvivable" only for the cases the docs name
(the destination or a handover's new VMM killed after it took the VM; the
source killed while it held the only running copy), and "lost" otherwise.
The witness stays the judge of two copies.

Each trial's schedule comes from random.Random("SEED:K"): `--seed S --trial
K` replays trial K (with the same --ops, --faults and --stop-max). Every trial takes the
lab's lock (/tmp/ferry-lab.lock, flock) for itself, so other lab users get
in between trials: do not run this under flock(1) on that file.

Results: bench/results/NAME.{json,md} (--out NAME; a path with a "/" is
taken as is); --append adds this run's trials to the file's.

Usage: python3 bench/chaos.py [--trials 20] [--seed S] [--trial K]
       [--ops precopy,postcopy,...] [--faults kill,stop,...] [--smoke]
       [--bound 60] [--stop-max 60] [--out chaos] [--append] [--unfenced]
"""
import argparse
import collections
import fcntl
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import benchlib
from benchlib import in_host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ["precopy", "postcopy", "hybrid", "handover", "postcopy-net", "drain", "upgrade"]
MIGRATE_OPS = ("precopy", "postcopy", "hybrid", "postcopy-net")
AGENT_OPS = ("drain", "upgrade")
FAULTS = ["kill", "stop", "cut", "blackhole", "slow", "host"]
HOSTS = {"h1": "ferry-h1", "h2": "ferry-h2", "h3": "ferry-h3"}
ADDR = {"h1": "10.77.0.1", "h2": "10.77.0.2", "h3": "10.77.0.3"}
# The VM: one vCPU always busy (compute, so guest_time moves every tick),
# 64 MiB of data that does not compress, a little dirtying.
MEM = "192M"
WORKLOAD = "compute+fill:content=worst,mib=64+dirty:rate=8,wss=8,pattern=random"
BANDWIDTH = "24M"  # paces the copy so a move lasts a few seconds
# Which processes each fault kind may hit, per operation.
PROC_TARGETS = {
    "precopy": ["src", "dst", "cmd"],
    "postcopy": ["src", "dst", "cmd"],
    "hybrid": ["src", "dst", "cmd"],
    "postcopy-net": ["src", "dst", "cmd", "standby"],
    "handover": ["src", "new", "cmd"],
    "drain": ["src", "dst", "cmd", "a1", "a2"],
    "upgrade": ["src", "new", "cmd", "a1"],
}
HOST_TARGETS = {
    "precopy": ["h1", "h2"], "postcopy": ["h1", "h2"], "hybrid": ["h1", "h2"],
    "postcopy-net": ["h1", "h2", "h3"], "handover": ["h1"],
    "drain": ["h1", "h2", "h3"], "upgrade": ["h1", "h3"],
}
# When faults may land, seconds after the command starts.
WINDOW = {"precopy": 4.0, "postcopy": 4.0, "hybrid": 5.0, "postcopy-net": 5.0, "handover": 0.4,
          "drain": 6.0, "upgrade": 1.0}
GT_FIELD = 43  # /proc/PID/stat: guest_time
OVERLAP_STEPS, OVERLAP_WINDOW = 3, 10
NEAR_SWITCH_S = 0.05
EXEC_SETTLE_S = 0.02
# The registry name of a direct operation's VM (fenced: --vm-name / --fenced,
# through the trial's own embedded registry); an agent's VM is fenced under
# its fleet name (vmK).
FENCE_NAME = "chaos-vm"
HANDED_WAIT_S = 10  # how long the audit lets a source that sent Complete find out it handed the VM


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- witness

def guest_time(pid):
    """guest_time of `pid` (clock ticks) and its parent, or None if gone."""
    try:
        s = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None  # ended (a zombie not yet reaped)
    return int(rest[GT_FIELD - 3]), int(rest[1])


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return []


def vm_of_socket(path):
    """The VM a control socket belongs to: NAME@ROLE.sock -> NAME (an
    agent's NAME.sock -> NAME)."""
    base = os.path.basename(path)
    base = base[:-5] if base.endswith(".sock") else base
    return base.split("@")[0]


def held_control_socket(pid, under):
    """The path under `under` of a listening unix socket `pid` holds (a
    handover's new VMM takes over its VM's control socket)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if t.startswith("socket:["):
                inodes.add(t[8:-1])
        for line in open(f"/proc/{pid}/net/unix").read().splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and f[6] in inodes and f[7].startswith(under):
                return f[7]
    except OSError:
        pass
    return None


class Witness(threading.Thread):
    """Samples guest_time of every VMM of the trial's VMs every `interval`
    seconds; flags two processes of one VM advancing together in
    OVERLAP_STEPS of OVERLAP_WINDOW consecutive intervals."""

    def __init__(self, under, interval=0.01):
        super().__init__(daemon=True)
        self.under, self.interval = under, interval
        self.lock = threading.Lock()
        self.procs = {}  # pid -> {vm, role, last, first_run, last_run, gone, sock}
        self.seen = set()
        self.pending = {}  # pid -> first seen (not attributed yet)
        self.waiting = False
        self.windows = collections.defaultdict(lambda: collections.deque(maxlen=OVERLAP_WINDOW))
        self.violations = []  # (t, vm, pids)
        self.max_overlap = collections.Counter()
        self.roles = {}  # sock path -> role
        self.stop_flag = False
        self.steps = 0

    def role_for(self, sock, role):
        self.roles[sock] = role

    def _attribute(self, pid, t):
        argv = cmdline(pid)
        if not argv or argv == [b""] or (os.path.basename(argv[0]) == b"ip" and b"netns" in argv):
            self.waiting = True  # not yet exec'd into what it runs
            return None
        if len(argv) < 2 or b"ferry" not in os.path.basename(argv[0]) or b"run" not in argv[1:2]:
            return None
        args = [a.decode(errors="replace") for a in argv]
        if "--control" in args:
            sock = args[args.index("--control") + 1]
            if sock.startswith(self.under):
                # an agent's VMM: its state directory names its host
                role = self.roles.get(sock) or ("src" if "/ferry-h1/" in sock else "dst")
                return {"vm": vm_of_socket(sock), "role": role, "sock": sock}
            return None
        if "--adopt-fd" in args:
            g = guest_time(pid)
            if g and g[1] in self.procs:
                p = self.procs[g[1]]
                return {"vm": p["vm"], "role": "new", "sock": p["sock"]}
            sock = held_control_socket(pid, self.under)
            if sock:
                return {"vm": vm_of_socket(sock), "role": "new", "sock": sock}
            self.waiting = True  # its parent gone, its control socket not yet held
        return None

    def _scan(self, t):
        try:
            pids = {int(x) for x in os.listdir("/proc") if x.isdigit()}
        except OSError:
            return
        # A new process is looked at once it is EXEC_SETTLE_S old: a child
        # forked but not yet exec'd shows its parent's command line (an
        # agent's, or the VMM a handover starts from).
        for pid in pids - self.seen:
            self.seen.add(pid)
            self.pending.setdefault(pid, t)
        for pid, t0 in list(self.pending.items()):
            if pid in self.procs or pid not in pids:
                self.pending.pop(pid)
                continue
            if t - t0 < EXEC_SETTLE_S:
                continue
            self.waiting = False
            a = self._attribute(pid, t)
            if a:
                self.pending.pop(pid)
                self._track(pid, a, t)
            elif t - t0 > (5 if self.waiting else EXEC_SETTLE_S + 0.5):
                self.pending.pop(pid)

    def add(self, pid, vm, role, sock):
        """A VMM the harness started itself."""
        self.seen.add(pid)
        self._track(pid, {"vm": vm, "role": role, "sock": sock}, time.monotonic())

    def _track(self, pid, a, t):
        g = guest_time(pid)
        with self.lock:
            if pid in self.procs:
                return
            self.procs[pid] = {**a, "pid": pid, "last": g[0] if g else 0, "first_run": None,
                               "last_run": None, "gone": None if g else t, "seen": t}

    def run(self):
        # What ran before the trial is none of its VMMs (those the harness
        # starts are added by `add`).
        self.seen |= {int(x) for x in os.listdir("/proc") if x.isdigit()} - set(self.procs)
        while not self.stop_flag:
            t = time.monotonic()
            self._scan(t)
            advanced = collections.defaultdict(list)
            with self.lock:
                for pid, p in self.procs.items():
                    if p["gone"] is not None:
                        continue
                    g = guest_time(pid)
                    if g is None:
                        p["gone"] = t
                        continue
                    if g[0] > p["last"]:
                        p["last"] = g[0]
                        p["last_run"] = t
                        if p["first_run"] is None:
                            p["first_run"] = t
                        advanced[p["vm"]].append(pid)
                vms = {p["vm"] for p in self.procs.values()}
                for vm in vms:
                    w = self.windows[vm]
                    both = len(advanced.get(vm, [])) >= 2
                    w.append(both)
                    n = sum(w)
                    self.max_overlap[vm] = max(self.max_overlap[vm], n)
                    if both and n >= OVERLAP_STEPS:
                        if not self.violations or self.violations[-1][1] != vm or t - self.violations[-1][0] > 1:
                            self.violations.append((t, vm, sorted(advanced[vm])))
                self.steps += 1
            time.sleep(max(0.0, self.interval - (time.monotonic() - t)))

    def stop(self):
        self.stop_flag = True
        self.join(timeout=2)

    def of_vm(self, vm):
        with self.lock:
            return [dict(p) for p in self.procs.values() if p["vm"] == vm]

    def running(self, vm, within):
        """Processes of `vm` that advanced guest_time in the last `within` s."""
        now = time.monotonic()
        return [p for p in self.of_vm(vm) if p["gone"] is None and p["last_run"] is not None
                and now - p["last_run"] <= within]

    def first_run(self, vm, roles):
        ts = [p["first_run"] for p in self.of_vm(vm) if p["role"] in roles and p["first_run"] is not None]
        return min(ts) if ts else None


# ---------------------------------------------------------------- faults

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
        p = tr.procs.get(target)
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
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            self.note(f, pids=pids)
            if kind == "stop" and pids:
                def cont(pids=pids):
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGCONT)
                        except ProcessLookupError:
                            pass
                    self.note({"kind": "cont", "target": target}, pids=pids)
                return (time.monotonic() + dur, cont)
            return None
        if kind == "host":
            shape(target, *BLACKHOLE)  # a dead host answers nothing
            self.shaped[target].insert(0, BLACKHOLE)  # for good
            pids = procs_in_host(HOSTS[target])
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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
                self.note({"kind": "restore", "target": target})
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
                self.note({"kind": "restore", "target": target})
            return (time.monotonic() + dur, unshaped)
        raise ValueError(f"unknown fault {kind}")


# ---------------------------------------------------------------- schedule

def schedule_of(seed, k, ops, faults, stop_max):
    """Trial k's operation, options and faults, from random.Random(f"{seed}:{k}").
    The operation and the first fault's kind go round the lists (so every
    operation x fault cell fills evenly); the rest is drawn."""
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
        else:
            target = rng.choice(HOST_TARGETS[op])
        if op == "handover" and kind in ("cut", "blackhole", "slow"):
            target = "h1"
        f = {"kind": kind, "target": target, "at": round(rng.uniform(0, WINDOW[op]), 3)}
        if kind in ("stop", "cut", "blackhole", "slow"):
            # log-uniform in [0.5, stop_max] s
            f["dur"] = round(math.exp(rng.uniform(math.log(0.5), math.log(stop_max))), 2)
        sched.append(f)
    opts = {}
    if op == "postcopy-net":
        opts["net_finishes"] = rng.random() < 0.5
    return {"op": op, "faults": sched, "opts": opts}


# ---------------------------------------------------------------- trials

class Trial:
    def __init__(self, ferry, seed, k, plan, bound, tmp, fenced=True):
        self.ferry, self.seed, self.k, self.plan, self.bound = ferry, seed, k, plan, bound
        self.fenced = fenced or plan["op"] in AGENT_OPS  # agents fence their VMs themselves
        self.dir = tempfile.mkdtemp(prefix=f"t{k}-", dir=tmp)
        self.vm = f"vm{k}"
        self.procs = {}
        self.witness = Witness(self.dir)
        self.notes = []
        self.src_sock = self.sock("src")
        self.registry = f"dir:{self.dir}/registry"
        self.fence_name = self.vm if plan["op"] in AGENT_OPS else FENCE_NAME

    def sock(self, role):
        return os.path.join(self.dir, f"{self.vm}@{role}.sock")

    def spawn(self, role, host, *args, out=subprocess.DEVNULL):
        err = open(os.path.join(self.dir, f"{role}.log"), "w")
        env = {k: v for k, v in os.environ.items() if k not in ("FERRY_TLS_DIR", "FERRY_INSECURE")}
        env["FERRY_HOST"] = host  # the holder's host in the owner record
        p = subprocess.Popen(in_host(host, self.ferry, *args), stdout=out, stderr=err, text=True, env=env)
        self.procs[role] = p
        return p

    def vmm(self, role, host, *extra):
        self.witness.role_for(self.sock(role), role)
        out = open(os.path.join(self.dir, f"{role}.out"), "w")
        if self.fenced and role == "src":
            extra += ("--vm-name", FENCE_NAME, "--registry", self.registry)
        if self.fenced and role == "dst":
            extra += ("--fenced", "--registry", self.registry)
        p = self.spawn(role, host, "run", "--mem", MEM, "--vcpus", "1", "--workload", WORKLOAD,
                       "--control", self.sock(role), "--quiet", "--json", *extra, out=out)
        self.witness.add(p.pid, self.vm, role, self.sock(role))
        return p

    def status(self, sock, host="ferry-h1"):
        out = benchlib.sh(*in_host(host, self.ferry, "status", sock, "--json", "--metrics"), check=False,
                          timeout=10)
        try:
            return json.loads(out.stdout)
        except ValueError:
            return None

    def wait_sockets(self, roles, timeout=20):
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(self.sock(r)) for r in roles):
            for r in roles:
                if self.procs[r].poll() is not None:
                    raise RuntimeError(f"the {r} VMM exited: {self.tail(r)}")
            if time.monotonic() > deadline:
                raise RuntimeError("VMMs did not start")
            time.sleep(0.02)

    def tail(self, role, n=300):
        try:
            return open(os.path.join(self.dir, f"{role}.log")).read()[-n:].strip()
        except OSError:
            return ""

    def wait_filled(self, timeout=30):
        """Until the fill (workload 1) is done: its pages are the move."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.status(self.src_sock)
            try:
                if s["metrics"]["workloads"][1]["tasks_done"] >= 1:
                    return
            except (TypeError, KeyError, IndexError):
                pass
            time.sleep(0.1)
        raise RuntimeError("the fill never finished")

    def agent(self, n):
        host = f"ferry-h{n}"
        p = self.spawn(f"a{n}", host, "agent", "--name", host, "--listen", f"10.77.0.{n}:7700",
                       "--registry", self.registry, "--mem", "2G", "--state-dir", f"{self.dir}/{host}", "--json",
                       out=subprocess.PIPE)
        if not p.stdout.readline():
            raise RuntimeError(f"the agent of {host} did not start: {self.tail(f'a{n}')}")

    def op(self, *args, timeout=60):
        out = benchlib.sh(*in_host("ferry-h3", self.ferry, *args, "--registry", self.registry, "--json"),
                          check=False, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"ferry {' '.join(args)}: {out.stderr.strip()[-300:]}")
        return json.loads(out.stdout) if out.stdout.strip() else None

    def start_agents(self):
        """An agent on each host; the VM started on ferry-h1 through its agent."""
        for n in (1, 2, 3):
            self.agent(n)
        self.op("vm", "start", self.vm, "--host", "ferry-h1", "--mem", MEM, "--workload", WORKLOAD)
        for h in self.op("vm", "list") or []:
            for vm in h.get("host", {}).get("vms", []):
                if vm["spec"]["name"] == self.vm:
                    self.src_sock = vm["socket"]
                    self.witness.role_for(vm["socket"], "src")
                    self.witness.add(vm["pid"], self.vm, "src", vm["socket"])
        self.wait_filled()

    def start(self):
        op = self.plan["op"]
        self.witness.start()
        if op in AGENT_OPS:
            return self.start_agents()
        if op != "handover":
            self.vmm("dst", "ferry-h2", "--incoming", "tcp:10.77.0.2:7401")
        if op == "postcopy-net":
            self.spawn("standby", "ferry-h3", "standby", "--listen", "10.77.0.3:7480", "--once", "--json")
        self.vmm("src", "ferry-h1")
        self.wait_sockets(["src"] + ([] if op == "handover" else ["dst"]))
        self.wait_filled()

    def command(self):
        op = self.plan["op"]
        if op == "drain":
            return ("drain", "ferry-h1", "--verify", "--bandwidth", BANDWIDTH, "--registry", self.registry, "--json")
        if op == "upgrade":
            return ("upgrade", "ferry-h1", "--registry", self.registry, "--json")
        if op == "handover":
            return ("handover", self.sock("src"), "--verify", "--json")
        args = ["migrate", self.sock("src"), "--to", "tcp:10.77.0.2:7401", "--verify", "--json",
                "--bandwidth", BANDWIDTH]
        if op in ("postcopy", "postcopy-net"):
            args += ["--mode", "postcopy"]
        if op == "hybrid":
            args += ["--mode", "hybrid", "--postcopy-after", "2"]
        if op == "postcopy-net":
            args += ["--safety-net", "10.77.0.3:7480"]
            if self.plan["opts"].get("net_finishes"):
                args.append("--net-finishes")
        return tuple(args)

    def run(self, cmd_cap):
        self.start()
        faults = Faults(self.plan["faults"], self)
        out_path = os.path.join(self.dir, "cmd.out")
        out = open(out_path, "w")
        t0 = time.monotonic()
        faults.t0 = t0
        self.spawn("cmd", "ferry-h3" if self.plan["op"] in AGENT_OPS else "ferry-h1", *self.command(), out=out)
        faults.start()
        faults.ended.wait()
        t_end = time.monotonic()
        # The command ends by itself once the faults have (or is stopped at the cap).
        try:
            self.procs["cmd"].wait(timeout=max(1, cmd_cap - (time.monotonic() - t_end)))
        except subprocess.TimeoutExpired:
            self.notes.append(f"the command still ran {cmd_cap:.0f} s after the faults ended: stopped")
            self.procs["cmd"].kill()
            self.procs["cmd"].wait()
        out.close()
        cmd_rc = self.procs["cmd"].returncode
        try:
            report = json.loads(open(out_path).read() or "null")
        except ValueError:
            report = None
        self.operator()
        result = self.audit(t_end, lambda: self.unsurvivable(faults))
        if self.fenced:
            result["ownership"] = self.ownership(result, t_end)
        self.witness.stop()
        result.update(self.classify(faults, result, report, cmd_rc))
        self.judge_ownership(faults, result, result)
        self.registry_says(result)
        if result["outcome"] == "one-copy" and result["running"] == ["dst"] and not result["verified"]:
            # The command's report is gone (killed) or the standby verified
            # (--net-finishes): the destination says what it verified.
            got = self.dst_verified()
            if got is not None:
                result["verified"] = got == int(MEM[:-1]) * 256
                result["verified_by"] = "destination"
            why = self.unsurvivable(faults)
            if not result["verified"] and why and self.plan["op"] in ("postcopy", "hybrid", "postcopy-net"):
                # It ran, but without the pages only its killed source held:
                # it waits for them (and loses the VM at its reconnect timeout).
                result["outcome"] = "unsurvivable"
                result["why"] = why + "; the destination ran on, unverified, without the pages only the source held"
        elif result["verified"]:
            result["verified_by"] = "command"
        if result.get("fence_notes"):
            self.notes = self.notes + result["fence_notes"]
        result["fault_log"] = [{k: (round(v - t0, 3) if k == "t" else v) for k, v in e.items()}
                               for e in faults.log]
        result["cmd_rc"] = cmd_rc
        # What the witness saw of each process of the VM (s from the command's start).
        rel = lambda x: None if x is None else round(x - t0, 3)  # noqa: E731
        result["witness"] = [{"role": p["role"], "pid": p["pid"], "seen": rel(p["seen"]),
                              "first_run": rel(p["first_run"]), "last_run": rel(p["last_run"]),
                              "gone": rel(p["gone"])} for p in self.witness.of_vm(self.vm)]
        if cmd_rc != 0:
            result["cmd_error"] = self.tail("cmd", 400)
        result["notes"] = self.notes
        return result

    def operator(self):
        """What the docs tell an operator to do: a postcopy paused on a broken
        link is continued with `ferry migrate --resume` (once)."""
        if self.plan["op"] not in MIGRATE_OPS or self.procs["src"].poll() is not None:
            return
        s = self.status(self.sock("src"))
        if s and isinstance(s.get("postcopy_paused"), str):
            r = benchlib.sh(*in_host("ferry-h1", self.ferry, "migrate", self.sock("src"), "--resume", "--json"),
                            check=False, timeout=120)
            self.notes.append(f"operator: ferry migrate --resume exited {r.returncode}"
                              + (f" ({r.stderr.strip()[-200:]})" if r.returncode else ""))

    def audit(self, t_end, excused):
        """Waits (at most `bound` s) until exactly one copy runs and its
        workload counts; says what runs where. Stops early when no copy can
        run again, or when none has run for 5 s and the faults include a
        documented unsurvivable case (`excused()`)."""
        deadline = t_end + self.bound
        stable_since = None
        while True:
            running = self.witness.running(self.vm, 0.3)
            if len(running) == 1:
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since >= 1.5 and self.counting(running[0]):
                    return {"running": [running[0]["role"]], "audit_s": round(time.monotonic() - t_end, 2)}
            else:
                stable_since = None
            if not running and (self.nothing_left() or (time.monotonic() > t_end + 5 and excused())):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        running = self.witness.running(self.vm, 0.5)
        alive = [p for p in self.witness.of_vm(self.vm) if p["gone"] is None]
        states = {}
        for p in alive:
            s = self.status(p["sock"], host="ferry-h2" if p["role"] == "dst" else "ferry-h1")
            if s and s.get("pid") == p["pid"]:
                states[p["role"]] = str(s.get("state")) + (" (postcopy paused)" if s.get("postcopy_paused") else "")
                o = s.get("owner")
                if isinstance(o, dict):
                    states[p["role"]] += (f" (owner {o.get('state')}, epoch {o.get('epoch')}"
                                          + (f", holder {o.get('holder')}" if o.get("holder") else "")
                                          + (", holder lapsed" if o.get("holder_lapsed") else "")
                                          + (f", registry unreachable: {o.get('unreachable')}" if o.get("unreachable") else "")
                                          + ")")
            else:
                states[p["role"]] = "no answer" + (f" (pid {s.get('pid')} answers)" if s else "")
            if p["first_run"] is None:
                states[p["role"]] += " (never ran)"
        return {"running": [p["role"] for p in running], "alive": states,
                "audit_s": round(time.monotonic() - t_end, 2)}

    def record(self, kind):
        """The trial's registry record `kind/<the VM's name>` (owners: {vm,
        epoch, holder: {host, pid, id}, since}; owners-alive: {id, renewed}),
        read straight from the embedded registry's directory, or None."""
        path = os.path.join(self.registry[len("dir:"):], "records", f"{kind}%2F{self.fence_name}")
        try:
            return json.loads(open(path).read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            return {"unreadable": repr(e)}

    def owner_of(self, p):
        """What the VMM `p` says of its VM's ownership (`ferry status`'s
        owner), or None when another process answers on its socket."""
        s = self.status(p["sock"], host="ferry-h2" if p["role"] == "dst" else "ferry-h1")
        if not s:
            return {"answer": "none"}
        if s.get("pid") != p["pid"]:
            return {"answer": f"pid {s.get('pid')} answers"}
        return {"state": s.get("state"), "postcopy_paused": bool(s.get("postcopy_paused")), "owner": s.get("owner")}

    def ownership(self, result, t_end):
        """The audit's view of the fence: each live VMM's owner (status), the
        registry's record and the holder's sign of life. A source that sent
        Complete beside a running destination is given up to HANDED_WAIT_S
        (within the bound) to learn from the registry that it handed the VM."""
        def look():
            owners = {}
            for p in self.witness.of_vm(self.vm):
                if p["gone"] is None:
                    owners[f"{p['role']}:{p['pid']}"] = self.owner_of(p)
            return owners, self.record("owners"), self.record("owners-alive")

        def src_in_doubt(owners):
            return any(k.startswith("src:") and ((o.get("owner") or {}).get("state") in ("in-doubt", "holding"))
                       for k, o in owners.items())

        t_look = time.monotonic()
        owners, rec, alive = look()
        deadline = min(t_look + HANDED_WAIT_S, t_end + self.bound)
        moved = len(result["running"]) == 1 and result["running"][0] != "src"
        while moved and src_in_doubt(owners) and time.monotonic() < deadline:
            time.sleep(0.5)
            owners, rec, alive = look()
        out = {"record": rec, "alive": alive, "owners": owners, "looked_s": round(time.monotonic() - t_end, 2)}
        holder = (rec or {}).get("holder")
        if holder:
            pid = holder.get("pid")
            procs = {p["pid"]: p for p in self.witness.of_vm(self.vm)}
            out["holder_role"] = procs[pid]["role"] if pid in procs else "unknown"
            g = guest_time(pid) if isinstance(pid, int) else None
            out["holder_alive"] = g is not None and any(b"ferry" in a for a in cmdline(pid)[:1])
        return out

    def killed_pids(self, faults):
        """pid -> the fault that ended it (a kill or its host's death)."""
        out = {}
        for e in faults.log:
            if e.get("kind") in ("kill", "host"):
                for pid in e.get("pids", []):
                    out.setdefault(pid, e)
        return out

    def judge_ownership(self, faults, result, out):
        """What the registry's record and each VMM's owner say, against the
        witness's outcome `out` (modified in place). The witness stays the
        judge of two copies; the registry explains who held the VM, and turns
        "no copy runs" into "unsurvivable as documented" only where
        docs/safety.md names the case."""
        own = result.get("ownership")
        if not own:
            return
        rec = own.get("record") or {}
        holder = rec.get("holder") or {}
        notes = out.setdefault("fence_notes", [])
        if rec.get("unreadable"):
            notes.append(f"registry record unreadable: {rec['unreadable']}")
        owners = own.get("owners", {})
        if out["outcome"] == "one-copy":
            role = result["running"][0]
            run = [p for p in self.witness.running(self.vm, 5.0) if p["role"] == role] or \
                  [p for p in self.witness.of_vm(self.vm) if p["role"] == role and p["gone"] is None]
            pid = run[0]["pid"] if run else None
            if holder.get("pid") != pid:
                notes.append(f"FENCE: the running copy ({role}, pid {pid}) is not the registry's holder "
                             f"({holder or 'none'}, epoch {rec.get('epoch')})")
            o = (owners.get(f"{role}:{pid}") or {}).get("owner") or {}
            if o.get("state") not in (None, "holding"):
                notes.append(f"FENCE: the running copy ({role}) says owner.state={o.get('state')}")
            for k, v in owners.items():
                if not k.startswith("src:") or role == "src":
                    continue
                st = (v.get("owner") or {}).get("state")
                if st == "handed":
                    out["src_handed"] = True  # paused beside the running destination, and says so: fine
                elif v.get("answer"):
                    notes.append(f"the source ({k}) is alive beside the running copy; its socket: {v['answer']}")
                else:
                    notes.append(f"the source ({k}) is alive beside the running copy, "
                                 f"{v.get('state')}, owner.state={st} {own['looked_s']} s after the faults")
            return
        if out["outcome"] == "violation":
            return
        # No copy runs.
        killed = self.killed_pids(faults)
        hpid, hrole = holder.get("pid"), own.get("holder_role")
        epoch = rec.get("epoch")
        if not rec:
            out["registry"] = "no owner record"
            return
        if not holder:
            out["registry"] = f"released at epoch {epoch}: nobody holds the VM"
            return
        if own.get("holder_alive"):
            out["registry"] = f"held by the {hrole} (pid {hpid}, epoch {epoch}), alive"
            return
        how = killed.get(hpid)
        if how and hrole in ("dst", "new"):
            out["outcome"] = "unsurvivable"
            out["why"] = (f"docs/safety.md cannot-survive {'1 and 3' if how['kind'] == 'host' else '1'}: "
                          f"the {'new VMM' if hrole == 'new' else 'destination'} "
                          f"took the VM (the registry: pid {hpid} holds epoch {epoch}) and was killed "
                          f"({how['kind']} {how['target']}): the VM's newest state died with it")
        elif how and hrole == "src":
            out["outcome"] = "unsurvivable"
            n = 3 if how["kind"] == "host" else 2
            out["why"] = (f"docs/safety.md cannot-survive {n}: the source held the VM's only running copy "
                          f"(the registry: pid {hpid}, epoch {epoch}) and was killed ({how['kind']} {how['target']})"
                          + ("" if self.witness.first_run(self.vm, ("dst", "new")) is None
                             else "; a destination had run it before"))
        else:
            out["outcome"] = "lost"
            out["why"] = (f"the registry says the {hrole} (pid {hpid}, epoch {epoch}) holds the VM, but that "
                          "process is gone and no fault killed it" if not how else
                          f"the registry says the {hrole} (pid {hpid}, epoch {epoch}) holds the VM; it was killed "
                          f"({how['kind']} {how['target']}), a case docs/safety.md does not name")
        out["registry"] = f"held by the {hrole} (pid {hpid}, epoch {epoch}), dead"

    def registry_says(self, out):
        if out.get("registry") and out.get("why") and "the registry" not in out["why"]:
            out["why"] += f" (the registry: {out['registry']})"

    def dst_verified(self):
        """Ends the destination's run (`ferry ctl quit`) and returns the pages
        its summary says it verified (received.verified_pages), or None."""
        if "dst" not in self.procs:
            return None
        benchlib.sh(*in_host("ferry-h2", self.ferry, "ctl", self.sock("dst"), "quit"), check=False, timeout=10)
        try:
            self.procs["dst"].wait(timeout=10)
            text = open(os.path.join(self.dir, "dst.out")).read()
            return json.loads(text)["received"]["verified_pages"]
        except (subprocess.TimeoutExpired, OSError, ValueError, KeyError, TypeError):
            return None

    def nothing_left(self):
        """No process of the VM holds a copy that could run again: every one
        still alive is a destination that never ran, and the source has been
        gone for 3 s (a destination waiting for a dead source)."""
        procs = self.witness.of_vm(self.vm)
        now = time.monotonic()
        src_gone = all(p["gone"] is not None and now - p["gone"] > 3 for p in procs if p["role"] == "src")
        return src_gone and all(p["gone"] is not None or (p["role"] == "dst" and p["first_run"] is None)
                                for p in procs)

    def counting(self, p):
        """The workload counter of process `p` advances (its status answers as it)."""
        host = "ferry-h2" if p["role"] == "dst" else "ferry-h1"
        a = self.status(p["sock"], host)
        time.sleep(0.3)
        b = self.status(p["sock"], host)
        try:
            return (a["pid"] == b["pid"] == p["pid"]
                    and b["metrics"]["workloads"][0]["progress"] > a["metrics"]["workloads"][0]["progress"])
        except (TypeError, KeyError, IndexError):
            return False

    def classify(self, faults, result, report, cmd_rc):
        op = self.plan["op"]
        viol = [v for v in self.witness.violations if v[1] == self.vm]
        pages = int(MEM[:-1]) * 256
        said = report_verified(report)
        verified = said == pages
        out = {"verified": verified, "verified_pages": said,
               "max_overlap": self.witness.max_overlap.get(self.vm, 0), "moved": None}
        if report and "downtime_ms" in report:
            out["downtime_ms"] = report.get("downtime_ms")
        if viol or len(result["running"]) >= 2:
            out["outcome"] = "violation"
            out["why"] = (f"two copies advanced together (pids {viol[0][2]})" if viol
                          else f"two copies run at the end: {result['running']}")
            return out
        if len(result["running"]) == 1:
            out["outcome"] = "one-copy"
            out["moved"] = result["running"][0] != "src"
            return out
        why = self.unsurvivable(faults)
        if why:
            out["outcome"], out["why"] = "unsurvivable", why
        elif result.get("alive"):
            out["outcome"] = "paused"
            out["why"] = "no copy runs; " + ", ".join(f"{r}: {s}" for r, s in result["alive"].items())
        else:
            out["outcome"] = "lost"
            out["why"] = "no process of the VM is left"
        return out

    def unsurvivable(self, faults):
        """The documented unsurvivable case among this trial's faults, or None."""
        op = self.plan["op"]
        dest_roles = ("new",) if op in ("handover", "upgrade") else ("dst",)
        t_sw = self.witness.first_run(self.vm, dest_roles)
        role_of = {p["pid"]: p["role"] for p in self.witness.of_vm(self.vm)}
        standby = self.procs.get("standby")
        if standby:
            role_of[standby.pid] = "standby"
        killed = []  # (role, t): each process a kill or a host's death ended
        for e in faults.log:
            if e.get("kind") == "kill" and e.get("pids"):
                killed.append((e["target"], e["t"]))
            if e.get("kind") == "host":
                killed += [(role_of[pid], e["t"]) for pid in e.get("pids", []) if pid in role_of]
        standby_hit = any(r == "standby" for r, _ in killed) or any(
            e.get("kind") == "stop" and e.get("target") == "standby" for e in faults.log)

        def before(t):
            return t_sw is None or t < t_sw + NEAR_SWITCH_S

        def after(t):
            return t_sw is not None and t > t_sw - NEAR_SWITCH_S

        for role, t in killed:
            if role == "src" and before(t):
                return "the only copy's process killed (the source, before the destination ran the VM)"
            if role in ("dst", "new") and after(t):
                if op in ("postcopy", "postcopy-net", "hybrid"):
                    return "the destination of a postcopy killed after it started the VM (its newest state died with it)"
                return "the only copy's process killed (the destination, after it started the VM)"
            if role == "src" and after(t) and op in ("postcopy", "hybrid"):
                return "the source of a postcopy without a safety net killed after the switch (pages only it held)"
            if role == "src" and after(t) and op == "postcopy-net" and standby_hit:
                return "the source of a postcopy killed after the switch, its standby hit as well"
        return None

    def keep_logs(self, where):
        """Copies the trial's logs to `where` (kept for a trial worth a look)."""
        os.makedirs(where, exist_ok=True)
        for d, _, files in os.walk(self.dir):
            for f in files:
                if f.endswith((".log", ".out", ".json")):  # the agents' VMM logs and records too
                    rel = os.path.relpath(os.path.join(d, f), self.dir).replace("/", "_")
                    shutil.copy(os.path.join(d, f), os.path.join(where, rel))

    def cleanup(self):
        self.witness.stop()
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        benchlib.reap(*self.procs.values())
        benchlib.sh(self.ferry, "lab", "down", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def report_verified(report):
    """The pages a command's --json report says were verified, or None."""
    try:
        if "moves" in report:  # ferry drain
            return report["moves"][0].get("verified_pages")
        if "vms" in report:  # ferry upgrade
            return (report["vms"][0].get("handover") or {}).get("verified_pages")
        return report.get("verified_pages")
    except (TypeError, AttributeError, IndexError, KeyError):
        return None


class LabLock:
    """The lab's lock, taken per trial (other users of the lab get in between)."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.path:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def run_trial(a, seed, k, plan, tmp):
    rec = {"seed": seed, "trial": k, "op": plan["op"], "faults": plan["faults"], "opts": plan["opts"]}
    with LabLock(a.lock):
        t_start = time.time()
        up = benchlib.sh(a.ferry, "lab", "up", "3", check=False)
        if up.returncode != 0:
            rec.update(outcome="error", why=f"cannot build the lab: {up.stderr.strip()}")
            return rec
        trial = Trial(a.ferry, seed, k, plan, a.bound, tmp, fenced=not a.unfenced)
        rec["fenced"] = trial.fenced
        try:
            rec.update(trial.run(a.cmd_cap))
        except Exception as e:  # noqa: BLE001 - a harness error is an outcome
            rec.update(outcome="error", why=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-800:])
        finally:
            if rec.get("outcome") != "one-copy" or rec.get("notes") or a.keep_logs:
                rec["logs"] = os.path.join(a.logs, f"s{seed}-t{k}")
                trial.keep_logs(rec["logs"])
            trial.cleanup()
    rec["secs"] = round(time.time() - t_start, 1)
    return rec


# ---------------------------------------------------------------- self-test

def self_test(a, tmp):
    """Two VMMs of one VM on purpose must be flagged; one alone must not."""
    res = {}
    with LabLock(a.lock):
        benchlib.sh(a.ferry, "lab", "up", "1", check=False)
        d = tempfile.mkdtemp(prefix="selftest-", dir=tmp)
        w = Witness(d)
        w.start()
        procs = []
        try:
            for i, role in enumerate(["a", "b"]):
                procs.append(subprocess.Popen(
                    in_host("ferry-h1", a.ferry, "run", "--mem", "64M", "--workload", "compute",
                            "--control", os.path.join(d, f"twin@{role}.sock"), "--duration", "3s", "--quiet"),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                if i == 0:
                    # the first as the harness adds its own VMMs, the second by discovery (its --control)
                    w.add(procs[0].pid, "twin", "a", os.path.join(d, "twin@a.sock"))
                    time.sleep(1.5)
                    res["one_alone_flagged"] = bool(w.violations)
            for p in procs:
                p.wait(timeout=20)
            time.sleep(0.1)
            res["two_flagged"] = bool(w.violations)
            res["max_overlap"] = w.max_overlap.get("twin", 0)
            res["sampling_steps"] = w.steps
            res["tracked"] = len(w.procs)
        finally:
            w.stop()
            benchlib.reap(*procs)
            benchlib.sh(a.ferry, "lab", "down", check=False)
            shutil.rmtree(d, ignore_errors=True)
    res["ok"] = res.get("two_flagged") is True and res.get("one_alone_flagged") is False
    return res


# ---------------------------------------------------------------- output

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


def fault_text(f):
    d = f" {f['dur']}s" if "dur" in f else ""
    return f"{f['kind']} {f['target']} @{f['at']}s{d}"


def write(a, data):
    path = a.out if "/" in a.out else os.path.join(ROOT, "bench/results", a.out)
    trials = data["trials"]
    ops = [o for o in OPS if any(t["op"] == o for t in trials)]
    faults = [f for f in FAULTS if any(t["faults"][0]["kind"] == f for t in trials)]
    benchlib.write_json(path + ".json", data, indent=1)
    c = collections.Counter(t["outcome"] for t in trials)
    runs = data["runs"]
    lines = ["# Chaos: random faults over ferry's operations, audited by a witness outside ferry", "",
             "Runs (each: its command, build, seed, trials):", ""]
    lines += [f"- `{r['command']}`: build {r['build']}, seed {r['seed']}, {r['trials']} trials, "
              f"bound {r['bound']} s, stops/link faults up to {r['stop_max']} s"
              + ("" if "fenced" not in r else ", fenced" if r["fenced"] else ", unfenced (agents fence theirs)")
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
            lines.append(f"| {t['seed']} | {t['trial']} | {t['op']}{'' if t.get('fenced') or 'fenced' not in t else ' (unfenced)'} | {'; '.join(map(fault_text, t['faults']))} | "
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--first", type=int, default=0, help="the first trial's number")
    ap.add_argument("--trial", type=int, default=None, help="replay this trial of --seed alone")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--smoke", action="store_true",
                    help="fixed seed 1, 20 short trials (stops and link faults 0.5-3 s), the witness's self-test")
    ap.add_argument("--bound", type=float, default=60.0, help="a VM paused longer than this after the faults end")
    ap.add_argument("--stop-max", type=float, default=60.0, help="the longest SIGSTOP / link fault, s")
    ap.add_argument("--cmd-cap", type=float, default=120.0,
                    help="the command is stopped this long after the faults end")
    ap.add_argument("--out", default="chaos")
    ap.add_argument("--append", action="store_true", help="add this run's trials to --out's")
    ap.add_argument("--lock", default="/tmp/ferry-lab.lock", help="the lab's lock file ('' for none)")
    ap.add_argument("--no-self-test", action="store_true")
    ap.add_argument("--logs", default="/tmp/ferry-chaos-logs",
                    help="where the logs of trials not ending with one copy are kept")
    ap.add_argument("--keep-logs", action="store_true", help="keep every trial's logs")
    ap.add_argument("--unfenced", action="store_true",
                    help="start the direct operations' VMMs without --vm-name/--fenced (agents fence theirs anyway)")
    a = ap.parse_args()
    if a.smoke:
        a.seed = 1 if a.seed is None else a.seed
        a.stop_max = min(a.stop_max, 3.0)
        a.bound = min(a.bound, 20.0)
        a.cmd_cap = min(a.cmd_cap, 20.0)
        if "--trials" not in sys.argv:
            a.trials = 20
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 10**6)
    a.ferry = os.path.abspath(a.ferry)
    ops, faults = a.ops.split(","), a.faults.split(",")
    for o in ops:
        if o not in OPS:
            sys.exit(f"unknown operation {o} (known: {', '.join(OPS)})")
    for f in faults:
        if f not in FAULTS:
            sys.exit(f"unknown fault {f} (known: {', '.join(FAULTS)})")
    if os.geteuid() != 0 or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        sys.exit("SKIP: the chaos harness needs root (lab namespaces) and /dev/kvm")
    build = build_of(a.ferry)
    command = benchlib.recorded_command("chaos.py")
    path = a.out if "/" in a.out else os.path.join(ROOT, "bench/results", a.out)
    data = {"trials": [], "runs": [], "self_tests": []}
    if a.append and os.path.exists(path + ".json"):
        data = json.load(open(path + ".json"))
    tmp = tempfile.mkdtemp(prefix="ferry-chaos-")
    ks = [a.trial] if a.trial is not None else list(range(a.first, a.first + a.trials))
    new = []
    stopping = []
    # SIGTERM: finish the trial under way, then write what was measured.
    signal.signal(signal.SIGTERM, lambda *_: (stopping.append(1), log("SIGTERM: stopping after this trial")))
    try:
        if not a.no_self_test and a.trial is None:
            st = self_test(a, tmp)
            st["build"] = build
            data["self_tests"].append(st)
            log(f"witness self-test: {st}")
        for k in ks:
            if stopping:
                break
            plan = schedule_of(a.seed, k, ops, faults, a.stop_max)
            log(f"trial {k} (seed {a.seed}): {plan['op']}: {'; '.join(map(fault_text, plan['faults']))}")
            rec = run_trial(a, a.seed, k, plan, tmp)
            rec["build"] = build
            new.append(rec)
            log(f"  -> {rec['outcome']}" + (f": {rec.get('why')}" if rec.get("why") else "")
                + (" (verified)" if rec.get("verified") else "") + f" [{rec.get('secs')} s]")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        data["trials"] += new
        data["runs"].append({"command": command, "build": build, "seed": a.seed, "trials": len(new),
                             "bound": a.bound, "stop_max": a.stop_max, "ops": ops, "faults": faults,
                             "fenced": not a.unfenced})
        lines = write(a, data)
        print("\n".join(lines))


if __name__ == "__main__":
    main()
