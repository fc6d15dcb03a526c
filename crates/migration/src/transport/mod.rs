//! How migration connections are made: TCP between hosts, Unix-domain
//! sockets on one host (with descriptor passing, [`fds`]). Every connection
//! opens with a `Hello` naming its role (control, bulk n, demand, fds), and
//! one listener accepts them all and tells them apart by that role.

pub mod fds;

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::{self, Hello, Kind, ProtocolError};
use crate::telemetry::LinkMeter;
use crate::MigrationError;

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

/// One connected socket, TCP or Unix, counting its bytes into a
/// [`LinkMeter`] once it has one (the timeline's bytes per stream).
#[derive(Debug)]
pub struct Stream {
    sock: Sock,
    meter: Option<Arc<LinkMeter>>,
}

#[derive(Debug)]
enum Sock {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn of(sock: Sock) -> Stream {
        Stream { sock, meter: None }
    }

    /// Connects to `to`, waiting at most `timeout`.
    pub fn connect(to: &Endpoint, timeout: Duration) -> io::Result<Stream> {
        match to {
            Endpoint::Tcp(a) => {
                let s = TcpStream::connect_timeout(a, timeout)?;
                s.set_nodelay(true)?;
                Ok(Stream::of(Sock::Tcp(s)))
            }
            Endpoint::Unix(p) => Ok(Stream::of(Sock::Unix(UnixStream::connect(p)?))),
        }
    }

    /// A second handle on the same socket (counting into the same meter).
    pub fn try_clone(&self) -> io::Result<Stream> {
        let sock = match &self.sock {
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
        };
        Ok(Stream {
            sock,
            meter: self.meter.clone(),
        })
    }

    /// Counts what this handle reads and writes from now on into `meter`.
    pub fn count_into(&mut self, meter: Arc<LinkMeter>) {
        self.meter = Some(meter);
    }

    /// Read and write timeouts (None: block).
    pub fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match &self.sock {
            Sock::Tcp(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
            Sock::Unix(s) => s.set_read_timeout(t).and_then(|_| s.set_write_timeout(t)),
        }
    }

    /// The read timeout alone.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match &self.sock {
            Sock::Tcp(s) => s.set_read_timeout(t),
            Sock::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.sock {
            Sock::Tcp(s) => s.shutdown(how),
            Sock::Unix(s) => s.shutdown(how),
        }
    }

    /// The Unix socket, for descriptor passing (None over TCP).
    pub fn as_unix(&self) -> Option<&UnixStream> {
        match &self.sock {
            Sock::Unix(s) => Some(s),
            Sock::Tcp(_) => None,
        }
    }

    /// True for TCP (the kernel's delivery rate is known there).
    pub fn is_tcp(&self) -> bool {
        matches!(self.sock, Sock::Tcp(_))
    }

    fn counted(&self, n: io::Result<usize>, sent: bool) -> io::Result<usize> {
        if let (Ok(n), Some(m)) = (&n, &self.meter) {
            let c = if sent { &m.sent } else { &m.received };
            c.fetch_add(*n as u64, Ordering::Relaxed);
        }
        n
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match &mut self.sock {
            Sock::Tcp(s) => s.read(buf),
            Sock::Unix(s) => s.read(buf),
        };
        self.counted(n, false)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = match &mut self.sock {
            Sock::Tcp(s) => s.write(buf),
            Sock::Unix(s) => s.write(buf),
        };
        self.counted(n, true)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let n = match &mut self.sock {
            Sock::Tcp(s) => s.write_vectored(bufs),
            Sock::Unix(s) => s.write_vectored(bufs),
        };
        self.counted(n, true)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match &self.sock {
            Sock::Tcp(s) => s.as_raw_fd(),
            Sock::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// A migration connection: buffered reader and writer over one socket.
pub struct Conn {
    /// Incoming frames.
    pub reader: BufReader<Stream>,
    /// Outgoing frames (flush after a message that must go now).
    pub writer: BufWriter<Stream>,
}

impl Conn {
    /// Wraps a connected socket; `timeout` bounds every read and write.
    pub fn new(s: Stream, timeout: Option<Duration>) -> io::Result<Conn> {
        s.set_timeouts(timeout)?;
        let w = s.try_clone()?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 << 10, s),
            writer: BufWriter::with_capacity(1 << 20, w),
        })
    }

    /// Connects to `to` and says who this connection is.
    pub fn open(to: &Endpoint, timeout: Duration, hello: &Hello) -> Result<Conn, MigrationError> {
        let s = Stream::connect(to, timeout).map_err(|source| MigrationError::Connect {
            addr: to.to_string(),
            source,
        })?;
        let mut c = Conn::new(s, Some(timeout)).map_err(ProtocolError::Io)?;
        protocol::send(&mut c.writer, Kind::Hello, hello)?;
        Ok(c)
    }

    /// Sends a postcard message and flushes.
    pub fn send<T: serde::Serialize>(&mut self, kind: Kind, msg: &T) -> Result<(), ProtocolError> {
        protocol::send(&mut self.writer, kind, msg)?;
        self.flush()
    }

    /// Sends a raw-body frame and flushes.
    pub fn send_frame(&mut self, kind: Kind, body: &[u8]) -> Result<(), ProtocolError> {
        protocol::write_frame(&mut self.writer, kind, body)?;
        self.flush()
    }

    /// Reads the next message, which must be `kind`.
    pub fn recv<T: serde::de::DeserializeOwned>(&mut self, kind: Kind) -> Result<T, ProtocolError> {
        protocol::recv(&mut self.reader, kind)
    }

    /// Flushes what was written.
    pub fn flush(&mut self) -> Result<(), ProtocolError> {
        self.writer.flush().map_err(ProtocolError::Io)
    }

    /// Counts this connection's bytes into `meter` from now on.
    pub fn count_into(&mut self, meter: Arc<LinkMeter>) {
        self.reader.get_mut().count_into(meter.clone());
        self.writer.get_mut().count_into(meter);
    }

    /// The socket (for TCP_INFO, timeouts, shutdown).
    pub fn stream(&self) -> &Stream {
        self.writer.get_ref()
    }

    /// Says why this side gives up, then closes its sending half gracefully:
    /// unread bytes at close would turn into a reset, and the peer would
    /// lose the reason.
    pub fn abort(&mut self, reason: &str) {
        let _ = protocol::write_frame(&mut self.writer, Kind::Abort, reason.as_bytes());
        let _ = self.writer.flush();
    }
}

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
            let mut p = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().clamp(1, 1000)).unwrap_or(1000);
            // SAFETY: one valid, exclusively borrowed pollfd and a count of 1.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(err(e));
                }
            }
            if r > 0 {
                let s = match self {
                    Listener::Tcp(l) => l.accept().map(|(s, _)| {
                        let _ = s.set_nodelay(true);
                        Stream::of(Sock::Tcp(s))
                    }),
                    Listener::Unix(l, _) => l.accept().map(|(s, _)| Stream::of(Sock::Unix(s))),
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
