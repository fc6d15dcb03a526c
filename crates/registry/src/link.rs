//! How the registry reaches etcd: one TCP connection per gateway call,
//! inside TLS with this host's client certificate for `etcds://`, the
//! whole call (connect, handshake, request, answer) under one deadline.
//! A connection per call costs a handshake (about a millisecond on a LAN)
//! a few times a minute, and makes each call see the credentials as they
//! are now: a rotated certificate is used from the next call on.
//!
//! Failures are put in words a user can act on: a refused client
//! certificate, an untrusted server certificate, a plaintext port spoken
//! to in TLS or the other way round.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_tls::Credentials;
use rustls::pki_types::ServerName;
use rustls::{AlertDescription, ClientConnection, StreamOwned};

use crate::http::{self, Answer, HttpError};

/// How long one gateway call may take, from connect to the answer's end.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Where etcd is, and how to speak to it.
pub(crate) struct Link {
    /// `HOST:PORT`.
    hostport: String,
    tls: Option<Tls>,
}

struct Tls {
    credentials: Arc<Credentials>,
    /// The name etcd's certificate must carry (the address's host).
    name: ServerName<'static>,
}

impl Link {
    /// Plaintext to `hostport`.
    pub(crate) fn plain(hostport: &str) -> Link {
        Link {
            hostport: hostport.into(),
            tls: None,
        }
    }

    /// TLS to `hostport` (whose host etcd's certificate must name), with
    /// the client certificate and CA in `credentials`.
    pub(crate) fn tls(hostport: &str, credentials: Arc<Credentials>) -> Result<Link, String> {
        let host = host_of(hostport);
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is not a host name or address: {e}"))?;
        Ok(Link {
            hostport: hostport.into(),
            tls: Some(Tls { credentials, name }),
        })
    }

    /// POSTs `body` to `path` and returns the answer; an error is a
    /// sentence saying what went wrong.
    pub(crate) fn call(&self, path: &str, body: &[u8]) -> Result<Answer, String> {
        let deadline = Instant::now() + CALL_TIMEOUT;
        let tcp = self.connect(deadline)?;
        let mut tcp = Timed { tcp, deadline };
        // The answer ends the connection (HTTP/1.0): nothing to close.
        let r = match &self.tls {
            None => http::post(&mut tcp, &self.hostport, path, body),
            Some(t) => {
                let mut conn = ClientConnection::new(t.credentials.client_config(), t.name.clone())
                    .map_err(|e| format!("TLS: {e}"))?;
                // The handshake apart, so that its failures are told apart.
                while conn.is_handshaking() {
                    conn.complete_io(&mut tcp)
                        .map_err(|e| self.explain(HttpError::Io(e), true))?;
                }
                http::post(&mut StreamOwned::new(conn, tcp), &self.hostport, path, body)
            }
        };
        r.map_err(|e| self.explain(e, false))
    }

    fn connect(&self, deadline: Instant) -> Result<TcpStream, String> {
        let addrs: Vec<SocketAddr> = self
            .hostport
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", self.hostport))?
            .collect();
        let mut last = None;
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(match last {
            Some(e) => format!("cannot connect: {e}"),
            None => format!("cannot connect within {} s", CALL_TIMEOUT.as_secs()),
        })
    }

    /// A failed exchange (or TLS handshake), in words.
    fn explain(&self, e: HttpError, handshake: bool) -> String {
        let plain_hint = "; if this etcd port speaks TLS, use etcds://";
        let io = match e {
            HttpError::Io(io) => io,
            HttpError::NoAnswer if self.tls.is_none() => {
                return format!("{e}{plain_hint}");
            }
            other => return other.to_string(),
        };
        if matches!(
            io.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return format!("no answer within {} s", CALL_TIMEOUT.as_secs());
        }
        let Some(tls) = &self.tls else {
            return match io.kind() {
                io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof => {
                    format!("{io}{plain_hint}")
                }
                _ => io.to_string(),
            };
        };
        let dir = tls.credentials.dir().display();
        let Some(t) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
            return match io.kind() {
                io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof if handshake => {
                    format!(
                        "the connection ended in the TLS handshake ({io}): if this etcd port is \
                         plaintext, use etcd://"
                    )
                }
                _ => format!("TLS session: {io}"),
            };
        };
        match t {
            rustls::Error::AlertReceived(a) if refuses_certificate(*a) => format!(
                "etcd refused this host's client certificate ({dir}/cert.pem; TLS alert {a:?}): \
                 it must be issued by the CA etcd trusts (its --trusted-ca-file)"
            ),
            rustls::Error::InvalidCertificate(c) => format!(
                "etcd's certificate is not trusted ({c}): it must be issued by the fleet CA \
                 in {dir}/ca.pem and name {}",
                host_of(&self.hostport)
            ),
            rustls::Error::InvalidMessage(_) => format!(
                "etcd does not speak TLS on this port ({t}); for a plaintext etcd use etcd://"
            ),
            _ => format!("TLS: {t}"),
        }
    }
}

/// Alerts a TLS server sends when it does not accept the client's
/// certificate.
fn refuses_certificate(a: AlertDescription) -> bool {
    matches!(
        a,
        AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::CertificateRequired
    )
}

/// The host of `HOST:PORT` (`[V6]:PORT` gives V6).
fn host_of(hostport: &str) -> &str {
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// A TCP connection whose every read and write ends by the deadline.
struct Timed {
    tcp: TcpStream,
    deadline: Instant,
}

impl Timed {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tcp.set_read_timeout(Some(self.left()?))?;
        self.tcp.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.set_write_timeout(Some(self.left()?))?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_taken_from_addresses() {
        assert_eq!(host_of("etcd1:2379"), "etcd1");
        assert_eq!(host_of("127.0.0.1:2379"), "127.0.0.1");
        assert_eq!(host_of("[::1]:2379"), "::1");
    }

    #[test]
    fn a_silent_etcd_costs_one_deadline_not_more() {
        // The kernel takes the connection into the backlog; nobody answers.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        let start = Instant::now();
        let err = Link::plain(&at).call("/v3/kv/range", b"{}").unwrap_err();
        let took = start.elapsed();
        assert!(err.contains("no answer within 3 s"), "{err}");
        assert!(took < CALL_TIMEOUT + Duration::from_millis(500), "{took:?}");
        drop(l);
    }
}
