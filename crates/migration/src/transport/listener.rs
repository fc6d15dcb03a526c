//! Where a destination or memory server waits: one listener per endpoint,
//! accepting every connection of a session and reading its Hello.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::stream::poll_in;
use super::{Conn, Endpoint, Stream};
use crate::error::MigrationError;
use crate::protocol::{Hello, Kind, ProtocolError};

/// Listens for migration connections.
pub enum Listener {
    /// On a TCP address.
    Tcp(TcpListener),
    /// On a Unix socket path (removed when dropped).
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Listens on `at` (port 0 picks a free port). A stale Unix socket
    /// file left by a dead process is replaced.
    pub fn bind(at: &Endpoint) -> Result<Listener, MigrationError> {
        let err = |source| MigrationError::Listen {
            addr: at.to_string(),
            source,
        };
        match at {
            Endpoint::Tcp(a) => TcpListener::bind(a).map(Listener::Tcp).map_err(err),
            Endpoint::Unix(p) => {
                if UnixStream::connect(p).is_err()
                    && std::fs::symlink_metadata(p).is_ok_and(|m| {
                        use std::os::unix::fs::FileTypeExt;
                        m.file_type().is_socket()
                    })
                {
                    let _ = std::fs::remove_file(p);
                }
                UnixListener::bind(p)
                    .map(|l| Listener::Unix(l, p.clone()))
                    .map_err(err)
            }
        }
    }

    /// Where it listens (with the port the kernel picked).
    pub fn endpoint(&self) -> Endpoint {
        match self {
            Listener::Tcp(l) => l
                .local_addr()
                .map(Endpoint::Tcp)
                .unwrap_or(Endpoint::Tcp(SocketAddr::from(([0, 0, 0, 0], 0)))),
            Listener::Unix(_, p) => Endpoint::Unix(p.clone()),
        }
    }

    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        }
    }

    /// Accepts one connection within `timeout`.
    pub fn accept(&self, timeout: Duration) -> Result<Stream, MigrationError> {
        let err = |source| MigrationError::Listen {
            addr: self.endpoint().to_string(),
            source,
        };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = left.clamp(Duration::from_millis(1), Duration::from_secs(1));
            if poll_in(self.fd(), wait).map_err(err)? {
                let s = match self {
                    Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::tcp(s)),
                    Listener::Unix(l, _) => l.accept().map(|(s, _)| Stream::unix(s)),
                };
                match s {
                    Ok(s) => return Ok(s),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(err(e)),
                }
            }
            if Instant::now() >= deadline {
                return Err(err(io::ErrorKind::TimedOut.into()));
            }
        }
    }

    /// Accepts one connection and reads its Hello (the role it plays).
    pub fn accept_hello(&self, timeout: Duration) -> Result<(Conn, Hello), MigrationError> {
        let s = self.accept(timeout)?;
        let mut c = Conn::new(s, Some(timeout)).map_err(ProtocolError::Io)?;
        let hello = c.recv(Kind::Hello)?;
        Ok((c, hello))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}
