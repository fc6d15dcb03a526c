"""--registry etcd: one real etcd per trial on its own lab host (ferry-h4,
plaintext `etcd://10.77.0.4:2379`), which the fenced VMMs, the agents and
the operator's commands use; the audit reads the ownership records from it
(etcd's v3 JSON gateway, through curl inside the lab). The default, dir:,
is an embedded registry in the trial's directory, read as files."""
import base64
import json
import os
import shutil
import subprocess
import time

import benchlib
from benchlib import in_host

from .common import ADDR, ETCD_PORT, HOSTS, REGISTRY_HOST

ETCD_HOST = HOSTS[REGISTRY_HOST]
ETCD_ADDR = f"{ADDR[REGISTRY_HOST]}:{ETCD_PORT}"


def address(kind, trial_dir):
    """The registry address the trial's processes are given."""
    return f"etcd://{ETCD_ADDR}" if kind == "etcd" else f"dir:{trial_dir}/registry"


def etcd_spawn(data_dir, log_path):
    """An etcd on the registry's lab host, on `data_dir` (kept across a
    restart: the same member comes back with what it had)."""
    binary = shutil.which("etcd")
    if not binary:
        raise RuntimeError("--registry etcd needs etcd (Debian: apt-get install etcd-server)")
    ip = ADDR[REGISTRY_HOST]
    peer = f"http://{ip}:{ETCD_PORT + 1}"
    return subprocess.Popen(
        in_host(ETCD_HOST, binary, "--name", "chaos", "--data-dir", data_dir,
                "--listen-client-urls", f"http://{ETCD_ADDR}", "--advertise-client-urls", f"http://{ETCD_ADDR}",
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"chaos={peer}"),
        stdout=subprocess.DEVNULL, stderr=open(log_path, "a"))


def gateway(path, body, timeout=3):
    """One call to etcd's JSON gateway, from inside the lab; its answer or None."""
    out = benchlib.sh(*in_host(ETCD_HOST, "curl", "-s", "-m", str(timeout), "-X", "POST",
                               f"http://{ETCD_ADDR}{path}", "-d", json.dumps(body)),
                      check=False, timeout=timeout + 5)
    try:
        return json.loads(out.stdout) if out.returncode == 0 else None
    except ValueError:
        return None


def etcd_ready(proc, timeout=20):
    """Waits until etcd answers a read (it elected itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited ({proc.returncode})")
        got = gateway("/v3/kv/range", {"key": base64.b64encode(b"/ferry/").decode()}, timeout=1)
        if got and "header" in got:
            return
        time.sleep(0.2)
    raise RuntimeError("etcd did not answer")


def record(registry, name, kind):
    """The record `kind/name` (owners: {vm, epoch, holder, since};
    owners-alive: {id, renewed}) as ferry keeps it: a file
    records/KIND%2FNAME in the embedded registry, the key
    /ferry/records/KIND/NAME in etcd. None when absent."""
    if registry.startswith("dir:"):
        path = os.path.join(registry[len("dir:"):], "records", f"{kind}%2F{name}")
        try:
            return json.loads(open(path).read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            return {"unreadable": repr(e)}
    key = base64.b64encode(f"/ferry/records/{kind}/{name}".encode()).decode()
    got = gateway("/v3/kv/range", {"key": key})
    if got is None:
        return {"unreadable": f"etcd at {ETCD_ADDR} did not answer"}
    kvs = got.get("kvs") or []
    if not kvs:
        return None
    try:
        return json.loads(base64.b64decode(kvs[0]["value"]))
    except (KeyError, ValueError) as e:
        return {"unreadable": repr(e)}


def gone(fault_log):
    """When the trial's processes could not reach the registry, from its
    faults' log (seconds from the command's start): [from, to, how], `to`
    None when it never came back. etcd is gone while it is stopped or dead
    (a kill of a stopped etcd ends with its restart); the registry's host
    while any cut or blackhole of it is in force."""
    out = []
    state = {"stopped": False, "dead": False, "links": 0}
    since, how = None, []
    for e in fault_log:
        kind, target, t = e.get("kind"), e.get("target"), e.get("t")
        was = state["stopped"] or state["dead"] or state["links"] > 0
        if kind == "registry-stop" and e.get("pids"):
            state["stopped"] = True
        elif kind == "registry-kill" and e.get("pids"):
            state["dead"], state["stopped"] = True, False
        elif kind == "cont" and target == "etcd":
            state["stopped"] = False
        elif kind == "restart" and target == "etcd":
            state["dead"] = False
        elif target == REGISTRY_HOST and kind in ("cut", "blackhole"):
            state["links"] += 1
        elif (target == REGISTRY_HOST and kind == "restore" and e.get("of", "cut") in ("cut", "blackhole")
              and state["links"] > 0):
            state["links"] -= 1
        else:
            continue
        now = state["stopped"] or state["dead"] or state["links"] > 0
        if now and not was:
            since, how = t, []
        if now and kind not in ("cont", "restart", "restore"):
            how.append(kind if target == "etcd" else f"{kind} {target}")
        if was and not now:
            out.append([since, t, ", ".join(how)])
    if state["stopped"] or state["dead"] or state["links"] > 0:
        out.append([since, None, ", ".join(how)])
    return out
