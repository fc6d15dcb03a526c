//! [`ProtocolError`]: every way a frame or message is refused, and the
//! peer's own Abort. One type for the whole wire, so a session reports a
//! corrupt frame, a version mismatch and a peer's reason the same way.

use std::io;

use super::{Kind, MAX_BODY, VERSION_MAX, VERSION_MIN};

/// Why a frame or message was refused.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Socket error.
    #[error("migration connection failed: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the migration connection")]
    Closed,
    /// The stream ended inside a frame.
    #[error("migration stream truncated inside a frame")]
    Truncated,
    /// The peer answered in TLS while this side speaks plaintext.
    #[error("the peer speaks TLS and this host sent plaintext: this process runs with --insecure (or FERRY_INSECURE=1), which fleet hosts refuse; drop it and give this host a certificate (ferry pki issue, --tls-dir)")]
    SpeaksTls,
    /// Not a ferry migration stream.
    #[error("not a ferry migration stream (magic {0:#x}): is the peer a ferry destination?")]
    BadMagic(u32),
    /// Unknown message kind.
    #[error("unknown message kind {0}")]
    BadKind(u16),
    /// A frame header's flags are not ones this build defines for its kind.
    #[error("{kind:?} frame with flags {flags:#x}: not flags this ferry defines for it (only a Pages frame may be sealed, with a zero checksum field); the peer is not a ferry this build understands, or the stream is corrupt")]
    BadFlags {
        /// The frame's kind.
        kind: Kind,
        /// The flags it carried.
        flags: u16,
    },
    /// A sealed frame (no checksum) where the link does not seal its
    /// bytes, or where only a checked frame may come.
    #[error("a {kind:?} frame without a checksum (sealed) arrived where its bytes are not sealed by the link (a plaintext link, or a reader that checks every frame): refused, the stream is corrupt or forged")]
    Unsealed {
        /// The frame's kind.
        kind: Kind,
    },
    /// Body too large.
    #[error("frame body of {0} bytes exceeds the {MAX_BODY}-byte limit")]
    TooLarge(u32),
    /// Checksum mismatch.
    #[error("frame checksum mismatch (kind {kind:?}, {len} bytes): corrupt stream")]
    Checksum {
        /// Kind of the corrupt frame.
        kind: Kind,
        /// Its length.
        len: u32,
    },
    /// The body does not decode.
    #[error("malformed {kind:?} message: {reason}")]
    Malformed {
        /// Kind.
        kind: Kind,
        /// What is wrong.
        reason: String,
    },
    /// No common version.
    #[error("peer speaks protocol versions {min}..={max}, this ferry speaks {VERSION_MIN}..={VERSION_MAX}")]
    Version {
        /// Peer's oldest.
        min: u16,
        /// Peer's newest.
        max: u16,
    },
    /// A message that does not belong here.
    #[error("unexpected {got:?} message while waiting for {want}")]
    Unexpected {
        /// What came.
        got: Kind,
        /// What was expected.
        want: &'static str,
    },
    /// The peer gave up.
    #[error("the peer aborted the migration: {0}")]
    Aborted(String),
}
