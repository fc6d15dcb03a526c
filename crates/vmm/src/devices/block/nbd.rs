//! A disk on shared storage: an export of an NBD server (qemu-nbd, nbdkit)
//! through ferry's NBD client (crates/nbd), with this process's TLS
//! credentials for `nbds://`. The server's bytes go through a buffer of
//! the device's own before they reach guest memory (and guest data through
//! one before it leaves), so no Rust reference ever points into memory the
//! guest may write. A server that dies or stalls costs the guest a wait
//! while the client reconnects (`Options::reconnect_within`), then an I/O
//! error for that request; the VM itself goes on.

use std::io;

use ferry_nbd::client::Options;
use ferry_nbd::{Client, NbdUri, Transport};

use super::backend::{BackendError, HostSeg};
use super::spec::SECTOR;

/// An NBD export as a disk.
pub struct NbdDisk {
    client: Client,
    size: u64,
    export: String,
}

impl NbdDisk {
    /// Connects to `uri` (as given to `--disk`) and checks the export
    /// against the declared size (`declared`: None takes the export's).
    pub fn open(uri: &str, declared: Option<u64>) -> Result<Self, BackendError> {
        let err = |reason: String| BackendError::Nbd {
            uri: uri.to_string(),
            reason,
        };
        let parsed = NbdUri::parse(uri).map_err(|e| err(e.to_string()))?;
        let tls = ferry_migration::transport::credentials();
        if matches!(parsed.transport, Transport::Tcp { tls: false, .. }) {
            tracing::warn!(
                "the disk's link to {uri} is not encrypted: anyone on the path can read and \
                 change the guest's disk; use nbds:// with the server's TLS"
            );
        }
        let client =
            Client::connect(&parsed, tls, Options::default()).map_err(|e| err(e.to_string()))?;
        let export = client.export();
        if export.read_only {
            return Err(err(
                "the export is read-only; a ferry disk is written".into()
            ));
        }
        if export.min_block > SECTOR as u32 {
            return Err(err(format!(
                "the export needs {}-byte aligned requests; a virtio-blk disk sends 512-byte sectors",
                export.min_block
            )));
        }
        let size = match declared {
            Some(d) if d > export.size => {
                return Err(err(format!(
                    "the export holds {} bytes, shorter than its declared size of {d} bytes",
                    export.size
                )))
            }
            Some(d) => d,
            None => export.size - export.size % SECTOR,
        };
        if size == 0 {
            return Err(err("the export holds no whole 512-byte sector".into()));
        }
        Ok(NbdDisk {
            client,
            size,
            export: parsed.export,
        })
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// True if the server says its connections see each other's writes
    /// (NBD_FLAG_CAN_MULTI_CONN): another VMM's connection reads what this
    /// one wrote without a flush first.
    pub fn coherent(&self) -> bool {
        self.client.export().multi_conn
    }

    /// The export's name on its server.
    pub fn export(&self) -> &str {
        &self.export
    }

    /// The export's address.
    pub fn describe(&self) -> String {
        self.client.describe()
    }

    /// Reads the disk from `offset` into `segs`, in order.
    pub fn read(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        let mut buf = vec![0u8; segs.iter().map(|s| s.len).sum()];
        self.client
            .read_at(&mut buf, offset)
            .map_err(io::Error::other)?;
        let mut at = 0;
        for s in segs {
            // SAFETY: `s` is guest memory the request owns (HostSeg), `len`
            // bytes long; `buf` holds at least `at + len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(at), s.ptr, s.len) };
            at += s.len;
        }
        Ok(())
    }

    /// Writes `segs`, in order, to the disk from `offset`.
    pub fn write(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        let mut buf = Vec::with_capacity(segs.iter().map(|s| s.len).sum());
        for s in segs {
            let at = buf.len();
            buf.resize(at + s.len, 0);
            // SAFETY: as in `read`; the guest's bytes are only read.
            unsafe { std::ptr::copy_nonoverlapping(s.ptr, buf.as_mut_ptr().add(at), s.len) };
        }
        self.client
            .write_at(&buf, offset, false)
            .map_err(io::Error::other)
    }

    /// Makes every completed write durable at the server.
    pub fn flush(&self) -> io::Result<()> {
        self.client.flush().map_err(io::Error::other)
    }

    /// Zeroes `len` bytes from `offset`.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client
            .write_zeroes(offset, len)
            .map_err(io::Error::other)
    }

    /// Discards `len` bytes from `offset` (advisory).
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client.trim(offset, len).map_err(io::Error::other)
    }

    /// How many times the link to the server was made again.
    pub fn reconnects(&self) -> u64 {
        self.client.reconnects()
    }
}
