"""Split and gather trials (docs/split.md): the VM's memory split between a
main host and two memory servers on ferry-h3.

split: the source on ferry-h1, the main host (a waiting `ferry run
--incoming`) on ferry-h2, the servers mem0 and mem1 on ferry-h3; the
command is `ferry migrate --mode split --verify` under faults.
gather: the same split done first without faults (the original source,
role orig, is then ended), so the VM runs split on ferry-h2 (role src,
paging from the servers); a gathering VMM waits on ferry-h1 (role dst) and
the command, run on the main host, is `ferry migrate --mode gather --verify`
under faults.

Half the trials keep every chunk on both servers (`--replicas 2`)."""
import os
import time

import benchlib
from benchlib import in_host

from .common import ADDR, BANDWIDTH, MAIN_BUDGET, MEM_PORTS

MAIN_PORT = 7401
MEM_ROLES = ("mem0", "mem1")


def subs():
    return ",".join(f"tcp:{ADDR['h3']}:{p}" for p in MEM_PORTS)


def split_args(trial, src_role, main_ip):
    """`ferry migrate` of a split from `src_role` to the main host at `main_ip`."""
    args = ["migrate", trial.sock(src_role), "--to", f"tcp:{main_ip}:{MAIN_PORT}", "--mode", "split",
            "--sub", subs(), "--main-budget", MAIN_BUDGET, "--verify", "--json"]
    if trial.plan["opts"].get("replicas", 1) > 1:
        args += ["--replicas", str(trial.plan["opts"]["replicas"])]
    return args


def memservers(trial):
    for role, port in zip(MEM_ROLES, MEM_PORTS):
        trial.spawn(role, "ferry-h3", "memserver", "--listen", f"tcp:{ADDR['h3']}:{port}",
                    "--capacity", "1G", "--no-registry")
    time.sleep(0.5)
    for role in MEM_ROLES:
        if trial.procs[role].poll() is not None:
            raise RuntimeError(f"memory server {role} exited: {trial.tail(role)}")


def start(trial):
    """The VMs and memory servers of a split or gather trial, ready for its command."""
    if trial.plan["op"] == "split":
        trial.vmm("dst", "ferry-h2", "--incoming", f"tcp:{ADDR['h2']}:{MAIN_PORT}")
        memservers(trial)
        trial.vmm("src", "ferry-h1")
        trial.wait_sockets(["src", "dst"])
        trial.wait_filled()
        return
    # gather: split first, without faults.
    trial.vmm("src", "ferry-h2", "--incoming", f"tcp:{ADDR['h2']}:{MAIN_PORT}", fence="take")
    memservers(trial)
    trial.vmm("orig", "ferry-h1", fence="boot")
    trial.wait_sockets(["orig", "src"])
    trial.src_sock = trial.sock("orig")
    trial.wait_filled()
    out = benchlib.sh(*in_host("ferry-h1", trial.ferry, *split_args(trial, "orig", ADDR["h2"])),
                      check=False, timeout=120)
    open(os.path.join(trial.dir, "split.out"), "w").write(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"the split before the gather failed: {out.stderr.strip()[-300:]}")
    trial.src_sock = trial.sock("src")
    # The original source handed the VM: it ends (paused for good, nothing to keep).
    benchlib.sh(*in_host("ferry-h1", trial.ferry, "ctl", trial.sock("orig"), "quit"), check=False, timeout=10)
    try:
        trial.procs["orig"].wait(timeout=10)
    except Exception:  # noqa: BLE001 - ended below
        trial.procs["orig"].kill()
    trial.vmm("dst", "ferry-h1", "--incoming", f"tcp:{ADDR['h1']}:{MAIN_PORT}")
    trial.wait_sockets(["dst"])
    # The split VM runs on its main host before the gather starts.
    deadline = time.monotonic() + 10
    while not trial.witness.running(trial.vm, 0.3) or trial.witness.running(trial.vm, 0.3)[0]["role"] != "src":
        if time.monotonic() > deadline:
            raise RuntimeError("the split VM does not run on its main host")
        time.sleep(0.1)


def command(trial):
    """The trial's command and the host it runs on."""
    if trial.plan["op"] == "split":
        return tuple(split_args(trial, "src", ADDR["h2"]) + ["--bandwidth", BANDWIDTH]), "ferry-h1"
    return ("migrate", trial.sock("src"), "--to", f"tcp:{ADDR['h1']}:{MAIN_PORT}", "--mode", "gather",
            "--verify", "--json", "--bandwidth", BANDWIDTH), "ferry-h2"


def dead_servers(killed, t_ok):
    """The memory servers a kill or a host's death ended, at a time `t_ok(t)` accepts."""
    out = set()
    for role, t in killed:
        if role in ("mem",) + MEM_ROLES and t_ok(t):
            out.add("mem0" if role == "mem" else role)
    return out


def pages_lost(trial, killed, before, after):
    """The documented case (docs/safety.md cannot-survive 4) among the
    kills, or None: a memory server that held the only copy of some of the
    split VM's pages killed while the VM depended on it (split: after the
    switch; gather: before it, when the main host still pages from it)."""
    op = trial.plan["op"]
    replicas = trial.plan["opts"].get("replicas", 1)
    dead = dead_servers(killed, after if op == "split" else before)
    if not dead or (replicas > 1 and len(dead) < len(MEM_ROLES)):
        return None
    when = "after the switch" if op == "split" else "before the gather took the VM"
    return (f"docs/safety.md cannot-survive 4: memory server{'s' if len(dead) > 1 else ''} "
            f"{', '.join(sorted(dead))} killed {when}, with the only copy of some of the split VM's pages "
            f"(--replicas {replicas})")


def judge(trial, faults, result):
    """A split VM that still runs (split: on its main host; gather: on the
    main host, the gather having failed) although a memory server died with
    the only copy of some of its pages: its memory is not whole any more
    (it stops when it touches one of them: docs/split.md), which is the
    documented loss, not one verified copy. The main host's own account
    (`ferry status`: split.lost_servers, split.failure) is kept."""
    split_role = "dst" if trial.plan["op"] == "split" else "src"
    alive = [p for p in trial.witness.of_vm(trial.vm) if p["role"] == split_role and p["gone"] is None]
    if alive:
        s = trial.status(alive[0]["sock"])
        sp = (s or {}).get("split") or {}
        result["split"] = {k: sp.get(k) for k in ("lost_servers", "failure", "page_ins", "page_outs")}
    if result["outcome"] != "one-copy" or result["running"] != [split_role]:
        return
    why = trial.unsurvivable(faults)
    if why and "cannot-survive 4" in why:
        result["outcome"] = "unsurvivable"
        result["why"] = why + "; the VM still runs on its main host, until it touches one of those pages"
