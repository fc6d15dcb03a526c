//! The fleet commands: `ferry agent` (one per host), `ferry vm
//! start|list|stop`, `ferry drain HOST` and `ferry upgrade HOST`. Each finds
//! the fleet through the registry (embedded by default) and speaks to the
//! agents over mutual TLS with this host's credentials (docs/agent.md).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ferry_fleet::drain::{self, defaults};
use ferry_fleet::{Agent, AgentOptions, Drain, DrainOptions, Fleet, VmSpec};

mod print;
use ferry_migration::Mode;
use ferry_vmm::boot::layout::parse_size;
use print::{print_plan, print_summary, DrainProgress};
use serde_json::json;

use crate::format;

fn parse_mem(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 512M, 4G)"))
}

/// `ferry agent`.
#[derive(clap::Args)]
pub struct AgentArgs {
    /// This host's name: its certificate's (peers name it as a VM's source).
    #[arg(long)]
    name: String,
    /// Where to listen (HOST:PORT, an address other hosts reach: VMs
    /// arriving here listen on the same address).
    #[arg(long)]
    listen: std::net::SocketAddr,
    /// The host registry: etcds://HOST:PORT (TLS), etcd://HOST:PORT, or
    /// dir:PATH; default: the embedded one on this machine.
    #[arg(long)]
    registry: Option<String>,
    /// Guest RAM offered to VMs in all (default: three quarters of this
    /// machine's memory).
    #[arg(long, value_parser = parse_mem)]
    mem: Option<u64>,
    /// vCPUs offered to VMs in all (default: 4 per CPU; the test guest's
    /// vCPUs idle in `hlt`).
    #[arg(long)]
    vcpus: Option<u32>,
    /// This host's link speed, for planning (e.g. 1gbit, 100M bytes/s).
    #[arg(long, value_parser = crate::migrate::parse_rate)]
    link: Option<u64>,
    /// Where its VMs' records, control sockets and logs go (default:
    /// /run/ferry/agent/NAME).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The ferry binary new VMs (and arriving ones) run (default: this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Run every VM of this host with --share-pages: a VM arriving (a
    /// drain, say) takes the pages the host's VMs already hold from them
    /// instead of over the link (docs/security.md says what this shares).
    #[arg(long)]
    share_pages: bool,
    /// Print JSON for machines (one line when ready).
    #[arg(long)]
    json: bool,
}

/// `ferry vm`.
#[derive(clap::Subcommand)]
pub enum VmCommand {
    /// Start a VM on a host of the fleet.
    Start(VmStartArgs),
    /// List the fleet's VMs, host by host.
    List(RegistryArgs),
    /// Stop a VM wherever it runs.
    Stop(VmStopArgs),
}

/// Where the fleet is.
#[derive(clap::Args)]
pub struct RegistryArgs {
    /// The host registry (default: the embedded one on this machine).
    #[arg(long)]
    registry: Option<String>,
    /// Print JSON for machines.
    #[arg(long)]
    json: bool,
}

/// `ferry vm start`.
#[derive(clap::Args)]
pub struct VmStartArgs {
    /// The VM's name, unique in the fleet.
    name: String,
    /// The host to run it on.
    #[arg(long)]
    host: String,
    /// Guest RAM.
    #[arg(long, default_value = "512M", value_parser = parse_mem)]
    mem: u64,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// What the guest runs (`ferry run --help` lists the workloads).
    #[arg(long, default_value = "idle")]
    workload: String,
    /// The VM's own address: its clients follow it when it moves.
    #[arg(long)]
    vm_address: Option<std::net::Ipv4Addr>,
    /// Where its service listens (HOST:PORT).
    #[arg(long)]
    serve: Option<std::net::SocketAddr>,
    #[command(flatten)]
    fleet: RegistryArgs,
}

/// `ferry vm stop`.
#[derive(clap::Args)]
pub struct VmStopArgs {
    /// The VM.
    name: String,
    #[command(flatten)]
    fleet: RegistryArgs,
}

/// `ferry drain`.
#[derive(clap::Args)]
pub struct DrainArgs {
    /// The host to empty.
    host: String,
    /// Print the plan and move nothing.
    #[arg(long)]
    dry_run: bool,
    /// Ask the drain of HOST running anywhere to start no new move (the
    /// running ones finish or roll back).
    #[arg(long, conflicts_with = "dry_run")]
    cancel: bool,
    /// Moves out of the host, and into any one host, at once.
    #[arg(long, default_value_t = defaults::PER_HOST)]
    per_host: usize,
    /// Moves in the whole fleet at once.
    #[arg(long, default_value_t = defaults::IN_FLEET)]
    in_fleet: usize,
    /// One mode for every VM (default: hybrid for each: precopy, then
    /// postcopy if its rounds do not converge).
    #[arg(long, value_parser = ["precopy", "postcopy", "hybrid"])]
    mode: Option<String>,
    /// Compare every page's hash at the end of each move.
    #[arg(long)]
    verify: bool,
    /// Other hosts a VM is tried on after a failed move.
    #[arg(long, default_value_t = defaults::RETRIES)]
    retries: usize,
    /// Each move's completion deadline per GiB of its VM: past it, a
    /// hybrid move switches to postcopy.
    #[arg(long, default_value_t = format::Secs(defaults::DEADLINE_PER_GIB), value_parser = format::parse_secs)]
    deadline_per_gib: format::Secs,
    /// The bandwidth the drain may use out of the host, shared by its
    /// moves (e.g. 1gbit, 100M bytes/s; default: the link's).
    #[arg(long, value_parser = crate::migrate::parse_rate)]
    bandwidth: Option<u64>,
    /// Each move's precopy rounds leave the link's queue to the VMs' own
    /// traffic, as `ferry migrate` does by default: the guests' clients
    /// keep their latency. (The default; kept for scripts that ask.)
    #[arg(long, conflicts_with = "own_link")]
    share_link: bool,
    /// The link is the drain's own: each move's precopy rounds send as fast
    /// as TCP goes (or --bandwidth), as `ferry migrate --own-link`.
    #[arg(long)]
    own_link: bool,
    /// Hybrid moves switch to postcopy after this many dirty rounds that
    /// did not converge (or at their deadline).
    #[arg(long, default_value_t = defaults::POSTCOPY_AFTER_ROUNDS)]
    postcopy_after_rounds: u32,
    /// Move by postcopy without a standby on a third host (by default each
    /// postcopy or hybrid move gets one, so a source that dies mid-postcopy
    /// loses no VM; it costs the pages sent to it out of the host).
    #[arg(long)]
    no_safety_net: bool,
    /// The source of a move with a standby pushes every page to the
    /// destination itself (by default it sends each page once, to the
    /// standby, hands the move over once it holds them all, and waits as
    /// its backup while the standby finishes the move from its host).
    #[arg(long, conflicts_with = "no_safety_net")]
    source_finishes: bool,
    #[command(flatten)]
    fleet: RegistryArgs,
}

/// `ferry upgrade`.
#[derive(clap::Args)]
pub struct UpgradeArgs {
    /// The host whose VMs get new VMM processes.
    host: String,
    /// The ferry binary the new processes run (default: the agent's own).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// VMs handed over at once.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    #[command(flatten)]
    fleet: RegistryArgs,
}

fn open_fleet(registry: Option<&str>) -> Result<Fleet> {
    let reg = ferry_registry::open(
        registry,
        crate::security::credentials_for_registry(registry)?,
    )?;
    Ok(Fleet::new(reg, crate::security::fleet_credentials()?))
}

fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    Ok(stop)
}

/// Runs this host's agent until Ctrl-C or SIGTERM (its VMs run on).
pub fn agent(a: AgentArgs) -> Result<ExitCode> {
    ferry_fleet::check_name(&a.name)?;
    let registry = ferry_registry::open(
        a.registry.as_deref(),
        crate::security::credentials_for_registry(a.registry.as_deref())?,
    )?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let opts = AgentOptions {
        name: a.name.clone(),
        listen: a.listen,
        mem_bytes: a.mem.unwrap_or_else(|| machine_memory() / 4 * 3),
        vcpus: a.vcpus.unwrap_or(4 * cpus),
        link_bps: a.link.map_or(0, |b| b * 8),
        state_dir: a
            .state_dir
            .unwrap_or_else(|| PathBuf::from(format!("/run/ferry/agent/{}", a.name))),
        ferry: match a.binary {
            Some(b) => std::fs::canonicalize(&b).with_context(|| format!("{}", b.display()))?,
            None => std::env::current_exe().context("cannot find this ferry binary")?,
        },
        tls: crate::security::fleet_credentials()?,
        share_pages: a.share_pages,
    };
    let secure = opts.tls.is_some();
    let stop = stop_flag()?;
    let agent = Agent::start(opts, registry.clone())?;
    let info = agent.info();
    if a.json {
        println!(
            "{}",
            json!({"name": info.name, "listen": info.addr, "registry": registry.describe(),
                   "tls": secure, "adopted": info.vms.len()})
        );
    } else {
        eprintln!(
            "ferry agent {}: listening on {} ({}), registered in {}, {} of guest RAM and {} vCPUs \
             offered, {} VMs adopted",
            info.name,
            info.addr,
            if secure { "mutual TLS" } else { "PLAINTEXT" },
            registry.describe(),
            format::bytes(info.mem_bytes as f64),
            info.vcpus,
            info.vms.len()
        );
    }
    let _ = std::io::stdout().flush();
    ferry_fleet::run_until(&agent, &stop);
    eprintln!("ferry agent {}: stopping; its VMs run on", info.name);
    Ok(ExitCode::SUCCESS)
}

/// This machine's memory (bytes), from /proc/meminfo.
fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kib| kib * 1024)
}

/// `ferry vm start|list|stop`.
pub fn vm(cmd: VmCommand) -> Result<ExitCode> {
    match cmd {
        VmCommand::Start(a) => {
            let fleet = open_fleet(a.fleet.registry.as_deref())?;
            if let Ok((host, _)) = fleet.find_vm(&a.name) {
                bail!("a VM named {} runs on {} already", a.name, host.name);
            }
            let spec = VmSpec {
                name: a.name.clone(),
                mem_bytes: a.mem,
                vcpus: a.vcpus,
                workload: a.workload.clone(),
                vm_address: a.vm_address.map(|v| v.to_string()),
                serve: a.serve.map(|s| s.to_string()),
            };
            let vm = fleet.agent(&a.host)?.start(spec)?;
            if a.fleet.json {
                println!("{}", json!({"host": a.host, "vm": vm}));
            } else {
                println!("VM {} runs on {} (pid {})", a.name, a.host, vm.pid);
            }
        }
        VmCommand::List(a) => {
            let fleet = open_fleet(a.registry.as_deref())?;
            let hosts = fleet.hosts()?;
            if a.json {
                let out: Vec<_> = hosts
                    .iter()
                    .map(|(e, h)| match h {
                        Ok(h) => json!({"host": h}),
                        Err(err) => json!({"host": {"name": e.name, "addr": e.addr}, "error": err.to_string()}),
                    })
                    .collect();
                println!("{}", serde_json::to_string(&out)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!("fleet in {}: {} hosts", fleet.describe(), hosts.len());
            println!(
                "{:<16} {:<20} {:>9} {:>5} {:<10} {:<9} {:>8} {:<10}",
                "host", "vm", "mem", "vcpus", "state", "pid", "up s", "came by"
            );
            for (e, h) in &hosts {
                match h {
                    Err(err) => println!("{:<16} (agent not answering: {err})", e.name),
                    Ok(h) if h.vms.is_empty() && h.stores.is_empty() => println!(
                        "{:<16} (no VMs; {} and {} vCPUs free)",
                        h.name,
                        format::bytes(h.free_mem as f64),
                        h.free_vcpus
                    ),
                    Ok(h) => {
                        for st in &h.stores {
                            println!(
                                "{:<16} {:<20} {:>9} {:>5} {:<10} {:<9} {:>8} memory server for split VM {} at {}",
                                h.name,
                                format!("(store {})", st.vm),
                                format::bytes(st.bytes as f64),
                                "-",
                                "serving",
                                st.pid,
                                "-",
                                st.vm,
                                st.addr
                            );
                        }
                        for v in &h.vms {
                            println!(
                                "{:<16} {:<20} {:>9} {:>5} {:<10} {:<9} {:>8.1} {:<10}",
                                h.name,
                                v.spec.name,
                                format::bytes(v.spec.mem_bytes as f64),
                                v.spec.vcpus,
                                v.state,
                                v.pid,
                                v.uptime_s,
                                v.came_by
                            );
                        }
                    }
                }
            }
        }
        VmCommand::Stop(a) => {
            let fleet = open_fleet(a.fleet.registry.as_deref())?;
            let (host, _) = fleet.find_vm(&a.name)?;
            fleet.agent(&host.name)?.stop(&a.name)?;
            // A split VM's memory servers on other hosts end with it, and
            // so does a VMM left forwarding its clients to it.
            let mut stores = Vec::new();
            for (_, h) in fleet.hosts()? {
                let Ok(h) = h else { continue };
                let forwarder = h
                    .vms
                    .iter()
                    .any(|v| v.spec.name == a.name && v.state == "forwarding");
                if h.name != host.name && (forwarder || h.stores.iter().any(|s| s.vm == a.name)) {
                    fleet.agent(&h.name)?.stop(&a.name)?;
                    stores.push(h.name);
                }
            }
            if a.fleet.json {
                println!(
                    "{}",
                    json!({"stopped": a.name, "host": host.name, "stores_stopped_on": stores})
                );
            } else {
                println!("VM {} on {} stopped", a.name, host.name);
                for s in stores {
                    println!("  its memory server or forwarder on {s} stopped");
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `ferry drain HOST`.
pub fn drain(a: DrainArgs) -> Result<ExitCode> {
    let fleet = open_fleet(a.fleet.registry.as_deref())?;
    if a.cancel {
        let r = drain::cancel(&fleet, &a.host)?;
        if a.fleet.json {
            println!("{}", json!({"cancelled": a.host, "owner": r.owner}));
        } else {
            println!(
                "drain of {} ({}) asked to start no new move; the moves under way finish or \
                 roll back",
                a.host, r.owner
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let opts = a.options();
    if a.dry_run {
        let plan = drain::plan_now(&fleet, &a.host, &opts)?;
        if a.fleet.json {
            println!("{}", serde_json::to_string(&plan)?);
        } else {
            print_plan(&plan);
        }
        return Ok(ExitCode::SUCCESS);
    }
    // A drain of this host that died is settled first (its moves in flight
    // end one way or the other), then the plan is made from where the VMs
    // are now.
    let (session, resumed) = Drain::begin(&fleet, &a.host, drain::SETTLE_WITHIN)?;
    if let (Some(r), false) = (resumed, a.fleet.json) {
        eprintln!(
            "resuming the drain of {} that {} started (it stopped renewing its record)",
            a.host, r.record.owner
        );
        for note in r.notes {
            eprintln!("  {note}");
        }
    }
    let plan = session.plan(&opts)?;
    if !a.fleet.json {
        print_plan(&plan);
    }
    let cancel = stop_flag()?;
    let mut progress = DrainProgress::new(!a.fleet.json);
    let report = session.run(plan, &opts, &cancel, &mut |moves| progress.show(moves))?;
    if a.fleet.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_summary(&report);
    }
    Ok(if report.emptied() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

impl DrainArgs {
    fn options(&self) -> DrainOptions {
        DrainOptions {
            per_host: self.per_host.max(1),
            in_fleet: self.in_fleet.max(1),
            mode: self.mode.as_deref().map(|m| match m {
                "precopy" => Mode::Precopy,
                "postcopy" => Mode::Postcopy,
                _ => Mode::Hybrid,
            }),
            verify: self.verify,
            retries: self.retries,
            deadline_per_gib: self.deadline_per_gib.0,
            bandwidth: self.bandwidth.map(|b| b as f64),
            share_link: !self.own_link,
            postcopy_after_rounds: self.postcopy_after_rounds,
            safety_net: !self.no_safety_net,
            net_finishes: !self.source_finishes,
        }
    }
}

/// `ferry upgrade HOST`.
pub fn upgrade(a: UpgradeArgs) -> Result<ExitCode> {
    let fleet = open_fleet(a.fleet.registry.as_deref())?;
    let binary = a
        .binary
        .map(|b| std::fs::canonicalize(&b).with_context(|| format!("{}", b.display())))
        .transpose()?;
    let json = a.fleet.json;
    let reports = ferry_fleet::upgrade(&fleet, &a.host, binary, a.parallel, &mut |r| {
        if !json {
            match &r.error {
                None => eprintln!(
                    "  {:<20} pid {} -> {}, downtime {:.2} ms, {} copied",
                    r.vm,
                    r.old_pid,
                    r.new_pid,
                    r.downtime_ms.unwrap_or(0.0),
                    format::bytes(r.copied_bytes as f64)
                ),
                Some(e) => eprintln!("  {:<20} FAILED: {e}", r.vm),
            }
        }
    })?;
    let failed = reports.iter().filter(|r| r.error.is_some()).count();
    if json {
        println!("{}", json!({"host": a.host, "vms": reports}));
        // (A person reads why on stderr, as each VM fails, without --json.)
        if let Some(e) = reports.iter().find_map(|r| r.error.as_ref()) {
            eprintln!(
                "ferry: error: upgrade {}: {failed} VM(s) not upgraded: {e}",
                a.host
            );
        }
    } else {
        let worst = reports
            .iter()
            .filter_map(|r| r.downtime_ms)
            .fold(0.0f64, f64::max);
        println!(
            "upgrade {}: {} VMs handed over, {failed} failed, largest downtime {worst:.2} ms, \
             {} of guest memory copied",
            a.host,
            reports.len() - failed,
            format::bytes(reports.iter().map(|r| r.copied_bytes).sum::<u64>() as f64)
        );
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
