//! ferry's migration engine. It knows nothing of KVM: it moves guest memory
//! and opaque VM state through the small traits in `vm.rs`, which the VMM
//! implements (and tests implement on plain memory).
//!
//! Layout (docs/architecture.md draws it):
//! - entry points: [`migrate`] and [`resume`] (source), [`receive`]
//!   (destination); each picks a mode object (`mode.rs`): the source from
//!   the options, the destination from the plan message that arrives.
//! - modes, a file or folder each: `precopy.rs` (the round loop every copy
//!   mode runs, with its hooks), `hybrid.rs`, `postcopy/`, `split/` (split
//!   and gather); `pager/` is a split VM's remote paging after the switch,
//!   [`memserver`] the memory servers, `standby/` postcopy's safety net.
//! - `session/`: what every mode shares on both sides (hello, layout, bulk
//!   streams, state, verify, Complete/Started); the source's session in
//!   rooms (`session/source/`: link, clients, rounds, finish) with the
//!   capabilities negotiated once; each side's state with the safety rule
//!   (`session/state.rs`).
//! - [`transport`]: the only code that touches a socket: TCP, TLS over TCP
//!   and Unix connections tagged with a role, fd passing.
//! - data path: `sender.rs` (fetch, encode, send; raw is the `none` codec),
//!   `batch.rs` (the Pages frames every sender builds), `pacer.rs`,
//!   `governor.rs`, `compress.rs` (codec policy); on the destination
//!   `receiver.rs` and `pagein.rs` land everything through one [`sink`].
//! - wire: [`protocol`] (versions 1 to 18), `encoded.rs`, `checksum.rs`;
//!   figures: `stats.rs`, `telemetry.rs`; options and their [`defaults`]:
//!   `options.rs`; ranges with their units: `ranges.rs`.
//!
//! The front door is the root: what a VMM and the CLI need (the entry
//! points, options, stats, the traits a VMM implements, errors) is
//! re-exported here and the rest is `pub(crate)`. Still public as modules,
//! because each is a whole surface rather than a handful of names:
//! [`protocol`] (the wire, which the hostile tests and fuzz targets write
//! frame by frame), [`transport`] (the socket layer the VMM's control
//! socket and handover use too: admission, security, fd passing),
//! [`memserver`] (a process of its own, `ferry memserver`, with its client
//! and messages), [`sink`] (the landing seam, tested on its own),
//! [`priority`] (thread priorities the VMM's own threads take too: vCPUs,
//! handover, preallocation); and `fuzzing`, the fuzz targets' door to the
//! code that reads a peer's bytes.

pub(crate) mod batch;
pub(crate) mod checksum;
pub(crate) mod compress;
pub(crate) mod destination;
pub(crate) mod dirty;
pub(crate) mod encoded;
mod error;
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod governor;
pub(crate) mod hybrid;
pub(crate) mod memory;
pub mod memserver;
pub(crate) mod mode;
pub(crate) mod options;
pub(crate) mod pacer;
pub(crate) mod pagein;
pub(crate) mod pager;
pub(crate) mod paused;
pub(crate) mod postcopy;
pub(crate) mod precopy;
pub mod priority;
pub mod protocol;
pub(crate) mod random;
pub(crate) mod ranges;
pub(crate) mod receiver;
pub(crate) mod sender;
pub(crate) mod session;
pub(crate) mod shared;
pub mod sink;
pub(crate) mod source;
pub(crate) mod split;
pub(crate) mod standby;
pub(crate) mod stats;
pub(crate) mod telemetry;
pub mod transport;
pub(crate) mod unchanged;
pub(crate) mod verify;
pub(crate) mod vm;
mod vm_error;

pub use compress::{Backend, BatchEncoder};
pub use destination::{receive, receive_with_reconnect};
pub use error::{MigrationError, VmOpError};
pub use memory::{compare_page_hashes, memory_hashes, HashMismatch, RegionView};
pub use options::{
    defaults, AutoConverge, BackendKind, Compress, CompressOptions, MigrateOptions, MigrationToken,
    Mode, PostcopyAfter, Rank, SplitOptions,
};
pub use paused::{Outcome, PausedPostcopy};
pub use protocol::ProtocolError;
pub use ranges::{GpaBytes, GpaPages, OffsetBytes};
pub use source::{migrate, resume};
pub use split::{PagerStats, RemotePager};
pub use standby::Standby;
pub use stats::{
    ClientsOutcome, CompressionStats, DestinationStats, DiskMove, DowntimeParts, FaultBin,
    FaultReport, GatherStats, Latency, MigrationStats, Phase, PostcopyStats, Progress, RoundStats,
    SplitServerStats, SplitStats, StartedReport,
};
pub use telemetry::{unix_now, LivePhase, Telemetry};
pub use transport::{Endpoint, Listener};
pub use vm::{
    AccessHistory, ClientsAnswer, ClientsPlan, DestinationVm, MigratableVm, OwnerFence, PageStore,
    TakeBackAnswer,
};
