//! `ferry run`: boot the test guest with a workload, sample its metrics every
//! 10 ms, show a live line, and end with a summary.
//!
//! Split by what each part does: the flags (`args`), access tracking
//! (`access`), a destination's wait for its VM (`incoming`), the run loop
//! (`drive`) and its summary (`summary`), and handing the run to another
//! process (`handover`). This file sets the VM up and starts the loop.

mod access;
mod args;
mod destination;
mod drive;
mod front;
mod handover;
mod summary;

use std::fs::File;
use std::io::LineWriter;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ferry_vmm::control::{ControlServer, VmControl};
use ferry_vmm::{Vm, VmConfig};

use crate::format;
use access::access_config;
use args::Prealloc;
pub use args::RunArgs;
use drive::drive;
use front::Carried;
use handover::{adopt, offer_handover};

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The guest console: printed unless quiet (which a taken-over VM learns
/// only with the offer, after its console exists).
fn console_sink(quiet: Arc<AtomicBool>) -> ferry_vmm::devices::serial::ConsoleSink {
    Arc::new(move |line: &str| {
        if !quiet.load(Ordering::Relaxed) {
            eprintln!("guest> {line}")
        }
    })
}

pub fn run(args: RunArgs) -> Result<ExitCode> {
    if let Some(fd) = args.adopt_fd {
        return adopt(fd);
    }
    let quiet = args.quiet;
    let mut config = VmConfig::new(args.mem, args.vcpus, args.workload.clone());
    config.kernel = args.kernel.clone();
    config.apf = args.apf && !args.no_apf;
    config.tick_hz = args.tick_hz;
    config.seed = args.seed;
    config.kvm_path = args.kvm.clone();
    config.console = (!quiet).then(|| console_sink(Arc::new(AtomicBool::new(false))));
    config.serve = args.serve;
    config.vm_address = args.vm_address;
    config.disks = args.disks.clone();
    if args.incoming.is_some() {
        use ferry_vmm::devices::block::DiskSource;
        if let Some(d) = args
            .disks
            .iter()
            .find(|d| matches!(d.source, DiskSource::Image(_)))
        {
            let DiskSource::Image(path) = &d.source else {
                unreachable!()
            };
            bail!(
                "--incoming with --disk {}: a VMM waiting for a migration takes only the source's disks on shared storage (nbd://…, the same exports); a local image cannot move yet (docs/disks.md)",
                path.display()
            );
        }
    }
    // An incoming VM's RAM is under the migration's userfaultfd.
    if args.incoming.is_none() {
        config.access = access_config(
            args.access_period,
            args.access_share,
            args.access_grain,
            args.access_writes == "log",
        );
    }
    if let (Some(ip), Some(serve)) = (args.vm_address, args.serve) {
        if !serve.ip().is_unspecified() && serve.ip() != std::net::IpAddr::V4(ip) {
            bail!("--serve {serve} and --vm-address {ip}: the service listens on the VM's address; give --serve {ip}:PORT or 0.0.0.0:PORT");
        }
    }

    let t_create = Instant::now();
    let vm = Arc::new(Vm::create(config).context("cannot create the VM")?);
    let socket = args
        .control
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/ferry-{}.sock", std::process::id())));
    let control = Arc::new(VmControl::new(vm.clone()));
    let server = ControlServer::start(&socket, control.clone())?;
    // Appending (after creating it empty): a process that takes the VM
    // over appends too, and neither overwrites the other's lines.
    let timeline = match &args.timeline {
        Some(p) => {
            let opened =
                File::create(p).and_then(|_| std::fs::OpenOptions::new().append(true).open(p));
            Some(LineWriter::new(opened.with_context(|| {
                format!("cannot create timeline {}", p.display())
            })?))
        }
        None => None,
    };
    let carried = Arc::new(Mutex::new(Carried {
        json: args.json,
        quiet,
        timeline: args
            .timeline
            .as_ref()
            .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())),
        duration_ms: args.duration.map(|d| d.as_millis() as u64),
        started_unix_ms: 0,
        vm_address: args.vm_address,
        access_period_ms: args.access_period,
        access_share: args.access_share,
        access_grain: args.access_grain,
        access_log_writes: args.access_writes == "log",
    }));
    if !quiet {
        eprintln!(
            "ferry: VM with {} RAM, {} vCPU(s), workload {}; control socket {}",
            format::bytes(args.mem as f64),
            args.vcpus,
            args.workload,
            socket.display()
        );
        if let Some(s) = vm.service() {
            eprintln!("ferry: service device listening on {}", s.local_addr());
        }
    }

    if let Some(at) = args.metrics {
        let tls = crate::security::credentials_for_metrics(at)?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let got = ferry_vmm::exporter::serve(&vm, at, tls)
            .with_context(|| format!("cannot serve metrics on {at}"))?;
        if !quiet {
            eprintln!("ferry: metrics at {scheme}://{got}/metrics");
        }
    }
    if args.share_pages {
        let dir = ferry_vmm::share::default_dir();
        vm.share_pages(&dir)
            .with_context(|| format!("cannot share pages through {}", dir.display()))?;
    }
    if args.prealloc == Prealloc::Waiting && args.incoming.is_some() {
        vm.prealloc_in_background();
    }
    if args.prealloc == Prealloc::Now {
        let t = Instant::now();
        vm.prealloc().context("cannot preallocate guest RAM")?;
        if !quiet {
            eprintln!(
                "ferry: preallocated {} of guest RAM in {:.2} s",
                format::bytes(args.mem as f64),
                t.elapsed().as_secs_f64()
            );
        }
    }
    let owner = fence(&vm, &args)?;
    let received = match &args.incoming {
        None => {
            vm.start()?;
            None
        }
        Some(at) => Some(destination::receive(&vm, at, &args, quiet)?),
    };
    // Only a VM whose memory is all here can be handed over: not while an
    // incoming migration (a postcopy's pages still arriving) runs.
    offer_handover(&control, &server, &carried)?;
    let t_start = Instant::now();
    carried
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .started_unix_ms = unix_ms();
    let front = carried.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut summary_extra = serde_json::Map::new();
    summary_extra.insert("incoming".into(), args.incoming.is_some().into());
    if let Some(got) = &received {
        summary_extra.insert("received".into(), serde_json::to_value(got)?);
    }
    let ended = drive(&vm, &front, timeline, t_create, t_start, summary_extra);
    if let Some(o) = owner {
        // Stopped here (not moved away): nobody runs it now.
        o.release();
    }
    ended
}

/// Fences the VM through the registry (`--vm-name`, `--fenced`): a fresh
/// VM takes its name's epoch now, before its first instruction, or the run
/// ends saying who holds it.
fn fence(vm: &Arc<Vm>, args: &RunArgs) -> Result<Option<Arc<ferry_vmm::owner::Owner>>> {
    if args.vm_name.is_none() && !args.fenced {
        if args.registry.is_some() && !args.advertise {
            bail!("--registry is for --advertise, --vm-name or --fenced");
        }
        return Ok(None);
    }
    let registry = ferry_registry::open(
        args.registry.as_deref(),
        crate::security::credentials_for_registry(args.registry.as_deref())?,
    )?;
    let owner = ferry_vmm::owner::Owner::new(registry.clone(), &ferry_vmm::owner::host_name(), vm);
    vm.set_owner(owner.clone());
    if let Some(name) = &args.vm_name {
        let claim = owner
            .boot(name)
            .with_context(|| format!("cannot take VM {name} in {}", registry.describe()))?;
        tracing::info!(vm = %name, epoch = claim.epoch, "holds the VM");
    }
    Ok(Some(owner))
}
