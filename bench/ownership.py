"""What fencing a VM through the registry costs a migration (docs/safety.md):
precopy of an idle VM and of a dirtying one over a Unix socket on this host,
fenced (`--vm-name` / `--fenced`) and not, alternating run by run; with the
embedded registry, and through a real etcd when one is installed. The
destination's take-over (a read and a compare-and-swap) lies inside the
downtime, so the downtime is the figure compared.

    python3 bench/ownership.py --ferry target/release/ferry --runs 7
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def etcd_up(tmp):
    """A plaintext etcd on loopback, or (None, None) without the binary."""
    binary = shutil.which("etcd")
    if not binary:
        return None, None
    import socket

    def port():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        return p

    client, peer = port(), port()
    proc = subprocess.Popen(
        [binary, "--name", "own", "--data-dir", os.path.join(tmp, "etcd"),
         "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"own=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    return proc, f"etcd://127.0.0.1:{client}"


def one(ferry, tmp, workload, registry, k):
    """One precopy; `registry` None: unfenced. Its stats."""
    src, dst = os.path.join(tmp, f"s{k}.sock"), os.path.join(tmp, f"d{k}.sock")
    inc = os.path.join(tmp, f"in{k}.sock")
    benchlib.fresh(src, dst, inc)
    fence_src = ["--vm-name", f"bench{k}", "--registry", registry] if registry else []
    fence_dst = ["--fenced", "--registry", registry] if registry else []
    common = ["run", "--mem", "512M", "--quiet", "--insecure"]
    s = subprocess.Popen([ferry, *common, "--workload", workload, "--control", src, *fence_src],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = subprocess.Popen([ferry, *common, "--control", dst, "--incoming", f"unix:{inc}", *fence_dst],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        benchlib.wait_for(src, dst, inc)
        time.sleep(1.0)
        out = benchlib.sh(ferry, "migrate", src, "--to", f"unix:{inc}", "--json", check=False)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip()[-300:])
        return json.loads(out.stdout)
    finally:
        benchlib.sh(ferry, "ctl", dst, "quit", check=False)
        benchlib.reap(s, d, grace=2.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", default="target/release/ferry")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="ownership")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ferry-own-bench-")
    etcd, etcd_addr = etcd_up(tmp)
    registries = {"unfenced": None, "embedded": f"dir:{tmp}/reg"}
    if etcd_addr:
        registries["etcd"] = etcd_addr
    cells = []
    k = 0
    try:
        for workload in ["idle", "dirty:rate=64,wss=128"]:
            runs = {name: [] for name in registries}
            errors = []
            for r in range(a.runs):
                for name in benchlib.alternated(list(registries), r):
                    k += 1
                    try:
                        st = one(a.ferry, tmp, workload, registries[name], k)
                        runs[name].append(st["downtime_ms"])
                    except Exception as e:  # noqa: BLE001 - a failed run is reported
                        errors.append(f"{workload} {name} run {r}: {e}")
            cells.append({"workload": workload, "runs": runs, "errors": errors})
    finally:
        if etcd:
            etcd.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [
        "# What fencing costs a migration's downtime",
        "",
        f"`{benchlib.recorded_command('ownership.py')}` ({time.strftime('%Y-%m-%d')}, "
        f"`{benchlib.sh('git', 'describe', '--always', '--dirty', check=False).stdout.strip()}`): "
        "precopy of a 512 MiB VM over a Unix socket on this host, fenced through each registry and not, "
        f"alternating run by run; downtime in ms, median (min-max) of {a.runs} runs.",
        "",
        "| workload | " + " | ".join(registries) + " |",
        "|---|" + "---|" * len(registries),
    ]
    for c in cells:
        row = []
        for name in registries:
            v = c["runs"][name]
            row.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
        lines.append(f"| {c['workload']} | " + " | ".join(row) + " |")
    lines += benchlib.error_lines([e for c in cells for e in c["errors"]])
    os.makedirs("bench/results", exist_ok=True)
    benchlib.write_md(f"bench/results/{a.out}.md", lines)
    benchlib.write_json(f"bench/results/{a.out}.json", cells, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
