//! How migration connections are made: TCP between hosts, Unix-domain
//! sockets on one host (with descriptor passing, [`fds`]). Every connection
//! opens with a `Hello` naming its role (control, bulk n, demand, fds), and
//! one listener accepts them all and tells them apart by that role.
//!
//! The transport is the only code that touches a socket: [`Stream`] (one
//! socket and every operation on it), [`Conn`] (its buffered halves, and a
//! [`Closer`] to cut it from another thread), [`Listener`] (and its gate,
//! which admits peers). The engine's modes and sessions see only these, so
//! mutual TLS ([`Security`], installed once per process) lives here alone:
//! every TCP link is TLS unless the process was told `--insecure`.

mod conn;
pub mod fds;
mod listener;
mod owner_only;
mod security;
mod stream;

pub use conn::{Closer, Conn, ConnReader, ConnWriter, Until};
pub use listener::{Admission, Listener, ADMISSION_TIMEOUT};
pub use owner_only::bind_owner_only;
pub use security::{credentials, describe, install, Security};
#[cfg(test)]
pub(crate) use stream::tls_pair;
pub use stream::Stream;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

/// Where a migration peer listens: `tcp:HOST:PORT` or `unix:PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix-domain socket path (same host).
    Unix(PathBuf),
}

impl std::str::FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("'{s}': unix: needs a socket path"));
            }
            return Ok(Endpoint::Unix(path.into()));
        }
        let Some(rest) = s.strip_prefix("tcp:") else {
            return Err(format!(
                "'{s}' is not an endpoint: expected tcp:HOST:PORT or unix:PATH"
            ));
        };
        rest.to_socket_addrs()
            .map_err(|e| format!("'{s}' is not a TCP address: {e}"))?
            .next()
            .map(Endpoint::Tcp)
            .ok_or_else(|| format!("'{s}' resolves to no address"))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl serde::Serialize for Endpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Endpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
