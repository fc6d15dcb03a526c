#!/usr/bin/env python3
"""The chaos harness (issue 54 item 2): random fault schedules over ferry's
operations between lab hosts, each trial audited by a witness outside ferry.

One trial = one operation on a fresh lab (`ferry lab up 3`: ferry-h1 the
source, ferry-h2 the destination, ferry-h3 the standby's host) with one or
two faults injected at random moments of it:

  operations  precopy, postcopy, hybrid (`ferry migrate --verify` from h1 to
              h2), handover (`ferry handover --verify` on h1), postcopy-net
              (postcopy with the safety net's standby on h3), drain and
              upgrade (agents on every host), split (`--mode split` to a
              main host on h2 and two memory servers on h3), gather (a VM
              split first without faults, then `--mode gather` to h1)
  faults      kill (SIGKILL), stop (SIGSTOP, SIGCONT after 0.5-60 s) of the
              source VMM, the destination VMM (a handover's new VMM), the
              command (`ferry migrate` / `ferry handover`), the standby, a
              memory server (mem), an agent;
              cut (the host's eth0 down), blackhole (every packet to and from
              the host dropped: tbf with a burst below one packet on both
              ends of its veth), slow (tbf 2 mbit on both ends), each for
              0.5-60 s; host (every process in the host's namespace
              SIGKILLed at once, its link blackholed for good);
              with --registry etcd (a real etcd per trial on ferry-h4):
              registry-stop (SIGSTOP, SIGCONT after 0.5-60 s), registry-kill
              (SIGKILL, restarted on its data dir after 0.5-60 s), and link
              faults of ferry-h4

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
killed after the switch, or a memory server with the only copy of some
of a split VM's pages), violation (two copies ran at once, or run at the
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
       [--registry dir|etcd]
"""
import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile

import benchlib
from chaoslib.common import DEFAULT_OPS, FAULTS, OPS, REGISTRY_FAULTS, ROOT, log
from chaoslib.faults import schedule_of
from chaoslib.lab import run_trial, self_test
from chaoslib.report import build_of, fault_text, write


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/release/ferry"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--first", type=int, default=0, help="the first trial's number")
    ap.add_argument("--trial", type=int, default=None, help="replay this trial of --seed alone")
    ap.add_argument("--ops", default=None,
                    help=f"default: {','.join(DEFAULT_OPS)} (--smoke: {','.join(OPS)})")
    ap.add_argument("--faults", default=None,
                    help=f"default: {','.join(FAULTS)} (and {','.join(REGISTRY_FAULTS)} with --registry etcd)")
    ap.add_argument("--registry", choices=("dir", "etcd"), default="dir",
                    help="dir: an embedded registry per trial (a directory); etcd: a real etcd per trial "
                         "on its own lab host, ferry-h4 (etcd://10.77.0.4:2379), which registry-stop and "
                         "registry-kill stop or kill, and link faults may cut off")
    ap.add_argument("--smoke", action="store_true",
                    help="fixed seed 1, 20 short trials over every operation (stops and link faults 0.5-3 s), "
                         "the witness's self-test")
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
    if a.ops is None:
        a.ops = ",".join(OPS if a.smoke else DEFAULT_OPS)
    if a.faults is None:
        a.faults = ",".join(FAULTS + (REGISTRY_FAULTS if a.registry == "etcd" else []))
    ops, faults = a.ops.split(","), a.faults.split(",")
    for o in ops:
        if o not in OPS:
            sys.exit(f"unknown operation {o} (known: {', '.join(OPS)})")
    for f in faults:
        if f not in FAULTS + REGISTRY_FAULTS:
            sys.exit(f"unknown fault {f} (known: {', '.join(FAULTS + REGISTRY_FAULTS)})")
        if f in REGISTRY_FAULTS and a.registry != "etcd":
            sys.exit(f"fault {f} needs --registry etcd")
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
            plan = schedule_of(a.seed, k, ops, faults, a.stop_max, a.registry)
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
                             "fenced": not a.unfenced, **({"registry": "etcd"} if a.registry == "etcd" else {})})
        lines = write(a, data)
        print("\n".join(lines))


if __name__ == "__main__":
    main()

