//! The request queue: taking chains off the split virtqueue (rust-vmm's
//! `virtio-queue` walks the rings and bounds each chain by the queue size),
//! handing each parsed request to a small pool of I/O threads so a vCPU
//! never waits for the disk, and putting finished ones on the used ring.
//!
//! ```text
//! vCPU: QueueNotify ─▶ pop chains ─▶ parse ─▶ job ─▶ I/O thread: pread/pwrite/fdatasync
//!                          │ refused: IOERR now          │ status byte, used ring ◀┘
//! ```
//! While requests are in flight the used ring carries NO_NOTIFY, and each
//! I/O thread that finishes one takes what the driver made available
//! meanwhile and runs the first of it itself: a busy queue costs the guest
//! no doorbell exit per request and the host no thread wake-up per request.
//! A reset (device status 0) bumps the epoch and waits for the jobs in
//! flight: no job of an earlier epoch writes to guest memory or the used
//! ring after the driver was told the device is reset.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::backend::HostSeg;
use super::backends::Backend;
use super::memory::GuestRam;
use super::request::{self, status, Op, Request, ID_BYTES};
use super::spec::SECTOR;

/// I/O threads per disk: requests in flight at once against the file.
pub const IO_THREADS: usize = 4;
/// The queue size the device offers (QueueNumMax).
pub const QUEUE_MAX: u16 = 256;

/// What the device did, for `ferry status`.
#[derive(Debug, Default)]
pub struct BlockStats {
    /// Read requests done.
    pub reads: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Write requests done.
    pub writes: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Flushes done.
    pub flushes: AtomicU64,
    /// Discards and write-zeroes done.
    pub zeroes: AtomicU64,
    /// Requests the backend failed (the guest got IOERR).
    pub io_errors: AtomicU64,
    /// Malformed requests refused (IOERR, or dropped with no status byte).
    pub bad_requests: AtomicU64,
    /// Request types the device does not do (UNSUPP).
    pub unsupported: AtomicU64,
    /// Times the queue itself was broken (the device then needs a reset).
    pub broken: AtomicU64,
    /// Doorbells (QueueNotify writes) from the driver.
    pub notifies: AtomicU64,
    /// Requests run by an I/O thread, with the two sums below.
    pub jobs: AtomicU64,
    /// Nanoseconds from taking a request off the ring to an I/O thread
    /// starting it, summed.
    pub wait_ns: AtomicU64,
    /// Nanoseconds in the backend (pread, pwrite, fdatasync, …), summed.
    pub io_ns: AtomicU64,
}

/// One request on its way through an I/O thread.
pub struct Job {
    head: u16,
    epoch: u64,
    req: Request,
    taken: std::time::Instant,
}

/// What the device's threads share.
pub struct Shared {
    pub(super) ram: GuestRam,
    pub(super) backend: Backend,
    pub(super) queue: Mutex<Queue>,
    /// InterruptStatus (bit 0: used buffer).
    pub(super) interrupt: AtomicU32,
    /// Set when the queue is found broken; the transport then reports
    /// DEVICE_NEEDS_RESET.
    pub(super) broken: AtomicBool,
    epoch: AtomicU64,
    inflight: Mutex<u64>,
    /// I/O threads between taking a job and leaving the ring after it
    /// (they write the used ring's flags after the job's count is gone);
    /// changed under `inflight`'s lock.
    busy: AtomicU64,
    idle: Condvar,
    /// Where jobs go to the I/O threads (None once the device shuts down).
    jobs: Mutex<Option<Sender<Job>>>,
    id: [u8; ID_BYTES],
    pub(super) stats: BlockStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// State for a device over `backend`, its id string `id`.
    pub fn new(ram: GuestRam, backend: Backend, id: &str, jobs: Sender<Job>) -> Self {
        let mut idb = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        idb[..n].copy_from_slice(&id.as_bytes()[..n]);
        Shared {
            ram,
            backend,
            // QUEUE_MAX is a power of two: Queue::new cannot refuse it.
            queue: Mutex::new(Queue::new(QUEUE_MAX).unwrap_or_else(|_| unreachable!())),
            interrupt: AtomicU32::new(0),
            broken: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            inflight: Mutex::new(0),
            busy: AtomicU64::new(0),
            idle: Condvar::new(),
            jobs: Mutex::new(Some(jobs)),
            id: idb,
            stats: BlockStats::default(),
        }
    }

    /// Capacity in sectors.
    pub fn capacity(&self) -> u64 {
        self.backend.size() / SECTOR
    }

    /// Starts a new epoch and waits until no job of the old one runs.
    pub fn quiesce(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let mut n = lock(&self.inflight);
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        self.interrupt.store(0, Ordering::SeqCst);
        self.broken.store(false, Ordering::SeqCst);
    }

    /// Takes every available chain off the queue: refused ones are
    /// answered at once, the rest go to the I/O threads, except one the
    /// caller keeps to run itself when `keep` (an I/O thread that just
    /// finished one: no hand-over, no wake-up).
    ///
    /// While requests are in flight the used ring says NO_NOTIFY: the
    /// driver need not ring the doorbell (an exit) for each request, as
    /// every completion looks at the available ring again. Only when none
    /// is left are notifications enabled again, and the ring looked at once
    /// more after that (virtio 2.7.7.2's race: a request made available
    /// just before is not left waiting for a notify that never comes).
    pub fn drain(&self, keep: bool) -> Option<Job> {
        let mem = self.ram.mem();
        let epoch = self.epoch.load(Ordering::SeqCst);
        let mut kept = None;
        loop {
            let mut chains = Vec::new();
            {
                let mut q = lock(&self.queue);
                if !q.ready() || self.broken.load(Ordering::SeqCst) {
                    return kept; // reset, or waiting for one
                }
                if !q.is_valid(mem) {
                    self.mark_broken("the queue's rings are not in guest RAM");
                    return kept;
                }
                let flags = q.disable_notification(mem);
                self.wrote_used_ring(&q);
                if let Err(e) = flags {
                    self.mark_broken(&format!("cannot write the used ring's flags: {e}"));
                    return kept;
                }
                match q.iter(mem) {
                    Ok(it) => chains.extend(it.take(usize::from(QUEUE_MAX))),
                    Err(e) => {
                        self.mark_broken(&format!("the available ring is invalid: {e}"));
                        return kept;
                    }
                }
                if chains.is_empty() {
                    if *lock(&self.inflight) > 0 || kept.is_some() {
                        return kept; // their completions look again
                    }
                    let flags = q.enable_notification(mem);
                    self.wrote_used_ring(&q);
                    match flags {
                        Ok(true) => continue, // made available meanwhile
                        Ok(false) => return kept,
                        Err(e) => {
                            self.mark_broken(&format!("cannot write the used ring's flags: {e}"));
                            return kept;
                        }
                    }
                }
                *lock(&self.inflight) += chains.len() as u64;
            }
            for chain in chains {
                let head = chain.head_index();
                match request::parse(chain, mem, self.capacity()) {
                    Ok(req) => {
                        let job = Job {
                            head,
                            epoch,
                            req,
                            taken: std::time::Instant::now(),
                        };
                        if keep && kept.is_none() {
                            kept = Some(job);
                            continue;
                        }
                        let sent = match lock(&self.jobs).as_ref() {
                            Some(tx) => tx.send(job).map_err(|back| back.0),
                            None => Err(job),
                        };
                        if let Err(job) = sent {
                            // No I/O threads (the device is going away).
                            self.finish(
                                job.head,
                                job.epoch,
                                Some(job.req.status),
                                status::IOERR,
                                0,
                            );
                        }
                    }
                    Err(refused) => {
                        self.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(head, why = %refused.why, "virtio-blk request refused");
                        self.finish(head, epoch, refused.status, status::IOERR, 0);
                    }
                }
            }
        }
    }

    /// Stops the I/O threads once the jobs queued are done.
    pub fn shutdown(&self) {
        lock(&self.jobs).take();
    }

    /// The device wrote the used ring (an entry, its index or its flags):
    /// a migration must send it again.
    fn wrote_used_ring(&self, q: &Queue) {
        self.ram.wrote(q.used_ring(), 6 + 8 * u64::from(q.size()));
    }

    /// Waits until no request is in flight and no I/O thread is still at
    /// the ring, for at most `timeout`: with the vCPUs paused nothing new
    /// comes, and every I/O thread that finishes takes what was left on
    /// the ring, so this is the moment the device has written everything
    /// it will into guest RAM. False if requests still run at the timeout
    /// (a backend that stalls).
    pub fn settle(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut n = lock(&self.inflight);
        while *n > 0 || self.busy.load(Ordering::SeqCst) > 0 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            n = self
                .idle
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    fn mark_broken(&self, why: &str) {
        if !self.broken.swap(true, Ordering::SeqCst) {
            self.stats.broken.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("virtio-blk device needs a reset: {why}");
        }
    }

    /// Runs one job on an I/O thread.
    pub fn run(&self, job: Job) {
        if job.epoch != self.epoch.load(Ordering::SeqCst) {
            self.finish(job.head, job.epoch, None, 0, 0);
            return;
        }
        let start = std::time::Instant::now();
        let (st, written) = self.execute(&job.req);
        if matches!(job.req.op, Op::Read | Op::GetId) {
            // Guest RAM the device wrote (all of it: a read that failed
            // may have written part).
            for seg in &job.req.data {
                self.ram.wrote_host(seg.ptr, seg.len);
            }
        }
        let s = &self.stats;
        s.jobs.fetch_add(1, Ordering::Relaxed);
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        s.wait_ns
            .fetch_add(ns(start - job.taken), Ordering::Relaxed);
        s.io_ns.fetch_add(ns(start.elapsed()), Ordering::Relaxed);
        self.finish(job.head, job.epoch, Some(job.req.status), st, written);
    }

    /// Does a request against the backend: its status and the data bytes
    /// it wrote into guest memory.
    fn execute(&self, req: &Request) -> (u8, u32) {
        let s = &self.stats;
        let offset = req.sector * SECTOR;
        let result = match req.op {
            Op::Read => self.backend.read(offset, &req.data).map(|_| {
                s.reads.fetch_add(1, Ordering::Relaxed);
                s.read_bytes.fetch_add(req.len, Ordering::Relaxed);
                req.len as u32
            }),
            Op::Write => self.backend.write(offset, &req.data).map(|_| {
                s.writes.fetch_add(1, Ordering::Relaxed);
                s.write_bytes.fetch_add(req.len, Ordering::Relaxed);
                0
            }),
            Op::Flush => self.backend.flush().map(|_| {
                s.flushes.fetch_add(1, Ordering::Relaxed);
                0
            }),
            Op::GetId => {
                copy_into(&req.data, &self.id);
                Ok(ID_BYTES as u32)
            }
            Op::Zero {
                zero,
                sector,
                sectors,
            } => {
                let (at, len) = (sector * SECTOR, sectors * SECTOR);
                let r = if zero {
                    self.backend.write_zeroes(at, len)
                } else {
                    self.backend.discard(at, len)
                };
                r.map(|_| {
                    s.zeroes.fetch_add(1, Ordering::Relaxed);
                    0
                })
            }
            Op::Unsupported(_) => {
                s.unsupported.fetch_add(1, Ordering::Relaxed);
                return (status::UNSUPP, 0);
            }
        };
        match result {
            Ok(n) => (status::OK, n),
            Err(e) => {
                s.io_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(op = ?req.op, sector = req.sector, "virtio-blk I/O error: {e}");
                (status::IOERR, 0)
            }
        }
    }

    /// Writes the status byte and puts `head` on the used ring (unless the
    /// device was reset since the job started), then counts it done.
    fn finish(&self, head: u16, epoch: u64, at: Option<GuestAddress>, st: u8, written: u32) {
        let mem = self.ram.mem();
        {
            let mut q = lock(&self.queue);
            if epoch == self.epoch.load(Ordering::SeqCst) && q.ready() {
                let mut used = written;
                if let Some(at) = at {
                    if mem.write_obj(st, at).is_ok() {
                        self.ram.wrote(at.0, 1);
                        used += 1;
                    }
                }
                let added = q.add_used(mem, head, used);
                self.wrote_used_ring(&q);
                match added {
                    Ok(()) => {
                        self.interrupt.fetch_or(1, Ordering::SeqCst);
                    }
                    Err(e) => self.mark_broken(&format!("cannot write the used ring: {e}")),
                }
            }
        }
        let mut n = lock(&self.inflight);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.idle.notify_all();
        }
    }

    /// An I/O thread took a job: it may write the ring until
    /// [`left_ring`](Self::left_ring).
    fn took_job(&self) {
        let _n = lock(&self.inflight);
        self.busy.fetch_add(1, Ordering::SeqCst);
    }

    /// The I/O thread is done with the ring for now.
    fn left_ring(&self) {
        let n = lock(&self.inflight);
        if self.busy.fetch_sub(1, Ordering::SeqCst) == 1 && *n == 0 {
            self.idle.notify_all();
        }
    }
}

/// Copies `src` into the guest segments `dst`, in order, as far as they reach.
fn copy_into(dst: &[HostSeg], src: &[u8]) {
    let mut at = 0;
    for s in dst {
        let n = s.len.min(src.len() - at);
        // SAFETY: `s` is live guest RAM of `s.len` bytes (checked when the
        // request was parsed); `n` is within both.
        unsafe { std::ptr::copy_nonoverlapping(src[at..].as_ptr(), s.ptr, n) };
        at += n;
        if at == src.len() {
            break;
        }
    }
}

/// An I/O thread: runs jobs until the device shuts down; after each, it
/// takes what the driver made available meanwhile and runs the first of
/// it itself.
pub fn io_thread(shared: Arc<Shared>, jobs: Arc<Mutex<Receiver<Job>>>) {
    loop {
        let job = lock(&jobs).recv();
        let Ok(job) = job else { return };
        let mut next = Some(job);
        while let Some(job) = next.take() {
            shared.took_job();
            shared.run(job);
            next = shared.drain(true);
            shared.left_ring();
        }
    }
}
