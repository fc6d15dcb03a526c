//! The new VMM's side (`ferry run --adopt-fd N`): builds the VM around the
//! memory it is handed, restores the state, and runs it at `Go`.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::{GuestMemory, MemfdRegion};

use super::wire::{self, Hello, Message};
use super::{cpu_secs, monotonic_ns, stall_before, HandoverError};
use crate::devices::serial::ConsoleSink;
use crate::devices::service::FrozenConn;
use crate::vm::{Vm, VmConfig, VmState};
use ferry_migration::priority::Urgent;

/// How long to wait for the old process's next message.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// A VM this process took over, running.
pub struct TakenOver {
    /// The VM.
    pub vm: Arc<Vm>,
    /// The control socket's path and listener, to serve from here on.
    pub control: Option<(PathBuf, UnixListener)>,
    /// The old front end's settings (JSON text).
    pub run: String,
    /// The process that ran it before.
    pub from_pid: u32,
    /// Its vCPUs' pause there to their resume here (ms).
    pub downtime_ms: f64,
    /// Building the VM here, before the pause (ms).
    pub build_ms: f64,
    /// Client connections taken over.
    pub connections: usize,
}

/// What arrived with the offer.
struct Offered {
    vm: Vm,
    control: Option<(PathBuf, UnixListener)>,
    run: String,
    from_pid: u32,
}

/// Takes over the VM offered on `sock`. Before `Go` any failure is told to
/// the old process (which keeps running the VM) and nothing here ran the
/// guest; after it the VM runs here.
pub fn take_over(
    sock: UnixStream,
    console: Option<ConsoleSink>,
    open_registry: &OpenRegistry,
) -> Result<TakenOver, HandoverError> {
    let mut sock = sock;
    sock.write_all(
        &Hello {
            version: wire::VERSION,
            pid: std::process::id(),
        }
        .encode(),
    )
    .map_err(HandoverError::from_io)?;
    sock.set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(HandoverError::Io)?;
    let t = Instant::now();
    let offered = match receive_offer(&mut sock, console) {
        Ok(o) => o,
        Err(e) => return Err(refuse(&mut sock, e)),
    };
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    stall_before("ready");
    wire::send(&mut sock, &Message::Ready { build_ms }, &[])?;

    let vm = Arc::new(offered.vm);
    // From here to the resume the VM is paused or about to be: each
    // wakeup on this thread is downtime.
    let mut urgent = Urgent::enter(super::HANDOVER_PRIORITY);
    let ready = restore(&mut sock, &vm, &mut urgent);
    let (adopted, paused_at) = match ready {
        Ok(r) => r,
        Err(e) => {
            // Connections registered here are still the old process's.
            if let Some(s) = vm.service() {
                s.hand_off();
            }
            return Err(refuse(&mut sock, e));
        }
    };
    stall_before("restored");
    let go = wire::send(&mut sock, &Message::Restored, &[])
        .and_then(|_| await_go(&mut sock, &vm, open_registry));
    let claim = match go {
        Ok(claim) => claim,
        Err(e) => {
            if let Some(s) = vm.service() {
                s.hand_off();
            }
            return Err(e);
        }
    };
    // Committed: the VM is ours, once the registry says so (fenced).
    if let Err(e) = take_ownership(&vm, claim.as_deref()) {
        if let Some(s) = vm.service() {
            s.hand_off();
        }
        let _ = wire::send(
            &mut sock,
            &Message::Abort {
                reason: e.to_string(),
            },
            &[],
        );
        return Err(e);
    }
    vm.resume()?;
    let resumed_at = monotonic_ns();
    drop(urgent);
    let mut connections = 0;
    let mut serving_at = 0;
    if let Some(s) = vm.service() {
        s.release();
        if let Some(a) = adopted {
            connections = a.len();
            a.serve(s);
        }
        serving_at = monotonic_ns();
    }
    // The old process waits for this only to report; the VM runs here
    // whether or not it arrives.
    let _ = wire::send(
        &mut sock,
        &Message::Running {
            resumed_at_ns: resumed_at,
            serving_at_ns: serving_at,
            cpu_s: cpu_secs(libc::CLOCK_PROCESS_CPUTIME_ID),
        },
        &[],
    );
    Ok(TakenOver {
        vm,
        control: offered.control,
        run: offered.run,
        from_pid: offered.from_pid,
        downtime_ms: resumed_at.saturating_sub(paused_at) as f64 / 1e6,
        build_ms,
        connections,
    })
}

/// Opens a registry by its address (the CLI's, with this host's
/// credentials for `etcds://`).
pub type OpenRegistry = dyn Fn(&str) -> Result<Arc<dyn ferry_registry::Registry>, String>;

/// Waits for Go; a fenced VM's claim (Owner) comes first, and the VM is
/// fenced here through the same registry. Returns the claim.
fn await_go(
    sock: &mut UnixStream,
    vm: &Arc<Vm>,
    open_registry: &OpenRegistry,
) -> Result<Option<Vec<u8>>, HandoverError> {
    let mut claim = None;
    loop {
        match wire::recv(sock, 0)?.0 {
            Message::Go => return Ok(claim),
            Message::Owner { registry, claim: c } if claim.is_none() => {
                let reg = open_registry(&registry).map_err(HandoverError::Fenced)?;
                let owner = crate::owner::Owner::new(reg, &crate::owner::host_name(), vm);
                vm.set_owner(owner.clone());
                {
                    use ferry_migration::OwnerFence;
                    // Refused now, before Go, if the claim is stale; and
                    // the take-over at Go is one compare-and-swap.
                    owner.expect(&c).map_err(HandoverError::Fenced)?;
                }
                claim = Some(c);
            }
            Message::Abort { reason } => return Err(HandoverError::Aborted(reason)),
            m => {
                return Err(HandoverError::Protocol(format!(
                    "expected Go, got {}",
                    m.name()
                )))
            }
        }
    }
}

/// Takes the VM from the old process's claim (a fenced VM) before its
/// vCPUs run here.
fn take_ownership(vm: &Vm, claim: Option<&[u8]>) -> Result<(), HandoverError> {
    use ferry_migration::OwnerFence;
    let (Some(owner), Some(claim)) = (vm.owner(), claim) else {
        return Ok(());
    };
    owner
        .take_over(claim)
        .map(|held| tracing::info!(%held, "took the VM's ownership"))
        .map_err(HandoverError::Fenced)
}

/// Tells the old process why this one gives up; returns the error.
fn refuse(sock: &mut UnixStream, e: HandoverError) -> HandoverError {
    let _ = wire::send(
        sock,
        &Message::Abort {
            reason: format!("the new VMM (pid {}): {e}", std::process::id()),
        },
        &[],
    );
    e
}

/// The offer: maps the memory and builds the VM around it.
fn receive_offer(
    sock: &mut UnixStream,
    console: Option<ConsoleSink>,
) -> Result<Offered, HandoverError> {
    let (msg, fds, disks) = wire::recv_with_disks(sock, ferry_migration::transport::fds::MAX_FDS)?;
    let Message::Offer {
        shape,
        regions,
        service,
        control,
        run,
        from_pid,
    } = msg
    else {
        return Err(HandoverError::Protocol(format!(
            "expected Offer, got {}",
            msg.name()
        )));
    };
    let want = regions.len() + service as usize + control.is_some() as usize;
    if fds.len() != want {
        return Err(HandoverError::Protocol(format!(
            "the offer carries {} descriptors, its fields call for {want}",
            fds.len()
        )));
    }
    let mut fds = fds.into_iter();
    let mut mapped = Vec::new();
    for (i, &(gpa, size)) in regions.iter().enumerate() {
        let fd: OwnedFd = fds.next().ok_or(HandoverError::Closed(String::new()))?;
        mapped.push(
            MemfdRegion::from_fd(&format!("ferry-ram{i}"), gpa, size, fd)
                .map_err(|e| HandoverError::Memory(e.to_string()))?,
        );
    }
    let memory = Arc::new(
        GuestMemory::from_regions(mapped).map_err(|e| HandoverError::Memory(e.to_string()))?,
    );
    let service_listener = match service {
        true => fds.next().map(std::net::TcpListener::from),
        false => None,
    };
    let control = control
        .zip(fds.next())
        .map(|(path, fd)| (PathBuf::from(path), UnixListener::from(fd)));
    let workloads = shape.workloads.parse().map_err(|e| {
        HandoverError::Protocol(format!("workload '{}' unknown here: {e}", shape.workloads))
    })?;
    let mut config = VmConfig::new(shape.mem_bytes, shape.vcpus, workloads);
    config.kernel = shape.kernel.map(PathBuf::from);
    config.apf = shape.apf;
    config.tick_hz = shape.tick_hz;
    config.seed = shape.seed;
    config.kvm_path = shape.kvm_path;
    config.console = console;
    config.disks = disks;
    let vm = Vm::build_adopting(config, memory, service_listener)?;
    Ok(Offered {
        vm,
        control,
        run,
        from_pid,
    })
}

/// The client connections and the state: restores them, registers the
/// clients, and starts the vCPU threads parked. Returns the connections
/// to serve at `Go` and when the old process paused the VM.
fn restore(
    sock: &mut UnixStream,
    vm: &Vm,
    urgent: &mut Urgent,
) -> Result<(Option<crate::devices::service::AdoptedConns>, u64), HandoverError> {
    let mut conns = Vec::new();
    let (state, paused_at, hashes) = loop {
        let (msg, fds, _) = wire::recv(sock, wire::CONNS_PER_MESSAGE)?;
        match msg {
            Message::Conns { conns: list } => {
                if list.len() != fds.len() {
                    return Err(HandoverError::Protocol(format!(
                        "{} connections with {} sockets",
                        list.len(),
                        fds.len()
                    )));
                }
                for ((id, pending), fd) in list.into_iter().zip(fds) {
                    conns.push(FrozenConn {
                        id,
                        stream: TcpStream::from(fd),
                        pending,
                    });
                }
            }
            Message::State {
                state,
                paused_at_ns,
                hashes,
            } => break (state, paused_at_ns, hashes),
            Message::Abort { reason } => return Err(HandoverError::Aborted(reason)),
            m => {
                return Err(HandoverError::Protocol(format!(
                    "expected Conns or State, got {}",
                    m.name()
                )))
            }
        }
    };
    if let Some(theirs) = hashes {
        // Hashing all of memory must not hold a core at real time.
        urgent.relax();
        compare(vm, &theirs)?;
    }
    let state = VmState::decode(&state)?;
    vm.restore_state(&state)?;
    let adopted = match vm.service() {
        Some(s) => Some(s.adopt_connections(conns)?),
        None if conns.is_empty() => None,
        None => {
            return Err(HandoverError::Protocol(
                "client connections offered to a VM without a service device".into(),
            ))
        }
    };
    vm.start_paused()?;
    Ok((adopted, paused_at))
}

/// `--verify`: this process's view of guest memory against the old one's.
fn compare(vm: &Vm, theirs: &[u64]) -> Result<(), HandoverError> {
    let regions = crate::migration::views(vm);
    ferry_migration::compare_page_hashes(
        &regions,
        &ferry_migration::memory_hashes(&regions, |i| crate::migration::data_ranges(vm, i)),
        theirs.iter().copied(),
    )
    .map(|_| ())
    .map_err(|m| HandoverError::Verify {
        bad: m.bad,
        total: m.total,
        first: m.first,
    })
}
