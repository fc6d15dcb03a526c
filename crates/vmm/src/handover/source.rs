//! The old VMM's side: starts the new process, offers it the memory and
//! listeners, pauses, sends the state, and lets go at `Go`.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, Hello, Message, VmShape, CONNS_PER_MESSAGE};
use super::MovingListener;
use super::{cpu_secs, memory_hashes, monotonic_ns, HandoverError, HandoverStats};
use crate::vm::{RunState, Vm};
use ferry_migration::priority::Urgent;

/// How long the new process may take to start and say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long it may take to build the VM around the memory (not downtime).
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long service readers may take to stop between frames, and clients
/// to take the answers already given (the VM is running, or just paused).
const SERVICE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long it may take to restore the state (the VM is paused meanwhile).
const RESTORE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a message may take to be taken by the new process.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long it may take to confirm it runs the VM after `Go`.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(10);

/// What to hand over to, and what goes with the VM.
pub struct HandoverPlan {
    /// The ferry binary the new process runs.
    pub binary: PathBuf,
    /// The control socket whose path moves to the new process.
    pub control: Option<Arc<dyn MovingListener>>,
    /// The old front end's settings for the new one (JSON text).
    pub run: String,
    /// Compare per-page hashes of guest memory in both processes.
    pub verify: bool,
}

/// The new process and the socket to it.
struct Peer {
    child: Child,
    sock: UnixStream,
    bytes: u64,
}

impl Peer {
    /// Starts `binary run --adopt-fd N`, N being its end of a socket pair.
    fn spawn(binary: &PathBuf) -> Result<Peer, HandoverError> {
        let io = |source| HandoverError::Spawn {
            binary: binary.display().to_string(),
            source,
        };
        let (sock, theirs) = UnixStream::pair().map_err(io)?;
        // The child's end must survive exec (socket pairs are close-on-exec).
        // SAFETY: F_SETFD on a descriptor we own; the result is checked.
        if unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_SETFD, 0) } < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        let child = Command::new(binary)
            .arg("run")
            .arg("--adopt-fd")
            .arg(theirs.as_raw_fd().to_string())
            .stdin(Stdio::null())
            .spawn()
            .map_err(io)?;
        drop(theirs);
        Ok(Peer {
            child,
            sock,
            bytes: 0,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, if it did (waiting up to a second for it: its
    /// socket closes as it exits, and on a busy host the exit itself can
    /// take a few hundred ms more to be seen).
    fn exit_note(&mut self) -> String {
        for _ in 0..100 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return format!(" (it exited: {status})");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        String::new()
    }

    fn timed<T>(
        &mut self,
        step: &'static str,
        timeout: Duration,
        f: impl FnOnce(&mut UnixStream) -> Result<T, HandoverError>,
    ) -> Result<T, HandoverError> {
        self.sock
            .set_read_timeout(Some(timeout))
            .and_then(|_| self.sock.set_write_timeout(Some(timeout)))
            .map_err(HandoverError::Io)?;
        match f(&mut self.sock) {
            Err(HandoverError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(HandoverError::TimedOut { step, timeout })
            }
            Err(HandoverError::Closed(_)) => Err(HandoverError::Closed(self.exit_note())),
            other => other,
        }
    }

    fn hello(&mut self) -> Result<Hello, HandoverError> {
        let hello = self.timed("start and say hello", HELLO_TIMEOUT, Hello::read)?;
        self.bytes += 16;
        Ok(hello)
    }

    /// The next message, which must be `want`.
    fn expect(
        &mut self,
        want: &'static str,
        step: &'static str,
        timeout: Duration,
    ) -> Result<Message, HandoverError> {
        let (msg, _, n) = self.timed(step, timeout, |s| wire::recv(s, 0))?;
        self.bytes += n;
        match msg {
            Message::Abort { reason } => Err(HandoverError::Aborted(reason)),
            m if m.name() == want => Ok(m),
            m => Err(HandoverError::Protocol(format!(
                "expected {want}, got {}",
                m.name()
            ))),
        }
    }

    /// Sends within SEND_TIMEOUT: a new process that stops reading must
    /// not keep the VM paused.
    fn send(&mut self, msg: &Message, fds: &[BorrowedFd<'_>]) -> Result<(), HandoverError> {
        self.send_with_disks(msg, fds, &[])
    }

    /// [`send`](Self::send), with the VM's disks after the message.
    fn send_with_disks(
        &mut self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
        disks: &[String],
    ) -> Result<(), HandoverError> {
        let _ = self.sock.set_write_timeout(Some(SEND_TIMEOUT));
        self.bytes +=
            wire::send_with_disks(&mut self.sock, msg, fds, disks).map_err(|e| match e {
                HandoverError::Io(io) if io.kind() == std::io::ErrorKind::WouldBlock => {
                    HandoverError::TimedOut {
                        step: "take a message",
                        timeout: SEND_TIMEOUT,
                    }
                }
                e => e,
            })?;
        Ok(())
    }

    /// Tells the new process why it is no longer wanted and ends it.
    fn abandon(&mut self, why: &HandoverError) {
        let _ = self
            .sock
            .set_write_timeout(Some(Duration::from_millis(100)));
        let _ = wire::send(
            &mut self.sock,
            &Message::Abort {
                reason: why.to_string(),
            },
            &[],
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long the pause waits for the disks' requests in flight.
const DISK_SETTLE: Duration = Duration::from_secs(5);

/// Hands `vm` over to a new VMM process; on success the VM runs there and
/// this process must let it go ([`Vm::finish_handed_over`]). On an error
/// before the commit point the VM runs here as before; after it
/// ([`HandoverError::InDoubt`]) it never runs here again.
pub fn hand_over(
    vm: &Vm,
    plan: &HandoverPlan,
    progress: &mut dyn FnMut(&str),
) -> Result<HandoverStats, HandoverError> {
    if !vm.has_started() || vm.run_state() != RunState::Running {
        return Err(HandoverError::NotNow(format!(
            "it is {} (only a running VM moves; resume it first)",
            match vm.run_state() {
                _ if !vm.has_started() => "not started",
                RunState::Paused => "paused",
                RunState::Stopped => "stopped",
                RunState::Running => "running",
            }
        )));
    }
    let t0 = Instant::now();
    let cpu0 = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID);
    let mut peer = Peer::spawn(&plan.binary)?;
    progress(&format!(
        "started {} as pid {}",
        plan.binary.display(),
        peer.pid()
    ));
    let mut stats = HandoverStats {
        new_pid: peer.pid(),
        binary: plan.binary.display().to_string(),
        guest_memory_bytes: vm.memory().total_size(),
        ..Default::default()
    };
    if let Err(e) = offer(vm, plan, &mut peer, &mut stats) {
        peer.abandon(&e);
        return Err(e);
    }
    progress(&format!(
        "the new VMM built the VM around its memory in {:.1} ms",
        stats.build_ms
    ));

    // From here the VM pauses; any failure before Go resumes it here.
    // Each wakeup of this thread until Running is downtime (a --verify
    // handover hashes all of memory meanwhile: not at real time).
    let urgent = (!plan.verify).then(|| Urgent::enter(super::HANDOVER_PRIORITY));
    let service = vm.service();
    let frozen_at = monotonic_ns();
    if let Some(s) = service {
        if let Err(e) = s.freeze(SERVICE_TIMEOUT) {
            s.release();
            let e = HandoverError::from(e);
            peer.abandon(&e);
            return Err(e);
        }
    }
    if let Some(c) = &plan.control {
        c.hold_clients();
    }
    // With --verify the new process hashes all of memory first.
    let restore_timeout = match plan.verify {
        true => RESTORE_TIMEOUT + Duration::from_secs(2 * (vm.memory().total_size() >> 30).max(1)),
        false => RESTORE_TIMEOUT,
    };
    let paused_at = monotonic_ns();
    let sent = send_state(vm, plan.verify, &mut peer, &mut stats, paused_at).and_then(|_| {
        let t = Instant::now();
        let restored = peer.expect("Restored", "restore the VM state", restore_timeout);
        stats.restore_ms = t.elapsed().as_secs_f64() * 1e3;
        restored
    });
    if let Err(e) = sent {
        peer.abandon(&e);
        give_back_here(vm, plan);
        return Err(e);
    }

    // A fenced VM: the new process takes it from this claim at Go, before
    // its vCPUs run; until the registry says it did, the VM stays this
    // process's to take back.
    let fence = vm.owner().and_then(|o| o.fence().cloned());
    if let Some(f) = &fence {
        let sent = owner_message(vm).and_then(|m| peer.send(&m, &[]));
        if let Err(e) = sent {
            peer.abandon(&e);
            give_back_here(vm, plan);
            return Err(e);
        }
        f.completing();
    }
    // The commit point: from Go on the VM belongs to the new process, and
    // so do the clients and the control socket's path, at once. A fenced
    // VM's are let go once the new process runs it (or holds it, by the
    // registry): a take-back needs them here.
    let go = peer.send(&Message::Go, &[]);
    if fence.is_none() {
        let_go(vm, plan);
    }
    let committed =
        go.and_then(|_| peer.expect("Running", "confirm it runs the VM", RUNNING_TIMEOUT));
    let committed = match (committed, &fence) {
        (Ok(m), Some(f)) => {
            f.handed();
            let_go(vm, plan);
            Ok(m)
        }
        (Err(e), Some(f)) => Err(settle_by_registry(vm, plan, f, &mut peer, stats.new_pid, e)),
        (r, None) => r.map_err(|e| HandoverError::InDoubt {
            pid: stats.new_pid,
            reason: e.to_string(),
        }),
    };
    let Message::Running {
        resumed_at_ns,
        serving_at_ns,
        cpu_s,
    } = committed?
    else {
        unreachable!("expect() returns the message asked for");
    };
    drop(urgent);
    stats.total_ms = t0.elapsed().as_secs_f64() * 1e3;
    stats.downtime_ms = resumed_at_ns.saturating_sub(paused_at) as f64 / 1e6;
    if service.is_some() {
        stats.service_pause_ms = serving_at_ns.saturating_sub(frozen_at) as f64 / 1e6;
    }
    stats.socket_bytes = peer.bytes;
    stats.source_cpu_s = cpu_secs(libc::CLOCK_THREAD_CPUTIME_ID) - cpu0;
    stats.destination_cpu_s = cpu_s;
    progress(&format!(
        "the VM runs in pid {} ({:.2} ms downtime)",
        stats.new_pid, stats.downtime_ms
    ));
    Ok(stats)
}

/// The clients and the control socket's path go to the new process.
fn let_go(vm: &Vm, plan: &HandoverPlan) {
    if let Some(s) = vm.service() {
        s.hand_off();
    }
    if let Some(c) = &plan.control {
        c.retire();
    }
}

/// A handover that failed before the VM left: it runs here again, with its
/// clients and control socket.
fn give_back_here(vm: &Vm, plan: &HandoverPlan) {
    let service = vm.service();
    if let Some(s) = service {
        s.thaw();
    }
    // Resumes only if this process paused it (pause may have failed and
    // resumed it already); the service device is released either way.
    let _ = vm.resume();
    if let Some(s) = service {
        s.release();
    }
    if let Some(c) = &plan.control {
        c.accept_again();
    }
}

/// The claim the new process takes the VM from, and where.
fn owner_message(vm: &Vm) -> Result<Message, HandoverError> {
    use ferry_migration::OwnerFence;
    let owner = vm
        .owner()
        .ok_or_else(|| HandoverError::Fenced("the VM is not fenced".into()))?;
    let claim = owner
        .claim()
        .ok_or_else(|| HandoverError::Fenced("this process does not hold the VM".into()))?;
    Ok(Message::Owner {
        registry: owner.registry(),
        claim,
    })
}

/// After Go the new process did not confirm it runs a fenced VM: the
/// registry says who holds it. Never taken: the new process is ended and
/// the VM runs here again. Taken: it is the new process's (gone or not),
/// never again this one's. No answer: in doubt, the fence's keeper goes on
/// asking and resumes the VM if the answer is "never taken".
fn settle_by_registry(
    vm: &Vm,
    plan: &HandoverPlan,
    fence: &ferry_registry::ownership::Fence,
    peer: &mut Peer,
    pid: u32,
    e: HandoverError,
) -> HandoverError {
    use ferry_registry::ownership::TakeBack;
    match fence.take_back(crate::owner::TAKE_BACK_PATIENCE) {
        TakeBack::Back(_) => {
            peer.abandon(&e);
            give_back_here(vm, plan);
            HandoverError::TakenBack(e.to_string())
        }
        TakeBack::Gone(rec) => {
            let_go(vm, plan);
            HandoverError::InDoubt {
                pid,
                reason: format!(
                    "{e}; the registry says it holds the VM ({})",
                    rec.map(|r| r.describe())
                        .unwrap_or_else(|| "no record".into())
                ),
            }
        }
        TakeBack::Unknown(why) => HandoverError::InDoubt {
            pid,
            reason: format!(
                "{e}; and the registry did not answer ({why}): the VM stays paused here and \
                 resumes by itself if the registry says the new VMM never took it"
            ),
        },
    }
}

/// Hello, Offer (memory and listeners), Ready.
fn offer(
    vm: &Vm,
    plan: &HandoverPlan,
    peer: &mut Peer,
    stats: &mut HandoverStats,
) -> Result<(), HandoverError> {
    let hello = peer.hello()?;
    if hello.version != wire::VERSION {
        return Err(HandoverError::Version {
            theirs: hello.version,
            ours: wire::VERSION,
        });
    }
    let c = vm.config();
    let shape = VmShape {
        mem_bytes: c.mem_bytes,
        vcpus: c.vcpus,
        workloads: c.workloads.to_string(),
        kernel: c.kernel.as_ref().map(|p| p.display().to_string()),
        apf: c.apf,
        tick_hz: c.tick_hz,
        seed: c.seed,
        kvm_path: c.kvm_path.clone(),
    };
    let service_listener = match vm.service() {
        Some(s) => Some(s.listener().map_err(HandoverError::Io)?),
        None => None,
    };
    let mut fds: Vec<BorrowedFd<'_>> = vm.memory().regions().iter().map(|r| r.fd()).collect();
    if let Some(l) = &service_listener {
        fds.push(l.as_fd());
    }
    if let Some(c) = &plan.control {
        fds.push(c.listener().as_fd());
    }
    let msg = Message::Offer {
        shape,
        regions: vm
            .memory()
            .regions()
            .iter()
            .map(|r| (r.gpa(), r.size()))
            .collect(),
        service: vm.service().is_some(),
        control: plan
            .control
            .as_ref()
            .map(|c| c.path().display().to_string()),
        run: plan.run.clone(),
        from_pid: std::process::id(),
    };
    // The new process opens the same disks (the same exports, the same
    // images by their absolute paths) while it builds the VM.
    let disks: Vec<String> = vm
        .disks()
        .iter()
        .map(|d| d.spec_for_handover().to_string())
        .collect();
    peer.send_with_disks(&msg, &fds, &disks)?;
    match peer.expect("Ready", "build the VM", READY_TIMEOUT)? {
        Message::Ready { build_ms } => stats.build_ms = build_ms,
        _ => unreachable!("expect() returns the message asked for"),
    }
    Ok(())
}

/// Pauses the vCPUs, flushes the service's answers, saves the state and
/// sends it with the client connections.
fn send_state(
    vm: &Vm,
    verify: bool,
    peer: &mut Peer,
    stats: &mut HandoverStats,
    paused_at: u64,
) -> Result<(), HandoverError> {
    let t = Instant::now();
    vm.pause()?;
    // The disks' requests in flight finish and their writes become the
    // new process's to read (its own connections, the same image).
    for d in vm.disks() {
        d.settle(DISK_SETTLE).map_err(HandoverError::NotNow)?;
    }
    let conns = match vm.service() {
        Some(s) => {
            s.flush_answers(SERVICE_TIMEOUT)?;
            s.export()?
        }
        None => Vec::new(),
    };
    let state = vm.save_state()?.encode()?;
    stats.save_ms = t.elapsed().as_secs_f64() * 1e3;
    stats.state_bytes = state.len() as u64;
    stats.connections = conns.len();
    stats.pending_client_bytes = conns.iter().map(|c| c.pending.len() as u64).sum();
    let t = Instant::now();
    let hashes = verify.then(|| memory_hashes(vm));
    stats.verify_ms = t.elapsed().as_secs_f64() * 1e3;
    stats.verified_pages = hashes.as_ref().map_or(0, |h| h.len() as u64);
    for chunk in conns.chunks(CONNS_PER_MESSAGE) {
        let fds: Vec<BorrowedFd<'_>> = chunk.iter().map(|c| c.stream.as_fd()).collect();
        let msg = Message::Conns {
            conns: chunk.iter().map(|c| (c.id, c.pending.clone())).collect(),
        };
        peer.send(&msg, &fds)?;
    }
    peer.send(
        &Message::State {
            state,
            paused_at_ns: paused_at,
            hashes,
        },
        &[],
    )
}
