//! A TCP connection after a mutual TLS handshake, shared by the threads
//! that use it: ferry reads a connection on one thread and writes it on
//! another, and rustls keeps one state machine per connection, so that
//! state sits behind a lock that is never held across a blocking call.
//!
//! - Reading: ciphertext is read ahead in large pieces (256 KiB: rustls
//!   itself would read 4 KiB at a time) outside the lock, then fed to
//!   rustls and decrypted under it.
//! - Writing: plaintext is encrypted and sent under the lock with
//!   non-blocking sends; when the socket is full the lock is let go while
//!   the writer waits for room, so the reader is never held up by it.
//!   Every send of ciphertext happens under the lock, which keeps records
//!   in order whichever thread sends them (a reader answering a key
//!   update, say).
//! - Keys: rustls renews the traffic keys itself (TLS 1.3 KeyUpdate)
//!   before a key's record limit, so a stream of any length stays safe.
//! - Timeouts: the socket's own read and write timeouts (`SO_RCVTIMEO`,
//!   `SO_SNDTIMEO`) bound each wait, as they would on a plain socket.

use std::io::{self, BufRead, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};

use crate::{PeerIdentity, TlsError};

/// Ciphertext read ahead of rustls, per connection.
const READ_AHEAD: usize = 256 * 1024;

/// Plaintext rustls may hold encrypted and unsent before a write waits.
const SEND_BUFFER: usize = 256 * 1024;

/// One TLS connection; [`try_clone`](Self::try_clone) gives another
/// handle on it for a second thread.
pub struct TlsSocket {
    tcp: TcpStream,
    shared: Arc<Shared>,
}

struct Shared {
    conn: Mutex<Connection>,
    /// Held by the reading thread for a whole read.
    rx: Mutex<ReadAhead>,
    peer: PeerIdentity,
}

struct ReadAhead {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    eof: bool,
}

/// Which side of the handshake this end plays.
pub enum Handshake {
    /// It connected: it checks the server against `name`.
    Client(Arc<ClientConfig>, ServerName<'static>),
    /// It accepted: the client must present a certificate.
    Server(Arc<ServerConfig>),
}

impl std::fmt::Debug for TlsSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSocket")
            .field("peer", &self.shared.peer)
            .finish()
    }
}

impl TlsSocket {
    /// Runs the handshake on `tcp` within `timeout` (a peer that is silent
    /// or trickles fails here), and checks the peer's certificate.
    pub fn handshake(tcp: TcpStream, side: Handshake, timeout: Duration) -> Result<Self, TlsError> {
        let peer = tcp
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let fail = |reason: String| TlsError::Handshake {
            peer: peer.clone(),
            reason,
        };
        let mut conn: Connection = match side {
            Handshake::Client(config, name) => ClientConnection::new(config, name)
                .map_err(|e| fail(e.to_string()))?
                .into(),
            Handshake::Server(config) => ServerConnection::new(config)
                .map_err(|e| fail(e.to_string()))?
                .into(),
        };
        conn.set_buffer_limit(Some(SEND_BUFFER));
        let deadline = Instant::now() + timeout;
        let late = || TlsError::HandshakeTimeout {
            peer: peer.clone(),
            secs: timeout.as_secs(),
        };
        let fd = tcp.as_raw_fd();
        while conn.is_handshaking() || conn.wants_write() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(late());
            }
            if conn.wants_write() {
                match conn.write_tls(&mut NoWait(fd)) {
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if !poll(fd, libc::POLLOUT, left).map_err(|e| fail(e.to_string()))? {
                            return Err(late());
                        }
                        continue;
                    }
                    Err(e) => return Err(fail(e.to_string())),
                }
            }
            if !poll(fd, libc::POLLIN, left).map_err(|e| fail(e.to_string()))? {
                return Err(late());
            }
            match conn.read_tls(&mut NoWait(fd)) {
                Ok(0) => return Err(fail(CLOSED_IN_HANDSHAKE.into())),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(fail(e.to_string())),
            }
            if let Err(e) = conn.process_new_packets() {
                // Tell the peer why (the alert rustls queued), best effort.
                let _ = conn.write_tls(&mut NoWait(fd));
                return Err(fail(explain(&e)));
            }
        }
        let identity = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .map(PeerIdentity::of)
            .transpose()
            .map_err(fail)?
            .unwrap_or_default();
        Ok(TlsSocket {
            tcp,
            shared: Arc::new(Shared {
                conn: Mutex::new(conn),
                rx: Mutex::new(ReadAhead {
                    buf: vec![0; READ_AHEAD].into_boxed_slice(),
                    start: 0,
                    end: 0,
                    eof: false,
                }),
                peer: identity,
            }),
        })
    }

    /// A second handle on the same connection and TLS session.
    pub fn try_clone(&self) -> io::Result<TlsSocket> {
        Ok(TlsSocket {
            tcp: self.tcp.try_clone()?,
            shared: self.shared.clone(),
        })
    }

    /// The socket underneath (timeouts, shutdown, statistics; never its
    /// bytes).
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Who the peer's certificate says it is.
    pub fn peer(&self) -> &PeerIdentity {
        &self.shared.peer
    }

    /// True if decrypted bytes, or ciphertext read ahead, wait to be read
    /// (a poll on the socket would miss them).
    pub fn has_buffered(&self) -> bool {
        let ahead = match self.shared.rx.try_lock() {
            Ok(rx) => rx.start < rx.end,
            // A reader is busy in it: it will return what it has.
            Err(_) => false,
        };
        ahead || self.conn().reader().fill_buf().is_ok_and(|b| !b.is_empty())
    }

    /// Says goodbye (close_notify), best effort: the peer's next read ends
    /// cleanly instead of seeing a cut.
    pub fn close_notify(&self) {
        let mut c = self.conn();
        c.send_close_notify();
        let _ = c.write_tls(&mut NoWait(self.tcp.as_raw_fd()));
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.shared.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends what rustls has encrypted, without waiting; true once
    /// nothing is left.
    fn send_pending(&self, c: &mut Connection) -> io::Result<bool> {
        while c.wants_write() {
            match c.write_tls(&mut NoWait(self.tcp.as_raw_fd())) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Encrypts and sends `bufs` (as much as rustls takes at once), waiting
    /// for room outside the lock.
    fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut c = self.conn();
        let mut n = None;
        loop {
            if n.is_none() && self.send_pending(&mut c)? {
                n = Some(c.writer().write_vectored(bufs)?);
            }
            if n.is_some() && self.send_pending(&mut c)? {
                return Ok(n.unwrap_or(0));
            }
            drop(c);
            let t = self.tcp.write_timeout()?.unwrap_or(Duration::MAX);
            if !poll(self.tcp.as_raw_fd(), libc::POLLOUT, t)? {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            c = self.conn();
        }
    }
}

impl Read for TlsSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &TlsSocket {
    /// Fills `buf` with what can be decrypted from what has arrived,
    /// waiting for the socket only while there is nothing at all.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut rx = self.shared.rx.lock().unwrap_or_else(|p| p.into_inner());
        let mut got = 0;
        loop {
            let mut eof_fed = false;
            {
                let mut c = self.conn();
                loop {
                    match c.reader().read(&mut buf[got..]) {
                        // close_notify: the end.
                        Ok(0) => return Ok(got),
                        Ok(n) => {
                            got += n;
                            if got == buf.len() {
                                return Ok(got);
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        // The peer closed without close_notify: an end all
                        // the same (ferry's frames say where a stream ends).
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(got),
                        Err(e) if got > 0 => {
                            tracing::debug!("TLS read ends early: {e}");
                            return Ok(got);
                        }
                        Err(e) => return Err(e),
                    }
                    // rustls holds no plaintext now: feed it what was read ahead.
                    if rx.start == rx.end && (!rx.eof || eof_fed) {
                        break;
                    }
                    eof_fed |= rx.start == rx.end;
                    let mut ahead = &rx.buf[rx.start..rx.end];
                    let fed = c.read_tls(&mut ahead)?;
                    if fed == 0 && !eof_fed {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "the TLS layer takes no more bytes",
                        ));
                    }
                    rx.start += fed;
                    if let Err(e) = c.process_new_packets() {
                        let _ = self.send_pending(&mut c);
                        return Err(io::Error::new(io::ErrorKind::InvalidData, explain(&e)));
                    }
                    // A key update or an alert may want an answer.
                    let _ = self.send_pending(&mut c);
                }
            }
            if got > 0 || eof_fed {
                return Ok(got);
            }
            // Nothing decrypted and nothing read ahead: wait for the socket.
            let t = self.tcp.read_timeout()?.unwrap_or(Duration::MAX);
            if !poll(self.tcp.as_raw_fd(), libc::POLLIN, t)? {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let rx = &mut *rx;
            match NoWait(self.tcp.as_raw_fd()).read(&mut rx.buf) {
                Ok(0) => rx.eof = true,
                Ok(n) => (rx.start, rx.end) = (0, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }
}

impl Write for TlsSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.send(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Non-blocking reads and sends on a socket, for rustls to use under the
/// lock.
struct NoWait(RawFd);

impl Read for NoWait {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: recv writes at most buf.len() bytes into buf, which we
            // borrow mutably.
            let n = unsafe {
                libc::recv(
                    self.0,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Write for NoWait {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let n = bufs.len().min(libc::UIO_MAXIOV as usize);
        // SAFETY: msghdr is plain data; all zeros is valid (no name, no
        // control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec; sendmsg only reads them.
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = n as _;
        loop {
            // SAFETY: msg points at `n` valid iovecs borrowed for the call.
            let r = unsafe { libc::sendmsg(self.0, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if r >= 0 {
                return Ok(r as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Waits up to `wait` for `events` on `fd`; false at the timeout.
fn poll(fd: RawFd, events: i16, wait: Duration) -> io::Result<bool> {
    let deadline = Instant::now().checked_add(wait);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let ms = match left {
            None => -1,
            Some(l) => {
                i32::try_from(l.as_millis().max(u128::from(!l.is_zero()))).unwrap_or(i32::MAX)
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid, exclusively borrowed pollfd and a count of 1.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return Ok(true);
        }
        if r == 0 {
            return Ok(false);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Why a peer hangs up mid-handshake, as far as this end can tell.
const CLOSED_IN_HANDSHAKE: &str = "the peer closed the connection during the handshake (it may \
     have refused this host's certificate, or it does not speak TLS)";

/// A rustls error in words an operator can act on.
fn explain(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(C::Expired) | E::InvalidCertificate(C::ExpiredContext { .. }) => {
            "the peer's certificate has expired".into()
        }
        E::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            "the peer's certificate is not from this fleet's CA".into()
        }
        E::InvalidCertificate(C::NotValidForName)
        | E::InvalidCertificate(C::NotValidForNameContext { .. }) => {
            "the peer's certificate does not name the address connected to".into()
        }
        E::InvalidCertificate(c) => format!("the peer's certificate was refused: {c:?}"),
        E::NoCertificatesPresented => "the peer presented no certificate".into(),
        E::AlertReceived(A::CertificateExpired) => {
            "the peer refused this host's certificate: it has expired".into()
        }
        E::AlertReceived(A::UnknownCA) => {
            "the peer refused this host's certificate: not from its fleet's CA".into()
        }
        E::AlertReceived(A::BadCertificate | A::CertificateRequired | A::CertificateUnknown) => {
            "the peer refused this host's certificate".into()
        }
        // What rustls answers a signature that does not verify: the two
        // ends' CAs differ.
        E::AlertReceived(A::DecryptError) => {
            "the peer refused this host's certificate (a signature did not verify: are both \
             hosts' certificates from the same fleet CA?)"
                .into()
        }
        E::DecryptError => {
            "cannot decrypt a record: it was corrupted or tampered with on the way".into()
        }
        E::InvalidMessage(_) => {
            "the peer does not speak TLS (is it running with --insecure?)".into()
        }
        other => other.to_string(),
    }
}
