//! A TCP connection that speaks plaintext or, given a host's credentials,
//! mutual TLS: what the small request/answer services between hosts use
//! (the metrics endpoint, the fleet agents' API). Migration links have
//! their own stream type, with Unix sockets and byte meters.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::{Credentials, Handshake, PeerIdentity, TlsError, TlsSocket};

/// One TCP connection, plain or after a mutual TLS handshake.
#[derive(Debug)]
pub enum Connection {
    /// Plaintext (only where the caller chose it: loopback, `--insecure`).
    Plain(TcpStream),
    /// Mutual TLS: both ends' certificates chain to the fleet CA.
    Tls(TlsSocket),
}

impl Connection {
    /// `tcp`, just accepted, as `tls` says: after a server handshake that
    /// must end within `timeout` (a silent or trickling peer fails here)
    /// and in which the client presents a fleet certificate; plain without.
    pub fn accept(
        tcp: TcpStream,
        tls: Option<&Credentials>,
        timeout: Duration,
    ) -> Result<Self, TlsError> {
        let _ = tcp.set_nodelay(true);
        match tls {
            None => Ok(Connection::Plain(tcp)),
            Some(c) => TlsSocket::handshake(tcp, Handshake::Server(c.server_config()), timeout)
                .map(Connection::Tls),
        }
    }

    /// Connects to `at` within `timeout` and, with `tls`, runs the client
    /// handshake: the server's certificate must chain to the fleet CA and
    /// name `at`'s address.
    pub fn connect(
        at: SocketAddr,
        tls: Option<&Credentials>,
        timeout: Duration,
    ) -> Result<Self, TlsError> {
        let tcp = TcpStream::connect_timeout(&at, timeout).map_err(|error| TlsError::Connect {
            peer: at.to_string(),
            error,
        })?;
        let _ = tcp.set_nodelay(true);
        match tls {
            None => Ok(Connection::Plain(tcp)),
            Some(c) => {
                let side =
                    Handshake::Client(c.client_config(), ServerName::IpAddress(at.ip().into()));
                TlsSocket::handshake(tcp, side, timeout).map(Connection::Tls)
            }
        }
    }

    /// The socket underneath (timeouts, shutdown; never its bytes).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Connection::Plain(s) => s,
            Connection::Tls(t) => t.tcp(),
        }
    }

    /// Who the peer's certificate says it is (TLS only).
    pub fn peer(&self) -> Option<&PeerIdentity> {
        match self {
            Connection::Plain(_) => None,
            Connection::Tls(t) => Some(t.peer()),
        }
    }

    /// Ends this side's sending: close_notify over TLS, then a TCP
    /// half-close, so the peer reads an end, not a cut.
    pub fn finish(&self) -> io::Result<()> {
        if let Connection::Tls(t) = self {
            t.close_notify();
        }
        self.tcp().shutdown(std::net::Shutdown::Write)
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Connection::Plain(s) => s.read(buf),
            Connection::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Connection::Plain(s) => s.write(buf),
            Connection::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
