"""What the benchmark drivers share: running ferry and the lab, waiting for
VMMs, reading their reports, medians, and recording results."""
import fcntl
import os
import sys


def recorded_command(script):
    """The command line to record with a result: this script's arguments
    without --ferry PATH (a private copy of the binary is not part of it)."""
    args = sys.argv[1:]
    kept = [x for i, x in enumerate(args) if x != "--ferry" and (i == 0 or args[i - 1] != "--ferry")]
    return " ".join(["python3", f"bench/{script}", *kept])


def kept_notes(md_path):
    """The hand-written analysis below a result file's generated part (its
    "## " sections), to be written back after the new tables."""
    if not os.path.exists(md_path):
        return ""
    old = open(md_path).read()
    return old[old.index("\n## "):] if "\n## " in old else ""


def failed_runs(cells, label):
    """Markdown lines naming every failed run (cell["errors"]) left out of
    the medians; `label(cell)` says which cell it was."""
    failed = [(label(c), e) for c in cells for e in c["errors"]]
    if not failed:
        return []
    return ["", "Failed runs (left out of the medians):", ""] + [f"- {l}: {e}" for l, e in failed]


def error_lines(errors):
    """Markdown lines listing a bench's failed runs (`errors`: one string
    each), or none."""
    if not errors:
        return []
    return ["", "Failed runs:", ""] + [f"- {e}" for e in errors]


def sh(*args, check=True, **kw):
    """Runs a command, capturing its output as text."""
    import subprocess
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def served(ferry, sock):
    """Requests the VM's first workload has answered so far (a kv workload:
    0 while it fills its table), from `ferry status --metrics`."""
    try:
        return status(ferry, sock)["metrics"]["workloads"][0]["progress"]
    except (KeyError, IndexError, TypeError):
        return 0


def in_host(host, *args):
    """`args` run inside lab host `host` (a network namespace); as they
    are when `host` is None (this host)."""
    return ["ip", "netns", "exec", host, *args] if host else list(args)


def fresh(*paths):
    """Removes sockets a previous run left."""
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def wait_for(*paths, timeout=20):
    """Waits until the VMMs have created their control sockets."""
    import time
    deadline = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.time() > deadline:
            raise RuntimeError("VMMs did not start")
        time.sleep(0.05)


def reap(*procs, grace=0.0):
    """Ends what is still running of `procs` (None entries are skipped):
    SIGTERM first when `grace` > 0 (a VMM then cleans up, e.g. takes its
    VM's address off the host), SIGKILL after `grace` seconds."""
    import subprocess
    for p in procs:
        if p and p.poll() is None:
            if grace > 0:
                p.terminate()
                try:
                    p.wait(timeout=grace)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            p.kill()
            p.wait()


def start_proxy(ferry, host, listen, rtt):
    """A `ferry lab delay` proxy on `host` (listening on its address `listen`
    points at) in front of `listen`; returns (process, address to migrate
    to), or (None, listen) without added delay."""
    import subprocess
    if rtt <= 0:
        return None, listen
    ip = listen.rsplit(":", 1)[0]
    proxy = subprocess.Popen(in_host(host, ferry, "lab", "delay", "--listen", f"{ip}:0",
                                     "--to", listen, "--rtt-ms", str(rtt)),
                             stdout=subprocess.PIPE, text=True)
    return proxy, proxy.stdout.readline().strip()


def drop_vm_address(addr, hosts):
    """Takes a VM's own address (`ferry run --vm-address`) off every lab
    host in `hosts` (a VMM that had to be killed leaves it behind)."""
    for host in hosts:
        sh(*in_host(host, "ip", "addr", "del", f"{addr}/32", "dev", "eth0"), check=False)


def lab_up(ferry, hosts, bandwidth=None):
    """`ferry lab up HOSTS [--bandwidth B]`; exits saying why when the lab
    cannot be built."""
    up = sh(ferry, "lab", "up", str(hosts), *(["--bandwidth", bandwidth] if bandwidth else []), check=False)
    if up.returncode != 0:
        import sys
        sys.exit(f"cannot build the lab: {up.stderr}")


def wait_started(procs, paths, timeout):
    """Waits until the VMMs `procs` have created their control sockets
    `paths`; exits with a VMM's stderr if one ended first, or after
    `timeout` seconds."""
    import sys
    import time
    deadline = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        for p in procs:
            if p.poll() is not None:
                sys.exit(f"a VMM exited: {p.stderr.read()}")
        if time.time() > deadline:
            sys.exit(f"VMMs did not start within {timeout} s")
        time.sleep(0.02)


def report_or_error(out):
    """The report a `--json` command printed, or {"error": its stderr} when
    it failed."""
    import json
    if out.returncode != 0:
        return {"error": out.stderr.strip()}
    return json.loads(out.stdout)


def report(out, say=lambda err: err):
    """The report a `--json` command printed; RuntimeError(say(stderr))
    when it failed."""
    import json
    if out.returncode != 0:
        raise RuntimeError(say(out.stderr))
    return json.loads(out.stdout)


def tls_env(ferry, name):
    """The environment of a bench whose VMMs speak mutual TLS, as by
    default: a fleet of one host (127.0.0.1) made in a fresh directory."""
    import tempfile
    fleet = tempfile.mkdtemp(prefix=f"ferry-{name}-fleet-")
    sh(ferry, "pki", "init", "--dir", f"{fleet}/ca")
    sh(ferry, "pki", "issue", "bench-host", "--dir", f"{fleet}/ca",
       "--out", f"{fleet}/host", "--san", "127.0.0.1")
    env = dict(os.environ, FERRY_TLS_DIR=f"{fleet}/host")
    env.pop("FERRY_INSECURE", None)
    return env


def add_build_args(ap, root):
    """--ferry (this build) and --old (an earlier one, run beside it)."""
    ap.add_argument("--ferry", default=os.path.join(root, "target/release/ferry"))
    ap.add_argument("--old", help="an earlier build, run beside --ferry in the same runs")


def builds_of(a):
    """The builds to run, by label: "new" (--ferry), and "old" with --old."""
    return {"new": a.ferry, **({"old": a.old} if a.old else {})}


def alternated(builds, run):
    """The builds' labels in the order run number `run` takes them: each
    run reverses the last, so neither build always goes first."""
    return list(builds) if run % 2 == 0 else list(reversed(builds))


def status(ferry, sock):
    """`ferry status --json --metrics` of the VM at `sock`, or None when
    it does not answer."""
    import json
    out = sh(ferry, "status", sock, "--json", "--metrics", check=False).stdout
    try:
        return json.loads(out)
    except ValueError:
        return None


def medians(runs, keys=None):
    """Per key (all of the first run's unless `keys`), the median over
    `runs` (dicts of numbers)."""
    import statistics
    return {k: statistics.median(r[k] for r in runs) for k in (runs[0] if keys is None else keys)}


def write_json(path, data, indent=None):
    """Writes a result's JSON file."""
    import json
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)


def write_md(path, lines):
    """Writes a result's markdown: `lines`, then the hand-written notes the
    file already had below them (kept_notes)."""
    notes = kept_notes(path)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + notes)


class LabLock:
    """The lab's lock, held for one trial (`with LabLock(path):`; other users
    of the lab get in between; no path: no lock)."""

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
