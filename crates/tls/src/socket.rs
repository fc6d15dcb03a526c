//! A TCP connection after a mutual TLS handshake, shared by the threads
//! that use it: ferry reads a connection on one thread and writes it on
//! another.
//!
//! - The handshake is rustls's ([`handshake`](crate::handshake)); after
//!   it, records are sealed and opened here ([`record`](crate::record)),
//!   each direction on its own: the reader and the writer never wait for
//!   each other.
//! - Reading: a read of at least a whole record's size receives the
//!   ciphertext straight into the caller's buffer and opens the records
//!   there, each one's data moved up against the last's as ring opens it,
//!   so a migration's pages are written once, by the kernel, into guest
//!   memory. A smaller read is served from a read-ahead (256 KiB) where
//!   records are opened in place and their plaintext copied out; an
//!   incomplete record moves between the two.
//! - Writing: up to 256 KiB of plaintext is sealed into records in one
//!   buffer and sent whole before the write returns.
//! - Keys: before a key has protected half of what its cipher allows, this
//!   end sends a key update and takes the next key, which rustls derives;
//!   a key update from the peer is followed the same way.
//! - Timeouts: the socket's own read and write timeouts (`SO_RCVTIMEO`,
//!   `SO_SNDTIMEO`) bound each wait, as they would on a plain socket.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::ServerName;
use rustls::server::UnbufferedServerConnection;
use rustls::{ClientConfig, ServerConfig};

use crate::handshake::{self, Failed, Kernel};
use crate::record::{self, Keys, Opened, Opener, RecordError, Sealer, MAX_PLAIN, MAX_RECORD};
use crate::{sys, PeerIdentity, TlsError};

/// Ciphertext read ahead, per connection.
const READ_AHEAD: usize = 256 * 1024;

/// Plaintext sealed and sent by one write.
const WRITE_BATCH: usize = 256 * 1024;

/// One TLS connection; [`try_clone`](Self::try_clone) gives another
/// handle on it for a second thread.
pub struct TlsSocket {
    tcp: TcpStream,
    shared: Arc<Shared>,
}

struct Shared {
    /// Held by the reading thread for a whole read.
    rx: Mutex<Rx>,
    /// Held by the writing thread for a whole write.
    tx: Mutex<Tx>,
    /// Taken only to renew keys (after a half's own lock).
    kernel: Mutex<Kernel>,
    /// The peer asked for this end's keys to be renewed.
    renewal_asked: AtomicBool,
    /// Key updates this end sent, and the peer's it followed.
    updates: [AtomicU64; 2],
    peer: PeerIdentity,
}

/// The receiving half: read-ahead ciphertext `[start, end)` and, before
/// it, the plaintext of the last record opened, not yet read.
struct Rx {
    opener: Opener,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    plain: Range<usize>,
    /// The peer closed the TCP stream.
    eof: bool,
    /// The peer said close_notify.
    closed: bool,
    /// Why the stream cannot be read any further.
    broken: Option<String>,
}

/// The sending half.
struct Tx {
    sealer: Sealer,
    out: Vec<u8>,
    /// Records sealed in the caller's buffer: header, where the data
    /// lies, the sealed content type and the tag.
    sealed: Vec<([u8; record::HEADER], Range<usize>, [u8; 1 + record::TAG])>,
    /// Why the stream cannot be written any further (a send failed
    /// mid-record, or close_notify was sent).
    broken: Option<&'static str>,
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
        let deadline = Instant::now() + timeout;
        let fd = tcp.as_raw_fd();
        let done = match side {
            Handshake::Client(config, name) => {
                let c = UnbufferedClientConnection::new(config, name)
                    .map_err(|e| fail(e.to_string()))?;
                handshake::run(c, fd, deadline)
            }
            Handshake::Server(config) => {
                let c = UnbufferedServerConnection::new(config).map_err(|e| fail(e.to_string()))?;
                handshake::run(c, fd, deadline)
            }
        };
        let done = done.map_err(|f| match f {
            Failed::Late => TlsError::HandshakeTimeout {
                peer: peer.clone(),
                secs: timeout.as_secs(),
            },
            Failed::Silent => TlsError::Silent { peer: peer.clone() },
            Failed::Because(reason) => fail(reason),
        })?;
        let keys = |(seq, s)| Keys::new(seq, s).map_err(|e: RecordError| fail(e.to_string()));
        let sealer = Sealer::new(keys(done.secrets.tx)?, done.kernel.renew_after());
        let opener = Opener::new(keys(done.secrets.rx)?);
        let mut buf = vec![0; READ_AHEAD.max(done.leftover.len())].into_boxed_slice();
        buf[..done.leftover.len()].copy_from_slice(&done.leftover);
        Ok(TlsSocket {
            tcp,
            shared: Arc::new(Shared {
                rx: Mutex::new(Rx {
                    opener,
                    buf,
                    start: 0,
                    end: done.leftover.len(),
                    plain: 0..0,
                    eof: false,
                    closed: false,
                    broken: None,
                }),
                tx: Mutex::new(Tx {
                    sealer,
                    out: Vec::with_capacity(
                        WRITE_BATCH + WRITE_BATCH / MAX_PLAIN * 64 + MAX_RECORD,
                    ),
                    sealed: Vec::with_capacity(WRITE_BATCH / MAX_PLAIN),
                    broken: None,
                }),
                kernel: Mutex::new(done.kernel),
                renewal_asked: AtomicBool::new(false),
                updates: [AtomicU64::new(0), AtomicU64::new(0)],
                peer: done.peer,
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

    /// The cipher suite the two ends agreed on.
    pub fn suite(&self) -> rustls::SupportedCipherSuite {
        Self::lock(&self.shared.kernel).suite()
    }

    /// How many key updates this end has sent, and how many of the
    /// peer's it has followed (tests see keys renewed with it).
    #[doc(hidden)]
    pub fn key_updates(&self) -> (u64, u64) {
        let [sent, followed] = &self.shared.updates;
        (
            sent.load(Ordering::Relaxed),
            followed.load(Ordering::Relaxed),
        )
    }

    /// True if a read would return at once from what was read ahead (a
    /// poll on the socket would miss it).
    pub fn has_buffered(&self) -> bool {
        match self.shared.rx.try_lock() {
            Ok(rx) => {
                !rx.plain.is_empty()
                    || rx.broken.is_some()
                    || rx.closed
                    || !matches!(record::complete(&rx.buf[rx.start..rx.end]), Ok(None))
            }
            // A reader is busy in it: it will return what it has.
            Err(_) => false,
        }
    }

    /// Says goodbye (close_notify), best effort and without waiting: the
    /// peer's next read ends cleanly instead of seeing a cut. Skipped if a
    /// writer is busy (it is about to be cut anyway).
    pub fn close_notify(&self) {
        let Ok(mut tx) = self.shared.tx.try_lock() else {
            return;
        };
        if tx.broken.is_some() {
            return;
        }
        let tx = &mut *tx;
        tx.out.clear();
        if tx.sealer.seal_close_notify(&mut tx.out).is_ok() {
            let soon = Instant::now() + Duration::from_millis(100);
            let _ = sys::send_all(self.fd(), &tx.out, Some(soon));
        }
        tx.broken = Some("this end has closed the TLS stream");
    }

    fn fd(&self) -> RawFd {
        self.tcp.as_raw_fd()
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seals up to [`WRITE_BATCH`] bytes of `bufs` and sends them.
    fn send(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut tx = Self::lock(&self.shared.tx);
        let tx = &mut *tx;
        if let Some(why) = tx.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, why));
        }
        let sent = self.seal_and_send(tx, bufs);
        if sent.is_err() {
            // Records may have been sealed (their counters spent) or sent in
            // part: nothing can follow them.
            tx.broken = Some("an earlier send on this TLS stream failed");
        }
        sent
    }

    /// Sends all of `data` in records sealed where it lies, sparing the
    /// copy into the record buffer that [`Write`] makes: afterwards `data`
    /// holds ciphertext, not what the caller put there. A migration's page
    /// batches go this way (the pages are in the batch already, and a
    /// record holds exactly four of them).
    pub fn send_in_place(&self, data: &mut [u8]) -> io::Result<()> {
        let mut tx = Self::lock(&self.shared.tx);
        let tx = &mut *tx;
        if let Some(why) = tx.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, why));
        }
        let mut at = 0;
        while at < data.len() {
            let burst = (at + WRITE_BATCH).min(data.len());
            if let Err(e) = self.seal_in_place_and_send(tx, data, at..burst) {
                tx.broken = Some("an earlier send on this TLS stream failed");
                return Err(e);
            }
            at = burst;
        }
        Ok(())
    }

    /// Seals `data[burst]` into records in place and sends them (with a
    /// key update first, if one is due).
    ///
    /// A record's content type must follow its data, so each record
    /// borrows the first byte of what comes after it in `data`, and gives
    /// it back once sealed, keeping the sealed byte with the tag. The last
    /// record of `data` has nothing after it to borrow: it is sealed by
    /// copy, like a [`Write`].
    fn seal_in_place_and_send(
        &self,
        tx: &mut Tx,
        data: &mut [u8],
        burst: Range<usize>,
    ) -> io::Result<()> {
        tx.out.clear();
        self.renew_if_due(tx)?;
        let lead = tx.out.len();
        tx.sealed.clear();
        let mut start = burst.start;
        while start < burst.end {
            let stop = (start + MAX_PLAIN).min(burst.end);
            if stop == data.len() {
                let at = Sealer::begin(&mut tx.out);
                tx.out.extend_from_slice(&data[start..stop]);
                tx.sealer.seal(&mut tx.out, at).map_err(invalid)?;
                break;
            }
            let lent = data[stop];
            let sealed = tx.sealer.seal_in_place(&mut data[start..=stop]);
            let content = std::mem::replace(&mut data[stop], lent);
            let (header, tag) = sealed.map_err(invalid)?;
            let mut tail = [0u8; 1 + record::TAG];
            tail[0] = content;
            tail[1..].copy_from_slice(tag.as_ref());
            tx.sealed.push((header, start..stop, tail));
            start = stop;
        }
        let mut iov = Vec::with_capacity(2 + 3 * tx.sealed.len());
        iov.push(IoSlice::new(&tx.out[..lead]));
        for (header, body, tail) in &tx.sealed {
            iov.push(IoSlice::new(header));
            iov.push(IoSlice::new(&data[body.clone()]));
            iov.push(IoSlice::new(tail));
        }
        iov.push(IoSlice::new(&tx.out[lead..]));
        let deadline = sys::deadline(self.tcp.write_timeout()?);
        sys::send_all_vectored(self.fd(), &mut iov, deadline)
    }

    /// [`send`](Self::send)'s work, under the send lock.
    fn seal_and_send(&self, tx: &mut Tx, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        tx.out.clear();
        let mut taken = 0;
        let mut open: Option<usize> = None;
        for b in bufs {
            let mut s: &[u8] = b;
            while !s.is_empty() && taken < WRITE_BATCH {
                let at = match open {
                    Some(at) => at,
                    None => {
                        self.renew_if_due(tx)?;
                        *open.insert(Sealer::begin(&mut tx.out))
                    }
                };
                let room = MAX_PLAIN - (tx.out.len() - at - record::HEADER);
                let k = room.min(s.len()).min(WRITE_BATCH - taken);
                tx.out.extend_from_slice(&s[..k]);
                s = &s[k..];
                taken += k;
                if k == room {
                    tx.sealer.seal(&mut tx.out, at).map_err(invalid)?;
                    open = None;
                }
            }
        }
        if let Some(at) = open {
            tx.sealer.seal(&mut tx.out, at).map_err(invalid)?;
        }
        if tx.out.is_empty() {
            return Ok(0);
        }
        let deadline = sys::deadline(self.tcp.write_timeout()?);
        sys::send_all(self.fd(), &tx.out, deadline)?;
        Ok(taken)
    }

    /// Renews this end's keys when they are due or the peer asked: a key
    /// update sealed with the old keys, then the new ones.
    fn renew_if_due(&self, tx: &mut Tx) -> io::Result<()> {
        let asked = self.shared.renewal_asked.swap(false, Ordering::Relaxed);
        if !asked && !tx.sealer.wants_new_keys() {
            return Ok(());
        }
        tx.sealer.seal_key_update(&mut tx.out).map_err(invalid)?;
        let next = Self::lock(&self.shared.kernel)
            .update_tx()
            .map_err(io::Error::other)?;
        tx.sealer.rekey(Keys::new(next.0, next.1).map_err(invalid)?);
        self.shared.updates[0].fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Opens the record at the front of the read-ahead, if all of it is
    /// there; false if it is not.
    fn open_next(&self, rx: &mut Rx) -> bool {
        let len = match record::complete(&rx.buf[rx.start..rx.end]) {
            Ok(Some(len)) => len,
            Ok(None) => return false,
            Err(e) => {
                rx.broken = Some(e.to_string());
                return true;
            }
        };
        let at = rx.start;
        rx.start += len;
        let opened = rx.opener.open(&mut rx.buf[at..at + len]);
        if let Some(r) = self.follow(rx, opened) {
            rx.plain = at + r.start..at + r.end;
        }
        true
    }

    /// Acts on an opened record: its data's range, if it held data; a key
    /// update, close_notify or error is taken into `rx`.
    fn follow(&self, rx: &mut Rx, opened: Result<Opened, RecordError>) -> Option<Range<usize>> {
        match opened {
            Ok(Opened::Data(r)) => return Some(r),
            Ok(Opened::Closed) => rx.closed = true,
            Ok(Opened::KeyUpdate { asked }) => {
                let next = Self::lock(&self.shared.kernel).update_rx();
                match next
                    .map_err(|e| e.to_string())
                    .and_then(|(seq, s)| Keys::new(seq, s).map_err(|e| e.to_string()))
                {
                    Ok(keys) => {
                        rx.opener.rekey(keys);
                        self.shared.updates[1].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => rx.broken = Some(format!("cannot follow the peer's key update: {e}")),
                }
                if asked {
                    self.shared.renewal_asked.store(true, Ordering::Relaxed);
                }
            }
            Err(RecordError::Alert(d)) => {
                rx.broken = Some(crate::error::explain(&rustls::Error::AlertReceived(d)));
            }
            Err(e) => rx.broken = Some(e.to_string()),
        }
        None
    }

    /// Receives ciphertext straight into `buf` and opens the records there,
    /// each one's data moved up against the last one's as it is opened
    /// (ring does both in one pass, while the record is in cache): the
    /// kernel writes each byte where it belongs (guest memory, for a
    /// migration's pages), one receive takes many records, and what is
    /// copied is at most one record each way, what was read ahead before
    /// and an incomplete record left after, which go back to the
    /// read-ahead. None if `buf` cannot hold a whole record; else the data
    /// bytes now at the front of `buf` (0 if the records held none: their
    /// effect, such as a key update, an end or an error, is in `rx`).
    fn read_direct(
        &self,
        rx: &mut Rx,
        buf: &mut [u8],
        deadline: &mut Option<Option<Instant>>,
    ) -> io::Result<Option<usize>> {
        if buf.len() < MAX_RECORD {
            return Ok(None);
        }
        // An incomplete record, at most, was read ahead (open_next would
        // have opened a whole one).
        let mut end = rx.end - rx.start;
        buf[..end].copy_from_slice(&rx.buf[rx.start..rx.end]);
        (rx.start, rx.end) = (0, 0);
        // buf: [data opened: ..w][not yet opened: r..end][free: end..]
        let (mut w, mut r) = (0, 0);
        let outcome = loop {
            while rx.broken.is_none() && !rx.closed {
                let len = match record::complete(&buf[r..end]) {
                    Ok(Some(len)) => len,
                    Ok(None) => break,
                    Err(e) => {
                        rx.broken = Some(e.to_string());
                        break;
                    }
                };
                let mut header = [0; record::HEADER];
                header.copy_from_slice(&buf[r..r + record::HEADER]);
                let opened =
                    rx.opener
                        .open_within(header, &mut buf[w..r + len], r + record::HEADER - w);
                r += len;
                if let Some(data) = self.follow(rx, opened) {
                    w += data.end;
                }
            }
            if w > 0 || rx.broken.is_some() || rx.closed {
                break Ok(Some(w));
            }
            // Nothing opened yet: keep room for a whole record and receive.
            if buf.len() - r < MAX_RECORD {
                buf.copy_within(r..end, 0);
                (r, end) = (0, end - r);
            }
            match sys::recv(self.fd(), &mut buf[end..]) {
                Ok(0) => {
                    rx.eof = true;
                    break Ok(Some(0));
                }
                Ok(n) => end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let deadline = match deadline {
                        Some(d) => *d,
                        None => *deadline.insert(sys::deadline(self.tcp.read_timeout()?)),
                    };
                    match sys::poll_until(self.fd(), libc::POLLIN, deadline) {
                        Ok(true) => {}
                        Ok(false) => break Err(io::ErrorKind::WouldBlock.into()),
                        Err(e) => break Err(e),
                    }
                }
                Err(e) => break Err(e),
            }
        };
        // What was received but not opened (an incomplete record) goes back
        // to the read-ahead, for the next read; after an end or an error
        // nothing more is read.
        if rx.broken.is_none() && !rx.closed {
            rx.buf[..end - r].copy_from_slice(&buf[r..end]);
            rx.end = end - r;
        }
        outcome
    }
}

fn invalid(e: RecordError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Read for TlsSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &TlsSocket {
    /// Fills `buf` with what can be opened from what has arrived, waiting
    /// for the socket only while there is nothing at all.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut rx = TlsSocket::lock(&self.shared.rx);
        let rx = &mut *rx;
        let mut got = 0;
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            if !rx.plain.is_empty() {
                let n = rx.plain.len().min(buf.len() - got);
                buf[got..got + n].copy_from_slice(&rx.buf[rx.plain.start..rx.plain.start + n]);
                rx.plain.start += n;
                got += n;
                if got == buf.len() {
                    return Ok(got);
                }
                continue;
            }
            if let Some(why) = &rx.broken {
                return if got > 0 {
                    Ok(got)
                } else {
                    Err(io::Error::new(io::ErrorKind::InvalidData, why.clone()))
                };
            }
            // close_notify: the end.
            if rx.closed {
                return Ok(got);
            }
            if self.open_next(rx) {
                continue;
            }
            if got > 0 {
                return Ok(got);
            }
            if !rx.eof {
                match self.read_direct(rx, buf, &mut deadline)? {
                    Some(0) => continue,
                    Some(n) => return Ok(n),
                    None => {}
                }
            }
            if rx.eof {
                if rx.start < rx.end {
                    rx.broken =
                        Some("the peer's TLS stream ended in the middle of a record".into());
                    continue;
                }
                // The peer closed without close_notify: an end all the same
                // (ferry's frames say where a stream ends).
                return Ok(0);
            }
            // Nothing to open: make room for a whole record, then wait.
            if rx.start == rx.end {
                (rx.start, rx.end) = (0, 0);
            } else if rx.buf.len() - rx.start < MAX_RECORD {
                rx.buf.copy_within(rx.start..rx.end, 0);
                (rx.start, rx.end) = (0, rx.end - rx.start);
            }
            // Try first: under load the bytes are usually there already.
            match sys::recv(self.fd(), &mut rx.buf[rx.end..]) {
                Ok(0) => rx.eof = true,
                Ok(n) => rx.end += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // One deadline for the whole read, set at its first
                    // wait: a peer that trickles a record byte by byte
                    // cannot stretch it past the socket's timeout.
                    let deadline = match deadline {
                        Some(d) => d,
                        None => *deadline.insert(sys::deadline(self.tcp.read_timeout()?)),
                    };
                    if !sys::poll_until(self.fd(), libc::POLLIN, deadline)? {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                }
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

#[cfg(test)]
mod tests;
