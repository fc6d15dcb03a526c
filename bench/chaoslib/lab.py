"""Running trials on the lab: its lock, one trial, the witness's self-test."""
import os
import shutil
import subprocess
import tempfile
import time
import traceback

import benchlib
from benchlib import LabLock, in_host

from .trial import Trial
from .witness import Witness


def run_trial(a, seed, k, plan, tmp):
    rec = {"seed": seed, "trial": k, "op": plan["op"], "faults": plan["faults"], "opts": plan["opts"]}
    with LabLock(a.lock):
        t_start = time.time()
        # --registry etcd: its own host, ferry-h4
        up = benchlib.sh(a.ferry, "lab", "up", "4" if a.registry == "etcd" else "3", check=False)
        if up.returncode != 0:
            rec.update(outcome="error", why=f"cannot build the lab: {up.stderr.strip()}")
            return rec
        trial = Trial(a.ferry, seed, k, plan, a.bound, tmp, fenced=not a.unfenced, registry_kind=a.registry)
        rec["fenced"] = trial.fenced
        if a.registry == "etcd":
            rec["registry"] = "etcd"
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

