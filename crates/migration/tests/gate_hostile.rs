//! A waiting destination against every kind of peer that is not its real
//! source: a certificate from another CA, an expired one, none at all, no
//! TLS at all, a fleet host that `--from` does not name, the right host
//! with a wrong or missing token, and a crowd of silent and trickling
//! connections opened first. Each stranger is refused before anything of
//! the VM moves, with a reason it can read where the protocol lets it and
//! one in the destination's log; the destination goes on waiting, and the
//! real source then migrates into it, every page and the state verified.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fake_vm::FakeVm;
use common::logs;
use ferry_migration::protocol::{self, Hello, Kind, Layout, Role};
use ferry_migration::transport::{Admission, Conn, ADMISSION_TIMEOUT};
use ferry_migration::{Backend, Endpoint, Listener, MigrateOptions, MigrationToken};
use ferry_tls::pki::{self, Validity};
use ferry_tls::rustls;
use ferry_tls::rustls::pki_types::pem::PemObject;
use ferry_tls::rustls::pki_types::{CertificateDer, ServerName};
use ferry_tls::{Credentials, Handshake, TlsSocket};

const PAGE: u64 = 4096;
const LAYOUT: &[(u64, u64)] = &[(0, 128 * PAGE), (1 << 32, 64 * PAGE)];
const PAGES: u64 = 192;
const T: Duration = Duration::from_secs(10);
/// How long a hand-made peer waits for the destination's answer.
const ANSWER: Duration = Duration::from_secs(4);
/// The token of the tests that demand one.
const TOKEN: &str = "5f0c2a9e81d34b7a";

/// Every byte of the real source's memory is non-zero: every page moves.
fn fill(_: u64, i: usize) -> u8 {
    (i as u64).wrapping_mul(0x9e37_79b9).to_le_bytes()[2] | 1
}

fn scratch(what: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "ferry-gate-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Another host of this process's fleet: its credentials, issued by the
/// fleet CA for 127.0.0.1 and valid as `validity` says.
fn fleet_host(name: &str, validity: Validity) -> Arc<Credentials> {
    common::secure();
    let out = scratch(name);
    let ca = common::fleet_dir().join("ca");
    pki::issue(&ca, name, &out, &["127.0.0.1".into()], validity).unwrap();
    Credentials::load(&out).unwrap()
}

/// A host of another fleet (its own CA, and this process's host name)
/// that trusts this fleet's CA: only the destination's check of the
/// client's certificate can stop it.
fn foreign_host() -> Arc<Credentials> {
    common::secure();
    let host = pki::local_fleet(&scratch("other-fleet"), "local-host").unwrap();
    let ours = common::fleet_dir().join("ca").join(ferry_tls::CA_FILE);
    std::fs::copy(ours, host.join(ferry_tls::CA_FILE)).unwrap();
    Credentials::load(&host).unwrap()
}

/// A TLS client that trusts this fleet's CA and presents no certificate.
fn anonymous() -> Arc<rustls::ClientConfig> {
    common::secure();
    let pem = std::fs::read(common::fleet_dir().join("ca").join(ferry_tls::CA_FILE)).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    // As ferry's own configs: its record layer takes the keys over.
    config.enable_secret_extraction = true;
    Arc::new(config)
}

fn tcp_addr(at: &Endpoint) -> SocketAddr {
    match at {
        Endpoint::Tcp(a) => *a,
        other => panic!("{other} is not TCP"),
    }
}

/// Connects to `at` and runs a TLS handshake with `config`: the socket
/// (or the handshake's error in words), and this end's address as the
/// destination's log names the peer.
fn tls_to(at: &Endpoint, config: Arc<rustls::ClientConfig>) -> (Result<TlsSocket, String>, String) {
    let at = tcp_addr(at);
    let tcp = TcpStream::connect(at).unwrap();
    let me = tcp.local_addr().unwrap().to_string();
    let name = ServerName::IpAddress(at.ip().into());
    let s = TlsSocket::handshake(tcp, Handshake::Client(config, name), Duration::from_secs(5))
        .map_err(|e| e.to_string());
    if let Ok(s) = &s {
        s.tcp().set_read_timeout(Some(ANSWER)).unwrap();
        s.tcp().set_write_timeout(Some(ANSWER)).unwrap();
    }
    (s, me)
}

fn hello(role: Role) -> Hello {
    Hello {
        version_min: 1,
        version_max: protocol::VERSION_MAX,
        role,
        session: 0xbad,
        streams: 1,
    }
}

/// What a peer hears when it opens a connection of `role` on `s`: the
/// kind of the destination's answer, or the error, in words.
fn ask(s: &mut (impl Read + Write), role: Role) -> String {
    let _ = protocol::send(s, Kind::Hello, &hello(role));
    match protocol::read_frame(s) {
        Ok(f) => format!("answered {:?}", f.kind),
        Err(e) => e.to_string(),
    }
}

/// [`ask`] over a TLS handshake's outcome (a refused handshake is heard
/// as its error).
fn ask_tls(s: Result<TlsSocket, String>, role: Role) -> String {
    match s {
        Ok(mut s) => ask(&mut s, role),
        Err(e) => e,
    }
}

fn untouched(vm: &FakeVm) -> bool {
    (0..LAYOUT.len()).all(|i| vm.bytes(i).iter().all(|&b| b == 0))
}

/// A destination waiting under `rules`: `strangers` runs against it first
/// (and checks what each heard), then nothing of the VM may have moved and
/// it must still wait; then the real source migrates in with `token`, and
/// every page and the state are checked. Returns how long the real
/// source's migration took. (The destination runs on a thread of its own
/// that a failed test leaves behind, rather than waiting for it forever.)
fn strangers_then_the_source(
    rules: Admission,
    token: Option<&str>,
    strangers: impl FnOnce(&Endpoint),
) -> Duration {
    common::secure();
    logs::capture();
    let dst = Arc::new(FakeVm::new(LAYOUT));
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    listener.admit(rules);
    let at = listener.endpoint();
    let (done_tx, done) = std::sync::mpsc::channel();
    let d = {
        let dst = dst.clone();
        std::thread::spawn(move || {
            let _ = done_tx.send(ferry_migration::receive(&*dst, &listener, T).map(|_| ()));
        })
    };
    let src = FakeVm::new(LAYOUT).with_fill(fill);
    *src.state.lock().unwrap() = b"the real source's vCPUs".to_vec();
    strangers(&at);
    assert_eq!(dst.started.load(Ordering::SeqCst), 0, "no VM started");
    assert!(untouched(&dst), "a stranger's bytes reached guest memory");
    assert!(!d.is_finished(), "the destination stopped waiting");
    let opts = MigrateOptions {
        verify: true,
        timeline_tail_ms: 0,
        token: token.map(|t| MigrationToken(t.into())),
        ..MigrateOptions::default()
    };
    let t = Instant::now();
    let stats = ferry_migration::migrate(&src, &at, &opts, &Backend::cpu(), &|_| {})
        .map(common::done)
        .unwrap_or_else(|e| panic!("the real source failed after {:?}: {e}", t.elapsed()));
    let took = t.elapsed();
    done.recv_timeout(T).unwrap().unwrap();
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert_eq!(stats.verified_pages, PAGES);
    for i in 0..LAYOUT.len() {
        assert!(src.bytes(i) == dst.bytes(i), "region {i} differs");
    }
    assert_eq!(*dst.state.lock().unwrap(), b"the real source's vCPUs");
    took
}

/// The destination's log says why it refused the peer at `me`.
fn logged(me: &str, why: &str) {
    let line = logs::line_with(&[me, why], Duration::from_secs(5));
    assert!(line.is_some(), "the destination logs '{why}' for {me}");
}

#[test]
fn a_certificate_from_another_ca_is_refused() {
    strangers_then_the_source(Admission::default(), None, |at| {
        let (s, me) = tls_to(at, foreign_host().client_config());
        let heard = ask_tls(s, Role::Control);
        assert!(
            heard.contains("refused this host's certificate"),
            "the stranger heard: {heard}"
        );
        logged(&me, "not from this fleet's CA");
    });
}

#[test]
fn an_expired_certificate_of_the_fleet_is_refused() {
    let past = Validity::days(1).not_before - Duration::from_secs(2 * 86400);
    let old = fleet_host("old-host", Validity::until(past));
    strangers_then_the_source(Admission::default(), None, |at| {
        let (s, me) = tls_to(at, old.client_config());
        let heard = ask_tls(s, Role::Control);
        assert!(heard.contains("expired"), "the old host heard: {heard}");
        logged(&me, "has expired");
    });
}

#[test]
fn a_peer_without_a_certificate_or_without_tls_is_refused() {
    strangers_then_the_source(Admission::default(), None, |at| {
        let (s, me) = tls_to(at, anonymous());
        let heard = ask_tls(s, Role::Control);
        assert!(
            heard.contains("refused this host's certificate"),
            "the anonymous peer heard: {heard}"
        );
        logged(&me, "presented no certificate");
        // Plaintext: a ferry Hello where a TLS ClientHello belongs. It can
        // read no reason (the answer is a TLS alert), but no HelloAck.
        let mut plain = TcpStream::connect(tcp_addr(at)).unwrap();
        plain.set_read_timeout(Some(ANSWER)).unwrap();
        let me = plain.local_addr().unwrap().to_string();
        let heard = ask(&mut plain, Role::Control);
        assert!(!heard.starts_with("answered"), "plaintext heard: {heard}");
        logged(&me, "does not speak TLS");
    });
}

#[test]
fn a_fleet_host_that_from_does_not_name_is_refused_on_every_connection() {
    let rules = Admission {
        from: Some("local-host".into()),
        token: None,
    };
    let other = fleet_host("other-host", Validity::days(1));
    strangers_then_the_source(rules, None, |at| {
        for role in [Role::Control, Role::Bulk(0)] {
            let (s, me) = tls_to(at, other.client_config());
            let heard = ask_tls(s, role);
            assert!(
                heard.contains("accepts migrations only from local-host")
                    && heard.contains("names other-host"),
                "other-host ({role:?}) heard: {heard}"
            );
            logged(&me, "accepts migrations only from local-host");
        }
    });
}

/// A source with this host's own certificate that gets through the gate,
/// presents `token` and pushes a layout and a page of its own at once.
/// Returns what it heard on its control connection.
fn push_with_token(at: &Endpoint, token: Option<&str>) -> String {
    let h = hello(Role::Control);
    let mut c = Conn::open(at, T, &h).unwrap();
    c.flush().unwrap();
    let version: u16 = c.recv(Kind::HelloAck).unwrap();
    assert!(version >= protocol::VERSION_TRUST, "v{version}");
    c.set_read_timeout(Some(ANSWER)).unwrap();
    let layout = Layout {
        regions: LAYOUT.to_vec(),
        vcpus: 1,
    };
    let _ = c.send(Kind::Token, &token.map(str::to_string));
    let _ = c.send(Kind::Layout, &layout);
    let mut bulk = Conn::open(
        at,
        T,
        &Hello {
            role: Role::Bulk(0),
            ..h
        },
    )
    .unwrap();
    let page = vec![0x66u8; PAGE as usize];
    let _ = protocol::write_frame(
        bulk.writer(),
        Kind::Pages,
        &protocol::encode_pages(&[0], &page),
    );
    let _ = bulk.flush();
    match c.read_frame() {
        Ok(f) => format!("answered {:?}", f.kind),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_right_host_with_a_wrong_or_missing_token_is_refused() {
    let rules = Admission {
        from: Some("local-host".into()),
        token: Some(TOKEN.into()),
    };
    strangers_then_the_source(rules, Some(TOKEN), |at| {
        let heard = push_with_token(at, Some("not-the-token"));
        assert!(heard.contains("wrong migration token"), "heard: {heard}");
        let heard = push_with_token(at, None);
        assert!(
            heard.contains("demands a migration token"),
            "heard: {heard}"
        );
        // The engine's own source, with a wrong token: a clear error, and
        // its VM never paused.
        let mistaken = FakeVm::new(LAYOUT).with_fill(fill);
        let opts = MigrateOptions {
            token: Some(MigrationToken("not-the-token-either".into())),
            ..MigrateOptions::default()
        };
        let e = ferry_migration::migrate(&mistaken, at, &opts, &Backend::cpu(), &|_| {})
            .map(|_| ())
            .expect_err("a wrong token is refused")
            .to_string();
        assert!(e.contains("wrong migration token"), "{e}");
        assert_eq!(mistaken.pauses.load(Ordering::SeqCst), 0);
        let line = logs::line_with(
            &["wrong migration token", "still waiting"],
            Duration::from_secs(5),
        );
        assert!(line.is_some(), "the destination logs the wrong token");
    });
}

/// Sends `bytes` one at a time, `every` apart, until `stop`, the peer
/// hangs up or 20 s passed.
fn trickle(s: &mut impl Write, bytes: &[u8], every: Duration, stop: &AtomicBool) {
    let t = Instant::now();
    for b in bytes {
        let over = stop.load(Ordering::Relaxed) || t.elapsed() > Duration::from_secs(20);
        if over || s.write_all(&[*b]).is_err() {
            return;
        }
        let _ = s.flush();
        std::thread::sleep(every);
    }
}

/// A TLS ClientHello as this fleet's hosts send it.
fn client_hello() -> Vec<u8> {
    let config = fleet_host("trickler", Validity::days(1)).client_config();
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let mut c = rustls::ClientConnection::new(config, name).unwrap();
    let mut out = Vec::new();
    c.write_tls(&mut out).unwrap();
    out
}

fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    protocol::write_frame(&mut f, kind, body).unwrap();
    f
}

#[test]
fn trickling_silent_and_idle_peers_opened_first_do_not_hold_up_the_real_source() {
    // Alone, for comparison.
    let alone = strangers_then_the_source(Admission::default(), None, |_| {});
    let stop = AtomicBool::new(false);
    let every = Duration::from_millis(250);
    let mut idle: Vec<TcpStream> = Vec::new();
    let mut opened = Instant::now();
    let crowded = std::thread::scope(|s| {
        let took = strangers_then_the_source(Admission::default(), None, |at| {
            let addr = tcp_addr(at);
            let stop = &stop;
            // A ClientHello a byte at a time: stuck in the TLS handshake.
            s.spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                trickle(&mut c, &client_hello(), every, stop);
            });
            // A fleet host through TLS that trickles its Hello: stuck in
            // the gate's Hello read.
            let other = fleet_host("slow-hello", Validity::days(1));
            let at2 = at.clone();
            s.spawn(move || {
                if let (Ok(mut c), _) = tls_to(&at2, other.client_config()) {
                    let mut h = Vec::new();
                    protocol::send(&mut h, Kind::Hello, &hello(Role::Control)).unwrap();
                    trickle(&mut c, &h, every, stop);
                }
            });
            // Through the gate with this host's own certificate, then a
            // token trickled (it announces 1000 bytes), and one silent
            // after its Hello: both stuck in the session's opening reads.
            for body_len in [1000usize, 0] {
                let at2 = at.clone();
                s.spawn(move || {
                    let Ok(mut c) = Conn::open(&at2, T, &hello(Role::Control)) else {
                        return;
                    };
                    if c.flush().is_err() || c.recv::<u16>(Kind::HelloAck).is_err() {
                        return;
                    }
                    if body_len == 0 {
                        let t = Instant::now();
                        while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(20)
                        {
                            std::thread::sleep(every);
                        }
                    }
                    let token = frame(Kind::Token, &vec![b'x'; body_len]);
                    trickle(c.writer(), &token, every, stop);
                });
            }
            // 200 connections that say nothing at all.
            for _ in 0..200 {
                idle.push(TcpStream::connect(addr).unwrap());
            }
            opened = Instant::now();
            // Every one of them is in by now.
            std::thread::sleep(Duration::from_millis(500));
        });
        stop.store(true, Ordering::Relaxed);
        took
    });
    eprintln!("real source alone: {alone:?}; after 204 stuck peers: {crowded:?}");
    assert!(
        crowded < alone + Duration::from_millis(1500),
        "the real source took {crowded:?} behind the crowd, {alone:?} alone"
    );
    // The idle ones are dropped at the handshake limit, not kept.
    let limit = ADMISSION_TIMEOUT + Duration::from_secs(2);
    let mut open = 0;
    for mut c in idle {
        let left = limit.saturating_sub(opened.elapsed());
        c.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .unwrap();
        if let Err(e) = c.read(&mut [0u8; 64]) {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                open += 1;
            }
        }
    }
    assert_eq!(
        open, 0,
        "idle connections still open past the handshake limit"
    );
}

#[test]
fn a_unix_endpoint_is_owner_only_whatever_the_umask_and_replaces_only_a_stale_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("unix");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("incoming.sock");
    let at = Endpoint::Unix(path.clone());
    // SAFETY: umask only swaps the process's mask; it is put back at once
    // (files other tests make meanwhile just get wider modes).
    let old = unsafe { libc::umask(0) };
    let listener = Listener::bind(&at);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = listener.unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "socket mode {mode:o} under umask 000");
    // It serves: a connection's Hello comes through the gate.
    let mut c = Conn::open(&at, T, &hello(Role::Control)).unwrap();
    c.flush().unwrap();
    let (_, h) = listener.accept_hello(T).unwrap();
    assert_eq!(h.role, Role::Control);
    // A live socket is not replaced; a stale one (its listener gone without
    // removing it) is; any other file is left alone.
    assert!(Listener::bind(&at).is_err(), "a live socket was replaced");
    drop(listener);
    assert!(!path.exists(), "the socket is removed with its listener");
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let l = Listener::bind(&Endpoint::Unix(stale.clone())).unwrap();
    let mode = std::fs::metadata(&stale).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
    drop(l);
    let data = dir.join("data");
    std::fs::write(&data, b"keep me").unwrap();
    assert!(Listener::bind(&Endpoint::Unix(data.clone())).is_err());
    assert_eq!(std::fs::read(&data).unwrap(), b"keep me");
}

#[test]
fn bulk_streams_are_kept_for_a_source_being_admitted_and_strays_are_refused() {
    common::secure();
    let dst = Arc::new(FakeVm::new(LAYOUT));
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let at = listener.endpoint();
    let (done_tx, done) = std::sync::mpsc::channel();
    {
        let dst = dst.clone();
        std::thread::spawn(move || {
            let _ = done_tx.send(ferry_migration::receive(&*dst, &listener, T).map(|_| ()));
        });
    }
    // A stray bulk stream, no source being admitted: refused at once.
    let mut stray = Conn::open(&at, T, &hello(Role::Bulk(0))).unwrap();
    stray.flush().unwrap();
    stray.set_read_timeout(Some(ANSWER)).unwrap();
    let heard = stray.read_frame().err().unwrap().to_string();
    assert!(heard.contains("no migration runs here yet"), "{heard}");
    // A source that opens its bulk stream while its opening is still
    // under way (its token not sent yet).
    let h = Hello {
        session: 0x5ca1ab1e,
        ..hello(Role::Control)
    };
    let mut c = Conn::open(&at, T, &h).unwrap();
    c.flush().unwrap();
    let _: u16 = c.recv(Kind::HelloAck).unwrap();
    let mut bulk = Conn::open(
        &at,
        T,
        &Hello {
            role: Role::Bulk(0),
            ..h
        },
    )
    .unwrap();
    bulk.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    common::send_opening(&mut c, None, LAYOUT);
    // Its bulk stream was kept and taken: a page sent on it lands.
    let page = vec![0x5au8; PAGE as usize];
    protocol::write_frame(
        bulk.writer(),
        Kind::Pages,
        &protocol::encode_pages(&[PAGE], &page),
    )
    .unwrap();
    bulk.flush().unwrap();
    let deadline = Instant::now() + ANSWER;
    while dst.byte(PAGE, 0) != 0x5a {
        assert!(Instant::now() < deadline, "the page never landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop((c, bulk));
    let e = done.recv_timeout(T).unwrap().unwrap_err().to_string();
    assert_eq!(dst.started.load(Ordering::SeqCst), 0, "{e}");
}
