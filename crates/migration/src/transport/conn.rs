//! A migration connection: one socket as a buffered reader half and a
//! buffered writer half. The halves can go to different threads (a bulk
//! stream's receiver, postcopy's demand lander and its fault thread), and a
//! [`Closer`] can cut the connection from a third. Every byte still passes
//! through [`Stream`]: the halves offer what callers need of the socket
//! (reads into guest memory, readiness, the delivery rate) as methods.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use super::{Endpoint, Stream};
use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, ProtocolError};
use crate::telemetry::LinkMeter;

/// Bytes the reader buffers: enough for a frame header and a small message
/// per read(2); page data bypasses it ([`ConnReader::read_exact_raw`]).
const READ_BUFFER: usize = 64 << 10;
/// Bytes the writer gathers before a write(2): a batch of pages.
const WRITE_BUFFER: usize = 1 << 20;

/// A migration connection: its reader and writer halves.
pub struct Conn {
    reader: ConnReader,
    writer: ConnWriter,
}

/// The receiving half of a [`Conn`].
pub struct ConnReader(BufReader<Stream>);

/// The sending half of a [`Conn`] (flush after a message that must go now).
pub struct ConnWriter(BufWriter<Stream>);

/// A handle that can only cut a connection (both directions), from any
/// thread: threads blocked on its halves wake with an error or an end.
pub struct Closer(Stream);

impl Conn {
    /// Wraps a connected socket; `timeout` bounds every read and write.
    pub fn new(s: Stream, timeout: Option<Duration>) -> io::Result<Conn> {
        s.set_timeouts(timeout)?;
        let w = s.try_clone()?;
        Ok(Conn {
            reader: ConnReader(BufReader::with_capacity(READ_BUFFER, s)),
            writer: ConnWriter(BufWriter::with_capacity(WRITE_BUFFER, w)),
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

    /// Reads the next frame, whatever its kind.
    pub fn read_frame(&mut self) -> Result<protocol::Frame, ProtocolError> {
        protocol::read_frame(&mut self.reader)
    }

    /// Flushes what was written.
    pub fn flush(&mut self) -> Result<(), ProtocolError> {
        self.writer.flush().map_err(ProtocolError::Io)
    }

    /// Counts this connection's bytes into `meter` from now on.
    pub fn count_into(&mut self, meter: Arc<LinkMeter>) {
        self.reader.0.get_mut().count_into(meter.clone());
        self.writer.0.get_mut().count_into(meter);
    }

    /// The receiving half.
    pub fn reader(&mut self) -> &mut ConnReader {
        &mut self.reader
    }

    /// The sending half.
    pub fn writer(&mut self) -> &mut ConnWriter {
        &mut self.writer
    }

    /// The two halves, for two threads.
    pub fn into_parts(self) -> (ConnReader, ConnWriter) {
        (self.reader, self.writer)
    }

    /// A handle that cuts this connection from another thread.
    pub fn closer(&self) -> io::Result<Closer> {
        self.writer.closer()
    }

    /// Cuts both directions now (threads blocked on the halves wake).
    pub fn shutdown(&self) {
        let _ = self.writer.0.get_ref().shutdown(Shutdown::Both);
    }

    /// Bounds every later read (None: block until the peer sends).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.reader.set_read_timeout(t)
    }

    /// Bounds every later read and write (None: block).
    pub fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.writer.0.get_ref().set_timeouts(t)
    }

    /// True if the link seals every byte ([`ConnWriter::seals`]).
    pub fn writer_seals(&self) -> bool {
        self.writer.seals()
    }

    /// Who the peer's certificate says it is (TLS links only).
    pub fn peer(&self) -> Option<&ferry_tls::PeerIdentity> {
        self.writer.0.get_ref().peer()
    }

    /// True when a frame (or an end) can be read within `wait`.
    pub fn wait_readable(&self, wait: Duration) -> bool {
        self.reader.wait_readable(wait)
    }

    /// Polls, without sleeping (yielding the core between polls), until a
    /// frame (or an end) can be read or `budget` has passed; true if it
    /// can. For an answer due in well under
    /// a millisecond while the VM is paused: a thread asleep in read(2)
    /// wakes 50-200 µs after the data is there on a virtualized host, and
    /// that wake-up is downtime. Where nothing came within the budget, the
    /// caller's read blocks as usual.
    pub fn spin_until_readable(&self, budget: Duration) -> bool {
        let t = std::time::Instant::now();
        loop {
            if self.reader.wait_readable(Duration::ZERO) {
                return true;
            }
            if t.elapsed() >= budget {
                return false;
            }
            // Yielded, not spun: on a small host the destination's threads
            // may need this core to send the answer.
            std::thread::yield_now();
        }
    }

    /// Says why this side gives up, then closes its sending half gracefully:
    /// unread bytes at close would turn into a reset, and the peer would
    /// lose the reason.
    pub fn abort(&mut self, reason: &str) {
        let _ = protocol::write_frame(&mut self.writer, Kind::Abort, reason.as_bytes());
        let _ = self.writer.flush();
    }

    /// After [`Conn::abort`]: stops sending and reads what the peer still
    /// sends for up to `wait`, so the reason is read before the close.
    pub fn drain(&mut self, wait: Duration) {
        let s = self.writer.0.get_ref();
        let _ = s.shutdown(Shutdown::Write);
        let _ = s.set_read_timeout(Some(wait));
        let mut sink = [0u8; 65536];
        while matches!(self.reader.read(&mut sink), Ok(n) if n > 0) {}
    }
}

impl ConnReader {
    /// Fills `ptr .. ptr + len` from the connection: first what the reader
    /// has buffered, then straight from the socket, no copy in between.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be writable memory that nothing else reads or
    /// writes during the call, and must not overlap the reader's buffer.
    pub unsafe fn read_exact_raw(&mut self, ptr: *mut u8, len: usize) -> io::Result<()> {
        let buffered = self.0.buffer();
        let k = buffered.len().min(len);
        // SAFETY: `ptr` is valid for `len >= k` bytes (the caller's promise);
        // the reader's own buffer cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(buffered.as_ptr(), ptr, k) };
        self.0.consume(k);
        let mut done = k;
        while done < len {
            // SAFETY: `ptr + done .. ptr + len` lies inside the caller's
            // stretch.
            match unsafe { self.0.get_mut().read_raw(ptr.add(done), len - done) }? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => done += n,
            }
        }
        Ok(())
    }

    /// True if the link seals every byte it carries (TLS: each record has
    /// an AEAD tag), so a sealed frame, which has no checksum of its own,
    /// may be taken from it.
    pub fn seals(&self) -> bool {
        self.0.get_ref().is_tls()
    }

    /// True if [`read_exact_raw`](Self::read_exact_raw) fills memory
    /// partly by a copy in this process and opens it there (TLS: records
    /// are received into the memory and opened in place, but the edges of
    /// a stretch come from the read-ahead), false if read(2) alone writes
    /// it, in the kernel.
    pub fn lands_by_copy(&self) -> bool {
        self.0.get_ref().is_tls()
    }

    /// True when bytes (or an end) can be read within `wait`: at once if the
    /// reader holds some already.
    pub fn wait_readable(&self, wait: Duration) -> bool {
        !self.0.buffer().is_empty() || self.0.get_ref().readable(wait)
    }

    /// Bounds every later read (None: block).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.0.get_ref().set_read_timeout(t)
    }

    /// Reads that give up at `at` whatever the peer's pace (each read
    /// waits at most what is left): a trickling peer cannot stretch a
    /// handshake.
    pub fn until(&mut self, at: std::time::Instant) -> Until<'_> {
        Until { r: self, at }
    }

    /// A handle that cuts this connection from another thread.
    pub fn closer(&self) -> io::Result<Closer> {
        self.0.get_ref().try_clone().map(Closer)
    }
}

/// A [`ConnReader`] that fails with TimedOut once its deadline passed
/// ([`ConnReader::until`]).
pub struct Until<'a> {
    r: &'a mut ConnReader,
    at: std::time::Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.at.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.r.set_read_timeout(Some(left))?;
        self.r.read(buf)
    }
}

impl Read for ConnReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl BufRead for ConnReader {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        self.0.fill_buf()
    }
    fn consume(&mut self, amt: usize) {
        self.0.consume(amt)
    }
}

impl ConnWriter {
    /// The kernel's latest delivery-rate sample of the path (bytes/s; TCP
    /// only): what the link really carries, measured from its ACKs.
    pub fn delivery_rate(&self) -> Option<f64> {
        self.0.get_ref().delivery_rate()
    }

    /// The path as this connection's TCP_INFO sees it (TCP only).
    pub(crate) fn path_sample(&self) -> Option<crate::governor::PathSample> {
        self.0.get_ref().path_sample()
    }

    /// After this bulk stream sent `bytes` more, has `governor` steer its
    /// pacing from the path's TCP_INFO: the governor's cap, never above
    /// `limit` (the stream's share of `--bandwidth`). No sample (not TCP):
    /// nothing changes.
    pub(crate) fn steer(
        &self,
        governor: &crate::governor::Governor,
        bytes: u64,
        limit: Option<u64>,
    ) {
        let Some(sample) = self.path_sample() else {
            return;
        };
        let cap = match (
            governor.observe(sample, bytes, std::time::Instant::now()),
            limit,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.pace_packets(cap);
    }

    /// Has the kernel pace this connection's packets at `rate` bytes/s at
    /// most (None: no cap); see [`Stream::set_pacing`]. Best effort: a
    /// kernel that refuses leaves the sender's own pacer alone in charge.
    pub fn pace_packets(&self, rate: Option<u64>) {
        if let Err(e) = self.0.get_ref().set_pacing(rate) {
            tracing::debug!(error = %e, "SO_MAX_PACING_RATE refused");
        }
    }

    /// True if the link seals every byte it carries (TLS): frames may go
    /// without a checksum of their own ([`protocol::SEALED`]).
    pub fn seals(&self) -> bool {
        self.0.get_ref().is_tls()
    }

    /// True over TCP (where [`ConnWriter::delivery_rate`] can answer).
    pub fn is_tcp(&self) -> bool {
        self.0.get_ref().is_tcp()
    }

    /// A handle that cuts this connection from another thread.
    pub fn closer(&self) -> io::Result<Closer> {
        self.0.get_ref().try_clone().map(Closer)
    }
}

impl protocol::SpendingWrite for ConnWriter {
    /// What is buffered goes first; then a TLS link seals `data` in place.
    fn write_all_spending(&mut self, data: &mut [u8]) -> io::Result<()> {
        self.0.flush()?;
        self.0.get_mut().write_all_spending(data)
    }
}

impl Write for ConnWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.0.write_vectored(bufs)
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl Closer {
    /// Cuts both directions.
    pub fn shutdown(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }

    /// Bounds the connection's reads (None: block).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(t)
    }
}

impl std::fmt::Debug for Closer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Closer").finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair() -> (Conn, Conn) {
        let (a, b) = UnixStream::pair().unwrap();
        (
            Conn::new(Stream::unix(a), Some(Duration::from_secs(5))).unwrap(),
            Conn::new(Stream::unix(b), Some(Duration::from_secs(5))).unwrap(),
        )
    }

    #[test]
    fn a_raw_read_takes_the_buffered_bytes_then_the_socket_and_counts_them() {
        let (mut a, mut b) = pair();
        let meter = Arc::new(LinkMeter::default());
        b.count_into(meter.clone());
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        a.send_frame(Kind::Pages, &[7u8; 3]).unwrap();
        a.writer().write_all(&payload).unwrap();
        a.flush().unwrap();
        // The frame's read fills the reader's buffer with page bytes too.
        let f = b.read_frame().unwrap();
        assert_eq!(f.body, [7u8; 3]);
        let mut dst = vec![0u8; payload.len()];
        // SAFETY: `dst` is ours, writable, and not the reader's buffer.
        unsafe { b.reader().read_exact_raw(dst.as_mut_ptr(), dst.len()) }.unwrap();
        assert_eq!(dst, payload);
        let counted = meter.received.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(counted, (protocol::HEADER + 3 + payload.len()) as u64);
    }

    #[test]
    fn a_raw_read_past_the_end_is_an_unexpected_eof() {
        let (mut a, mut b) = pair();
        a.writer().write_all(&[1, 2, 3]).unwrap();
        a.flush().unwrap();
        drop(a);
        let mut dst = [0u8; 8];
        // SAFETY: as above.
        let e = unsafe { b.reader().read_exact_raw(dst.as_mut_ptr(), dst.len()) }.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(&dst[..3], &[1, 2, 3]);
    }

    #[test]
    fn readiness_sees_the_socket_and_the_reader_buffer() {
        let (mut a, mut b) = pair();
        assert!(!b.wait_readable(Duration::from_millis(10)));
        a.send_frame(Kind::Complete, &[]).unwrap();
        a.send_frame(Kind::Complete, &[]).unwrap();
        assert!(b.wait_readable(Duration::from_secs(1)));
        b.read_frame().unwrap();
        // The second frame sits in the buffer, not in the socket.
        assert!(b.wait_readable(Duration::ZERO));
    }

    #[test]
    fn a_closer_wakes_a_reader_blocked_on_a_silent_peer() {
        let (_a, b) = pair();
        let closer = b.closer().unwrap();
        let (mut reader, _writer) = b.into_parts();
        let t = std::thread::spawn(move || protocol::read_frame(&mut reader));
        std::thread::sleep(Duration::from_millis(50));
        closer.shutdown();
        let r = t.join().unwrap();
        assert!(r.is_err(), "a cut connection ends the read");
    }

    #[test]
    fn tcp_reports_a_delivery_rate_and_unix_does_not() {
        let (a, _b) = pair();
        assert!(!a.writer.is_tcp());
        assert_eq!(a.writer.delivery_rate(), None);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut c = Conn::new(Stream::tcp(tcp), None).unwrap();
        let (server, _) = l.accept().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = server;
            let mut buf = vec![0u8; 1 << 20];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        });
        for _ in 0..16 {
            c.writer().write_all(&vec![0u8; 1 << 20]).unwrap();
        }
        c.flush().unwrap();
        assert!(c.writer.is_tcp());
        let rate = c.writer.delivery_rate();
        assert!(rate.is_some_and(|r| r > 0.0), "{rate:?}");
        c.shutdown();
        t.join().unwrap();
    }

    #[test]
    fn a_paced_tcp_connection_delivers_no_faster_than_its_rate() {
        // 8 MiB at 16 MB/s: at least half a second at the reader, where an
        // unpaced loopback connection takes milliseconds.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut c = Conn::new(Stream::tcp(tcp), None).unwrap();
        c.writer().pace_packets(Some(16_000_000));
        let (server, _) = l.accept().unwrap();
        let t = std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut s = server;
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            while let Ok(n @ 1..) = s.read(&mut buf) {
                got += n;
            }
            (got, start.elapsed())
        });
        for _ in 0..8 {
            c.writer().write_all(&vec![0u8; 1 << 20]).unwrap();
        }
        c.flush().unwrap();
        c.shutdown();
        let (got, took) = t.join().unwrap();
        assert_eq!(got, 8 << 20);
        assert!(took >= Duration::from_millis(400), "{took:?}");
    }

    #[test]
    fn a_cap_comes_off_and_a_socket_never_capped_is_not_touched() {
        use std::os::fd::AsRawFd;
        let max_pacing = |s: &std::net::TcpStream| {
            let mut v = 0u64;
            let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into `v`, ours.
            let r = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_MAX_PACING_RATE,
                    (&mut v as *mut u64).cast(),
                    &mut len,
                )
            };
            assert_eq!(r, 0);
            v
        };
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let probe = tcp.try_clone().unwrap();
        let c = Conn::new(Stream::tcp(tcp), None).unwrap();
        let untouched = max_pacing(&probe);
        c.writer.pace_packets(None);
        assert_eq!(max_pacing(&probe), untouched);
        c.writer.pace_packets(Some(16_000_000));
        assert_eq!(max_pacing(&probe), 16_000_000);
        c.writer.pace_packets(None);
        assert_eq!(max_pacing(&probe), untouched);
    }
}
