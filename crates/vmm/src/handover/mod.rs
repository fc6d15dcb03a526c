//! Zero-copy handover: a running VM moves to a new VMM process on the same
//! host (a newer ferry, or a fresh copy of this one) without its memory
//! being copied. Guest RAM is memfds; the new process maps the same files.
//!
//! ```text
//! old VMM (source)                              new VMM (destination, `run --adopt-fd`)
//!   spawn ──────────────────────────────────▶   Hello (magic, version, pid)
//!   Offer + memfds, service & control listeners ▶ map memory, KVM VM, memslots,
//!                                               vCPUs, devices
//!                                          ◀── Ready
//!   freeze service readers, pause vCPUs,
//!   flush answers, save state
//!   Conns + client sockets, State ──────────▶  restore, register clients,
//!                                               vCPU threads started parked
//!                                          ◀── Restored
//!   Go ─────────────────────────────────────▶  resume vCPUs, serve clients,
//!                                          ◀── Running   accept on both sockets
//!   exit (guest memory untouched)
//! ```
//! Until `Go` the old process can take the VM back: any failure (the new
//! process dies, refuses, speaks another version, times out) thaws its
//! clients and resumes its vCPUs. `Go` is the commit point: after it the old
//! process never runs the VM again, so the guest never runs twice on one
//! memory. Everything the new process can do before the pause it does
//! before it, so the pause covers only state save, two messages and restore.
//! The protocol is documented in docs/handover.md.

mod destination;
mod source;
pub mod wire;

pub use destination::{take_over, TakenOver};
pub use source::{hand_over, HandoverPlan};

use std::time::Duration;

/// The threads that carry the pause run at real-time priority
/// ([`ferry_migration::priority::Urgent`]); `FERRY_HANDOVER_PRIORITY=normal`
/// leaves them at normal priority (to measure what the raise buys).
const HANDOVER_PRIORITY: &str = "FERRY_HANDOVER_PRIORITY";

/// Why a handover failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// The VM is not in a state that can move.
    #[error("the VM cannot be handed over now: {0}")]
    NotNow(String),
    /// The new VMM could not be started.
    #[error("cannot start the new VMM {binary}: {source}")]
    Spawn {
        /// What was run.
        binary: String,
        /// OS error.
        source: std::io::Error,
    },
    /// The peer did not start with a handover hello.
    #[error("the other process does not speak ferry's handover protocol (is it a ferry binary?)")]
    NotFerry,
    /// The peer speaks another protocol version.
    #[error("the new VMM speaks handover protocol version {theirs}, this one speaks {ours}")]
    Version {
        /// The peer's version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The peer closed the connection (it exited or crashed).
    #[error("the other VMM process closed the handover connection{0}")]
    Closed(String),
    /// A step took too long.
    #[error("the other VMM process did not {step} within {timeout:?}")]
    TimedOut {
        /// What was awaited.
        step: &'static str,
        /// How long.
        timeout: Duration,
    },
    /// The socket failed.
    #[error("handover connection failed: {0}")]
    Io(std::io::Error),
    /// A message that does not belong here.
    #[error("handover protocol error: {0}")]
    Protocol(String),
    /// The other side gave up, and said why.
    #[error("the other VMM process gave up: {0}")]
    Aborted(String),
    /// Building or restoring the VM failed (new process).
    #[error(transparent)]
    Vm(#[from] crate::vm::VmError),
    /// Guest memory could not be mapped (new process).
    #[error("cannot map the handed-over guest memory: {0}")]
    Memory(String),
    /// The service device could not move its connections.
    #[error(transparent)]
    Service(#[from] crate::devices::service::ServiceError),
    /// `--verify`: the new process's mapping differs from the old one's.
    #[error("verification failed: {bad} of {total} pages differ in the new VMM's mapping (first at guest address {first:#x})")]
    Verify {
        /// Pages that differ.
        bad: u64,
        /// Pages compared.
        total: u64,
        /// The first that differs.
        first: u64,
    },
    /// Saving or decoding the VM state failed.
    #[error(transparent)]
    Persist(#[from] crate::vstate::persist::PersistError),
    /// The owner fence: the new process may not take the VM, or cannot
    /// reach the registry it is fenced through.
    #[error("ownership: {0}")]
    Fenced(String),
    /// After `Go` the new process did not confirm it runs the VM, and the
    /// registry says it never took it: the VM runs here again.
    #[error("the new VMM did not take the VM ({0}); the registry says it never did, so it runs here again")]
    TakenBack(String),
    /// After the commit point the new process did not confirm it runs the
    /// VM. The old process does not run it again either way.
    #[error("the new VMM (pid {pid}) took the VM and then did not confirm it runs it: {reason}")]
    InDoubt {
        /// The new process.
        pid: u32,
        /// What went wrong.
        reason: String,
    },
}

impl HandoverError {
    pub(crate) fn from_io(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionReset => HandoverError::Closed(String::new()),
            _ => HandoverError::Io(e),
        }
    }
}

/// What a handover did, as the old process reports it.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct HandoverStats {
    /// The new VMM process.
    pub new_pid: u32,
    /// The binary it runs.
    pub binary: String,
    /// From the request to the new process's confirmation (ms).
    pub total_ms: f64,
    /// vCPUs paused in the old process to running in the new one (ms).
    pub downtime_ms: f64,
    /// Service readers stopped in the old process to reading in the new
    /// one (ms): how long a client's request could wait. 0 without a
    /// service device.
    pub service_pause_ms: f64,
    /// The new process building the VM around the memory (ms), before the pause.
    pub build_ms: f64,
    /// Pausing vCPUs and saving their state (ms), inside the downtime.
    pub save_ms: f64,
    /// `--verify`: hashing guest memory in the old process (ms), inside the
    /// downtime (the new process hashes its mapping too before `Restored`).
    pub verify_ms: f64,
    /// From the state sent to the new process's `Restored` (ms), inside
    /// the downtime: it decodes and restores the state and, with
    /// `--verify`, first hashes its own mapping of all guest memory.
    #[serde(default)]
    pub restore_ms: f64,
    /// `--verify`: pages whose hashes matched in both processes.
    pub verified_pages: u64,
    /// Guest RAM handed over (bytes), not copied.
    pub guest_memory_bytes: u64,
    /// Guest memory bytes copied: none, by construction (no page crosses
    /// the socket); reported so a table can say so beside a migration's.
    pub memory_bytes_copied: u64,
    /// Every byte written to and read from the handover socket.
    pub socket_bytes: u64,
    /// The encoded VM state (bytes).
    pub state_bytes: u64,
    /// Client connections moved.
    pub connections: usize,
    /// Bytes read from clients and not handled yet, moved with them.
    pub pending_client_bytes: u64,
    /// CPU seconds the old process's handover thread used.
    pub source_cpu_s: f64,
    /// CPU seconds the new process used from its start to running the VM.
    pub destination_cpu_s: f64,
}

/// Per-page hashes of the VM's guest memory as this process maps it.
fn memory_hashes(vm: &crate::vm::Vm) -> Vec<u64> {
    ferry_migration::memory_hashes(&crate::migration::views(vm), |i| {
        crate::migration::data_ranges(vm, i)
    })
}

/// CLOCK_MONOTONIC now, in ns: one clock for both processes on a host, so
/// the downtime can be taken from the old process's pause to the new one's
/// resume.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn cpu_secs(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Test hook: `FERRY_HANDOVER_STALL=ready|restored` makes a new VMM stall
/// before it sends that message, so a test can kill it mid-handover.
fn stall_before(step: &str) {
    if std::env::var("FERRY_HANDOVER_STALL").is_ok_and(|s| s == step) {
        eprintln!("ferry: FERRY_HANDOVER_STALL={step}: stalling the handover here");
        std::thread::sleep(Duration::from_secs(600));
    }
}

/// A listening socket whose path moves to the new process at a handover
/// (the control socket): the handover holds its clients, hands its
/// descriptor over, and retires it or takes it back. The control socket
/// implements it; the handover needs nothing else of the control code.
pub trait MovingListener: Send + Sync {
    /// The socket path.
    fn path(&self) -> &std::path::Path;
    /// The listening socket, to duplicate for the next process.
    fn listener(&self) -> &std::os::unix::net::UnixListener;
    /// New clients wait in the listen queue until `accept_again` (or the
    /// next process accepts them).
    fn hold_clients(&self);
    /// Accept clients again (the handover failed).
    fn accept_again(&self);
    /// Another process serves this path now.
    fn retire(&self);
}
