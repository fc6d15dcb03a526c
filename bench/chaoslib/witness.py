"""The witness outside ferry: guest_time of every VMM of a VM, sampled
every 10 ms (docs/chaos.md, "The witness")."""
import collections
import os
import threading
import time

from .common import EXEC_SETTLE_S, GT_FIELD, OVERLAP_STEPS, OVERLAP_WINDOW


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

