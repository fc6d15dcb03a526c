#!/usr/bin/env python3
"""Precopy benchmark: live-migrate VMs between two lab hosts (network
namespaces, `ferry lab`) and record total time, downtime, bytes and rounds.

Matrix: --sizes x workloads (idle, dirty at --rates MiB/s) x links (unshaped,
and 1 Gbit shaped with tbf). Each cell is the median of --runs migrations,
each between fresh VMMs. In the same run it measures what one plain TCP
stream carries between the two hosts (python sender/receiver, 1 MiB writes),
so migration throughput can be compared with it.

Needs root (network namespaces) and /dev/kvm. Results:
bench/results/precopy.{json,md}.

Usage: python3 bench/precopy.py [--runs 3] [--sizes 256M,1G,4G] [--rates 64,256,1024]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import sh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC, DST = ("ferry-h1", "10.77.0.1"), ("ferry-h2", "10.77.0.2")


def tcp_stream(seconds=2.0):
    """Bytes/s one TCP stream carries from h1 to h2."""
    recv = ("import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            "s.bind(('10.77.0.2',7990));s.listen(1);c,_=s.accept();n=0;b=bytearray(1<<20)\n"
            "while True:\n r=c.recv_into(b)\n if not r: break\n n+=r\nprint(n)")
    rx = subprocess.Popen(["ip", "netns", "exec", DST[0], sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    send = (f"import socket,time\ns=socket.create_connection(('10.77.0.2',7990));b=bytes(1<<20);t=time.time()\n"
            f"while time.time()-t<{seconds}: s.sendall(b)\ns.close();print(time.time()-t)")
    el = float(sh("ip", "netns", "exec", SRC[0], sys.executable, "-c", send).stdout)
    return int(rx.communicate()[0]) / el


def migrate_once(ferry, mem, workload, tmp):
    src_sock, dst_sock = os.path.join(tmp, "src.sock"), os.path.join(tmp, "dst.sock")
    benchlib.fresh(src_sock, dst_sock)
    vcpus = "2"
    dst = subprocess.Popen(["ip", "netns", "exec", DST[0], ferry, "run", "--mem", mem, "--vcpus", vcpus,
                            "--workload", workload, "--incoming", f"tcp:{DST[1]}:7400", "--control", dst_sock,
                            "--duration", "1s", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    src = subprocess.Popen(["ip", "netns", "exec", SRC[0], ferry, "run", "--mem", mem, "--vcpus", vcpus,
                            "--workload", workload, "--control", src_sock, "--duration", "120s", "--quiet"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    benchlib.wait_started((src, dst), (src_sock, dst_sock), timeout=20)
    time.sleep(1.5)  # the workload runs (and the dirty workload touches its working set)
    out = sh("ip", "netns", "exec", SRC[0], ferry, "migrate", src_sock, "--to", f"tcp:{DST[1]}:7400",
             "--max-rounds", "15", "--json", check=False)
    src.wait(timeout=30)
    dst.wait(timeout=60)
    return benchlib.report_or_error(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="256M,1G,4G")
    ap.add_argument("--rates", default="64,256,1024")
    ap.add_argument("--links", default="unshaped,1gbit")
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "release", "ferry"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "precopy"))
    a = ap.parse_args()
    workloads = ["idle"] + [f"dirty:rate={r},wss=128,pattern=random" for r in a.rates.split(",")]
    rows, baselines = [], {}
    tmp = tempfile.mkdtemp()
    try:
        for link in a.links.split(","):
            benchlib.lab_up(a.ferry, 2, None if link == "unshaped" else link)
            baselines[link] = statistics.median(tcp_stream() for _ in range(3))
            print(f"link {link}: one TCP stream carries {baselines[link] / 2**20:.0f} MiB/s")
            for mem in a.sizes.split(","):
                for wl in workloads:
                    runs = [migrate_once(a.ferry, mem, wl, tmp) for _ in range(a.runs)]
                    ok = [r for r in runs if "error" not in r]
                    if not ok:
                        print(f"{link} {mem} {wl}: failed: {runs[0]['error']}")
                        rows.append({"link": link, "mem": mem, "workload": wl, "error": runs[0]["error"]})
                        continue
                    med = lambda f: statistics.median(f(r) for r in ok)
                    row = {
                        "link": link, "mem": mem, "workload": wl, "runs": len(ok),
                        "total_s": med(lambda r: r["total_secs"]),
                        "downtime_ms": med(lambda r: r["downtime_ms"]),
                        "bytes": med(lambda r: r["bytes"]),
                        "nonzero_pages": med(lambda r: r["pages"]),
                        "rounds": med(lambda r: len(r["rounds"])),
                        "round0_throughput": med(lambda r: r["rounds"][0]["throughput"]),
                        "src_cpu_s": med(lambda r: r["source_cpu_s"]),
                        "dst_cpu_s": med(lambda r: r["destination_cpu_s"]),
                        "converged": ok[0]["converged"],
                    }
                    rows.append(row)
                    print(f"{link:8} {mem:5} {wl:40} total {row['total_s']:7.3f} s  downtime {row['downtime_ms']:8.2f} ms  "
                          f"{row['bytes'] / 2**20:8.1f} MiB  rounds {row['rounds']:.0f}  "
                          f"round0 {row['round0_throughput'] / 2**20:6.0f} MiB/s")
    finally:
        sh(a.ferry, "lab", "down", check=False)
    res = {"command": benchlib.recorded_command("precopy.py"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "tcp_stream_bytes_per_s": baselines, "rows": rows}
    benchlib.write_json(a.out + ".json", res, indent=2)
    notes = benchlib.kept_notes(a.out + ".md")
    with open(a.out + ".md", "w") as f:
        f.write(f"# Precopy benchmark\n\nCommand: `{res['command']}` (after `cargo build --release`)  \n"
                f"Date: {res['date']}; 2 vCPUs; lab hosts are network namespaces on one 2-core machine "
                f"(PVM KVM); 1gbit = tbf shaping; --max-rounds 15; auto-converge on; median of {a.runs} runs.\n\n"
                "One plain TCP stream between the hosts, measured in the same run: "
                + ", ".join(f"{k} {v / 2**20:.0f} MiB/s" for k, v in baselines.items()) + "\n\n"
                "| link | RAM | workload | total s | downtime ms | MiB on wire | non-zero pages | rounds | round-0 MiB/s | CPU s src / dst |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if "error" in r:
                f.write(f"| {r['link']} | {r['mem']} | {r['workload']} | failed: {r['error'][:60]} |||||||\n")
                continue
            f.write(f"| {r['link']} | {r['mem']} | {r['workload']} | {r['total_s']:.3f} | {r['downtime_ms']:.2f} | "
                    f"{r['bytes'] / 2**20:.1f} | {r['nonzero_pages']:.0f} | {r['rounds']:.0f} | "
                    f"{r['round0_throughput'] / 2**20:.0f} | {r['src_cpu_s']:.3f} / {r['dst_cpu_s']:.3f} |\n")
        f.write(notes)
    print(f"wrote {a.out}.json and {a.out}.md")


if __name__ == "__main__":
    main()
