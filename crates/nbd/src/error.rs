//! What can go wrong talking to an NBD server, told apart so a caller can
//! act on it (reconnect on a broken link; report a refusal as it is).

use std::io;

/// Why an NBD exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// The address does not parse.
    #[error("bad NBD address {0:?}: expected nbd://HOST[:PORT]/EXPORT, nbds://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")]
    BadUri(String),
    /// Connecting, reading or writing failed (refused, reset, timed out).
    #[error("NBD link to {addr}: {source}")]
    Io {
        /// The server.
        addr: String,
        /// The OS's error.
        #[source]
        source: io::Error,
    },
    /// The server does not speak the fixed-newstyle protocol.
    #[error("{0}")]
    NotNbd(String),
    /// The server broke the protocol (a wrong magic, a length over its
    /// limit, an answer to a request never made).
    #[error("the NBD server broke the protocol: {0}")]
    Protocol(String),
    /// The server refused an option (an unknown export, TLS required or
    /// refused, a policy).
    #[error("the NBD server refused {option}: {reason}")]
    Refused {
        /// The option.
        option: &'static str,
        /// Its answer, in words.
        reason: String,
    },
    /// TLS was asked for and failed, or is required by the server and
    /// was not asked for.
    #[error("NBD TLS: {0}")]
    Tls(String),
    /// A request the export cannot take: past its end, a write to a
    /// read-only export, an unaligned request.
    #[error("{0}")]
    Invalid(String),
    /// The server answered a request with an error (its errno).
    #[error("the NBD server failed the {command} at offset {offset}: {}", errno_text(*errno))]
    Server {
        /// The request.
        command: &'static str,
        /// Its offset.
        offset: u64,
        /// The NBD error value (errno-like).
        errno: u32,
    },
}

impl NbdError {
    /// A broken or silent link: the request may succeed on a new
    /// connection (the server died, restarted, or the path dropped).
    pub fn is_link_break(&self) -> bool {
        matches!(self, NbdError::Io { .. })
    }
}

/// The NBD error values, in words.
pub fn errno_text(e: u32) -> String {
    let name = match e {
        1 => "EPERM: operation not permitted",
        5 => "EIO: I/O error",
        12 => "ENOMEM: out of memory",
        22 => "EINVAL: invalid request",
        28 => "ENOSPC: no space left on the server",
        75 => "EOVERFLOW: value too large",
        95 => "ENOTSUP: not supported",
        108 => "ESHUTDOWN: the server is shutting down",
        _ => return format!("error {e}"),
    };
    name.to_string()
}
