//! A connection to one export: reads, writes, flush, trim and write-zeroes
//! at byte offsets, checked against the export (its end, read-only, block
//! alignment) before anything is sent, split to the server's largest
//! request, one request at a time per connection (a device that wants
//! several in flight opens several clients when the export says
//! `multi_conn`). A broken or silent link is reconnected and the request
//! sent again, within `reconnect_within`: a server restarted under a
//! running VM costs its guest a wait, not an error; a request the server
//! answered with an error is not sent again.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_tls::Credentials;
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, StreamOwned};

use crate::error::NbdError;
use crate::handshake::{self, read_exact, write_all};
use crate::uri::{NbdUri, Transport};
use crate::wire::{self, Command};

/// What the export is, as the server said at GO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    /// Its size, bytes.
    pub size: u64,
    /// Writes are refused.
    pub read_only: bool,
    /// The server takes FLUSH (without it, its writes need none).
    pub flush: bool,
    /// The server takes TRIM.
    pub trim: bool,
    /// The server takes WRITE_ZEROES.
    pub write_zeroes: bool,
    /// Connections see each other's writes; a flush on one covers all.
    pub multi_conn: bool,
    /// Requests must be aligned to this (1: none).
    pub min_block: u32,
    /// The largest request sent (the server's maximum, at most 32 MiB).
    pub max_request: u32,
}

impl Export {
    fn of(info: wire::ExportInfo) -> Export {
        let f = info.flags;
        let has = |bit: u16| f & wire::TFLAG_HAS_FLAGS != 0 && f & bit != 0;
        let (min, max) = info.block.map_or((1, wire::MAX_REQUEST), |(min, _, max)| {
            (min, max.min(wire::MAX_REQUEST))
        });
        Export {
            size: info.size,
            read_only: has(wire::TFLAG_READ_ONLY),
            flush: has(wire::TFLAG_SEND_FLUSH),
            trim: has(wire::TFLAG_SEND_TRIM),
            write_zeroes: has(wire::TFLAG_SEND_WRITE_ZEROES),
            multi_conn: has(wire::TFLAG_CAN_MULTI_CONN),
            min_block: min,
            // A multiple of the alignment.
            max_request: (max / min).max(1) * min,
        }
    }
}

/// How the client behaves on a bad day.
#[derive(Clone, Debug)]
pub struct Options {
    /// Connecting, and each read or write on the link.
    pub timeout: Duration,
    /// How long a request keeps reconnecting before it fails.
    pub reconnect_within: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            timeout: Duration::from_secs(10),
            reconnect_within: Duration::from_secs(30),
        }
    }
}

/// A connection to one NBD export.
pub struct Client {
    uri: NbdUri,
    tls: Option<Arc<Credentials>>,
    opts: Options,
    export: Export,
    /// None after a break, until the next request reconnects.
    link: Mutex<Option<Link>>,
    cookie: AtomicU64,
    reconnects: AtomicU64,
}

impl Client {
    /// Connects to `uri` (`tls`: the credentials for `nbds://`) and
    /// negotiates the export.
    pub fn connect(
        uri: &NbdUri,
        tls: Option<Arc<Credentials>>,
        opts: Options,
    ) -> Result<Client, NbdError> {
        let (link, info) = open(uri, tls.as_ref(), &opts)?;
        let export = Export::of(info);
        Ok(Client {
            uri: uri.clone(),
            tls,
            opts,
            export,
            link: Mutex::new(Some(link)),
            cookie: AtomicU64::new(1),
            reconnects: AtomicU64::new(0),
        })
    }

    /// What the export is.
    pub fn export(&self) -> Export {
        self.export
    }

    /// The server, for messages.
    pub fn describe(&self) -> String {
        self.uri.describe()
    }

    /// How many times the link was made again after a break.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), NbdError> {
        self.check(Command::Read, offset, buf.len() as u64)?;
        let step = self.export.max_request as usize;
        for (i, chunk) in buf.chunks_mut(step).enumerate() {
            let at = offset + (i * step) as u64;
            self.request(Command::Read, 0, at, chunk.len() as u32, Body::Read(chunk))?;
        }
        Ok(())
    }

    /// Writes `data` at `offset`; `fua`: durable when answered.
    pub fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), NbdError> {
        self.check(Command::Write, offset, data.len() as u64)?;
        let flags = if fua { wire::CMD_FLAG_FUA } else { 0 };
        let step = self.export.max_request as usize;
        for (i, chunk) in data.chunks(step).enumerate() {
            let at = offset + (i * step) as u64;
            self.request(
                Command::Write,
                flags,
                at,
                chunk.len() as u32,
                Body::Write(chunk),
            )?;
        }
        Ok(())
    }

    /// Makes every answered write durable (nothing to do on a server that
    /// does not take FLUSH: the protocol forbids sending it, and such a
    /// server's writes need none).
    pub fn flush(&self) -> Result<(), NbdError> {
        if !self.export.flush {
            return Ok(());
        }
        self.request(Command::Flush, 0, 0, 0, Body::None)
    }

    /// Discards `len` bytes at `offset` (advisory: nothing on a server that
    /// does not take TRIM).
    pub fn trim(&self, offset: u64, len: u64) -> Result<(), NbdError> {
        self.check(Command::Trim, offset, len)?;
        if !self.export.trim {
            return Ok(());
        }
        self.ranges(Command::Trim, offset, len)
    }

    /// Writes `len` zero bytes at `offset` (written out as zeroes where the
    /// server does not take WRITE_ZEROES).
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), NbdError> {
        self.check(Command::WriteZeroes, offset, len)?;
        if self.export.write_zeroes {
            return self.ranges(Command::WriteZeroes, offset, len);
        }
        let zeroes = vec![0u8; (self.export.max_request as u64).min(len) as usize];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(zeroes.len() as u64) as usize;
            self.write_at(&zeroes[..n], at, false)?;
            at += n as u64;
        }
        Ok(())
    }

    /// Ends the session politely (DISC); the connection closes.
    pub fn disconnect(&self) {
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut l) = link.take() {
            let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
            let _ = l.write_all(&wire::request(Command::Disc, 0, cookie, 0, 0));
            let _ = l.flush();
        }
    }

    /// A request the export cannot take, refused before it is sent.
    fn check(&self, cmd: Command, offset: u64, len: u64) -> Result<(), NbdError> {
        let e = &self.export;
        let end = offset.checked_add(len).filter(|&end| end <= e.size);
        if end.is_none() {
            return Err(NbdError::Invalid(format!(
                "a {} of {len} bytes at offset {offset} is past the end of the {}-byte export {}",
                cmd.name(),
                e.size,
                self.uri.describe()
            )));
        }
        if cmd != Command::Read && e.read_only {
            return Err(NbdError::Invalid(format!(
                "the export {} is read-only: no {}",
                self.uri.describe(),
                cmd.name()
            )));
        }
        let align = e.min_block as u64;
        if align > 1 && (!offset.is_multiple_of(align) || !len.is_multiple_of(align)) {
            return Err(NbdError::Invalid(format!(
                "a {} of {len} bytes at offset {offset} is not aligned to the export's {align}-byte blocks",
                cmd.name()
            )));
        }
        Ok(())
    }

    /// A length-only command over `len` bytes, in pieces the server takes.
    fn ranges(&self, cmd: Command, offset: u64, len: u64) -> Result<(), NbdError> {
        let step = self.export.max_request as u64;
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(step);
            self.request(cmd, 0, at, n as u32, Body::None)?;
            at += n;
        }
        Ok(())
    }

    /// One request and its reply, reconnecting on a broken link.
    fn request(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u32,
        mut body: Body<'_>,
    ) -> Result<(), NbdError> {
        let deadline = Instant::now() + self.opts.reconnect_within;
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let result = match link.as_mut() {
                Some(l) => self.exchange(l, cmd, flags, offset, len, &mut body),
                None => match open(&self.uri, self.tls.as_ref(), &self.opts) {
                    Ok((l, info)) => {
                        let again = Export::of(info);
                        if again.size != self.export.size
                            || again.read_only != self.export.read_only
                        {
                            return Err(NbdError::Protocol(format!(
                                "the export {} came back as another disk ({} bytes{}; it was {} bytes{})",
                                self.uri.describe(),
                                again.size,
                                if again.read_only { ", read-only" } else { "" },
                                self.export.size,
                                if self.export.read_only { ", read-only" } else { "" },
                            )));
                        }
                        self.reconnects.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(server = %self.uri.describe(), "NBD link made again");
                        *link = Some(l);
                        continue;
                    }
                    Err(e) => Err(e),
                },
            };
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.is_link_break() && Instant::now() < deadline => {
                    if link.take().is_some() {
                        tracing::warn!(server = %self.uri.describe(), error = %e, "NBD link broke; reconnecting");
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    // The link's state is unknown after any failure.
                    link.take();
                    return Err(e);
                }
            }
        }
    }

    fn exchange(
        &self,
        l: &mut Link,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u32,
        body: &mut Body<'_>,
    ) -> Result<(), NbdError> {
        let addr = self.uri.describe();
        let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
        let head = wire::request(cmd, flags, cookie, offset, len);
        match body {
            Body::Write(data) => {
                l.write_all(&head)
                    .and_then(|_| l.write_all(data))
                    .map_err(|source| NbdError::Io {
                        addr: addr.clone(),
                        source,
                    })?;
                write_all(l, &[], &addr)?;
            }
            _ => write_all(l, &head, &addr)?,
        }
        let mut r = [0u8; 16];
        read_exact(l, &mut r, &addr)?;
        let (error, got) = wire::simple_reply(&r)?;
        if got != cookie {
            return Err(NbdError::Protocol(format!(
                "a reply for request {got} while request {cookie} was the only one in flight"
            )));
        }
        if error != 0 {
            return Err(NbdError::Server {
                command: cmd.name(),
                offset,
                errno: error,
            });
        }
        if let Body::Read(buf) = body {
            read_exact(l, buf, &addr)?;
        }
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// What goes with a request, or comes back with its reply.
enum Body<'a> {
    None,
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

/// The byte stream to the server.
enum Link {
    Tcp(TcpStream),
    Unix(UnixStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Read for Link {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(b),
            Link::Unix(s) => s.read(b),
            Link::Tls(s) => s.read(b),
        }
    }
}

impl Write for Link {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.write(b),
            Link::Unix(s) => s.write(b),
            Link::Tls(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Tcp(s) => s.flush(),
            Link::Unix(s) => s.flush(),
            Link::Tls(s) => s.flush(),
        }
    }
}

/// A new connection, negotiated up to transmission.
fn open(
    uri: &NbdUri,
    tls: Option<&Arc<Credentials>>,
    opts: &Options,
) -> Result<(Link, wire::ExportInfo), NbdError> {
    let addr = uri.describe();
    let io = |source| NbdError::Io {
        addr: addr.clone(),
        source,
    };
    match &uri.transport {
        Transport::Unix(path) => {
            let s = UnixStream::connect(path).map_err(io)?;
            s.set_read_timeout(Some(opts.timeout)).map_err(io)?;
            s.set_write_timeout(Some(opts.timeout)).map_err(io)?;
            let mut link = Link::Unix(s);
            handshake::greet(&mut link, &addr)?;
            let info = handshake::go(&mut link, &uri.export, false, &addr)?;
            Ok((link, info))
        }
        Transport::Tcp {
            hostport,
            tls: want_tls,
        } => {
            let mut tcp = connect(hostport, opts.timeout).map_err(io)?;
            tcp.set_read_timeout(Some(opts.timeout)).map_err(io)?;
            tcp.set_write_timeout(Some(opts.timeout)).map_err(io)?;
            let _ = tcp.set_nodelay(true);
            handshake::greet(&mut tcp, &addr)?;
            if !want_tls {
                let mut link = Link::Tcp(tcp);
                let info = handshake::go(&mut link, &uri.export, false, &addr)?;
                return Ok((link, info));
            }
            let Some(creds) = tls else {
                return Err(NbdError::Tls(format!(
                    "{addr} is nbds:// and no TLS credentials were given (ferry --tls-dir)"
                )));
            };
            handshake::starttls(&mut tcp, &addr)?;
            let host = host_of(hostport);
            let name = ServerName::try_from(host.to_string()).map_err(|e| {
                NbdError::Tls(format!("{host:?} is not a host name or address: {e}"))
            })?;
            let mut conn = ClientConnection::new(creds.client_config(), name)
                .map_err(|e| NbdError::Tls(e.to_string()))?;
            while conn.is_handshaking() {
                conn.complete_io(&mut tcp)
                    .map_err(|e| NbdError::Tls(format!("handshake with {addr}: {e}")))?;
            }
            let mut link = Link::Tls(Box::new(StreamOwned::new(conn, tcp)));
            let info = handshake::go(&mut link, &uri.export, true, &addr)?;
            Ok((link, info))
        }
    }
}

fn connect(hostport: &str, timeout: Duration) -> io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = hostport.to_socket_addrs()?.collect();
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{hostport} has no address"),
    );
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The host of `HOST:PORT` (brackets off a v6 address).
fn host_of(hostport: &str) -> &str {
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_export_is_read_from_its_flags_and_block_sizes() {
        let info = wire::ExportInfo {
            size: 1 << 30,
            flags: wire::TFLAG_HAS_FLAGS | wire::TFLAG_SEND_FLUSH | wire::TFLAG_SEND_TRIM,
            block: Some((512, 4096, u32::MAX)),
        };
        let e = Export::of(info);
        assert!(e.flush && e.trim && !e.write_zeroes && !e.read_only && !e.multi_conn);
        assert_eq!((e.min_block, e.max_request), (512, wire::MAX_REQUEST));
        // Flags without HAS_FLAGS mean nothing.
        let e = Export::of(wire::ExportInfo {
            flags: wire::TFLAG_READ_ONLY,
            ..info
        });
        assert!(!e.read_only && !e.flush);
        // A maximum that is not a multiple of the alignment is rounded
        // down to one.
        let e = Export::of(wire::ExportInfo {
            block: Some((4096, 4096, 10_000)),
            ..info
        });
        assert_eq!(e.max_request, 8192);
    }

    #[test]
    fn hosts_come_out_of_addresses() {
        assert_eq!(host_of("[::1]:10809"), "::1");
        assert_eq!(host_of("store:1"), "store");
    }
}
