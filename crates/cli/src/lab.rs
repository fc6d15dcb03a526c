//! `ferry lab`: test hosts as network namespaces on this machine, so
//! migrations cross a real network stack (and, shaped, a 1 Gbit or 10 Gbit link).
//!
//! ```text
//!  ferry-h1 (10.77.0.1)   ferry-h2 (10.77.0.2)   ...
//!      eth0                   eth0
//!       │ veth                  │ veth
//!  ┌────┴──────────── ferry-sw: bridge br0 ─────┴──────┐   (a namespace of its own:
//!  └──────────────────────────────────────────────────┘    the host's network is untouched)
//! ```
//! Only these namespaces' addresses are ever used.
//!
//! Each host gets its own certificate from a lab CA ([`LAB_CA`]), in
//! `/etc/netns/ferry-hN/ferry/tls`: `ip netns exec` shows a host that
//! directory as `/etc/ferry/tls`, ferry's default, so every command run on
//! a lab host speaks mutual TLS as that host with no flag.

use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

const SWITCH: &str = "ferry-sw";
const SUBNET: &str = "10.77.0";

/// The lab's certificate authority (made anew by every `ferry lab up`).
pub const LAB_CA: &str = "/run/ferry-lab/ca";

/// Host `i`'s credentials directory, as the host sees it at /etc/ferry/tls.
pub fn host_tls_dir(i: u32) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/etc/netns/{}/ferry/tls", host(i)))
}

#[derive(clap::Subcommand)]
pub enum LabCommand {
    /// Create N hosts (ferry-h1..ferry-hN) joined by a bridge.
    Up {
        /// Number of hosts.
        n: u32,
        /// Shape each host's link to this rate (tc rate syntax: 1gbit, 10gbit, 500mbit).
        #[arg(long)]
        bandwidth: Option<String>,
        /// Add this one-way delay on each host's link (e.g. 0.1ms).
        #[arg(long)]
        delay: Option<String>,
    },
    /// Remove every lab host, stopping whatever still runs on them.
    Down,
    /// Forward TCP from LISTEN to TO adding a round-trip delay (this kernel
    /// has no netem): run it on the destination's host and point the
    /// migration at LISTEN. Prints the address it listens on.
    Delay {
        /// Where to listen (port 0 picks one).
        #[arg(long)]
        listen: std::net::SocketAddr,
        /// Where to forward.
        #[arg(long)]
        to: std::net::SocketAddr,
        /// Round-trip time to add, in milliseconds (half each way), e.g. 0.15.
        #[arg(long)]
        rtt_ms: f64,
    },
    /// Measure the bare cost of a local userfaultfd fault (the floor under
    /// any postcopy fault): prints p50/p99 in µs as JSON.
    UffdCost {
        /// Pages to fault in.
        #[arg(long, default_value_t = 20000)]
        pages: u64,
    },
    /// List the lab hosts and their addresses.
    List,
}

/// Namespace name of host `i` (1-based).
pub fn host(i: u32) -> String {
    format!("ferry-h{i}")
}

/// Address of host `i`.
pub fn addr(i: u32) -> String {
    format!("{SUBNET}.{i}")
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run `ip` (install iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn in_ns(ns: &str, cmd: &[&str]) -> Result<()> {
    let mut args = vec!["netns", "exec", ns];
    args.extend_from_slice(cmd);
    ip(&args)
}

fn namespaces() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("ferry-"))
        .map(str::to_string)
        .collect()
}

pub fn up(n: u32, bandwidth: Option<&str>, delay: Option<&str>) -> Result<()> {
    if !(1..=200).contains(&n) {
        bail!("a lab has 1 to 200 hosts");
    }
    down()?;
    let r = build(n, bandwidth, delay);
    if r.is_err() {
        let _ = down(); // leave nothing half-built
    }
    r
}

fn build(n: u32, bandwidth: Option<&str>, delay: Option<&str>) -> Result<()> {
    ip(&["netns", "add", SWITCH]).context("cannot create network namespaces (needs root)")?;
    in_ns(SWITCH, &["ip", "link", "add", "br0", "type", "bridge"])?;
    in_ns(SWITCH, &["ip", "link", "set", "br0", "up"])?;
    for i in 1..=n {
        let ns = host(i);
        let (outer, inner) = (format!("fh{i}"), format!("fh{i}i"));
        ip(&["netns", "add", &ns])?;
        ip(&[
            "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ])?;
        ip(&["link", "set", &outer, "netns", SWITCH])?;
        ip(&["link", "set", &inner, "netns", &ns])?;
        in_ns(SWITCH, &["ip", "link", "set", &outer, "master", "br0"])?;
        in_ns(SWITCH, &["ip", "link", "set", &outer, "up"])?;
        in_ns(&ns, &["ip", "link", "set", &inner, "name", "eth0"])?;
        in_ns(
            &ns,
            &[
                "ip",
                "addr",
                "add",
                &format!("{}/24", addr(i)),
                "dev",
                "eth0",
            ],
        )?;
        in_ns(&ns, &["ip", "link", "set", "eth0", "up"])?;
        in_ns(&ns, &["ip", "link", "set", "lo", "up"])?;
        shape(&ns, bandwidth, delay)?;
    }
    certificates(n)
}

/// A lab CA and a certificate for each host (its name and address).
fn certificates(n: u32) -> Result<()> {
    use ferry_tls::pki::{self, Validity};
    let ca = std::path::Path::new(LAB_CA);
    let _ = std::fs::remove_dir_all(ca);
    pki::init_ca(ca, "ferry lab CA", Validity::days(30))?;
    // The mount point `ip netns exec` binds each host's /etc/netns/HOST/ferry on.
    std::fs::create_dir_all("/etc/ferry").context("cannot make /etc/ferry")?;
    for i in 1..=n {
        let dir = host_tls_dir(i);
        let _ = std::fs::remove_dir_all(&dir);
        pki::issue(ca, &host(i), &dir, &[addr(i)], Validity::days(30))?;
    }
    Ok(())
}

/// Delay needs netem; a rate alone uses tbf, which more kernels have.
fn shape(ns: &str, bandwidth: Option<&str>, delay: Option<&str>) -> Result<()> {
    match (bandwidth, delay) {
        (None, None) => Ok(()),
        (Some(b), None) => in_ns(
            ns,
            &[
                "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", b, "burst", "256kb",
                "latency", "50ms",
            ],
        )
        .context("cannot limit the link's rate (tc tbf)"),
        (b, Some(d)) => {
            let mut tc = vec![
                "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", d, "limit", "100000",
            ];
            if let Some(b) = b {
                tc.extend_from_slice(&["rate", b]);
            }
            in_ns(ns, &tc).context(
                "cannot add link delay: it needs the kernel's sch_netem (tc netem), which this host may lack; \
                 --bandwidth alone works with tbf",
            )
        }
    }
}

pub fn down() -> Result<()> {
    let stopped = stop_processes_in(&namespaces());
    if stopped > 0 {
        eprintln!("ferry lab down: stopped {stopped} process(es) still running on lab hosts");
    }
    for ns in namespaces() {
        ip(&["netns", "del", &ns])?;
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}/ferry"));
        let _ = std::fs::remove_dir(format!("/etc/netns/{ns}"));
    }
    Ok(())
}

/// Ends every process whose network namespace is one of `names` (a lab
/// host going down is powered off: its agents, VMMs, memory servers and
/// the VMMs they handed over to would otherwise run on, unreachable).
/// SIGTERM, then SIGKILL for those still there after 2 s. Returns how many
/// there were.
fn stop_processes_in(names: &[String]) -> usize {
    use std::os::unix::fs::MetadataExt;
    let ids: Vec<(u64, u64)> = names
        .iter()
        .filter_map(|n| std::fs::metadata(format!("/run/netns/{n}")).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    let in_lab = || -> Vec<i32> {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::metadata(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|m| ids.contains(&(m.dev(), m.ino())))
            })
            .collect()
    };
    let first = in_lab();
    for &pid in &first {
        // SAFETY: kill has no memory effects; a pid that ended meanwhile
        // only makes it fail.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !in_lab().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    for pid in in_lab() {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    first.len()
}

pub fn lab(cmd: LabCommand) -> Result<ExitCode> {
    match cmd {
        LabCommand::Up {
            n,
            bandwidth,
            delay,
        } => {
            up(n, bandwidth.as_deref(), delay.as_deref())?;
            for i in 1..=n {
                println!("{}  {}", host(i), addr(i));
            }
            println!(
                "run a command on a host: ip netns exec {} ferry run ... (each host has its own \
                 certificate from the lab CA in {LAB_CA})",
                host(1)
            );
        }
        LabCommand::Down => down()?,
        LabCommand::Delay { listen, to, rtt_ms } => {
            if !(rtt_ms >= 0.0 && rtt_ms.is_finite()) {
                bail!("--rtt-ms must be a duration in milliseconds, not {rtt_ms}");
            }
            crate::delay::run(listen, to, std::time::Duration::from_secs_f64(rtt_ms / 1e3))?;
        }
        LabCommand::UffdCost { pages } => {
            let l = ferry_migration::Latency::of(crate::uffd_cost::fault_times(pages.max(1))?);
            println!("{}", serde_json::to_string(&l)?);
        }
        LabCommand::List => {
            for ns in namespaces().into_iter().filter(|n| n != SWITCH) {
                let i = ns.trim_start_matches("ferry-h");
                println!("{ns}  {SUBNET}.{i}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
