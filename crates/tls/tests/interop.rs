//! ferry's own record layer against unmodified TLS 1.3 peers: rustls's
//! buffered connection (`StreamOwned`, its whole record layer) and the
//! `openssl` binary (`s_server`, `s_client`), each as client and as
//! server, over loopback with the fleet's mutual TLS.
//!
//! Megabytes each way, across key updates in both directions: ferry's
//! own (a cipher limited to 64 records per key, so it renews every 32),
//! the peer's (rustls's `refresh_traffic_keys` and its own renewal at the
//! limit; openssl's `k` and `K` commands), and ferry's answer to a peer
//! that asks for one. The openssl tests are skipped, loudly, where there
//! is no `openssl` binary.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_tls::pki::Validity;
use ferry_tls::{Credentials, Handshake, TlsSocket};
use rustls::crypto::ring::cipher_suite as cs;
use rustls::pki_types::ServerName;
use rustls::{ConnectionCommon, SideData, StreamOwned};

use common::{fleet, issue, limited, pattern};

const WAIT: Duration = Duration::from_secs(20);

/// The rustls end: reads all ferry sends (asking for ferry's keys to be
/// renewed a third of the way in), sends its own data (asking again after
/// each MiB), reads ferry's last word and close_notify, says close_notify.
fn rustls_peer<C, S>(mut s: StreamOwned<C, TcpStream>, from_ferry: &[u8], to_ferry: &[u8])
where
    C: DerefMut + Deref<Target = ConnectionCommon<S>>,
    S: SideData,
{
    let mut got = vec![0u8; from_ferry.len()];
    let third = got.len() / 3;
    s.read_exact(&mut got[..third]).unwrap();
    s.conn.refresh_traffic_keys().unwrap();
    s.read_exact(&mut got[third..]).unwrap();
    assert!(got == from_ferry, "rustls read other bytes than ferry sent");
    for chunk in to_ferry.chunks(1 << 20) {
        s.write_all(chunk).unwrap();
        s.conn.refresh_traffic_keys().unwrap();
    }
    s.flush().unwrap();
    let mut last = Vec::new();
    // Ok only if the stream ends with close_notify (rustls says
    // UnexpectedEof otherwise).
    s.read_to_end(&mut last).unwrap();
    assert_eq!(last, b"bye");
    s.conn.send_close_notify();
    s.flush().unwrap();
}

/// ferry (client if `ferry_is_client`) and rustls's buffered connection
/// exchange `len` bytes each way under `suite`, limited to 64 records per
/// key on both ends.
fn with_rustls(ferry_is_client: bool, suite: rustls::SupportedCipherSuite, len: usize) {
    let p = limited(suite, 64);
    let (ca, a) = fleet("ferry", Validity::days(1));
    let b = issue(&ca, "rustls", Validity::days(1));
    let ferry = Credentials::load_with(&a, p.clone()).unwrap();
    let peer = Credentials::load_with(&b, p).unwrap();
    let (from_ferry, to_ferry) = (pattern(len, 3), pattern(len, 4));
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let name = ServerName::IpAddress(at.ip().into());
    let (sent, expect) = (from_ferry.clone(), to_ferry.clone());
    let (l_peer, l_ferry) = if ferry_is_client {
        (Some(l), None)
    } else {
        (None, Some(l))
    };
    let rustls_end = {
        let name = name.clone();
        std::thread::spawn(move || {
            let tcp = match l_peer {
                Some(l) => l.accept().unwrap().0,
                None => TcpStream::connect(at).unwrap(),
            };
            tcp.set_read_timeout(Some(WAIT)).unwrap();
            if ferry_is_client {
                let c = rustls::ServerConnection::new(peer.server_config()).unwrap();
                rustls_peer(StreamOwned::new(c, tcp), &sent, &expect);
            } else {
                let c = rustls::ClientConnection::new(peer.client_config(), name).unwrap();
                rustls_peer(StreamOwned::new(c, tcp), &sent, &expect);
            }
        })
    };
    let sock = match l_ferry {
        None => {
            let side = Handshake::Client(ferry.client_config(), name);
            TlsSocket::handshake(TcpStream::connect(at).unwrap(), side, WAIT).unwrap()
        }
        Some(l) => {
            let tcp = l.accept().unwrap().0;
            let side = Handshake::Server(ferry.server_config());
            TlsSocket::handshake(tcp, side, WAIT).unwrap()
        }
    };
    ferry_end(sock, from_ferry, to_ferry);
    rustls_end.join().unwrap();
}

/// ferry's end of [`with_rustls`]: writes by copy and in place in
/// awkward sizes while a second thread reads, then its last word once all
/// the peer's data (and key update requests) have been read.
fn ferry_end(sock: TlsSocket, from_ferry: Vec<u8>, to_ferry: Vec<u8>) {
    sock.tcp().set_read_timeout(Some(WAIT)).unwrap();
    let len = from_ferry.len();
    let mut r = sock.try_clone().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; to_ferry.len()];
        r.read_exact(&mut got).unwrap();
        assert!(got == to_ferry, "ferry read other bytes than rustls sent");
        done_tx.send(()).unwrap();
        // Then the peer's close_notify: an end.
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    });
    let mut w = sock.try_clone().unwrap();
    let sizes = [100_003, 1, 16_384, 16_385, 262_145, 5000];
    let (mut at, mut i) = (0, 0);
    while at < len {
        let end = (at + sizes[i % sizes.len()]).min(len);
        if i % 2 == 0 {
            w.write_all(&from_ferry[at..end]).unwrap();
        } else {
            w.send_in_place(&mut from_ferry[at..end].to_vec()).unwrap();
        }
        at = end;
        i += 1;
    }
    done_rx.recv_timeout(WAIT).unwrap();
    // The peer asked for new keys: this write answers first.
    w.write_all(b"bye").unwrap();
    sock.close_notify();
    reader.join().unwrap();
    let (sent, followed) = sock.key_updates();
    // ferry renews every 32 records of at most 16 KiB, and answered; the
    // peer asked once while reading and once a MiB while sending.
    let records = (len / (16 << 10)) as u64;
    assert!(sent > records / 32, "ferry sent {sent} key updates");
    assert!(
        followed > (len >> 20) as u64,
        "ferry followed {followed} key updates"
    );
}

#[test]
fn ferry_as_client_and_rustls_as_server_exchange_megabytes_across_key_updates() {
    with_rustls(true, cs::TLS13_AES_128_GCM_SHA256, 4 << 20);
    with_rustls(true, cs::TLS13_CHACHA20_POLY1305_SHA256, 1 << 20);
}

#[test]
fn rustls_as_client_and_ferry_as_server_exchange_megabytes_across_key_updates() {
    with_rustls(false, cs::TLS13_AES_128_GCM_SHA256, 4 << 20);
    with_rustls(false, cs::TLS13_AES_256_GCM_SHA384, 1 << 20);
}

/// True if there is an `openssl` binary; else says loudly that the test
/// is skipped.
fn have_openssl() -> bool {
    match Command::new("openssl").arg("version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            eprintln!(
                "SKIPPED: no openssl binary, ferry's record layer is NOT tested against \
                 OpenSSL here (apt-get install -y openssl)"
            );
            false
        }
    }
}

/// A running `openssl s_server` or `s_client`: its stdin, and what it
/// has printed so far. Killed when dropped.
struct Openssl {
    child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
}

impl Openssl {
    fn start(args: &[&str]) -> Openssl {
        let mut child = Command::new("openssl")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let keep = |mut from: Box<dyn Read + Send>| {
            let buf = Arc::new(Mutex::new(Vec::new()));
            let to = buf.clone();
            std::thread::spawn(move || {
                let mut b = vec![0u8; 64 << 10];
                while let Ok(n @ 1..) = from.read(&mut b) {
                    to.lock().unwrap().extend_from_slice(&b[..n]);
                }
            });
            buf
        };
        let out = keep(Box::new(child.stdout.take().unwrap()));
        let err = keep(Box::new(child.stderr.take().unwrap()));
        Openssl { child, out, err }
    }

    /// Types `bytes` on its stdin.
    fn say(&mut self, bytes: &[u8]) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(bytes).unwrap();
        stdin.flush().unwrap();
    }

    /// Its stdout, without what s_server prints between pieces of
    /// received data: after a command, and when a read found no data
    /// (after a key update: "Read BLOCK").
    fn stdout(&self) -> Vec<u8> {
        let out = self.out.lock().unwrap().clone();
        let noise: [&[u8]; 2] = [b"SSL_do_handshake -> 1\n", b"Read BLOCK\n"];
        let mut clean = Vec::with_capacity(out.len());
        let mut i = 0;
        'bytes: while i < out.len() {
            for n in noise {
                if out[i..].starts_with(n) {
                    i += n.len();
                    continue 'bytes;
                }
            }
            clean.push(out[i]);
            i += 1;
        }
        clean
    }

    fn printed(&self) -> String {
        let out = self.out.lock().unwrap();
        let err = self.err.lock().unwrap();
        let tail =
            |b: &[u8]| String::from_utf8_lossy(&b[b.len().saturating_sub(3000)..]).into_owned();
        format!("stdout (end): {}\nstderr (end): {}", tail(&out), tail(&err))
    }

    /// Waits until its stdout holds `what`.
    fn wait_for(&self, what: &[u8]) {
        let t = Instant::now();
        while !contains(&self.stdout(), what) {
            assert!(
                t.elapsed() < WAIT,
                "openssl never printed {:?}; {}",
                String::from_utf8_lossy(what),
                self.printed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Closes its stdin (it then ends the connection) and waits for it to
    /// exit.
    fn finish(&mut self) {
        drop(self.child.stdin.take());
        let t = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                t.elapsed() < WAIT,
                "openssl did not exit; {}",
                self.printed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&self.out.lock().unwrap()),
            String::from_utf8_lossy(&self.err.lock().unwrap())
        );
        assert!(
            !all.contains(":error:"),
            "openssl reported an error; {}",
            self.printed()
        );
    }
}

impl Drop for Openssl {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// `len` bytes of digits and newlines (no byte openssl reads as a
/// command at the start of a read from its stdin), framed as `<n<...>n>`.
fn framed(n: u8, len: usize) -> Vec<u8> {
    let mut d: Vec<u8> = pattern(len, u64::from(n) + 10)
        .iter()
        .enumerate()
        .map(|(i, b)| if i % 64 == 63 { b'\n' } else { b'0' + b % 10 })
        .collect();
    d.splice(0..0, [b'<', b'0' + n, b'<']);
    d.extend_from_slice(&[b'>', b'0' + n, b'>', b'\n']);
    d
}

/// Reads exactly `n` bytes from `sock`, whose reads time out quickly.
fn read_n(sock: &TlsSocket, n: usize) -> Vec<u8> {
    let (mut got, t) = (vec![0u8; n], Instant::now());
    let mut at = 0;
    while at < n {
        match (&mut &*sock).read(&mut got[at..]) {
            Ok(0) => panic!("the stream ended after {at} of {n} bytes"),
            Ok(k) => at += k,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(t.elapsed() < WAIT, "{at} of {n} bytes came")
            }
            Err(e) => panic!("read failed after {at} bytes: {e}"),
        }
    }
    got
}

/// Reads (no data expected) until `sock` has followed `k` key updates of
/// the peer's.
fn follow(sock: &TlsSocket, k: u64) {
    let t = Instant::now();
    while sock.key_updates().1 < k {
        match (&mut &*sock).read(&mut [0u8; 4096]) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("waiting for a key update: {other:?}"),
        }
        assert!(t.elapsed() < WAIT, "the peer's key update {k} never came");
    }
}

/// The exchange with openssl on an established `sock`: ferry sends 1 MiB
/// (renewing its keys every 32 records); openssl renews its keys (`k`),
/// sends 256 KiB, renews them asking for ferry's too (`K`); ferry follows
/// both and answers the second before its next data, which openssl reads.
fn exchange_with_openssl(sock: TlsSocket, o: &mut Openssl) {
    sock.tcp()
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut w = sock.try_clone().unwrap();
    let d1 = framed(1, 1 << 20);
    w.write_all(&d1).unwrap();
    o.wait_for(b">1>");
    let (renewed, _) = sock.key_updates();
    assert!(
        renewed >= 2,
        "ferry renewed its keys {renewed} times in 1 MiB"
    );
    o.say(b"k\n");
    follow(&sock, 1);
    let d2 = framed(2, 256 << 10);
    o.say(&d2);
    assert!(
        read_n(&sock, d2.len()) == d2,
        "ferry read other bytes than openssl sent"
    );
    o.say(b"K\n");
    follow(&sock, 2);
    let before = sock.key_updates().0;
    let d3 = framed(3, 20 << 10);
    w.write_all(&d3).unwrap();
    o.wait_for(b">3>");
    assert_eq!(
        sock.key_updates().0,
        before + 1,
        "ferry did not answer openssl's K"
    );
    let out = o.stdout();
    assert!(
        contains(&out, &d1),
        "openssl printed other bytes than ferry sent (1)"
    );
    assert!(
        contains(&out, &d3),
        "openssl printed other bytes than ferry sent (3)"
    );
    sock.close_notify();
    let _ = sock.tcp().shutdown(std::net::Shutdown::Write);
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pem(dir: &Path, f: &str) -> String {
    dir.join(f).to_str().unwrap().to_owned()
}

/// `openssl`'s arguments naming the credentials in `dir`, then `more`.
fn openssl_args(dir: &Path, more: &[&str]) -> Vec<String> {
    let own = [
        "-cert".to_string(),
        pem(dir, "cert.pem"),
        "-key".to_string(),
        pem(dir, "key.pem"),
        "-CAfile".to_string(),
        pem(dir, "ca.pem"),
    ];
    own.into_iter()
        .chain(more.iter().map(|a| a.to_string()))
        .collect()
}

#[test]
fn ferry_as_client_and_openssl_s_server_exchange_data_across_key_updates() {
    if !have_openssl() {
        return;
    }
    let (ca, theirs) = fleet("openssl", Validity::days(1));
    let ours = issue(&ca, "ferry", Validity::days(1));
    let port = free_port().to_string();
    let accept = format!("127.0.0.1:{port}");
    let args = openssl_args(
        &theirs,
        &[
            "-Verify",
            "1",
            "-verify_return_error",
            "-num_tickets",
            "0",
            "-naccept",
            "1",
        ],
    );
    let mut o = Openssl::start(
        &["s_server", "-tls1_3", "-accept", &accept]
            .into_iter()
            .chain(args.iter().map(String::as_str))
            .collect::<Vec<_>>(),
    );
    o.wait_for(b"ACCEPT");
    let ferry = Credentials::load_with(&ours, limited(cs::TLS13_AES_256_GCM_SHA384, 64)).unwrap();
    let at: std::net::SocketAddr = accept.parse().unwrap();
    let side = Handshake::Client(ferry.client_config(), ServerName::IpAddress(at.ip().into()));
    let sock = TlsSocket::handshake(TcpStream::connect(at).unwrap(), side, WAIT).unwrap();
    assert!(sock.peer().is("openssl"));
    exchange_with_openssl(sock, &mut o);
    o.finish();
}

#[test]
fn openssl_s_client_and_ferry_as_server_exchange_data_across_key_updates() {
    if !have_openssl() {
        return;
    }
    let (ca, ours) = fleet("ferry", Validity::days(1));
    let theirs = issue(&ca, "openssl", Validity::days(1));
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let connect = l.local_addr().unwrap().to_string();
    let args = openssl_args(
        &theirs,
        &["-verify_return_error", "-verify_ip", "127.0.0.1"],
    );
    let mut o = Openssl::start(
        &["s_client", "-tls1_3", "-connect", &connect]
            .into_iter()
            .chain(args.iter().map(String::as_str))
            .collect::<Vec<_>>(),
    );
    let ferry =
        Credentials::load_with(&ours, limited(cs::TLS13_CHACHA20_POLY1305_SHA256, 64)).unwrap();
    let tcp = l.accept().unwrap().0;
    let sock = TlsSocket::handshake(tcp, Handshake::Server(ferry.server_config()), WAIT).unwrap();
    assert!(sock.peer().is("openssl"));
    exchange_with_openssl(sock, &mut o);
    o.finish();
}

#[test]
fn a_server_that_sends_session_tickets_is_refused_with_a_clear_error() {
    // ferry's servers send none, and its record layer takes no handshake
    // message after the handshake but a key update: a TLS 1.3 server that
    // sends tickets (openssl's default) is refused on the first read, with
    // a typed error, not a panic or a hang.
    if !have_openssl() {
        return;
    }
    let (ca, theirs) = fleet("openssl", Validity::days(1));
    let ours = issue(&ca, "ferry", Validity::days(1));
    let accept = format!("127.0.0.1:{}", free_port());
    let (cert, key, cafile) = (
        pem(&theirs, "cert.pem"),
        pem(&theirs, "key.pem"),
        pem(&theirs, "ca.pem"),
    );
    let o = Openssl::start(&[
        "s_server", "-tls1_3", "-accept", &accept, "-cert", &cert, "-key", &key, "-CAfile",
        &cafile, "-Verify", "1", "-naccept", "1",
    ]);
    o.wait_for(b"ACCEPT");
    let ferry = Credentials::load(&ours).unwrap();
    let at: std::net::SocketAddr = accept.parse().unwrap();
    let side = Handshake::Client(ferry.client_config(), ServerName::IpAddress(at.ip().into()));
    let mut sock = TlsSocket::handshake(TcpStream::connect(at).unwrap(), side, WAIT).unwrap();
    sock.tcp().set_read_timeout(Some(WAIT)).unwrap();
    let e = sock.read(&mut [0u8; 100]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(
        e.to_string()
            .contains("unexpected TLS message (content type 22)"),
        "{e}"
    );
}
