//! Which backend a disk has: a raw image file on this host or an NBD
//! export on shared storage, behind one set of calls for the device's
//! queue.

use std::io;

use super::backend::{BackendError, HostSeg, RawFile};
use super::nbd::NbdDisk;
use super::spec::{DiskSource, DiskSpec};

/// Where a disk's blocks live, as the device's queue sees it.
pub enum Backend {
    /// A raw image file on this host.
    Raw(RawFile),
    /// An NBD export.
    Nbd(NbdDisk),
}

impl Backend {
    /// Opens what `spec` names.
    pub fn open(spec: &DiskSpec) -> Result<Self, BackendError> {
        match &spec.source {
            DiskSource::Image(_) => RawFile::open(spec).map(Backend::Raw),
            DiskSource::Nbd(uri) => NbdDisk::open(uri, spec.size).map(Backend::Nbd),
        }
    }

    /// `raw` or `nbd`, for status.
    pub fn kind(&self) -> &'static str {
        match self {
            Backend::Raw(_) => "raw",
            Backend::Nbd(_) => "nbd",
        }
    }

    /// The image's path or the export's address.
    pub fn describe(&self) -> String {
        match self {
            Backend::Raw(f) => f.path().display().to_string(),
            Backend::Nbd(n) => n.describe(),
        }
    }

    /// What names the disk's blocks wherever the VM runs: an NBD export's
    /// name (the same export, reached from any host); None for an image
    /// on this host's own disk.
    pub fn shared_name(&self) -> Option<&str> {
        match self {
            Backend::Raw(_) => None,
            Backend::Nbd(n) => Some(n.export()),
        }
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        match self {
            Backend::Raw(f) => f.size(),
            Backend::Nbd(n) => n.size(),
        }
    }

    /// True if aligned requests go through `O_DIRECT` (images only).
    pub fn direct(&self) -> bool {
        matches!(self, Backend::Raw(f) if f.direct())
    }

    /// Times the link to an NBD server was made again (0 for an image).
    pub fn reconnects(&self) -> u64 {
        match self {
            Backend::Raw(_) => 0,
            Backend::Nbd(n) => n.reconnects(),
        }
    }

    /// Reads the disk from `offset` into `segs`, in order.
    pub fn read(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        match self {
            Backend::Raw(f) => f.read(offset, segs),
            Backend::Nbd(n) => n.read(offset, segs),
        }
    }

    /// Writes `segs`, in order, to the disk from `offset`.
    pub fn write(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        match self {
            Backend::Raw(f) => f.write(offset, segs),
            Backend::Nbd(n) => n.write(offset, segs),
        }
    }

    /// Makes every completed write durable.
    pub fn flush(&self) -> io::Result<()> {
        match self {
            Backend::Raw(f) => f.flush(),
            Backend::Nbd(n) => n.flush(),
        }
    }

    /// Before another VMM takes the disk over: what it must do so that
    /// VMM reads every write this one finished. An NBD server whose
    /// connections are coherent (multi-conn) needs nothing; any other is
    /// flushed (the NBD spec promises nothing across connections without
    /// it). An image is flushed.
    pub fn hand_off(&self) -> io::Result<()> {
        match self {
            Backend::Nbd(n) if n.coherent() => Ok(()),
            _ => self.flush(),
        }
    }

    /// Zeroes `len` bytes from `offset`.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        match self {
            Backend::Raw(f) => f.write_zeroes(offset, len),
            Backend::Nbd(n) => n.write_zeroes(offset, len),
        }
    }

    /// Discards `len` bytes from `offset`.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        match self {
            Backend::Raw(f) => f.discard(offset, len),
            Backend::Nbd(n) => n.discard(offset, len),
        }
    }
}
