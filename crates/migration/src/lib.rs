//! ferry's migration engine. It knows nothing of KVM: it moves guest memory
//! and opaque VM state through the small traits in [`vm`], which the VMM
//! implements (and tests implement on plain memory).
//!
//! Layout (docs/architecture.md draws it):
//! - entry points: [`source::migrate`] and [`source::resume`] (source),
//!   [`destination::receive`] (destination); each picks a mode object
//!   ([`mode`]): the source from the options, the destination from the
//!   plan message that arrives.
//! - modes, a file or folder each: [`precopy`] (the round loop every copy
//!   mode runs, with its hooks), [`hybrid`], [`postcopy`], [`split`]
//!   (split and gather); [`pager`] is a split VM's remote paging after the
//!   switch, and [`memserver`] the memory servers.
//! - [`session`]: what every mode shares on both sides (hello, layout,
//!   bulk streams, state, verify, Complete/Started) and each side's state
//!   with the safety rule ([`session::state`]).
//! - [`transport`]: the only code that touches a socket: TCP and Unix
//!   connections tagged with a role, fd passing.
//! - data path: [`sender`] (fetch, encode, send; raw is the `none` codec),
//!   [`batch`] (the Pages frames every sender builds),
//!   [`pacer`], [`compress`] (codec policy); on the destination
//!   [`receiver`] and [`pagein`] land everything through one [`sink`].
//! - wire: [`protocol`], [`encoded`], [`checksum`]; figures: [`stats`],
//!   [`telemetry`]; options: [`options`]; ranges with their units:
//!   [`ranges`]; the VMM's side: [`vm`].

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
pub mod options;
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
pub mod split;
pub(crate) mod standby;
pub(crate) mod stats;
pub mod telemetry;
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
    BackendKind, Compress, CompressOptions, MigrateOptions, MigrationToken, Mode, PostcopyAfter,
    Rank, SplitOptions,
};
pub use paused::{Outcome, PausedPostcopy};
pub use protocol::ProtocolError;
pub use ranges::{GpaBytes, GpaPages, OffsetBytes};
pub use source::{migrate, resume};
pub use standby::Standby;
pub use stats::{
    ClientsOutcome, CompressionStats, DestinationStats, DowntimeParts, FaultBin, FaultReport,
    GatherStats, Latency, MigrationStats, Phase, PostcopyStats, Progress, RoundStats,
    SplitServerStats, SplitStats, StartedReport,
};
pub use transport::{Endpoint, Listener};
pub use vm::{
    AccessHistory, ClientsAnswer, ClientsPlan, DestinationVm, MigratableVm, OwnerFence, PageStore,
    TakeBackAnswer,
};
