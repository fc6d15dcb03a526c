//! `ferry bench SUITE`: runs one of the benchmark suites under `bench/`
//! (Python drivers of this same binary; results and their commands land in
//! `bench/results/`).

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Suite {
    /// Live precopy migrations between lab hosts: sizes x dirty rates x links.
    Precopy,
    /// The kv service: clients x vCPUs, device-only latency.
    Kv,
    /// Precopy's bulk copy rate against one plain TCP stream, same run.
    Throughput,
    /// Compressed migrations over a 1 Gbit lab link: fill best / worst /
    /// mixed and dirty VMs x codecs (and auto) x pipeline on / off.
    Compression,
    /// The guest alone: boot time, dirty rate accuracy, compute vs host.
    Guest,
    /// Postcopy between lab hosts: APF on / off x prefetch 0 / 8 x added
    /// round-trip delay; faults, their service time, guest execution ratio.
    Postcopy,
    /// Postcopy under 128 kv clients: request latency around the switch,
    /// faults and execution ratio per 100 ms, time back to baseline.
    PostcopyKv,
    /// Hybrid against precopy with auto-converge on the 1 Gbit lab link.
    Hybrid,
    /// Zero-copy handover to a new VMM process beside precopy over
    /// loopback: 256 MiB to 16 GiB, idle and dirtying 1 GiB/s.
    Handover,
    /// Clients that follow their VM: kv under 128 clients migrated with
    /// its address and connections (TCP_REPAIR) beside the forwarder.
    Clients,
    /// What a migration does to the guest: compute and kv (under load on
    /// the same 1 Gbit link) at several dirty rates, every mode, from the
    /// runs' timelines.
    Degradation,
    /// Split migration of a sorting VM to a main host holding part of its
    /// memory, beside enough memory and swap (memory cgroup + swap file):
    /// migration time, downtime, the sort's slowdown, page-ins, chunk sizes.
    Split,
    /// What mutual TLS costs: precopy of 1 GiB random in a 2 GiB VM and an
    /// idle VM's downtime, TLS against --insecure, alternating run by run.
    Tls,
    /// What --verify adds to a precopy's downtime (idle and filled VMs),
    /// with and without it alternating run by run; --old BINARY runs an
    /// earlier build beside.
    Verify,
    /// A precopy's downtime and its parts (idle and random VMs); --old
    /// BINARY runs an earlier build beside, alternating.
    Downtime,
    /// The destination's RAM populated ahead of the stream (`--prealloc off`
    /// and `waiting`) under precopy and postcopy: speed, downtime, memory
    /// given back; --old BINARY runs an earlier build beside.
    Prealloc,
    /// Draining a host through its agent (8 VMs x 1 GiB over a 1 Gbit link
    /// at concurrency 1, 2, 4) against the link's limit, and upgrading a
    /// host in place.
    Drain,
    /// Pages shared across VMs moving to one host (`--share-pages`): 4 VMs
    /// holding the same 512 MiB data set moved one after another, with and
    /// without sharing: bytes on the wire, time, downtime.
    Share,
    /// Random faults (kills, stops, link cuts, blackholes, slow links, a
    /// host dying) over precopy, postcopy, hybrid, handover, postcopy with
    /// its standby, drain and upgrade, each VM audited after by a witness
    /// outside ferry (two copies never run at once, one runs at the end);
    /// `--smoke` is a fixed-seed 20-trial run.
    Chaos,
    /// A VM doing mixed disk I/O on shared NBD storage (qemu-nbd on a third
    /// lab host) moved by precopy, postcopy and hybrid across a shaped link
    /// (100 Mbit by default) that its disk traffic shares: the guest's disk
    /// MiB/s before, during and after the move, migration time, downtime.
    Disk,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which suite.
    #[arg(value_enum)]
    suite: Suite,
    /// Passed to the suite (e.g. --runs 5 --sizes 256M,1G).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn bench_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench")
}

pub fn bench(args: BenchArgs) -> Result<ExitCode> {
    let script = bench_dir().join(match args.suite {
        Suite::Precopy => "precopy.py",
        Suite::Kv => "kv_baseline.py",
        Suite::Compression => "compression.py",
        Suite::Throughput => "throughput.py",
        Suite::Guest => "guest_baseline.py",
        Suite::Postcopy => "postcopy.py",
        Suite::PostcopyKv => "postcopy_kv.py",
        Suite::Hybrid => "hybrid.py",
        Suite::Handover => "handover.py",
        Suite::Clients => "clients.py",
        Suite::Degradation => "degradation.py",
        Suite::Split => "split.py",
        Suite::Tls => "tls.py",
        Suite::Verify => "verify.py",
        Suite::Downtime => "downtime.py",
        Suite::Drain => "drain.py",
        Suite::Prealloc => "prealloc.py",
        Suite::Share => "share.py",
        Suite::Chaos => "chaos.py",
        Suite::Disk => "disk_shared.py",
    });
    if !script.exists() {
        bail!(
            "{} is missing: `ferry bench` runs from a ferry source tree",
            script.display()
        );
    }
    let ferry = std::env::current_exe().context("cannot find the ferry binary")?;
    let status = Command::new("python3")
        .arg(&script)
        .arg("--ferry")
        .arg(&ferry)
        .args(&args.args)
        .status()
        .context("cannot run python3 (install it to run the benchmarks)")?;
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
