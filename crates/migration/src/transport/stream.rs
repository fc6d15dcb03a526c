//! One connected socket, TCP, TLS over TCP or Unix, and every way ferry
//! touches it: reads and writes (counted into the link's meter), reads
//! straight into guest memory, readiness, timeouts, shutdown and the
//! kernel's TCP statistics. Nothing outside the transport sees the
//! socket's descriptor, so every byte passes through here, and TLS (the
//! process's [`Security`](super::Security)) is decided here once.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferry_tls::rustls::pki_types::ServerName;
use ferry_tls::{Handshake, PeerIdentity, TlsSocket, HANDSHAKE_TIMEOUT};

use super::security::{installed, Security};
use super::Endpoint;
use crate::telemetry::LinkMeter;

/// One connected socket, counting its bytes into a [`LinkMeter`] once it
/// has one (the timeline's bytes per stream).
#[derive(Debug)]
pub struct Stream {
    sock: Sock,
    meter: Option<Arc<LinkMeter>>,
    /// The pacing cap last set on the socket (bytes/s; u64::MAX: none, the
    /// kernel's own value): a call that changes nothing makes no syscall,
    /// and a socket never capped is left exactly as the kernel made it.
    paced_at: std::sync::atomic::AtomicU64,
    /// Whether the receiver holds this stream back, from its TCP_INFO
    /// (the governor's path samples).
    window: std::sync::Mutex<crate::governor::WindowWatch>,
    /// A TCP connection to a loopback address (its peer never changes:
    /// asked once, not at every path sample).
    to_loopback: bool,
}

#[derive(Debug)]
enum Sock {
    Tcp(TcpStream),
    Tls(TlsSocket),
    Unix(UnixStream),
}

impl Stream {
    fn of(sock: Sock) -> Stream {
        Stream {
            to_loopback: to_loopback(&sock),
            sock,
            meter: None,
            paced_at: std::sync::atomic::AtomicU64::new(u64::MAX),
            window: Default::default(),
        }
    }

    /// A TCP connection just accepted or connected (Nagle off: frames are
    /// batched by the writer's buffer already).
    pub fn tcp(s: TcpStream) -> Stream {
        let _ = s.set_nodelay(true);
        Stream::of(Sock::Tcp(s))
    }

    /// A Unix-domain connection.
    pub fn unix(s: UnixStream) -> Stream {
        Stream::of(Sock::Unix(s))
    }

    /// Connects to `to`, waiting at most `timeout`; over TCP, runs the TLS
    /// handshake this process's security asks for (the peer's certificate
    /// must chain to the fleet CA and name the address connected to).
    pub fn connect(to: &Endpoint, timeout: Duration) -> io::Result<Stream> {
        match to {
            Endpoint::Tcp(a) => {
                let security = installed().map_err(io::Error::other)?;
                let tcp = TcpStream::connect_timeout(a, timeout)?;
                Stream::secured(tcp, &security, |creds| {
                    Handshake::Client(creds.client_config(), ServerName::IpAddress(a.ip().into()))
                })
            }
            Endpoint::Unix(p) => Ok(Stream::unix(UnixStream::connect(p)?)),
        }
    }

    /// A TCP connection just accepted, after the handshake `security` asks
    /// for (within a few seconds: a silent peer fails here).
    pub(super) fn accepted_tcp(tcp: TcpStream, security: &Security) -> io::Result<Stream> {
        Stream::secured(tcp, security, |creds| {
            Handshake::Server(creds.server_config())
        })
    }

    /// `tcp` as `security` wants it: plain, or after the TLS handshake of
    /// the side `side` gives (Nagle off either way).
    fn secured(
        tcp: TcpStream,
        security: &Security,
        side: impl FnOnce(&ferry_tls::Credentials) -> Handshake,
    ) -> io::Result<Stream> {
        match security {
            Security::Tls(creds) => {
                let _ = tcp.set_nodelay(true);
                let tls = TlsSocket::handshake(tcp, side(creds), HANDSHAKE_TIMEOUT)
                    .map_err(io::Error::other)?;
                Ok(Stream::of(Sock::Tls(tls)))
            }
            _ => Ok(Stream::tcp(tcp)),
        }
    }

    /// Who the peer's certificate says it is (TLS links only).
    pub fn peer(&self) -> Option<&PeerIdentity> {
        match &self.sock {
            Sock::Tls(t) => Some(t.peer()),
            _ => None,
        }
    }

    /// True if the link is encrypted and its peer authenticated.
    pub fn is_tls(&self) -> bool {
        matches!(self.sock, Sock::Tls(_))
    }

    /// A second handle on the same socket (counting into the same meter).
    pub(super) fn try_clone(&self) -> io::Result<Stream> {
        let sock = match &self.sock {
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
            Sock::Tls(s) => Sock::Tls(s.try_clone()?),
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
        };
        Ok(Stream {
            sock,
            meter: self.meter.clone(),
            paced_at: std::sync::atomic::AtomicU64::new(
                self.paced_at.load(std::sync::atomic::Ordering::Relaxed),
            ),
            window: Default::default(),
            to_loopback: self.to_loopback,
        })
    }

    /// Counts what this handle reads and writes from now on into `meter`.
    pub(super) fn count_into(&mut self, meter: Arc<LinkMeter>) {
        self.meter = Some(meter);
    }

    /// Read and write timeouts (None: block).
    pub(super) fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)?;
        match &self.sock {
            Sock::Tcp(s) => s.set_write_timeout(t),
            Sock::Tls(s) => s.tcp().set_write_timeout(t),
            Sock::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// The read timeout alone.
    pub(super) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match &self.sock {
            Sock::Tcp(s) => s.set_read_timeout(t),
            Sock::Tls(s) => s.tcp().set_read_timeout(t),
            Sock::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// Shuts down one or both directions.
    pub(super) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.sock {
            Sock::Tcp(s) => s.shutdown(how),
            Sock::Tls(s) => {
                if how != Shutdown::Read {
                    s.close_notify();
                }
                s.tcp().shutdown(how)
            }
            Sock::Unix(s) => s.shutdown(how),
        }
    }

    /// True for TCP (the kernel's delivery rate is known there).
    pub(super) fn is_tcp(&self) -> bool {
        matches!(self.sock, Sock::Tcp(_) | Sock::Tls(_))
    }

    fn fd(&self) -> RawFd {
        match &self.sock {
            Sock::Tcp(s) => s.as_raw_fd(),
            Sock::Tls(s) => s.tcp().as_raw_fd(),
            Sock::Unix(s) => s.as_raw_fd(),
        }
    }

    /// True if the socket has bytes (or an end) to read within `wait`.
    pub(super) fn readable(&self, wait: Duration) -> bool {
        if let Sock::Tls(t) = &self.sock {
            if t.has_buffered() {
                return true;
            }
        }
        poll_in(self.fd(), wait).unwrap_or(false)
    }

    /// Reads up to `len` bytes straight to `ptr` with read(2): page data
    /// lands in guest memory with no copy in between.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be writable memory that nothing else reads or
    /// writes during the call.
    pub(super) unsafe fn read_raw(&mut self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        if let Sock::Tls(t) = &mut self.sock {
            // SAFETY: the caller's promise: the range is ours to write for
            // the call. Decrypted bytes are copied there once.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            let n = t.read(buf);
            return self.counted(n, false);
        }
        loop {
            // SAFETY: the caller's promise covers `ptr .. ptr + len`; read(2)
            // writes at most `len` bytes there.
            let n = unsafe { libc::read(self.fd(), ptr.cast(), len) };
            if n >= 0 {
                return self.counted(Ok(n as usize), false);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// The path as this TCP connection's TCP_INFO sees it: smoothed and
    /// shortest round trip, and whether the receiver's window holds the
    /// stream back (a kernel before 4.10 does not say: taken as not). None
    /// over Unix sockets or on a kernel without the round trips.
    pub(super) fn path_sample(&self) -> Option<crate::governor::PathSample> {
        let (info, len) = self.tcp_info()?;
        let needed = std::mem::offset_of!(libc::tcp_info, tcpi_min_rtt) + 4;
        if len < needed {
            return None;
        }
        let has_limits = len >= std::mem::offset_of!(libc::tcp_info, tcpi_rwnd_limited) + 8;
        let receiver_limited = has_limits
            && self
                .window
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .update(info.tcpi_busy_time, info.tcpi_rwnd_limited);
        Some(crate::governor::PathSample {
            srtt_us: info.tcpi_rtt,
            rttvar_us: info.tcpi_rttvar,
            min_rtt_us: info.tcpi_min_rtt,
            receiver_limited,
            to_loopback: self.to_loopback,
        })
    }

    /// TCP_INFO and how many bytes of it the kernel filled.
    fn tcp_info(&self) -> Option<(libc::tcp_info, usize)> {
        if !self.is_tcp() {
            return None;
        }
        // SAFETY: tcp_info is plain integers; all zeros is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `info`, which we own.
        let r = unsafe {
            libc::getsockopt(
                self.fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        (r == 0).then_some((info, len as usize))
    }

    /// The kernel's latest delivery-rate sample of a TCP connection
    /// (bytes/s): what the path really carries, measured from its ACKs.
    /// None over Unix sockets or before the first sample.
    pub(super) fn delivery_rate(&self) -> Option<f64> {
        let (info, len) = self.tcp_info()?;
        let needed = std::mem::offset_of!(libc::tcp_info, tcpi_delivery_rate) + 8;
        (len >= needed && info.tcpi_delivery_rate > 0).then_some(info.tcpi_delivery_rate as f64)
    }

    /// Caps the rate at which the kernel sends this TCP connection's packets
    /// (SO_MAX_PACING_RATE, bytes/s; None: no cap). The kernel spreads the
    /// packets evenly at that rate instead of sending each write as one
    /// burst, so a bottleneck's queue, which the VM's own traffic shares,
    /// stays short. A no-op over Unix sockets. Once capped, a socket stays
    /// paced by the kernel at TCP's own rate after the cap comes off.
    pub(super) fn set_pacing(&self, rate: Option<u64>) -> io::Result<()> {
        // Setting the option at all turns the kernel's TCP pacing on, so a
        // socket that was never capped is not touched to say "no cap" (nor
        // one told again what it has: the governor asks every batch).
        use std::sync::atomic::Ordering::Relaxed;
        let rate: u64 = rate.unwrap_or(u64::MAX);
        if !self.is_tcp() || rate == self.paced_at.load(Relaxed) {
            return Ok(());
        }
        // SAFETY: setsockopt reads size_of::<u64>() bytes from `rate`, a
        // u64 we own (a kernel before 4.20 reads its first 4 bytes, an int:
        // u64::MAX's are ~0, no cap there too).
        let r = unsafe {
            libc::setsockopt(
                self.fd(),
                libc::SOL_SOCKET,
                libc::SO_MAX_PACING_RATE,
                (&rate as *const u64).cast(),
                std::mem::size_of::<u64>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        self.paced_at.store(rate, Relaxed);
        Ok(())
    }

    /// Writes all of `data`, which a TLS link seals in place (so it holds
    /// ciphertext afterwards) instead of copying it into its records.
    pub(super) fn write_all_spending(&mut self, data: &mut [u8]) -> io::Result<()> {
        let Sock::Tls(s) = &self.sock else {
            return self.write_all(data);
        };
        let r = s.send_in_place(data).map(|()| data.len());
        self.counted(r, true).map(|_| ())
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
            Sock::Tls(s) => s.read(buf),
            Sock::Unix(s) => s.read(buf),
        };
        self.counted(n, false)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = match &mut self.sock {
            Sock::Tcp(s) => s.write(buf),
            Sock::Tls(s) => s.write(buf),
            Sock::Unix(s) => s.write(buf),
        };
        self.counted(n, true)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let n = match &mut self.sock {
            Sock::Tcp(s) => s.write_vectored(bufs),
            Sock::Tls(s) => s.write_vectored(bufs),
            Sock::Unix(s) => s.write_vectored(bufs),
        };
        self.counted(n, true)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// True if `fd` (a socket or listener of the transport's) is readable, or
/// at its end, within `wait`; false at the timeout or on an interrupt.
pub(super) fn poll_in(fd: RawFd, wait: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid, exclusively borrowed pollfd and a count of 1.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(r > 0)
}

/// Two ends of one loopback TLS connection, each host of a throwaway fleet
/// made in `dir` (the engine's unit tests of what changes over TLS).
/// True for a TCP connection to a loopback address.
fn to_loopback(sock: &Sock) -> bool {
    let tcp = match sock {
        Sock::Tcp(s) => s,
        Sock::Tls(s) => s.tcp(),
        Sock::Unix(_) => return false,
    };
    tcp.peer_addr().is_ok_and(|a| a.ip().is_loopback())
}

#[cfg(test)]
pub(crate) fn tls_pair(dir: &std::path::Path) -> (Stream, Stream) {
    let Security::Tls(creds) = Security::local_fleet(dir).expect("a local fleet") else {
        unreachable!("local_fleet makes TLS credentials")
    };
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("address");
    let server = {
        let creds = creds.clone();
        std::thread::spawn(move || {
            let (tcp, _) = l.accept().expect("accept");
            Stream::accepted_tcp(tcp, &Security::Tls(creds)).expect("server handshake")
        })
    };
    let tcp = TcpStream::connect(addr).expect("connect");
    let client = Stream::secured(tcp, &Security::Tls(creds), |c| {
        Handshake::Client(c.client_config(), ServerName::IpAddress(addr.ip().into()))
    })
    .expect("client handshake");
    (client, server.join().expect("server thread"))
}
