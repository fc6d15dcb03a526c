//! The mutual TLS handshake, run by rustls's unbuffered API over a
//! non-blocking socket within a deadline, and then handed over: rustls
//! gives up the traffic keys and keeps only what it needs to derive the
//! next ones (its kernel connection), and [`record`](crate::record) does
//! the rest.
//!
//! Records are given to rustls one at a time, so it never decrypts
//! application data that arrived right behind the handshake: those bytes
//! stay in the buffer and go to the record layer.

use std::ops::DerefMut;
use std::os::fd::RawFd;
use std::time::Instant;

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, UnbufferedConnectionCommon, UnbufferedStatus,
};
use rustls::{ConnectionTrafficSecrets, ExtractedSecrets, SupportedCipherSuite};

use crate::record::HEADER;
use crate::sys;
use crate::PeerIdentity;

/// Most handshake bytes buffered (rustls allows 64 KiB per message).
const MAX_HANDSHAKE_BUFFER: usize = 128 << 10;

/// A finished handshake.
pub struct Established {
    /// Derives the next keys on a key update.
    pub kernel: Kernel,
    /// The traffic keys and where their record counters stand.
    pub secrets: ExtractedSecrets,
    /// Bytes that arrived behind the handshake: the first records.
    pub leftover: Vec<u8>,
    /// Who the peer's certificate says it is.
    pub peer: PeerIdentity,
}

/// How a handshake failed.
pub enum Failed {
    /// The deadline passed.
    Late,
    /// The peer closed the connection before sending anything.
    Silent,
    /// Why, in words.
    Because(String),
}

/// rustls's remainder of a connection after the handshake, either side.
pub enum Kernel {
    /// This end connected.
    Client(KernelConnection<ClientConnectionData>),
    /// This end accepted.
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    /// The next keys for what this end sends (sequence restarts at 0).
    pub fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_tx_secret(),
            Kernel::Server(k) => k.update_tx_secret(),
        }
    }

    /// The next keys for what the peer sends.
    pub fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_rx_secret(),
            Kernel::Server(k) => k.update_rx_secret(),
        }
    }

    /// The cipher suite the two ends agreed on.
    pub fn suite(&self) -> SupportedCipherSuite {
        match self {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    /// Records one key may protect before it must be renewed: half the
    /// cipher's confidentiality limit.
    pub fn renew_after(&self) -> u64 {
        match self.suite() {
            SupportedCipherSuite::Tls13(s) => (s.common.confidentiality_limit / 2).max(1),
            #[allow(unreachable_patterns)]
            _ => 1 << 20,
        }
    }
}

/// One side of the handshake, as rustls's unbuffered API has it.
pub trait Side: DerefMut<Target = UnbufferedConnectionCommon<Self::Data>> + Sized {
    /// rustls's per-side data.
    type Data;
    /// Processes what `incoming` holds.
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    /// Gives up the keys after the handshake.
    fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error>;
}

impl Side for UnbufferedClientConnection {
    type Data = ClientConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error> {
        let (s, k) = self.dangerous_into_kernel_connection()?;
        Ok((s, Kernel::Client(k)))
    }
}

impl Side for UnbufferedServerConnection {
    type Data = ServerConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(incoming)
    }
    fn into_kernel(self) -> Result<(ExtractedSecrets, Kernel), rustls::Error> {
        let (s, k) = self.dangerous_into_kernel_connection()?;
        Ok((s, Kernel::Server(k)))
    }
}

/// What one round with rustls asks for next.
enum Next {
    /// Send what was encoded.
    Transmit,
    /// More bytes from the peer.
    Read,
    /// The handshake is done.
    Done,
}

/// Runs the handshake on `fd` (non-blocking) until `deadline`.
pub fn run<S: Side>(mut conn: S, fd: RawFd, deadline: Instant) -> Result<Established, Failed> {
    let mut incoming = vec![0u8; 16 << 10];
    let mut used = 0;
    let mut outgoing: Vec<u8> = Vec::with_capacity(16 << 10);
    // Bytes of `incoming` rustls is shown: whole records, one more each
    // time it needs more, so it never reads past the handshake's last
    // record. Headers are read only past this point: rustls rewrites what
    // it was shown (it joins a fragmented handshake message in place, over
    // the next record's header), and the slice it is shown never shrinks
    // except by what it discards.
    let mut shown = 0;
    let mut heard = false;
    loop {
        let status = conn.process(&mut incoming[..shown]);
        let discard = status.discard;
        let next = match status.state {
            Ok(ConnectionState::EncodeTlsData(mut e)) => {
                let at = outgoing.len();
                outgoing.resize(at + (16 << 10), 0);
                let n = match e.encode(&mut outgoing[at..]) {
                    Err(EncodeError::InsufficientSize(s)) => {
                        outgoing.resize(at + s.required_size, 0);
                        e.encode(&mut outgoing[at..])
                    }
                    other => other,
                }
                .map_err(|err| {
                    Failed::Because(format!("cannot encode a handshake record: {err}"))
                })?;
                outgoing.truncate(at + n);
                None
            }
            Ok(ConnectionState::TransmitTlsData(t)) => {
                sys::send_all(fd, &outgoing, Some(deadline)).map_err(|e| io_failed(e, deadline))?;
                outgoing.clear();
                t.done();
                Some(Next::Transmit)
            }
            Ok(ConnectionState::BlockedHandshake) => Some(Next::Read),
            Ok(ConnectionState::WriteTraffic(_)) => Some(Next::Done),
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
                return Err(Failed::Because(crate::error::CLOSED_IN_HANDSHAKE.into()))
            }
            Ok(other) => {
                return Err(Failed::Because(format!(
                    "unexpected TLS state {other:?} in the handshake"
                )))
            }
            Err(e) => {
                // Tell the peer why (the alert rustls queued), best effort.
                let why = crate::error::explain(&e);
                let _ = send_alert(&mut conn, fd, deadline);
                return Err(Failed::Because(why));
            }
        };
        if discard > 0 {
            incoming.copy_within(discard..used, 0);
            used -= discard;
            shown -= discard;
        }
        match next {
            None | Some(Next::Transmit) => {}
            // A record was used up: show rustls the next one first.
            Some(Next::Read | Next::Done) if discard > 0 && conn.is_handshaking() => {}
            // Application data may be sent before the peer's last flight
            // has arrived (a server's half round trip): wait for it.
            Some(Next::Done) if !conn.is_handshaking() => break,
            Some(Next::Done | Next::Read) => {
                if let Some(len) = next_record(&incoming[shown..used]) {
                    shown += len;
                    continue;
                }
                if used == incoming.len() {
                    if incoming.len() >= MAX_HANDSHAKE_BUFFER {
                        return Err(Failed::Because(
                            "the peer's handshake messages are too large".into(),
                        ));
                    }
                    incoming.resize(incoming.len() * 2, 0);
                }
                if !sys::poll_until(fd, libc::POLLIN, Some(deadline))
                    .map_err(|e| io_failed(e, deadline))?
                {
                    return Err(Failed::Late);
                }
                match sys::recv(fd, &mut incoming[used..]) {
                    Ok(0) if !heard => return Err(Failed::Silent),
                    Ok(0) => return Err(Failed::Because(crate::error::CLOSED_IN_HANDSHAKE.into())),
                    Ok(n) => {
                        used += n;
                        heard = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(io_failed(e, deadline)),
                }
            }
        }
    }
    let peer = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(PeerIdentity::of)
        .transpose()
        .map_err(Failed::Because)?
        .unwrap_or_default();
    let (secrets, kernel) = conn
        .into_kernel()
        .map_err(|e| Failed::Because(e.to_string()))?;
    // What rustls was shown is the handshake's; the rest is records.
    incoming.truncate(used);
    incoming.drain(..shown);
    Ok(Established {
        kernel,
        secrets,
        leftover: incoming,
        peer,
    })
}

/// The length of the record at the front of `buf` if all of it is there
/// (all of `buf` when its header is not a record's: rustls will say what
/// is wrong with it).
fn next_record(buf: &[u8]) -> Option<usize> {
    let h = buf.get(..HEADER)?;
    let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
    let plausible = (20..=23).contains(&h[0]) && h[1] == 3;
    if !plausible || len > crate::record::MAX_BODY {
        return Some(buf.len());
    }
    (buf.len() >= HEADER + len).then_some(HEADER + len)
}

/// Encodes and sends the alert rustls queued after an error.
fn send_alert<S: Side>(conn: &mut S, fd: RawFd, deadline: Instant) -> std::io::Result<()> {
    let mut out = vec![0u8; 1 << 10];
    let n = match conn.process(&mut []).state {
        Ok(ConnectionState::EncodeTlsData(mut e)) => e.encode(&mut out).unwrap_or(0),
        _ => 0,
    };
    let soon = deadline.min(Instant::now() + std::time::Duration::from_millis(100));
    sys::send_all(fd, &out[..n], Some(soon))
}

fn io_failed(e: std::io::Error, deadline: Instant) -> Failed {
    if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() >= deadline {
        Failed::Late
    } else {
        Failed::Because(e.to_string())
    }
}
