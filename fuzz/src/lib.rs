//! What ferry's fuzz targets share (docs/fuzzing.md): reading structured
//! values out of the fuzzer's bytes ([`Input`]), guest memory on the heap
//! that the engine's real sinks land pages in ([`Memory`]), a socket pair
//! whose far end a thread feeds and drains ([`Peer`]), and the codec
//! lockstep check ([`codec`]), and the seed corpora ([`seeds`]).

pub mod codec;
pub mod input;
pub mod memory;
pub mod peer;
pub mod seeds;

pub use input::Input;
pub use memory::Memory;
pub use peer::Peer;

use std::sync::Once;

use ferry_migration::protocol::{self, Kind};

/// Once per process, before a target's first input: a write to a socket
/// the code under test closed must be an error, not SIGPIPE (libFuzzer's
/// `main` is not Rust's, which ignores it), and a postcopy demand thread
/// must not lift the fuzzing thread to real-time priority.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: setting a signal's disposition to SIG_IGN has no
        // preconditions; no handler runs.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        std::env::set_var("FERRY_FAULT_PRIORITY", "normal");
    });
}

/// One frame on the wire: header (flags 0, the body's real checksum) and
/// body, as the engine writes it.
pub fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(protocol::HEADER + body.len());
    protocol::write_frame(&mut out, kind, body).expect("writing to a Vec");
    out
}

/// The message kinds in wire order (1..=49), for a byte that picks one.
pub fn kind_of(b: u8) -> Kind {
    const KINDS: [Kind; 52] = [
        Kind::Hello,
        Kind::HelloAck,
        Kind::Layout,
        Kind::Pages,
        Kind::ZeroRanges,
        Kind::RoundDone,
        Kind::State,
        Kind::Verify,
        Kind::Complete,
        Kind::Started,
        Kind::Abort,
        Kind::RoundAck,
        Kind::Codec,
        Kind::Encoded,
        Kind::PostcopyPlan,
        Kind::PageRequest,
        Kind::Finished,
        Kind::PostcopyResume,
        Kind::ClientsPlan,
        Kind::ClientsAnswer,
        Kind::Clients,
        Kind::TimelineAsk,
        Kind::Timeline,
        Kind::StoreOpen,
        Kind::StoreAck,
        Kind::StoreSync,
        Kind::StoreDrop,
        Kind::StoreList,
        Kind::StoreHeld,
        Kind::StoreClose,
        Kind::StoreFetch,
        Kind::SplitPlan,
        Kind::GatherPlan,
        Kind::GatherReady,
        Kind::Token,
        Kind::StandbyPlan,
        Kind::StandbyHeld,
        Kind::StandbyBeat,
        Kind::HashAsk,
        Kind::VerifyDigests,
        Kind::SwitchAhead,
        Kind::SwitchReady,
        Kind::ShareAsk,
        Kind::SharedOffer,
        Kind::SharedPages,
        Kind::SharedMissed,
        Kind::AnswersAsk,
        Kind::AnswersHeld,
        Kind::StandbyTakeOver,
        Kind::DropAhead,
        Kind::DroppedAhead,
        Kind::Owner,
    ];
    KINDS[usize::from(b) % KINDS.len()]
}

/// Decodes `body` as a `T` the way the engine does (postcard); when it
/// decodes, checks that the value's encoding decodes to a value with the
/// same encoding (a decoded value always re-encodes, and that encoding is
/// stable).
pub fn postcard_round_trip<T>(body: &[u8]) -> Option<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let v: T = postcard::from_bytes(body).ok()?;
    let once = postcard::to_stdvec(&v).expect("a decoded value encodes");
    let again: T = postcard::from_bytes(&once).expect("an encoded value decodes");
    assert_eq!(
        postcard::to_stdvec(&again).expect("re-encodes"),
        once,
        "encoding is not stable"
    );
    Some(v)
}
