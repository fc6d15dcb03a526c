//! Why a migration failed, as one typed enum with the cause chained.

use crate::protocol::ProtocolError;
use crate::sink::SinkError;
pub use crate::vm_error::VmOpError;

/// Why a migration failed. On the source, every failure but
/// [`MigrationError::InDoubt`] leaves the VM running there with nothing lost.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The wire protocol failed or the peer refused.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The VMM could not do what the engine asked.
    #[error("VM operation '{op}' failed: {source}")]
    Vm {
        /// What was asked.
        op: &'static str,
        /// The VMM's error.
        source: VmOpError,
    },
    /// A bulk stream failed (a corrupt frame, a bad address, a broken
    /// connection); the stream's own error is the source.
    #[error("bulk stream {stream}: {source}")]
    Stream {
        /// Stream number.
        stream: u16,
        /// What went wrong on it.
        source: Box<MigrationError>,
    },
    /// Pages could not land in the destination's memory.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A memory server refused a peer or a request.
    #[error(transparent)]
    Store(#[from] crate::memserver::StoreError),
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
    /// Verification of a v12 precopy in the pause: pages that landed are
    /// not the pages that were sent.
    #[error("verification failed: the pages that landed differ from those sent in {digests} of {total} stretches of 16 MiB (the first at {first:#x})")]
    VerifyLanded {
        /// Stretches that differ.
        digests: u64,
        /// Stretches compared.
        total: u64,
        /// First guest address of the first that differs.
        first: u64,
    },
    /// Verification after the VM started at the destination: the source's
    /// memory, frozen since the pause, differs from what it sent.
    #[error("verification failed after the VM started at the destination: {bad} of {total} pages here changed after they were last sent (first at {first:#x}), so the destination runs them stale; the VM stays paused here with all its memory")]
    VerifyAfterSwitch {
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
    /// The owner fence refused the move (docs/safety.md): the destination
    /// may not take the VM, or the two sides do not fence alike.
    #[error("ownership: {0}")]
    Fence(String),
    /// Complete went out, the switch then failed, and the registry says the
    /// destination took the VM: it runs there, never again here.
    #[error("the switch failed ({error}), but the registry says the destination took the VM ({holder}): it runs there, and nothing here runs it again")]
    HandedOver {
        /// What failed.
        error: String,
        /// Who holds the VM, as the registry says.
        holder: String,
    },
    /// Postcopy failed after the VM started at the destination (source
    /// side): the source keeps the VM paused with all its memory.
    #[error("postcopy broke after the VM started at the destination: {reason}. {unsent} of {pending} pending pages had not been sent, and the destination had not confirmed the rest; the VM stays paused here with all its memory: do not resume it here while the destination runs it")]
    PostcopyBroken {
        /// What failed.
        reason: String,
        /// Pending pages never sent.
        unsent: u64,
        /// Pages pending at the switch.
        pending: u64,
    },
    /// Postcopy failed at the destination after its VM started: pages it
    /// needs never arrived.
    #[error("postcopy failed after the VM started here: {reason}. {missing} pages never arrived (first at {first:#x}); the VM cannot run on without them: only the source had them, and it keeps the VM paused there if it still runs")]
    PagesLost {
        /// What failed.
        reason: String,
        /// Pages that never arrived.
        missing: u64,
        /// The first of them.
        first: u64,
    },
    /// A codec failed on the source's own pages (a bug, not bad input).
    #[error("encoding a batch failed: {0}")]
    Codec(#[source] VmOpError),
    /// Could not connect.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// Destination.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Could not listen or accept.
    #[error("cannot accept migration connections on {addr}: {source}")]
    Listen {
        /// Where.
        addr: String,
        /// OS error.
        source: std::io::Error,
    },
    /// What was asked cannot be done by this build or with these options.
    #[error("{0}")]
    Unsupported(String),
    /// The engine broke its own rule (a bug): reported, not acted on.
    #[error("internal error: {0}")]
    Internal(String),
}

impl MigrationError {
    /// Wraps a VMM error as the failure of operation `op`.
    pub(crate) fn vm<E: Into<VmOpError>>(op: &'static str) -> impl FnOnce(E) -> MigrationError {
        move |e| MigrationError::Vm {
            op,
            source: e.into(),
        }
    }

    /// True if the error is a connection that broke or went silent (as
    /// opposed to a peer that refused, or a corrupt stream): postcopy
    /// pauses and reconnects on these.
    pub fn is_link_break(&self) -> bool {
        match self {
            MigrationError::Protocol(
                ProtocolError::Io(_) | ProtocolError::Closed | ProtocolError::Truncated,
            )
            | MigrationError::Connect { .. } => true,
            MigrationError::Stream { source, .. } => source.is_link_break(),
            _ => false,
        }
    }

    /// True if the peer said it gives up (its reason is in the error).
    pub fn is_peer_abort(&self) -> bool {
        match self {
            MigrationError::Protocol(ProtocolError::Aborted(_)) => true,
            MigrationError::Stream { source, .. } => source.is_peer_abort(),
            _ => false,
        }
    }
}
