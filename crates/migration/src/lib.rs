//! ferry's migration engine. It knows nothing of KVM: it moves guest memory
//! and opaque VM state through the small traits in [`vm`], which the VMM
//! implements (and tests implement on plain memory).
//!
//! Layout (docs/architecture.md draws it):
//! - entry points: [`outgoing::migrate`] (source), [`incoming::receive`]
//!   (destination); each dispatches to a mode's file ([`precopy`], which
//!   also runs hybrid's rounds; [`postcopy`]).
//! - [`session`]: what every mode shares on both sides (hello, layout,
//!   bulk streams, state, verify, Complete/Started, the failure guard).
//! - [`transport`]: TCP and Unix connections tagged with a role, fd passing.
//! - data path: [`sender`] (fetch, encode, send; raw is the `none` codec),
//!   [`batch`] (the Pages frames every sender builds),
//!   [`pacer`], [`compress`] (codec policy); on the destination
//!   [`receiver`] and [`pagein`] land everything through one [`sink`].
//! - wire: [`protocol`], [`encoded`], [`checksum`]; figures: [`stats`];
//!   options: [`options`]; ranges with their units: [`ranges`].

pub(crate) mod batch;
pub mod checksum;
pub mod compress;
pub(crate) mod dirty;
pub mod encoded;
mod error;
pub(crate) mod hybrid;
pub mod incoming;
pub mod memory;
pub mod memserver;
pub(crate) mod mode;
pub mod options;
pub mod outgoing;
pub(crate) mod pacer;
pub mod pagein;
pub(crate) mod postcopy;
pub(crate) mod precopy;
pub(crate) mod priority;
pub mod protocol;
pub mod ranges;
pub(crate) mod receiver;
pub(crate) mod sender;
pub(crate) mod session;
pub mod sink;
pub mod split;
pub mod stats;
pub mod telemetry;
pub mod transport;
pub mod vm;

pub use compress::{Backend, BatchEncoder, Compress};
pub use error::{MigrationError, VmOpError};
pub use incoming::{receive, receive_with_reconnect};
pub use memory::RegionView;
pub use options::{
    BackendKind, CompressOptions, MigrateOptions, Mode, PostcopyAfter, Rank, SplitOptions,
};
pub use outgoing::{migrate, resume};
pub use postcopy::PausedPostcopy;
pub use protocol::ProtocolError;
pub use ranges::{GpaBytes, GpaPages, OffsetBytes};
pub use stats::{
    ClientsOutcome, CompressionStats, DowntimeParts, FaultBin, FaultReport, GatherStats,
    IncomingStats, Latency, MigrationStats, Phase, PostcopyStats, Progress, RoundStats,
    SplitServerStats, SplitStats,
};
pub use transport::{Endpoint, Listener};
pub use vm::{AccessHistory, ClientsAnswer, ClientsPlan, IncomingVm, MigratableVm, PageStore};
