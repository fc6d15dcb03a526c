"""One trial: the VMs, the operation under faults, the audit."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import benchlib
from benchlib import in_host

from . import registry, split
from .audit import Audit
from .common import (AGENT_OPS, BANDWIDTH, FENCE_NAME, MEM, MIGRATE_OPS, SPLIT_OPS, SPLIT_WORKLOAD, WORKLOAD)
from .faults import Faults
from .witness import Witness


class Trial(Audit):
    def __init__(self, ferry, seed, k, plan, bound, tmp, fenced=True, registry_kind="dir"):
        self.ferry, self.seed, self.k, self.plan, self.bound = ferry, seed, k, plan, bound
        self.fenced = fenced or plan["op"] in AGENT_OPS  # agents fence their VMs themselves
        self.dir = tempfile.mkdtemp(prefix=f"t{k}-", dir=tmp)
        self.vm = f"vm{k}"
        self.procs = {}
        self.witness = Witness(self.dir)
        self.notes = []
        self.src_sock = self.sock("src")
        self.registry_kind = registry_kind
        self.registry = registry.address(registry_kind, self.dir)
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

    def vmm(self, role, host, *extra, fence=None):
        """A VMM of the VM; fenced (unless --unfenced) as a fresh VM
        (`fence="boot"`, the default for src) or as a destination
        (`"take"`, the default for dst)."""
        self.witness.role_for(self.sock(role), role)
        out = open(os.path.join(self.dir, f"{role}.out"), "w")
        fence = fence or {"src": "boot", "dst": "take"}.get(role)
        if self.fenced and fence == "boot":
            extra += ("--vm-name", FENCE_NAME, "--registry", self.registry)
        if self.fenced and fence == "take":
            extra += ("--fenced", "--registry", self.registry)
        workload = SPLIT_WORKLOAD if self.plan["op"] in SPLIT_OPS else WORKLOAD
        p = self.spawn(role, host, "run", "--mem", MEM, "--vcpus", "1", "--workload", workload,
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

    def etcd_start(self):
        """(Re)starts the trial's etcd on its data dir; its pid."""
        p = registry.etcd_spawn(os.path.join(self.dir, "etcd"), os.path.join(self.dir, "etcd.log"))
        self.procs["etcd"] = p
        return p.pid

    def start(self):
        op = self.plan["op"]
        if self.registry_kind == "etcd":
            self.etcd_start()
            registry.etcd_ready(self.procs["etcd"])
        self.witness.start()
        if op in SPLIT_OPS:
            return split.start(self)
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
        if self.plan["op"] in SPLIT_OPS:
            cmd, host = split.command(self)
        else:
            cmd, host = self.command(), "ferry-h3" if self.plan["op"] in AGENT_OPS else "ferry-h1"
        self.spawn("cmd", host, *cmd, out=out)
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
        if self.plan["op"] in SPLIT_OPS:
            split.judge(self, faults, result)
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
        if self.registry_kind == "etcd":
            result["registry_gone"] = registry.gone(result["fault_log"])
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

