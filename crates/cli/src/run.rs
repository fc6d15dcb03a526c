//! `ferry run`: boot the test guest with a workload, sample its metrics every
//! 10 ms, show a live line, and end with a summary.

use std::fs::File;
use std::io::{IsTerminal, LineWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ferry_vmm::boot::layout::parse_size;
use ferry_vmm::control::{ControlServer, HandoverSetup, VmControl};
use ferry_vmm::metrics::{rate, MetricsSnapshot};
use ferry_vmm::workload::WORKLOAD_HELP;
use ferry_vmm::{Vm, VmConfig, VmExit, WorkloadSet};
use serde_json::json;

use crate::format;

const SAMPLE_EVERY: Duration = Duration::from_millis(10);
const LIVE_EVERY: Duration = Duration::from_millis(500);

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("'{s}' is neither on nor off")),
    }
}

fn parse_mem(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 512M, 4G)"))
}

#[derive(clap::Args)]
#[command(after_help = WORKLOAD_HELP)]
pub struct RunArgs {
    /// Guest RAM (e.g. 512M, 4G).
    #[arg(long, default_value = "512M", value_parser = parse_mem)]
    mem: u64,
    /// Number of vCPUs (1-8).
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// What the guest runs (see below).
    #[arg(long, default_value = "idle")]
    workload: WorkloadSet,
    /// Stop after this long (e.g. 10s, 500ms). Without it, the run ends when every
    /// workload has finished, or at Ctrl-C / `ferry ctl SOCKET quit` for endless ones.
    #[arg(long, value_parser = format::parse_duration)]
    duration: Option<Duration>,
    /// Write the 10 ms metric samples here as JSON lines.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Give the VM a service port here (HOST:PORT, port 0 picks one). A kv
    /// workload gets 127.0.0.1 with any port when this is not given.
    #[arg(long)]
    serve: Option<std::net::SocketAddr>,
    /// The VM's own IPv4 address on this host's network (e.g. 10.77.0.100 in
    /// `ferry lab`): added to the interface whose subnet holds it, the
    /// service listens there (port from --serve, else any), and at a
    /// migration the address and every client connection move with the VM
    /// (TCP_REPAIR) and this VMM exits. Needs CAP_NET_ADMIN.
    #[arg(long)]
    vm_address: Option<std::net::Ipv4Addr>,
    /// Serve Prometheus metrics (migration progress named like KubeVirt's,
    /// and the guest's counters) at http://ADDR/metrics (port 0 picks one).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Incoming postcopy: how long to wait for the source to come back
    /// when the link breaks (e.g. 5m) before the VM is given up.
    #[arg(long, value_parser = format::parse_duration,
          default_value = "300s")]
    reconnect_timeout: Duration,
    /// Wait for a live migration on tcp:HOST:PORT (or unix:PATH, same host)
    /// instead of booting; the VM shape (--mem, --vcpus) must match the
    /// source's.
    #[arg(long)]
    incoming: Option<ferry_migration::Endpoint>,
    /// With --incoming: advertise this waiting VMM in the host registry
    /// (a main host `ferry migrate --mode split` can pick), until a VM
    /// arrives.
    #[arg(long, requires = "incoming")]
    advertise: bool,
    /// The host registry for --advertise: etcd://HOST:PORT or dir:PATH
    /// (default: this machine's).
    #[arg(long, requires = "advertise")]
    registry: Option<String>,
    /// With --advertise: guest memory offered to a split VM (default: all
    /// of --mem).
    #[arg(long, requires = "advertise", value_parser = parse_offer)]
    offer: Option<u64>,
    /// Control socket path (default: /tmp/ferry-<pid>.sock).
    #[arg(long)]
    control: Option<PathBuf>,
    /// Guest kernel ELF (default: the one built into ferry).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Allocate all guest RAM before the VM boots or the migration starts
    /// (like QEMU's -mem-prealloc): the first touch of host memory then
    /// happens outside the guest's and the migration's time.
    #[arg(long)]
    prealloc: bool,
    /// KVM asynchronous page faults for the guest: on, or off (the guest
    /// is not told of the feature, so a vCPU waits out every host fault).
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    apf: bool,
    /// Same as --apf off.
    #[arg(long, conflicts_with = "apf")]
    no_apf: bool,
    /// Access tracking period in ms (0 = off): every period, sampled
    /// userfaultfd minor faults (and with `--access-writes log`, KVM's
    /// dirty log) update each page's clock and aging history, which split
    /// migration ranks memory by (1000 is the paper's period). On by
    /// default: it costs a guest ~1-4% here (bench/results/access.md).
    /// Never on for --incoming.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    access_period: u64,
    /// Access tracking samples 1/N of the pages per period (each page
    /// every N periods).
    #[arg(long, default_value_t = 8, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    access_share: u32,
    /// Access tracking: pages one sampled fault answers for (a power of
    /// two up to 512): the fault maps that aligned group back and marks
    /// it read, so a task streaming through sampled memory faults once
    /// per group, not per page.
    #[arg(long, default_value_t = ferry_memory::DEFAULT_GRAIN_PAGES, value_name = "PAGES",
          value_parser = parse_grain)]
    access_grain: u64,
    /// Access tracking: where writes are seen. `sample`: the sampled
    /// faults alone (a write to an armed page raises one too); `log`: KVM's
    /// dirty log as well, every write in the sampled share (on this PVM
    /// host a logging memslot slows a writing guest by ~25%).
    #[arg(long, default_value = "sample", value_parser = ["sample", "log"], value_name = "FROM")]
    access_writes: String,
    /// Guest timer ticks per second.
    #[arg(long, default_value_t = 100)]
    tick_hz: u32,
    /// Seed for the workloads' random numbers.
    #[arg(long, default_value_t = 0x5eed_f0e1)]
    seed: u64,
    /// KVM device.
    #[arg(long, default_value = "/dev/kvm")]
    kvm: String,
    /// Print the summary as JSON on stdout (live line and guest console go to stderr).
    #[arg(long)]
    json: bool,
    /// Do not show the live line or guest console.
    #[arg(long, short)]
    quiet: bool,
    /// Take over a running VM from the VMM at the other end of this Unix
    /// socket (how `ferry handover` starts the new VMM; not for people).
    #[arg(long, hide = true)]
    adopt_fd: Option<i32>,
}

/// What the front end of a run passes to the next process at a handover,
/// so the run goes on there as it would have here.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Carried {
    json: bool,
    quiet: bool,
    timeline: Option<PathBuf>,
    duration_ms: Option<u64>,
    /// When the run's clock started (ms since the epoch).
    started_unix_ms: u64,
    /// The VM's own address (up on this host; the new process removes it
    /// when the VM leaves). Kept in the run's settings, not the handover
    /// protocol, so a ferry without the feature can still hand over.
    #[serde(default)]
    vm_address: Option<std::net::Ipv4Addr>,
    /// Access tracking (period ms, share); absent or 0: off.
    #[serde(default)]
    access_period_ms: u64,
    #[serde(default)]
    access_share: u32,
    /// 0 (an older ferry's run): the default grain.
    #[serde(default)]
    access_grain: u64,
    /// Writes from KVM's dirty log (--access-writes log).
    #[serde(default)]
    access_log_writes: bool,
}

/// The access tracking a run asks for.
fn access_config(
    period_ms: u64,
    share: u32,
    grain: u64,
    log_writes: bool,
) -> Option<ferry_vmm::access::AccessConfig> {
    (period_ms > 0).then(|| ferry_vmm::access::AccessConfig {
        period: Duration::from_millis(period_ms),
        share: share.max(1),
        grain: if grain == 0 {
            ferry_memory::DEFAULT_GRAIN_PAGES
        } else {
            grain
        },
        writes: if log_writes {
            ferry_vmm::access::WriteSource::Log
        } else {
            ferry_vmm::access::WriteSource::Sample
        },
    })
}

/// A power of two from 1 to 512 (pages).
fn parse_grain(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if ferry_memory::valid_grain(n) => Ok(n),
        _ => Err(format!("{s:?} is not a power of two from 1 to 512")),
    }
}

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

/// Why the run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
enum Ending {
    Migrated,
    Duration,
    WorkloadsDone,
    Interrupted,
    ControlQuit,
    GuestStopped,
    HandedOver,
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
        let got = ferry_vmm::exporter::serve(&vm, at)
            .with_context(|| format!("cannot serve metrics on {at}"))?;
        if !quiet {
            eprintln!("ferry: metrics at http://{got}/metrics");
        }
    }
    if args.prealloc {
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
    let received = match &args.incoming {
        None => {
            vm.start()?;
            None
        }
        Some(at) => {
            let incoming = ferry_vmm::migration::Incoming::listen(at)
                .context("cannot listen for the incoming migration")?;
            // Withdrawn (dropped) once a VM arrived.
            let _advert = if args.advertise {
                let registry = ferry_registry::open(args.registry.as_deref())?;
                let addr = incoming.endpoint().to_string();
                let addr = addr.strip_prefix("tcp:").unwrap_or(&addr).to_string();
                let offer = args.offer.unwrap_or(vm.config().mem_bytes);
                let entry = ferry_registry::HostEntry {
                    name: format!("vmm@{addr}"),
                    kind: ferry_registry::HostKind::Vmm,
                    addr,
                    capacity: offer,
                    free: offer,
                };
                Some(ferry_registry::Advertisement::start(
                    registry,
                    entry,
                    ferry_registry::DEFAULT_TTL,
                )?)
            } else {
                None
            };
            if !quiet {
                eprintln!(
                    "ferry: waiting for an incoming migration on {}",
                    incoming.endpoint()
                );
            }
            let got = match incoming.receive_with_reconnect(
                &vm,
                Duration::from_secs(30),
                args.reconnect_timeout,
            ) {
                Ok(got) => got,
                // After a postcopy switch a failure ends a VM that ran
                // here, whether or not pages were missing.
                Err(e) if vm.has_started() => {
                    return Err(anyhow::Error::new(e).context(
                        "incoming postcopy migration failed; the VM started here is stopped",
                    ))
                }
                Err(e) => {
                    return Err(anyhow::Error::new(e)
                        .context("incoming migration failed; no VM was started here"))
                }
            };
            if !quiet {
                eprintln!(
                    "ferry: migration received ({} pages, {} zero pages, {} rounds, {} verified); VM running",
                    got.pages, got.zero_pages, got.rounds, got.verified_pages
                );
                if let Some(f) = &got.postcopy {
                    eprintln!(
                        "ferry: postcopy faults {} ({} major, p50 {:.0} µs, p99 {:.0} µs; {} absorbed by async PF, {} stopped a vCPU)",
                        f.faults, f.major, f.latency_us.p50, f.latency_us.p99,
                        f.apf_absorbed.unwrap_or(0), f.blocked
                    );
                }
            }
            Some(got)
        }
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
    drive(&vm, &front, timeline, t_create, t_start, summary_extra)
}

/// The handover request's needs: this binary, the control socket, and
/// this run's settings for the next process.
fn offer_handover(
    control: &VmControl,
    server: &ControlServer,
    carried: &Arc<Mutex<Carried>>,
) -> Result<()> {
    let carried = carried.clone();
    control.set_handover(HandoverSetup {
        default_binary: std::env::current_exe().context("cannot find the ferry binary")?,
        control: Some(server.socket()),
        run: Box::new(move || {
            let c = carried.lock().unwrap_or_else(|e| e.into_inner());
            serde_json::to_string(&*c).unwrap_or_default()
        }),
    });
    Ok(())
}

/// `ferry run --adopt-fd N`: the new VMM of a handover.
fn adopt(fd: i32) -> Result<ExitCode> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: all-zero is a valid `struct stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on any integer only reads it (failing on a closed fd)
    // and writes the stat buffer we own.
    let is_open = fd >= 0 && unsafe { libc::fstat(fd, &mut st) } == 0;
    if !is_open || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        bail!("--adopt-fd {fd} is not an open socket (it is for `ferry handover`, which starts this process)");
    }
    // SAFETY: the descriptor is open (checked above) and this process owns
    // it from here: `ferry handover` passed it for this purpose alone.
    let sock = std::os::unix::net::UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let quiet = Arc::new(AtomicBool::new(true));
    let taken = ferry_vmm::handover::take_over(sock, Some(console_sink(quiet.clone())))
        .context("handover failed; the VM keeps running in the old VMM")?;
    let mut front: Carried = serde_json::from_str(&taken.run).unwrap_or_default();
    quiet.store(front.quiet, Ordering::Relaxed);
    let vm = taken.vm.clone();
    if let Some(access) = access_config(
        front.access_period_ms,
        front.access_share,
        front.access_grain,
        front.access_log_writes,
    ) {
        vm.start_access(access);
    }
    if let (Some(ip), Some(svc)) = (front.vm_address, vm.service()) {
        if let Err(e) = svc.keep_address(ip) {
            eprintln!("ferry: warning: the VM's address {ip} stays on this host, but its clients cannot move with it from this process: {e}");
        }
    }
    let control = Arc::new(VmControl::new(vm.clone()));
    // The VM runs here now: from here on a failure must not end it.
    let server = match taken.control {
        Some((path, listener)) => match ControlServer::adopt(listener, &path, control.clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("ferry: warning: the VM runs without its control socket: {e}");
                None
            }
        },
        None => None,
    };
    if !front.quiet {
        eprintln!(
            "ferry: took over the VM from pid {} ({:.2} ms downtime, {} client connections){}",
            taken.from_pid,
            taken.downtime_ms,
            taken.connections,
            server
                .as_ref()
                .map(|s| format!("; control socket {}", s.path().display()))
                .unwrap_or_default()
        );
    }
    let timeline = match &front.timeline {
        Some(p) => match std::fs::OpenOptions::new().append(true).open(p) {
            Ok(f) => Some(LineWriter::new(f)),
            Err(e) => {
                eprintln!(
                    "ferry: warning: cannot reopen timeline {}: {e}",
                    p.display()
                );
                None
            }
        },
        None => None,
    };
    // The run's clock goes on from where the old process started it.
    let ran = Duration::from_millis(unix_ms().saturating_sub(front.started_unix_ms));
    let t_start = Instant::now().checked_sub(ran).unwrap_or_else(Instant::now);
    if front.started_unix_ms == 0 {
        front.started_unix_ms = unix_ms();
    }
    let carried = Arc::new(Mutex::new(front.clone()));
    if let Some(s) = &server {
        if let Err(e) = offer_handover(&control, s, &carried) {
            eprintln!("ferry: warning: this VMM cannot hand the VM over again: {e:#}");
        }
    }
    let mut extra = serde_json::Map::new();
    extra.insert("incoming".into(), false.into());
    extra.insert(
        "handover".into(),
        serde_json::json!({
            "from_pid": taken.from_pid,
            "downtime_ms": taken.downtime_ms,
            "build_ms": taken.build_ms,
            "connections": taken.connections,
        }),
    );
    let code = drive(&vm, &front, timeline, Instant::now(), t_start, extra);
    drop(server);
    code
}

/// Samples the running VM until the run ends, then reports.
fn drive(
    vm: &Arc<Vm>,
    front: &Carried,
    mut timeline: Option<LineWriter<File>>,
    t_create: Instant,
    t_start: Instant,
    summary_extra: serde_json::Map<String, serde_json::Value>,
) -> Result<ExitCode> {
    let quiet = front.quiet;
    let duration = front.duration_ms.map(Duration::from_millis);
    // The next migration's timeline starts with the seconds before it.
    ferry_vmm::timeline::keep_history(vm);
    // Only now catch Ctrl-C / SIGTERM (to end with a summary): while an
    // incoming VMM waits for its migration, they simply end the process.
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())?;
    }
    let mut first: Option<MetricsSnapshot> = None;
    // Per workload: the first sample where it had made progress. Rates are
    // measured from there, so set-up (e.g. dirty touching its working set
    // once) does not dilute them.
    let nworkloads = vm.config().workloads.0.len();
    let mut started: Vec<Option<MetricsSnapshot>> = vec![None; nworkloads];
    let mut boot_ms = None;
    let mut last_live = Instant::now();
    let mut live_base: Option<MetricsSnapshot> = None;
    let mut next = Instant::now();
    let live = !quiet && std::io::stderr().is_terminal();
    let ending = loop {
        next += SAMPLE_EVERY;
        if let Some(exit) = vm.wait_exit(next.saturating_duration_since(Instant::now())) {
            break match exit {
                VmExit::Stopped if interrupted.load(Ordering::Relaxed) => Ending::Interrupted,
                VmExit::Stopped => Ending::ControlQuit,
                VmExit::Migrated { .. } => Ending::Migrated,
                VmExit::HandedOver { .. } => Ending::HandedOver,
                _ => Ending::GuestStopped,
            };
        }
        let snap = vm.metrics()?;
        if !snap.valid() {
            continue;
        }
        if first.is_none() {
            boot_ms = Some(t_create.elapsed().as_secs_f64() * 1e3);
            first = Some(snap.clone());
            live_base = Some(snap.clone());
        }
        for (i, s) in started.iter_mut().enumerate() {
            if s.is_none() && snap.progress(i) > 0 {
                *s = Some(snap.clone());
            }
        }
        if let Some(w) = timeline.as_mut() {
            write_sample(w, vm, &snap, t_start)?;
        }
        if live && last_live.elapsed() >= LIVE_EVERY {
            if let Some(base) = &live_base {
                eprint!("\r\x1b[2K{}", live_line(vm, base, &snap, t_start));
            }
            live_base = Some(snap.clone());
            last_live = Instant::now();
        }
        if interrupted.load(Ordering::Relaxed) {
            break Ending::Interrupted;
        }
        if duration.is_some_and(|d| t_start.elapsed() >= d) {
            break Ending::Duration;
        }
        let done =
            (0..vm.config().workloads.0.len()).all(|i| snap.tasks_done(i) >= snap.tasks_of(i));
        if duration.is_none() && vm.config().workloads.finishes() && done {
            break Ending::WorkloadsDone;
        }
    };
    // (Only then is the VM stopped here: a migrated VM's device still
    // forwards its clients below.)
    let handed_over = match ending {
        Ending::HandedOver => match vm.stop() {
            VmExit::HandedOver { pid } => Some(pid),
            _ => None,
        },
        _ => None,
    };
    if let Some(pid) = handed_over {
        // The run goes on in the new process (same stdout, same control
        // socket path); guest memory is its now, so nothing here reads it.
        if live {
            eprint!("\r\x1b[2K");
        }
        if !quiet {
            eprintln!(
                "ferry: the VM was handed over to VMM process {pid}, which carries on this run; this process exits"
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if let (Ending::Migrated, Some(svc)) = (ending, vm.service()) {
        let moved = svc.stats.moved_out.load(Ordering::Relaxed);
        if svc.redirected_to().is_none() && !quiet {
            eprintln!(
                "ferry: VM migrated with its clients ({moved} connections moved); this VMM exits"
            );
        }
        if let Some(to) = svc.redirected_to() {
            // Like a moved IP address: this host keeps the VM's service port and
            // forwards to the new host until the run's time is up (or Ctrl-C).
            if !quiet {
                eprintln!(
                    "ferry: VM migrated; forwarding its service port {} to {to}",
                    svc.local_addr()
                );
            }
            while !interrupted.load(Ordering::Relaxed)
                && duration.is_none_or(|d| t_start.elapsed() < d)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let ran = t_start.elapsed();
    let last = vm.metrics()?;
    let exit = vm.stop();
    if live {
        eprint!("\r\x1b[2K");
    }
    if let Some(mut w) = timeline {
        w.flush()?;
    }
    let mut summary = summary_json(vm, &started, &last, ending, &exit, boot_ms, ran);
    if let Some(obj) = summary.as_object_mut() {
        obj.extend(summary_extra);
    }
    if front.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(vm, &summary, &exit);
    }
    let failed = exit.is_error() || (0..vm.config().workloads.0.len()).any(|i| last.result(i) == 2);
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

fn write_sample(w: &mut impl Write, vm: &Vm, s: &MetricsSnapshot, t_start: Instant) -> Result<()> {
    let progress: Vec<u64> = (0..vm.config().workloads.0.len())
        .map(|i| s.progress(i))
        .collect();
    let c = s.cpu_totals();
    let line = json!({
        "t_ms": s.at.saturating_duration_since(t_start).as_secs_f64() * 1e3,
        "guest_ms": s.guest_ms(),
        "progress": progress,
        "apf_not_present": c.apf_not_present,
        "apf_ready": c.apf_ready,
        "apf_waiting": c.apf_waiting,
        "context_switches": c.context_switches,
        "idle_ms": c.idle_ms,
    });
    writeln!(w, "{line}")?;
    Ok(())
}

fn live_line(vm: &Vm, base: &MetricsSnapshot, now: &MetricsSnapshot, t_start: Instant) -> String {
    let mut parts = vec![format!("[{:6.1}s]", t_start.elapsed().as_secs_f64())];
    for (i, w) in vm.config().workloads.0.iter().enumerate() {
        let r = rate(base, now, base.progress(i), now.progress(i));
        let label = if w.name() == "dirty" {
            "dirty rate"
        } else {
            w.name()
        };
        let done = now.tasks_done(i);
        let tasks = now.tasks_of(i);
        if tasks > 0 && done == tasks {
            parts.push(format!("{} done", w.name()));
        } else if tasks > 0 {
            parts.push(format!("{label} {}", format::rate(r, w.unit())));
        }
    }
    let (a, b) = (base.cpu_totals(), now.cpu_totals());
    let span =
        now.at.saturating_duration_since(base.at).as_secs_f64() * 1e3 * vm.config().vcpus as f64;
    if span > 0.0 {
        parts.push(format!(
            "idle {:.0}%",
            100.0 * (b.idle_ms - a.idle_ms).max(0.0) / span
        ));
    }
    if b.apf_not_present > 0 {
        parts.push(format!(
            "APF {} ({} waiting)",
            b.apf_not_present, b.apf_waiting
        ));
    }
    parts.join(" | ")
}

fn summary_json(
    vm: &Vm,
    started: &[Option<MetricsSnapshot>],
    last: &MetricsSnapshot,
    ending: Ending,
    exit: &VmExit,
    boot_ms: Option<f64>,
    ran: Duration,
) -> serde_json::Value {
    let workloads: Vec<_> = vm
        .config()
        .workloads
        .0
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let r = started[i]
                .as_ref()
                .map_or(0.0, |f| rate(f, last, f.progress(i), last.progress(i)));
            let task_ms: Vec<Option<f64>> = last
                .tasks()
                .iter()
                .filter(|t| t.workload == i as u64 && t.end_tsc != 0)
                .map(|t| last.task_ms(t))
                .collect();
            json!({
                "spec": w.to_string(),
                "unit": w.unit(),
                "progress": last.progress(i),
                "rate_per_s": r,
                "tasks": last.tasks_of(i),
                "tasks_done": last.tasks_done(i),
                "result": match last.result(i) { 1 => "ok", 2 => "FAILED", _ => "" },
                "finished_task_ms": task_ms,
            })
        })
        .collect();
    json!({
        "vm": {
            "mem_bytes": vm.config().mem_bytes,
            "vcpus": vm.config().vcpus,
            "apf": vm.config().apf,
            "tick_hz": vm.config().tick_hz,
            "tsc_khz": vm.tsc_khz(),
        },
        "ending": ending,
        "exit": exit,
        "boot_to_first_sample_ms": boot_ms,
        "ran_s": ran.as_secs_f64(),
        "guest_ms": last.guest_ms(),
        "workloads": workloads,
        "kernel": last.cpu_totals(),
        "service": vm.service().map(|s| service_json(s)),
        "split": vm.pager_stats(),
        "access": vm.access().status(),
    })
}

fn parse_offer(s: &str) -> Result<u64, String> {
    ferry_vmm::boot::layout::parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64M)"))
}

fn service_json(s: &ferry_vmm::devices::service::ServiceDevice) -> serde_json::Value {
    let st = &s.stats;
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "address": s.local_addr().to_string(),
        "connections": n(&st.connections),
        "posted": n(&st.posted),
        "responses": n(&st.responses),
        "echoes": n(&st.echoes),
        "bad_frames": n(&st.bad_frames),
        "not_ready": n(&st.not_ready),
        "guest_errors": n(&st.guest_errors),
        "forwarded": n(&st.forwarded),
        "moved_out": n(&st.moved_out),
        "moved_in": n(&st.moved_in),
        "vm_address": s.vm_address().map(|a| a.to_string()),
        "redirected_to": s.redirected_to().map(|a| a.to_string()),
    })
}

fn print_summary(vm: &Vm, s: &serde_json::Value, exit: &VmExit) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    println!("── ferry run summary ─────────────────────────────────────────────");
    println!(
        "VM           {} RAM, {} vCPU(s), APF {}, tick {} Hz",
        format::bytes(vm.config().mem_bytes as f64),
        vm.config().vcpus,
        if vm.config().apf { "on" } else { "off" },
        vm.config().tick_hz
    );
    println!(
        "ended        {} after {:.2} s ({exit})",
        s["ending"].as_str().unwrap_or("?"),
        f(&s["ran_s"])
    );
    match s["boot_to_first_sample_ms"].as_f64() {
        Some(ms) if s["incoming"] == true => {
            println!("incoming     guest running {ms:.1} ms after VM creation (includes waiting for the source)")
        }
        Some(ms) => println!("boot         first guest metrics {ms:.1} ms after VM creation began"),
        None => println!("boot         the guest never published metrics"),
    }
    println!(
        "{:<44} {:>12} {:>16} {:>8}",
        "workload", "total", "rate", "tasks"
    );
    for w in s["workloads"].as_array().into_iter().flatten() {
        let unit = w["unit"].as_str().unwrap_or("");
        let tasks = format!("{}/{}", w["tasks_done"], w["tasks"]);
        println!(
            "{:<44} {:>12} {:>16} {:>8} {}",
            w["spec"].as_str().unwrap_or(""),
            format::amount(f(&w["progress"]), unit),
            format::rate(f(&w["rate_per_s"]), unit),
            tasks,
            w["result"].as_str().unwrap_or("")
        );
        let times: Vec<String> = w["finished_task_ms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_f64())
            .map(|t| format!("{t:.1}"))
            .collect();
        if !times.is_empty() {
            println!("{:<44} task times (ms): {}", "", times.join(" "));
        }
    }
    if let Some(svc) = s["service"].as_object() {
        println!(
            "service      {}: {} connections, {} requests to the guest, {} answered, {} echoes, {} bad frames",
            svc["address"].as_str().unwrap_or(""),
            svc["connections"], svc["posted"], svc["responses"], svc["echoes"], svc["bad_frames"]
        );
    }
    if let Some(line) = crate::status::access_line(&s["access"]) {
        println!("access       {line}");
    }
    let k = &s["kernel"];
    println!(
        "guest kernel ticks {}  switches {}  syscalls {}  idle {:.0} ms  APF not-present {} ready {} double {}",
        k["ticks"], k["context_switches"], k["syscalls"], f(&k["idle_ms"]),
        k["apf_not_present"], k["apf_ready"], k["apf_double"]
    );
}
