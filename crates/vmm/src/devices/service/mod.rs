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

mod conn;
mod moving;
pub mod wire;

pub use conn::FrozenConn;

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_memory::{GuestMemory, MemoryError};
use kvm_bindings::kvm_msi;
use kvm_ioctls::VmFd;

use crate::guest_abi::{self, slot_state, svc_off, svc_slot_gpa, SVC_GPA, SVC_SLOTS};
use conn::{Conn, Gate, Inbox, Outbox, Spares};
use wire::MAX_BODY;

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
    /// What it did.
    pub stats: ServiceStats,
}

/// Connections taken over from another process, registered and not read yet.
pub struct AdoptedConns(Vec<(FrozenConn, Outbox, Inbox)>);

impl AdoptedConns {
    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True if none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Starts serving them on `device`, each from what its reader left.
    pub fn serve(self, device: &Arc<ServiceDevice>) {
        for (c, tx, rx) in self.0 {
            device.spawn_connection(c.id, c.stream, c.pending, tx, rx);
        }
    }
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
            gate: Gate::new().map_err(listen_err)?,
            spares: Spares::new(),
            held: AtomicBool::new(true),
            redirect: Mutex::new(None),
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

    /// Migration is about to pause the VM: stop posting new requests and wait
    /// until the guest has answered every request in the ring, so nothing in
    /// flight belongs to a connection the destination does not know.
    pub fn hold_and_drain(&self, timeout: Duration) -> Result<(), String> {
        self.held.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + timeout;
        let mut ring = lock(&self.ring);
        while ring.free.len() < SVC_SLOTS {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the guest did not answer {} in-flight service requests within {timeout:?}",
                    SVC_SLOTS - ring.free.len()
                ));
            }
            ring = self
                .slot_freed
                .wait_timeout(ring, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// The VM runs (it started, or a migration failed): clients that
    /// moved here go live (or, after a failed move, come back), readers
    /// go on, requests go into the ring, and clients are accepted.
    pub fn release(self: &Arc<Self>) {
        self.settle_move();
        self.thaw();
        self.held.store(false, Ordering::SeqCst);
        self.slot_freed.notify_all();
        self.start_accepting();
    }

    /// The VM now runs elsewhere: forward every request (waiting ones
    /// first) to its service there.
    pub fn redirect(&self, to: SocketAddr) {
        *lock(&self.redirect) = Some(to);
        self.held.store(false, Ordering::SeqCst);
        self.slot_freed.notify_all();
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

    /// Handover, first step (the VM still runs): stop accepting, and stop
    /// every reader between two frames, so no request is half-read or on
    /// its way into the ring. Requests already in the ring stay there: they
    /// travel with guest memory, and the next process answers them.
    /// Undo with [`thaw`](Self::thaw).
    pub fn freeze(&self, timeout: Duration) -> Result<(), ServiceError> {
        if let Some(to) = self.redirected_to() {
            return Err(ServiceError::Handover(format!(
                "the VM moved to {to} and this device forwards its clients there"
            )));
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(ServiceError::Handover("the device is shut down".into()));
        }
        // The gate first: its eventfd also wakes the accept thread.
        self.accepting.store(false, Ordering::Release);
        self.gate.close();
        self.stop_accepting();
        self.slot_freed.notify_all(); // readers waiting for a slot see the gate
        if let Err(busy) = self.gate.wait_parked(timeout) {
            self.thaw();
            return Err(ServiceError::Handover(format!(
                "{busy} connection readers did not stop within {timeout:?}"
            )));
        }
        Ok(())
    }

    /// Handover, second step (the VM is paused, so the guest answers
    /// nothing more): waits until every answer given so far is written to
    /// its client, so the next process starts with empty queues.
    pub fn flush_answers(&self, timeout: Duration) -> Result<(), ServiceError> {
        // Only writers with answers queued are asked (and woken).
        let acks: Vec<_> = lock(&self.conns)
            .values()
            .filter_map(|c| c.tx.barrier())
            .collect();
        let deadline = std::time::Instant::now() + timeout;
        for rx in acks {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            // A writer that ended (its client left) drops the barrier: fine.
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(left) {
                return Err(ServiceError::Handover(format!(
                    "a client did not take its answers within {timeout:?}"
                )));
            }
        }
        Ok(())
    }

    /// Handover, third step: duplicates of every connection's socket, each
    /// with what its reader had not handled. The device
    /// keeps serving nothing until [`thaw`](Self::thaw) or
    /// [`hand_off`](Self::hand_off).
    pub fn export(&self) -> Result<Vec<FrozenConn>, ServiceError> {
        let io = |e: std::io::Error| ServiceError::Handover(e.to_string());
        let mut pending = self.gate.pending();
        let conns = lock(&self.conns)
            .iter()
            .map(|(&id, c)| {
                Ok(FrozenConn {
                    id,
                    stream: c.stream.try_clone().map_err(io)?,
                    pending: pending.remove(&id).unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Ok(conns)
    }

    /// The handover failed: readers go on where they stopped (clients are
    /// accepted again at [`release`](Self::release)).
    pub fn thaw(&self) {
        self.gate.thaw();
        self.slot_freed.notify_all();
    }

    /// The handover succeeded: another process serves every connection.
    /// Readers and writers leave without a shutdown, which would end the
    /// connections for that process too; nothing is accepted here again.
    pub fn hand_off(&self) {
        self.stop.store(true, Ordering::Release);
        self.spares.close();
        // The other process holds the VM's address too: leave it up.
        if let Some(a) = lock(&self.address).as_ref() {
            a.forget();
        }
        self.gate.hand_off();
        // Dropping the senders ends the writers once they are idle.
        lock(&self.conns).clear();
        self.slot_freed.notify_all();
    }

    /// Takes over connections another process exported: each is registered
    /// at once (answers to its requests still in the ring may come as soon
    /// as the VM resumes); [`AdoptedConns::serve`] starts reading them.
    pub fn adopt_connections(&self, conns: Vec<FrozenConn>) -> Result<AdoptedConns, ServiceError> {
        let mut out = Vec::new();
        for c in conns {
            let shut = c
                .stream
                .try_clone()
                .map_err(|e| ServiceError::Handover(e.to_string()))?;
            let (tx, rx) = Outbox::new();
            self.register(c.id, tx.clone(), shut);
            self.next_conn.fetch_max(c.id + 1, Ordering::Relaxed);
            out.push((c, tx, rx));
        }
        Ok(AdoptedConns(out))
    }

    /// Stops posting new requests into the ring (they wait in the device)
    /// until [`release`](Self::release). A VM is built with its device held
    /// and releases it when it starts: until then its memory may still be
    /// arriving (or be handed over) with a ring the device must not touch.
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Takes over a saved device state (the ring itself is in guest memory
    /// and travels with it): the slots the saved device owned and its next
    /// connection id, so requests already in the ring are finished exactly as
    /// there. Refused once this device has posted requests of its own.
    ///
    /// `state.port` is left alone: this device listens on its own address
    /// (on the same host the source still holds the old port until it
    /// redirects), and the source's device forwards its clients here.
    pub fn restore(&self, state: &ServiceState) -> Result<(), ServiceError> {
        let mut owned = [false; SVC_SLOTS];
        for &slot in &state.free_slots {
            let i = slot as usize;
            if i >= SVC_SLOTS {
                return Err(ServiceError::BadState(format!(
                    "free slot {i} is outside the ring of {SVC_SLOTS}"
                )));
            }
            if std::mem::replace(&mut owned[i], true) {
                return Err(ServiceError::BadState(format!(
                    "free slot {i} is listed twice"
                )));
            }
        }
        if state.next_conn == 0 {
            return Err(ServiceError::BadState(
                "next connection id 0 (ids start at 1)".into(),
            ));
        }
        // Under the ring lock: a reader takes a slot and counts the post
        // under it, so no post slips between this check and the update.
        let mut ring = lock(&self.ring);
        let posted = self.stats.posted.load(Ordering::Relaxed);
        if posted > 0 {
            return Err(ServiceError::AlreadyPosting { posted });
        }
        ring.free = state.free_slots.iter().map(|&i| i as usize).collect();
        // Slots in flight carry the saved connections' ids as tags; new
        // connections here must never reuse one (their answers would go to
        // the wrong client), nor an id this device already gave out.
        self.next_conn.fetch_max(state.next_conn, Ordering::Relaxed);
        drop(ring);
        self.slot_freed.notify_all();
        Ok(())
    }

    /// The device state besides guest memory.
    pub fn state(&self) -> ServiceState {
        ServiceState {
            port: self.local_addr().port(),
            next_conn: self.next_conn.load(Ordering::Relaxed),
            free_slots: lock(&self.ring).free.iter().map(|&i| i as u16).collect(),
        }
    }

    /// Sends a request frame to the VM's new host on this connection's own
    /// upstream connection; a thread copies the answers back to the client.
    fn forward(
        &self,
        upstream: &mut Option<TcpStream>,
        to: SocketAddr,
        body: &[u8],
        tx: &Outbox,
    ) -> std::io::Result<()> {
        if upstream.is_none() {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            let mut r = BufReader::new(s.try_clone()?);
            let tx = tx.clone();
            std::thread::Builder::new()
                .name("svc-fwd".into())
                .spawn(move || {
                    while let Ok(Some(b)) = wire::read_frame(&mut r, MAX_BODY) {
                        let mut f = (b.len() as u32).to_le_bytes().to_vec();
                        f.extend_from_slice(&b);
                        if !tx.frame(f) {
                            break;
                        }
                    }
                })?;
            *upstream = Some(s);
        }
        let s = upstream.as_mut().ok_or(std::io::ErrorKind::NotConnected)?;
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        s.write_all(&f)?;
        self.stats.forwarded.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Puts a request body into a free slot and tells the guest, or says
    /// where it must go instead.
    fn post(&self, body: &[u8], conn: u64) -> Result<Route, MemoryError> {
        let mut ring = lock(&self.ring);
        let slot = loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(Route::Closed);
            }
            if let Some(to) = *lock(&self.redirect) {
                return Ok(Route::Forward(to));
            }
            if self.gate.is_frozen() {
                return Ok(Route::Frozen);
            }
            if !self.held.load(Ordering::SeqCst) {
                if let Some(i) = ring.free.pop() {
                    break i;
                }
            }
            ring = self
                .slot_freed
                .wait_timeout(ring, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let gpa = svc_slot_gpa(slot);
        let m = &self.memory;
        m.write_bytes(gpa + guest_abi::SVC_SLOT_HEADER, body)?;
        m.write_u32_volatile(gpa + svc_off::SLOT_LEN, body.len() as u32)?;
        m.write_u64_volatile(gpa + svc_off::SLOT_TAG, conn)?;
        m.write_u64_volatile(gpa + svc_off::SLOT_POST_TSC, rdtsc())?;
        fence(Ordering::Release);
        m.write_u32_volatile(gpa + svc_off::SLOT_STATE, slot_state::POSTED)?;
        let posted = m.read_u64_volatile(SVC_GPA + svc_off::POSTED)? + 1;
        m.write_u64_volatile(SVC_GPA + svc_off::POSTED, posted)?;
        self.stats.posted.fetch_add(1, Ordering::Relaxed);
        // Posted before reading `spinner` and the sleepers; the guest clears
        // `spinner` / raises its sleeper count before checking `posted`: one
        // of us sees the other, so a request is never left unseen.
        fence(Ordering::SeqCst);
        if m.read_u64_volatile(SVC_GPA + svc_off::SPINNER)? != 0 {
            return Ok(Route::Posted); // a worker is polling the ring: no interrupt needed
        }
        for n in 0..self.vcpus {
            let cpu = (ring.next_irq_cpu + n) % self.vcpus;
            if m.read_u64_volatile(SVC_GPA + svc_off::SLEEPERS + 8 * cpu as u64)? > 0 {
                ring.next_irq_cpu = cpu + 1;
                self.interrupt(cpu);
                break;
            }
        }
        Ok(Route::Posted)
    }

    fn interrupt(&self, cpu: usize) {
        let msi = kvm_msi {
            address_lo: 0xfee0_0000 | ((cpu as u32) << 12),
            data: guest_abi::VEC_SVC,
            ..Default::default()
        };
        let _ = self.vm.signal_msi(msi);
    }

    /// A guest worker finished the request in `slot` (called on the vCPU thread).
    pub fn doorbell(&self, slot: u32) {
        let slot = slot as usize;
        if slot >= SVC_SLOTS {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let gpa = svc_slot_gpa(slot);
        let m = &self.memory;
        if m.read_u32_volatile(gpa + svc_off::SLOT_STATE).ok() != Some(slot_state::DONE) {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        fence(Ordering::Acquire);
        let len = m.read_u32_volatile(gpa + svc_off::SLOT_LEN).unwrap_or(0) as usize;
        let conn = m.read_u64_volatile(gpa + svc_off::SLOT_TAG).unwrap_or(0);
        let posted_tsc = m
            .read_u64_volatile(gpa + svc_off::SLOT_POST_TSC)
            .unwrap_or(0);
        let mut frame = vec![0u8; 4 + len.min(MAX_BODY)];
        frame[..4].copy_from_slice(&(len.min(MAX_BODY) as u32).to_le_bytes());
        let ok = len <= MAX_BODY
            && m.read_bytes(gpa + guest_abi::SVC_SLOT_HEADER, &mut frame[4..])
                .is_ok();
        let _ = m.write_u32_volatile(gpa + svc_off::SLOT_STATE, slot_state::FREE);
        lock(&self.ring).free.push(slot);
        self.slot_freed.notify_all();
        if !ok {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Another host's TSC (a move between machines) reads as nonsense:
        // a negative or over-a-minute time is not counted.
        let ticks = rdtsc().wrapping_sub(posted_tsc);
        if ticks < 60 * 4_000_000_000 {
            self.stats.latency_ticks.fetch_add(ticks, Ordering::Relaxed);
            self.stats
                .latency_max_ticks
                .fetch_max(ticks, Ordering::Relaxed);
        }
        self.stats.responses.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = lock(&self.conns).get(&conn) {
            let _ = c.tx.frame(frame);
        }
    }
}

impl Drop for ServiceDevice {
    /// A device that never ran (a VM whose creation failed after the device
    /// put the VM's address up) leaves no address behind.
    fn drop(&mut self) {
        self.drop_address();
    }
}

fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
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
