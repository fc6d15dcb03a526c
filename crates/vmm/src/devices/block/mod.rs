//! A virtio-blk disk (virtio 1.x, split virtqueue, virtio-mmio transport),
//! as a standard guest driver would use it, backed by a local raw image or
//! an NBD export on shared storage.
//!
//! One responsibility per file: `mmio.rs` the transport's registers and
//! status/feature handshake, `queue.rs` the virtqueue and the I/O threads,
//! `request.rs` parsing and checking one request, `backend.rs` the image
//! file, `nbd.rs` an NBD export, `backends.rs` the choice between them, `memory.rs` guest RAM as rust-vmm's crates see it, `spec.rs` the
//! `--disk` text. This file ties them into a [`BlockDevice`] at its MMIO
//! window.
//!
//! rust-vmm's `virtio-queue` walks the split rings (it bounds every chain
//! by the queue size, follows `next` indices only inside the table and
//! checks the avail index), `virtio-bindings` gives the spec's constants,
//! and `vm-memory` is the view of guest RAM they need: an adapter over
//! ferry's memfd mappings costs a few lines (`memory.rs`), so nothing here
//! walks rings by hand.
//!
//! Interrupts: the device sets InterruptStatus for every used buffer but
//! injects nothing yet; ferry's test guest drives the queue from CPL3 and
//! polls the used ring (guest/user/vblk.c), which is how its service ring
//! works too. A guest that needs an interrupt line is later work.
//!
//! Migration: a disk on shared storage (NBD) stays on its server; the
//! pause settles the requests in flight ([`BlockDevice::settle`]), the
//! device's state ([`DiskState`]) rides with the VM's, and every page the
//! device writes into guest RAM reaches the dirty log through its
//! [`memory::WriteMarker`]. A local image cannot migrate yet; a handover
//! (same host) hands every disk over (docs/disks.md).

pub mod backend;
pub mod backends;
pub mod memory;
pub mod mmio;
pub mod nbd;
pub mod queue;
pub mod request;
pub mod spec;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_memory::GuestMemory;
use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

pub use backend::{BackendError, RawFile};
pub use backends::Backend;
pub use spec::{DiskSource, DiskSpec, DiskSpecError};

use mmio::{Action, Transport, TransportState};
use queue::{BlockStats, Shared, IO_THREADS};
use request::{MAX_DATA, MAX_SEGS};
use virtio_queue::{Queue, QueueState, QueueT};

/// Guest address of disk 0's register window; disk `i` is `i` windows on.
pub const MMIO_BASE: u64 = crate::guest_abi::BLK_MMIO_GPA;
/// Most disks a VM has (their windows share the doorbell's 2 MiB page).
pub const MAX_DISKS: usize = 4;

/// Why a disk could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Guest memory could not be described to the virtio crates.
    #[error("virtio-blk: {0}")]
    Memory(#[from] memory::AdaptError),
    /// An I/O thread could not start.
    #[error("virtio-blk: cannot start an I/O thread: {0}")]
    Thread(std::io::Error),
    /// More disks than windows.
    #[error("at most {MAX_DISKS} disks per VM")]
    TooMany,
}

/// Why a migrated disk's state was refused here.
#[derive(Debug, thiserror::Error)]
pub enum DiskStateError {
    /// Not the disk the source had.
    #[error("disk {index}: the source's disk is {theirs}, this VMM's is {ours}: start the destination with the same shared disks (docs/disks.md)")]
    NotTheSame {
        /// Which disk.
        index: usize,
        /// What the source had.
        theirs: String,
        /// What this VMM has.
        ours: String,
    },
    /// The source's VM has another number of disks.
    #[error("the source's VM has {theirs} disk(s), this VMM {ours}: start the destination with the same shared disks (docs/disks.md)")]
    Count {
        /// The source's.
        theirs: usize,
        /// Ours.
        ours: usize,
    },
    /// The driver's settings or the queue cannot be taken.
    #[error("disk {index}: the guest driver's state cannot be restored: {why}")]
    Driver {
        /// Which disk.
        index: usize,
        /// Why.
        why: String,
    },
}

/// The queue's registers and ring positions, as a migration carries them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueRegs {
    /// Entries the driver chose.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Guest addresses of the descriptor table, available and used rings.
    pub desc: u64,
    /// As above.
    pub avail: u64,
    /// As above.
    pub used: u64,
    /// The next available entry the device takes.
    pub next_avail: u16,
    /// The next used entry the device fills.
    pub next_used: u16,
}

/// One disk's device state: which disk it is, what its driver set, where
/// its queue stands. Taken with no request in flight (see
/// [`BlockDevice::settle`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskState {
    /// `nbd` (shared storage: the only kind that moves so far).
    pub backend: String,
    /// The export's name.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// The register file.
    pub transport: TransportState,
    /// The queue.
    pub queue: QueueRegs,
    /// InterruptStatus.
    pub interrupt: u32,
}

/// A disk as `ferry status` shows it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct DiskInfo {
    /// Which disk (its window is MMIO_BASE + index × 4 KiB).
    pub index: usize,
    /// `raw`: a local image file; `nbd`: an NBD export.
    pub backend: String,
    /// The image, or the export's address.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Times the link to the NBD server was made again (0 for an image).
    pub reconnects: u64,
    /// True if aligned requests bypass the host's page cache.
    pub direct_io: bool,
    /// Read requests done.
    pub reads: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Write requests done.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Discards and write-zeroes.
    pub zeroes: u64,
    /// Requests the backend failed.
    pub io_errors: u64,
    /// Malformed requests refused.
    pub bad_requests: u64,
    /// Times the queue was found broken.
    pub broken: u64,
    /// The driver finished set-up and the device runs.
    pub live: bool,
    /// Doorbells the driver rang (fewer than requests while the queue is
    /// busy: the device then says NO_NOTIFY).
    pub notifies: u64,
    /// Mean µs from a request leaving the ring to an I/O thread starting it.
    pub wait_us_mean: f64,
    /// Mean µs a request spent in the backend.
    pub io_us_mean: f64,
}

/// One virtio-blk device.
pub struct BlockDevice {
    index: usize,
    /// What `--disk` said (a handover's new process opens the same).
    spec: DiskSpec,
    transport: Mutex<Transport>,
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The features the device offers.
pub fn features() -> u64 {
    (1u64 << VIRTIO_F_VERSION_1)
        | (1 << vb::VIRTIO_BLK_F_SIZE_MAX)
        | (1 << vb::VIRTIO_BLK_F_SEG_MAX)
        | (1 << vb::VIRTIO_BLK_F_FLUSH)
        | (1 << vb::VIRTIO_BLK_F_DISCARD)
        | (1 << vb::VIRTIO_BLK_F_WRITE_ZEROES)
}

/// `struct virtio_blk_config` for a disk of `capacity` sectors.
fn config_space(capacity: u64) -> Vec<u8> {
    let mut c = vec![0u8; 60];
    let put32 =
        |c: &mut Vec<u8>, at: usize, v: u32| c[at..at + 4].copy_from_slice(&v.to_le_bytes());
    c[0..8].copy_from_slice(&capacity.to_le_bytes());
    put32(&mut c, 8, MAX_DATA as u32); // size_max
    put32(&mut c, 12, MAX_SEGS as u32); // seg_max
    put32(&mut c, 20, 512); // blk_size
    c[34..36].copy_from_slice(&1u16.to_le_bytes()); // num_queues
    let max_sectors = u32::try_from(capacity).unwrap_or(u32::MAX);
    put32(&mut c, 36, max_sectors); // max_discard_sectors
    put32(&mut c, 40, 1); // max_discard_seg
    put32(&mut c, 44, 1); // discard_sector_alignment
    put32(&mut c, 48, max_sectors); // max_write_zeroes_sectors
    put32(&mut c, 52, 1); // max_write_zeroes_seg
    c[56] = 1; // write_zeroes_may_unmap
    c
}

impl BlockDevice {
    /// Opens disk `index`'s image and starts its I/O threads; `marker` is
    /// told of every page the device writes into guest RAM.
    pub fn new(
        index: usize,
        spec: &DiskSpec,
        memory: Arc<GuestMemory>,
        marker: Option<memory::WriteMarker>,
    ) -> Result<Arc<Self>, BlockError> {
        if index >= MAX_DISKS {
            return Err(BlockError::TooMany);
        }
        let backend = Backend::open(spec)?;
        let ram = memory::GuestRam::new(memory)?.with_marker(marker);
        let (tx, rx) = std::sync::mpsc::channel();
        let rx = Arc::new(Mutex::new(rx));
        let shared = Arc::new(Shared::new(ram, backend, &format!("ferry-disk{index}"), tx));
        let transport = Transport::new(features(), config_space(shared.capacity()));
        for k in 0..IO_THREADS {
            let (s, r) = (shared.clone(), rx.clone());
            std::thread::Builder::new()
                .name(format!("blk{index}-io{k}"))
                .spawn(move || queue::io_thread(s, r))
                .map_err(BlockError::Thread)?;
        }
        Ok(Arc::new(BlockDevice {
            index,
            spec: spec.clone(),
            transport: Mutex::new(transport),
            shared,
        }))
    }

    /// The disk as another VMM process on this host opens it: the same
    /// export, or the same image by its absolute path (a new process may
    /// run elsewhere in the file tree), at its size, never created.
    pub fn spec_for_handover(&self) -> DiskSpec {
        let source = match &self.spec.source {
            DiskSource::Image(p) => {
                DiskSource::Image(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
            }
            nbd => nbd.clone(),
        };
        DiskSpec {
            source,
            size: Some(self.shared.backend.size()),
            create: false,
        }
    }

    /// The guest address of this device's register window.
    pub fn base(&self) -> u64 {
        MMIO_BASE + self.index as u64 * mmio::WINDOW
    }

    /// True if `addr` is in this device's window.
    pub fn owns(&self, addr: u64) -> bool {
        (self.base()..self.base() + mmio::WINDOW).contains(&addr)
    }

    fn transport(&self) -> MutexGuard<'_, Transport> {
        let mut t = lock(&self.transport);
        if self.shared.broken.load(Ordering::SeqCst) {
            t.set_needs_reset();
        }
        t
    }

    /// A guest load from the window.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        let mut t = self.transport();
        let q = lock(&self.shared.queue);
        let irq = self.shared.interrupt.load(Ordering::SeqCst);
        t.read(&q, irq, addr - self.base(), data);
    }

    /// A guest store to the window.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        let offset = addr - self.base();
        let mut t = self.transport();
        if offset == mmio::reg::STATUS && data.iter().all(|b| *b == 0) {
            // A reset: nothing in flight may touch guest memory after it.
            self.shared.quiesce();
        }
        if offset == mmio::reg::INTERRUPT_ACK && data.len() == 4 {
            let bits = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            self.shared.interrupt.fetch_and(!bits, Ordering::SeqCst);
        }
        let action = {
            let mut q = lock(&self.shared.queue);
            t.write(&mut q, offset, data)
        };
        match action {
            Action::Notify(0) if t.live() => {
                drop(t);
                self.shared.stats.notifies.fetch_add(1, Ordering::Relaxed);
                self.shared.drain(false);
            }
            Action::Notify(_) | Action::None | Action::Reset => {}
        }
    }

    /// Its figures for `ferry status`.
    pub fn info(&self) -> DiskInfo {
        let s: &BlockStats = &self.shared.stats;
        let b = &self.shared.backend;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        DiskInfo {
            index: self.index,
            backend: b.kind().into(),
            path: b.describe(),
            size: b.size(),
            reconnects: b.reconnects(),
            direct_io: b.direct(),
            reads: get(&s.reads),
            read_bytes: get(&s.read_bytes),
            writes: get(&s.writes),
            write_bytes: get(&s.write_bytes),
            flushes: get(&s.flushes),
            zeroes: get(&s.zeroes),
            io_errors: get(&s.io_errors),
            bad_requests: get(&s.bad_requests),
            broken: get(&s.broken),
            live: lock(&self.transport).live(),
            notifies: get(&s.notifies),
            wait_us_mean: get(&s.wait_ns) as f64 / get(&s.jobs).max(1) as f64 / 1000.0,
            io_us_mean: get(&s.io_ns) as f64 / get(&s.jobs).max(1) as f64 / 1000.0,
        }
    }

    /// [reads, writes, bytes read, bytes written] so far (atomics only:
    /// cheap enough for a timeline sample every 10 ms).
    pub fn io_counters(&self) -> [u64; 4] {
        let s = &self.shared.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        [
            get(&s.reads),
            get(&s.writes),
            get(&s.read_bytes),
            get(&s.write_bytes),
        ]
    }

    /// Stops the I/O threads once the jobs queued are done.
    pub fn shutdown(&self) {
        self.shared.shutdown();
    }

    /// With the vCPUs paused: waits until no request is in flight (so the
    /// device wrote all it will into guest RAM and the used ring), then
    /// makes its writes visible to the next VMM (`Backend::hand_off`: a
    /// flush unless the NBD server's connections are coherent; a flush of
    /// qemu-nbd's image took ~50 ms of downtime here, which multi-conn
    /// spares). An error if requests still run after `timeout` or the
    /// flush fails: the VM must not move then.
    pub fn settle(&self, timeout: std::time::Duration) -> Result<(), String> {
        if !self.shared.settle(timeout) {
            return Err(format!(
                "disk {}: requests to {} still in flight after {} s",
                self.index,
                self.shared.backend.describe(),
                timeout.as_secs()
            ));
        }
        if lock(&self.transport).live() {
            self.shared
                .backend
                .hand_off()
                .map_err(|e| format!("disk {}: flush: {e}", self.index))?;
        }
        Ok(())
    }

    /// Its state for a migration (taken once [`settle`](Self::settle)d).
    pub fn state(&self) -> DiskState {
        let t = lock(&self.transport);
        let q = lock(&self.shared.queue);
        let b = &self.shared.backend;
        DiskState {
            backend: b.kind().into(),
            name: b.shared_name().map_or_else(|| b.describe(), str::to_string),
            size: b.size(),
            transport: t.state(),
            queue: QueueRegs {
                size: q.size(),
                ready: q.ready(),
                desc: q.desc_table(),
                avail: q.avail_ring(),
                used: q.used_ring(),
                next_avail: q.next_avail(),
                next_used: q.next_used(),
            },
            interrupt: self.shared.interrupt.load(Ordering::SeqCst),
        }
    }

    /// Takes a moved disk's state, into a VM that has not started: only
    /// the same disk (kind, export name or image path, size), with driver
    /// settings this device accepts. (A migration's destination has NBD
    /// disks only, so a local image's state never fits there; a handover's
    /// new process opened the same image.)
    pub fn restore(&self, s: &DiskState) -> Result<(), DiskStateError> {
        let b = &self.shared.backend;
        let name = b.shared_name().map_or_else(|| b.describe(), str::to_string);
        let ours = DiskIdentity::of(b.kind(), &name, b.size());
        let theirs = DiskIdentity::of(&s.backend, &s.name, s.size);
        if ours != theirs {
            return Err(DiskStateError::NotTheSame {
                index: self.index,
                theirs: theirs.0,
                ours: ours.0,
            });
        }
        let driver = |why: String| DiskStateError::Driver {
            index: self.index,
            why,
        };
        let queue = Queue::try_from(QueueState {
            max_size: queue::QUEUE_MAX,
            next_avail: s.queue.next_avail,
            next_used: s.queue.next_used,
            event_idx_enabled: false,
            size: s.queue.size,
            ready: s.queue.ready,
            desc_table: s.queue.desc,
            avail_ring: s.queue.avail,
            used_ring: s.queue.used,
        })
        .map_err(|e| driver(format!("queue: {e}")))?;
        let mut t = lock(&self.transport);
        t.restore(&s.transport).map_err(driver)?;
        *lock(&self.shared.queue) = queue;
        self.shared.interrupt.store(s.interrupt, Ordering::SeqCst);
        Ok(())
    }
}

/// A disk as a migration names it: kind, export name, size.
#[derive(PartialEq)]
struct DiskIdentity(String);

impl DiskIdentity {
    fn of(kind: &str, name: &str, size: u64) -> Self {
        DiskIdentity(format!("{kind} export {name:?} of {size} bytes"))
    }
}

impl Drop for BlockDevice {
    /// The I/O threads hold the shared state; they end with the device.
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Why a VM with these disks may not migrate to another host now (None:
/// it may). A disk on shared storage (an NBD export) stays where it is and
/// the destination attaches the same export; a local image would stay
/// behind, and moving its blocks is not built yet: writes the guest made
/// could be lost, so such a migration is refused before anything starts.
pub fn why_not_migrate(disks: &[Arc<BlockDevice>]) -> Option<String> {
    let local: Vec<String> = disks
        .iter()
        .filter(|d| d.shared.backend.shared_name().is_none())
        .map(|d| d.info().path)
        .collect();
    if local.is_empty() {
        return None;
    }
    Some(format!(
        "the VM has {} disk(s) on local images ({}), and moving a local disk is not built yet: \
         migrating the VM now could lose writes its guest made, so nothing was started; disks on \
         shared storage (nbd://) move (docs/disks.md)",
        local.len(),
        local.join(", ")
    ))
}

#[cfg(test)]
mod tests;
