//! ferry's migration engine. It knows nothing of KVM: it moves guest memory
//! and opaque VM state through the small traits in [`vm`], which the VMM
//! implements (and tests implement on plain memory).
//!
//! Layout: [`protocol`] is the wire format, [`precopy`] the sending side,
//! [`incoming`] the receiving side, [`stats`] what a migration measured.

pub mod checksum;
pub mod compress;
pub mod encoded;
pub mod incoming;
pub mod pagein;
pub(crate) mod pipeline;
pub mod precopy;
pub mod protocol;
pub mod stats;
pub mod vm;
pub mod written;

pub use compress::{Backend, BatchEncoder, Compress, CompressOptions};
pub use incoming::receive;
pub use precopy::{migrate, PrecopyOptions};
pub use protocol::ProtocolError;
pub use stats::{CompressionStats, MigrationStats, Progress, RoundStats};
pub use vm::{IncomingVm, MigratableVm, RegionView};

/// Why a migration failed. On the source, every failure leaves the VM
/// running there with nothing lost.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The wire protocol failed or the peer refused.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The VMM could not do what the engine asked.
    #[error("VM operation '{op}' failed: {reason}")]
    Vm {
        /// What was asked.
        op: &'static str,
        /// The VMM's error.
        reason: String,
    },
    /// The two sides describe different VMs.
    #[error("the destination VM does not match: {0}")]
    Mismatch(String),
    /// End-to-end verification found differences.
    #[error("verification failed: {bad} of {total} pages differ (first at {first:#x})")]
    Verify {
        /// Pages that differ.
        bad: u64,
        /// Pages compared.
        total: u64,
        /// First differing guest address.
        first: u64,
    },
    /// Complete was sent but no Started came back: the destination may or
    /// may not run the VM. The source keeps it paused.
    #[error("the destination got everything but did not confirm the start ({0}); the VM stays paused here: resume it only if the destination did not start it")]
    InDoubt(String),
    /// A codec failed on the source's own pages (a bug, not bad input).
    #[error("encoding a batch failed: {0}")]
    Codec(String),
    /// Could not connect.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// Destination.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
}

impl MigrationError {
    pub(crate) fn vm(op: &'static str) -> impl FnOnce(String) -> MigrationError {
        move |reason| MigrationError::Vm { op, reason }
    }
}
