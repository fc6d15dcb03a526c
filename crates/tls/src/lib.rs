//! A fleet's identity and the mutual TLS every link between its hosts
//! speaks.
//!
//! - [`pki`] makes a fleet certificate authority and host certificates
//!   (`ferry pki init`, `ferry pki issue`).
//! - [`Credentials`] is one host's directory of them (`ca.pem`, `cert.pem`,
//!   `key.pem`): the rustls configs built from it, rebuilt when the files
//!   change on disk, so certificates rotate without restarting a VM.
//! - [`TlsSocket`] is a TCP connection after a mutual handshake, shared by
//!   a reading and a writing thread (ferry's connections have one of each).
//! - [`PeerIdentity`] is what the other end's certificate says it is.
//! - [`Connection`] is a TCP connection that is plain or mutual TLS, for
//!   the small request/answer services between hosts.
//! - [`record`] seals and opens the records after the handshake (public
//!   for the fuzzer: it reads a peer's bytes).
//!
//! Only TLS 1.3 with the ring provider: ferry's two ends are ferry.

mod connection;
mod credentials;
mod error;
mod handshake;
mod peer;
pub mod pki;
pub mod record;
mod socket;
mod sys;

pub use connection::Connection;
pub use credentials::{default_dir, Credentials, CA_FILE, CERT_FILE, KEY_FILE, TLS_DIR_ENV};
pub use error::TlsError;
pub use peer::PeerIdentity;
/// The rustls this crate builds on (its types appear in the API).
pub use rustls;
pub use socket::{Handshake, TlsSocket};

/// How long a handshake may take before the connection is dropped: a
/// silent or trickling peer costs a thread this long, never a session.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
