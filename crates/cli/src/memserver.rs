//! `ferry memserver` (a memory server for split migration, advertised in
//! the registry) and `ferry hosts` (what the registry lists).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use ferry_migration::memserver::MemServer;
use ferry_migration::Listener;
use ferry_registry::{Advertisement, HostEntry, HostKind, DEFAULT_TTL};
use serde_json::json;

use crate::format;

/// `ferry memserver`.
#[derive(clap::Args)]
pub struct MemserverArgs {
    /// Where to listen for migrations and main hosts (HOST:PORT or tcp:HOST:PORT).
    #[arg(long)]
    listen: String,
    /// Guest memory this server may hold, for all VMs together (e.g. 2G).
    #[arg(long, value_parser = format::parse_capacity)]
    capacity: u64,
    /// The host registry: etcds://HOST:PORT (TLS), etcd://HOST:PORT, or dir:PATH; default: the
    /// embedded one on this machine.
    #[arg(long)]
    registry: Option<String>,
    /// Do not advertise in any registry.
    #[arg(long, conflicts_with = "registry")]
    no_registry: bool,
    /// The name to advertise (default: memserver@ADDR).
    #[arg(long)]
    name: Option<String>,
    /// Stop after this long (default: until Ctrl-C or SIGTERM).
    #[arg(long, value_parser = format::parse_duration)]
    duration: Option<Duration>,
    /// Print JSON for machines.
    #[arg(long)]
    json: bool,
}

/// Raises this process's descriptor limit to its hard limit: each
/// connection takes two descriptors, and a server with a 1024-descriptor
/// soft limit would run out long before its connection cap. Best effort
/// (the server lives through running out anyway).
fn raise_nofile() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                tracing::debug!("cannot raise the descriptor limit");
            }
        }
    }
}

/// Runs a memory server until stopped.
pub fn memserver(a: MemserverArgs) -> Result<ExitCode> {
    raise_nofile();
    let at = format::tcp_endpoint(&a.listen).map_err(|e| anyhow::anyhow!("--listen {e}"))?;
    let listener = Listener::bind(&at)?;
    let at = listener.endpoint().to_string();
    let at = at.strip_prefix("tcp:").unwrap_or(&at).to_string();
    let server = MemServer::new(a.capacity / 4096);
    let advert = if a.no_registry {
        None
    } else {
        let registry = ferry_registry::open(
            a.registry.as_deref(),
            crate::security::credentials_for_registry(a.registry.as_deref())?,
        )?;
        let entry = HostEntry {
            name: a.name.clone().unwrap_or_else(|| format!("memserver@{at}")),
            kind: HostKind::Memserver,
            addr: at.clone(),
            capacity: a.capacity,
            free: a.capacity,
            agent: None,
        };
        let where_ = registry.describe();
        Some((Advertisement::start(registry, entry, DEFAULT_TTL)?, where_))
    };
    if a.json {
        println!(
            "{}",
            json!({"listen": at, "capacity": a.capacity,
                   "registry": advert.as_ref().map(|(_, w)| w)})
        );
    } else {
        eprintln!(
            "ferry memserver: listening on {at}, {} for VMs{}",
            format::bytes(a.capacity as f64),
            advert
                .as_ref()
                .map_or(String::new(), |(_, w)| format!(", advertised in {w}"))
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let serving = {
        let server = server.clone();
        std::thread::Builder::new()
            .name("memserver".into())
            .spawn(move || server.serve(&listener))?
    };
    let t0 = Instant::now();
    let mut told = u64::MAX;
    while !stop.load(Ordering::Relaxed) && a.duration.is_none_or(|d| t0.elapsed() < d) {
        std::thread::sleep(Duration::from_millis(100));
        if serving.is_finished() {
            break;
        }
        // Keep the registry's view of the room left current.
        let free = server.free_pages() * 4096;
        if free != told {
            if let Some((ad, _)) = &advert {
                if ad.update(free).is_ok() {
                    told = free;
                }
            }
        }
    }
    server.stop();
    let served = serving
        .join()
        .map_err(|_| anyhow::anyhow!("the memory server thread panicked"))?;
    drop(advert);
    let st = &server.stats;
    let summary = json!({
        "listen": at,
        "seconds": t0.elapsed().as_secs_f64(),
        "connections": st.connections.load(Ordering::Relaxed),
        "pages_in": st.pages_in.load(Ordering::Relaxed),
        "pages_out": st.pages_out.load(Ordering::Relaxed),
        "refused": st.refused.load(Ordering::Relaxed),
        "accept_errors": st.accept_errors.load(Ordering::Relaxed),
        "held_pages": server.vms().iter().map(|(_, n)| n).sum::<u64>(),
        "vms": server.vms().into_iter().map(|(v, n)| json!({"vm": v, "pages": n})).collect::<Vec<_>>(),
    });
    if a.json {
        println!("{summary}");
    } else {
        eprintln!(
            "ferry memserver: stopped after {:.1} s: {} connections, {} pages in, {} pages out, {} still held",
            summary["seconds"].as_f64().unwrap_or(0.0),
            summary["connections"],
            summary["pages_in"],
            summary["pages_out"],
            summary["held_pages"],
        );
    }
    served?;
    Ok(ExitCode::SUCCESS)
}

/// `ferry hosts`.
#[derive(clap::Args)]
pub struct HostsArgs {
    /// The host registry: etcds://HOST:PORT (TLS), etcd://HOST:PORT, or dir:PATH; default: the
    /// embedded one on this machine.
    #[arg(long)]
    registry: Option<String>,
    /// Print JSON for machines.
    #[arg(long)]
    json: bool,
    /// With --json: an object of the hosts and the drains in progress
    /// (without: the list of hosts alone, as before).
    #[arg(long, requires = "json")]
    drains: bool,
}

/// Lists the hosts the registry knows, and the drains in progress.
pub fn hosts(a: HostsArgs) -> Result<ExitCode> {
    let registry = ferry_registry::open(
        a.registry.as_deref(),
        crate::security::credentials_for_registry(a.registry.as_deref())?,
    )?;
    let hosts = registry.hosts()?;
    let drains = ferry_fleet::drains(&*registry)?;
    let dead = ferry_fleet::Fleet::new(registry.clone(), None).dead_hosts()?;
    if a.json {
        if a.drains {
            let dead: Vec<_> = dead
                .iter()
                .map(|(n, a)| json!({"name": n, "addr": a}))
                .collect();
            println!(
                "{}",
                json!({"hosts": hosts, "drains": drains, "dead": dead})
            );
        } else {
            println!("{}", serde_json::to_string(&hosts)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    println!("registry {}: {} hosts", registry.describe(), hosts.len());
    if !hosts.is_empty() {
        println!(
            "{:<32} {:<10} {:<24} {:>10} {:>10}",
            "name", "kind", "address", "capacity", "free"
        );
    }
    for h in &hosts {
        println!(
            "{:<32} {:<10} {:<24} {:>10} {:>10}{}",
            h.name,
            h.kind.to_string(),
            h.addr,
            format::bytes(h.capacity as f64),
            format::bytes(h.free as f64),
            h.agent.as_ref().map_or(String::new(), |o| format!(
                "  {} VMs, {}/{} vCPUs free",
                o.vms, o.free_vcpus, o.vcpus
            ))
        );
    }
    for (name, addr) in &dead {
        println!(
            "{name:<32} {:<10} {addr:<24} DEAD: its agent holds no lease (the host is down, or its \
             agent stopped; VMs there may run on)",
            "agent"
        );
    }
    for d in &drains {
        let moving = d.moves.iter().filter(|m| !m.state.ended()).count();
        println!(
            "drain of {}: {} ({}), {} moves recorded, {moving} not ended",
            d.host,
            if d.stale() {
                "its process died; run it again to resume"
            } else {
                "running"
            },
            d.owner,
            d.moves.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
