//! [`StoreError`]: every way a memory server refuses a peer or a request.
//! The server sends its text as the Abort reason, so the client reads the
//! same words.

use std::time::Duration;

use crate::protocol::Kind;

/// Why a memory server refused.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The layout is not one a VM can have, or more than the server maps.
    #[error("bad layout: {0}")]
    Layout(String),
    /// A sparse memfd could not be made.
    #[error(transparent)]
    Region(#[from] ferry_memory::RegionError),
    /// The peer opened a VM's store with another secret than its owner's.
    #[error("not the owner of VM {vm}: this connection's secret is not the one the VM's store was opened with")]
    NotOwner {
        /// The VM id asked for.
        vm: String,
    },
    /// A held VM opened with another layout.
    #[error("VM {vm} is held here with layout {held:?}, not {asked:?}")]
    LayoutChanged {
        /// The VM.
        vm: String,
        /// The store's layout.
        held: Vec<(u64, u64)>,
        /// The layout asked for.
        asked: Vec<(u64, u64)>,
    },
    /// A reservation larger than the room not yet held or reserved.
    #[error("this memory server has {free} pages free, {asked} asked for VM {vm}")]
    NoRoom {
        /// The VM.
        vm: String,
        /// Pages asked for.
        asked: u64,
        /// Pages free.
        free: u64,
    },
    /// The VM id is empty, too long or not printable.
    #[error("bad VM id {0:?}: 1 to 128 printable ASCII characters")]
    VmId(String),
    /// A client older than the server's oldest Store version.
    #[error("memory servers need protocol v{need} (store owner secrets); this client speaks v{min}..=v{max}: upgrade ferry there")]
    TooOld {
        /// The version needed.
        need: u16,
        /// The client's oldest.
        min: u16,
        /// The client's newest.
        max: u16,
    },
    /// A connection that is not a Store connection.
    #[error("this is a ferry memory server; a {0} connection belongs to a VMM")]
    NotStore(String),
    /// All connection slots are taken.
    #[error("this memory server serves {0} connections already (its limit); try again later")]
    Busy(usize),
    /// The peer did not say Hello and open a store in time, or went silent.
    #[error("{what} within {after:?}: connection closed")]
    Silent {
        /// What did not happen.
        what: &'static str,
        /// How long the server waited.
        after: Duration,
    },
    /// A request's body is larger than its kind may be.
    #[error(
        "a {kind:?} request of {len} bytes is over this memory server's {most}-byte limit for it"
    )]
    TooLarge {
        /// Kind.
        kind: Kind,
        /// Its length.
        len: u32,
        /// The limit.
        most: u32,
    },
    /// A request names more runs, addresses or pages than it may.
    #[error("a {kind:?} request names {count} {what}, over the limit of {most}")]
    TooMany {
        /// Kind.
        kind: Kind,
        /// What was counted.
        what: &'static str,
        /// How many.
        count: u64,
        /// The limit.
        most: u64,
    },
    /// A run or page outside the VM's memory (or not page aligned).
    #[error("{pages} pages at {gpa:#x} are not inside VM {vm}'s memory")]
    Outside {
        /// The VM.
        vm: String,
        /// First page.
        gpa: u64,
        /// Pages.
        pages: u64,
    },
    /// All buffers' room is taken and none came back in time.
    #[error(
        "this memory server has no buffer room for a {bytes}-byte request now; try again later"
    )]
    NoBuffer {
        /// Bytes asked.
        bytes: u64,
    },
    /// The kernel's random source failed (a client making a secret).
    #[error("cannot make a store secret: {0}")]
    Random(std::io::Error),
}
