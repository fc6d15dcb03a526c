//! The service device: gives the VM a TCP port on its host and carries
//! length-prefixed request frames between client connections and a request
//! ring in guest memory (docs/service.md).
//!
//! ```text
//! client ──frame──▶ reader thread ──post──▶ slot POSTED ──▶ guest worker (CPL3)
//!                                  (MSI if workers are parked)      │ writes response in place,
//! client ◀──frame── writer thread ◀──────── doorbell (vCPU exit) ◀──┘ slot DONE, out 0xf8
//! ```
//! Requests never wait in the device: a reader posts its frame straight into a
//! free slot (or waits for one), so the ring in guest memory holds every
//! queued request, and the device's own state is only which connection each
//! slot belongs to ([`ServiceState`]).
//!
//! This file holds the device, its start, the accept thread and the switches
//! a VM's run and migration flip (hold, release, redirect, shutdown). The
//! rest is split by what it serves: `ring.rs` (posting into the ring,
//! the doorbell, forwarding, the saved state), `conn.rs` (client
//! connections), `handover.rs` (handing them to another VMM process) and
//! `moving.rs` (moving them with the VM to another host); [`wire`] is the
//! frame format.

mod conn;
mod follow;
mod handover;
mod moving;
mod ring;
pub mod wire;

pub use conn::FrozenConn;
pub use handover::AdoptedConns;

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use ferry_memory::GuestMemory;
use kvm_ioctls::VmFd;

use crate::guest_abi::{svc_off, SVC_GPA, SVC_SLOTS};
use conn::{Conn, Gate, Spares};

/// Why the device could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The port could not be bound.
    #[error("service device cannot listen on {addr}: {source}")]
    Listen {
        /// Address asked for.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// The device cannot hand its connections over now.
    #[error("the service device cannot hand over its connections: {0}")]
    Handover(String),
    /// The clients cannot move with the VM now.
    #[error("the service device cannot move its clients: {0}")]
    Move(String),
    /// The VM's own address could not be set up, moved or restored.
    #[error(transparent)]
    Address(crate::hostnet::NetError),
    /// A saved state that no device could have had.
    #[error("saved service state is invalid: {0}")]
    BadState(String),
    /// The device already put requests of its own into the ring, so a saved
    /// ring state cannot replace its own.
    #[error("cannot restore the service device's state: it has already posted {posted} requests into the ring")]
    AlreadyPosting {
        /// Requests it posted.
        posted: u64,
    },
}

/// Counters of what the device did.
#[derive(Debug, Default)]
pub struct ServiceStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Requests posted to the guest.
    pub posted: AtomicU64,
    /// Responses returned by the guest.
    pub responses: AtomicU64,
    /// ECHO requests answered by the device itself.
    pub echoes: AtomicU64,
    /// Malformed or oversized frames refused.
    pub bad_frames: AtomicU64,
    /// Requests refused because the guest was not serving yet.
    pub not_ready: AtomicU64,
    /// Doorbells for a slot that was not DONE (a guest bug).
    pub guest_errors: AtomicU64,
    /// Requests forwarded to the VM's new host after a migration.
    pub forwarded: AtomicU64,
    /// Answers to requests in flight at a migration's pause, collected
    /// from the VM's new host (the pause did not wait for them).
    pub collected: AtomicU64,
    /// Connections checkpointed here and moved with the VM.
    pub moved_out: AtomicU64,
    /// Connections restored here from the VM's previous host.
    pub moved_in: AtomicU64,
    /// Sum over answered requests of post-to-answer time (host TSC ticks;
    /// the post time is in the slot, in guest memory, so a request posted
    /// before a migration and answered after it counts the downtime).
    pub latency_ticks: AtomicU64,
    /// Longest of those since the timeline last took it (ticks).
    pub latency_max_ticks: AtomicU64,
}

/// The device's own state besides guest memory, for save/restore: which
/// slots the device owns and where connection ids go on. Which connection a
/// slot in flight belongs to is its tag in the ring, in guest memory. (Client
/// connections themselves stay on the source host; migration redirects them.)
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServiceState {
    /// Port the VM's service listened on (informational: a restored device
    /// keeps its own, see [`ServiceDevice::restore`]).
    pub port: u16,
    /// Next connection id.
    pub next_conn: u64,
    /// Slots owned by the device (FREE in the ring), in the order the device
    /// hands them out (it takes the last one first).
    pub free_slots: Vec<u16>,
}

struct Ring {
    free: Vec<usize>,
    next_irq_cpu: usize,
}

/// A running service device.
pub struct ServiceDevice {
    memory: Arc<GuestMemory>,
    vm: Arc<VmFd>,
    vcpus: usize,
    /// Where clients connect (replaced once, before the VM runs, when a
    /// migration brings the VM's own address).
    addr: Mutex<SocketAddr>,
    ring: Mutex<Ring>,
    slot_freed: Condvar,
    conns: Mutex<HashMap<u64, Conn>>,
    next_conn: AtomicU64,
    stop: AtomicBool,
    /// The listening socket (the accept thread uses a duplicate), kept so
    /// it can be handed to another VMM process.
    listener: Mutex<TcpListener>,
    /// The VM's own IP address on the hosts' network, if it has one: its
    /// clients move with it (moving.rs).
    address: Mutex<Option<Arc<crate::hostnet::VmAddress>>>,
    /// Where a move of the clients is.
    moving: Mutex<moving::Moving>,
    /// The accept thread runs (from the VM's start until a freeze).
    accepting: AtomicBool,
    accept_thread: Mutex<Option<JoinHandle<()>>>,
    /// Wakes the accept thread to stop (readable until it is restarted).
    accept_wake: vmm_sys_util::eventfd::EventFd,
    /// Stops the readers between frames for a handover.
    gate: Gate,
    /// Threads started ahead for connections a migration brings.
    spares: Spares,
    /// Migration: readers stop posting into the ring (requests wait in the
    /// device) while the VM's memory is being switched over.
    held: AtomicBool,
    /// After a migration: where the VM's service now listens; every request
    /// is forwarded there, like a moved IP address.
    redirect: Mutex<Option<SocketAddr>>,
    /// Source of a migration: answers to what is in flight at the pause
    /// come from the destination (follow.rs).
    follow: Mutex<follow::Follow>,
    /// Destination: answers to what was in flight at the source's pause.
    orphans: Mutex<follow::Orphans>,
    /// What it did.
    pub stats: ServiceStats,
}

/// What happens to a request frame.
enum Route {
    /// Into this VM's ring.
    Posted,
    /// To the VM's new host.
    Forward(SocketAddr),
    /// The device is shutting down.
    Closed,
    /// The readers are stopping for a handover: keep the frame.
    Frozen,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ServiceDevice {
    /// Binds `addr` (port 0 picks one). Clients are accepted from the VM's
    /// start on ([`release`](Self::release)); until then they wait in the
    /// listen queue.
    pub fn start(
        addr: SocketAddr,
        memory: Arc<GuestMemory>,
        vm: Arc<VmFd>,
        vcpus: u32,
    ) -> Result<Arc<Self>, ServiceError> {
        let listen_err = |source| ServiceError::Listen { addr, source };
        let listener = TcpListener::bind(addr).map_err(listen_err)?;
        Self::adopt(listener, memory, vm, vcpus)
    }

    /// A device on a listening socket another VMM process handed over
    /// (clients queued on it wait for this process to accept them).
    pub fn adopt(
        listener: TcpListener,
        memory: Arc<GuestMemory>,
        vm: Arc<VmFd>,
        vcpus: u32,
    ) -> Result<Arc<Self>, ServiceError> {
        let local = listener
            .local_addr()
            .map_err(|source| ServiceError::Listen {
                addr: SocketAddr::from(([0, 0, 0, 0], 0)),
                source,
            })?;
        let listen_err = |source| ServiceError::Listen {
            addr: local,
            source,
        };
        listener.set_nonblocking(true).map_err(listen_err)?;
        Ok(Arc::new(ServiceDevice {
            memory,
            vm,
            vcpus: vcpus as usize,
            addr: Mutex::new(local),
            ring: Mutex::new(Ring {
                free: (0..SVC_SLOTS).rev().collect(),
                next_irq_cpu: 0,
            }),
            slot_freed: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            listener: Mutex::new(listener),
            address: Mutex::new(None),
            moving: Mutex::new(moving::Moving::Idle),
            accepting: AtomicBool::new(false),
            accept_thread: Mutex::new(None),
            accept_wake: vmm_sys_util::eventfd::EventFd::new(
                vmm_sys_util::eventfd::EFD_NONBLOCK | libc::EFD_CLOEXEC,
            )
            .map_err(listen_err)?,
            gate: Gate::new().map_err(listen_err)?,
            spares: Spares::new(),
            held: AtomicBool::new(true),
            redirect: Mutex::new(None),
            follow: Mutex::new(follow::Follow::default()),
            orphans: Mutex::new(follow::Orphans::default()),
            stats: ServiceStats::default(),
        }))
    }

    /// Starts the accept thread unless it runs.
    fn start_accepting(self: &Arc<Self>) {
        let mut t = lock(&self.accept_thread);
        if t.is_some() || self.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(listener) = self.listener() else {
            return;
        };
        let _ = self.accept_wake.read(); // a stop's wake-up is spent
        self.accepting.store(true, Ordering::Release);
        let d = self.clone();
        *t = std::thread::Builder::new()
            .name("svc-accept".into())
            .spawn(move || d.accept_loop(listener))
            .ok();
    }

    /// Stops the accept thread and waits for it (new clients wait in the
    /// listen queue).
    fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::Release);
        let _ = self.accept_wake.write(1);
        if let Some(t) = lock(&self.accept_thread).take() {
            let _ = t.join();
        }
    }

    /// The listening socket, duplicated (a handover lends it to the next
    /// process).
    pub fn listener(&self) -> std::io::Result<TcpListener> {
        lock(&self.listener).try_clone()
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        *lock(&self.addr)
    }

    /// True once the guest's workload answers requests.
    pub fn guest_ready(&self) -> bool {
        self.memory
            .read_u64_volatile(SVC_GPA + svc_off::READY)
            .unwrap_or(0)
            == 1
    }

    /// The VM runs (it started, or a migration failed): clients that
    /// moved here go live (or, after a failed move, come back), readers
    /// go on, requests go into the ring, and clients are accepted.
    pub fn release(self: &Arc<Self>) {
        self.forget_follow();
        self.settle_move();
        self.thaw();
        self.held.store(false, Ordering::SeqCst);
        self.slot_freed.notify_all();
        self.start_accepting();
    }

    /// The VM now runs elsewhere: forward every request (waiting ones
    /// first) to its service there, and collect from it the answers to
    /// what was in flight at the pause.
    pub fn redirect(self: &Arc<Self>, to: SocketAddr) {
        *lock(&self.redirect) = Some(to);
        self.held.store(false, Ordering::SeqCst);
        self.slot_freed.notify_all();
        self.collect_answers(to);
    }

    /// Where requests are forwarded, if the VM moved.
    pub fn redirected_to(&self) -> Option<SocketAddr> {
        *lock(&self.redirect)
    }

    /// Stops accepting, closes every connection and wakes waiting readers.
    pub fn shutdown(&self) {
        self.drop_address();
        self.spares.close();
        self.stop.store(true, Ordering::Release);
        self.stop_accepting();
        self.gate.thaw();
        for (_, c) in lock(&self.conns).drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        self.slot_freed.notify_all();
    }

    /// Stops posting new requests into the ring (they wait in the device)
    /// until [`release`](Self::release). A VM is built with its device held
    /// and releases it when it starts: until then its memory may still be
    /// arriving (or be handed over) with a ring the device must not touch.
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }
}

impl Drop for ServiceDevice {
    /// A device that never ran (a VM whose creation failed after the device
    /// put the VM's address up) leaves no address behind.
    fn drop(&mut self) {
        self.drop_address();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_state_round_trips() {
        let s = ServiceState {
            port: 4000,
            next_conn: 17,
            free_slots: vec![3, 1, 2],
        };
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<ServiceState>(&text).unwrap(), s);
    }
}
