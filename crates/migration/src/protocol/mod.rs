//! ferry's migration wire protocol. This code speaks versions 1 to 18
//! ([`VERSION_MIN`]..=[`VERSION_MAX`]; `version.rs` says what each one
//! added); docs/protocol.md is the full text, with every message's body and
//! the rules for adding a version.
//!
//! A migration is a few connections, all opened by the source, each
//! starting with a `Hello` that names its role; every message is one frame
//! (16-byte header, then a postcard or raw body):
//!
//! ```text
//! source                                            destination
//!  control  Hello{MIN..=MAX, Control, session, streams} ──▶
//!                                                   ◀──  HelloAck{version}  or Abort
//!  control  [Token], Layout                          ──▶  admitted, checked against the waiting VM
//!  control  ClientsPlan, TimelineAsk, HashAsk,       ──▶  each from the version that added it;
//!           SwitchAhead, ShareAsk, AnswersAsk        ◀──  some are answered (ClientsAnswer, ...)
//!  bulk i   Hello{Bulk(i), session}, one per stream  ──▶
//!  bulk i   Pages / Encoded / ZeroRanges / SharedPages ──▶  written into guest memory
//!  control  RoundDone{round, frames per stream}      ──▶  waits for them all
//!                                                   ◀──  RoundAck
//!  ... rounds; then precopy pauses the VM and sends State (from v15
//!  before its last round) and the last pages, or postcopy sends
//!  PostcopyPlan and opens the demand connection:
//!  demand   Hello{Demand, session}                   ──▶
//!  control  [State], [Verify or VerifyDigests], Complete ──▶  restores, starts the vCPUs
//!                                                   ◀──  Started
//!  postcopy only, after Started:
//!  demand   Pages{p and its neighbours}              ◀──  PageRequest{p}: a vCPU waits on p
//!  bulk i   Pages / ZeroRanges: the rest             ──▶
//!  control  RoundDone, [Verify], Complete            ──▶  every page landed
//!                                                   ◀──  Finished{fault report}
//!  either side, at any point: Abort{reason}.
//! ```
//!
//! The parts, one file each, all re-exported here (`protocol::X`):
//! - `frame.rs`: the header layout, reading and writing frames, the limits.
//! - `kind.rs`: the message kinds and their numbers on the wire.
//! - `version.rs`: the versions, what each added, negotiation.
//! - `messages.rs`: the postcard messages and send/recv/decode.
//! - `pages.rs`: raw bodies (Pages, ZeroRanges, holes), the page hash.
//! - `error.rs`: [`ProtocolError`].
//!
//! Also on the wire, beside this module: `encoded.rs` (v2's compressed
//! batches), `checksum.rs` (the frames' CRC-32C), and the bodies the modes
//! define beside their code (`shared/`, `memserver/`, `split/`); every
//! kind is numbered in `kind.rs`.

mod error;
pub(crate) mod frame;
mod kind;
mod messages;
mod pages;
mod version;

pub use error::ProtocolError;
pub use frame::{
    eof_is_truncated, read_body_into, read_frame, read_frame_into, read_header, write_frame,
    write_frame_parts, write_pages_frame, write_sealed_pages_frame,
    write_sealed_pages_frame_spending, Frame, Header, SpendingWrite, HEADER, MAGIC, MAX_BODY,
    SEALED,
};
pub use kind::Kind;
pub use messages::{
    decode, recv, run_frames, send, DropAhead, Hello, Layout, PostcopyPlan, PostcopyResume, Role,
    RoundDone, SharedOffer, StandbyPlan, PLAN_RUNS_PER_FRAME,
};
pub use pages::{
    decode_pages, encode_pages, page_hash, write_holes, write_zero_ranges, MAX_BATCH, PAGE,
};
pub use version::{
    negotiate, Caps, VERSION_ANSWERS_FOLLOW, VERSION_CLIENTS, VERSION_DROP_AHEAD,
    VERSION_EARLY_STATE, VERSION_LANDED_HASHES, VERSION_MAX, VERSION_MIN, VERSION_OWNER,
    VERSION_POSTCOPY, VERSION_RESUME, VERSION_SEALED_PAGES, VERSION_SHARED_PAGES, VERSION_SPLIT,
    VERSION_STANDBY, VERSION_STORE, VERSION_SWITCH_AHEAD, VERSION_TIMELINE, VERSION_TRUST,
};
