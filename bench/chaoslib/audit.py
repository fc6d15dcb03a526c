"""The audit after a trial's faults: what runs where, what the registry
says, and the trial's outcome (docs/chaos.md, "Outcomes")."""
import json
import os
import subprocess
import time

import benchlib
from benchlib import in_host

from . import registry, split
from .common import HANDED_WAIT_S, MEM, NEAR_SWITCH_S, SPLIT_OPS
from .witness import cmdline, guest_time


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



class Audit:
    """The audit's half of a Trial."""

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
                sp = s.get("split") or {}
                if sp.get("failure") or sp.get("lost_servers"):
                    states[p["role"]] += (f" (split: lost servers {sp.get('lost_servers')}, "
                                          f"paging failure: {sp.get('failure')})")
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
        read straight from the embedded registry's directory or from etcd, or None."""
        return registry.record(self.registry, self.fence_name, kind)

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
        for r in ("standby",) + split.MEM_ROLES:
            if self.procs.get(r):
                role_of[self.procs[r].pid] = r
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
        if op in SPLIT_OPS:
            return split.pages_lost(self, killed, before, after)
        return None

