//! A fleet made with `pki`, and mutual TLS between its hosts over real
//! loopback sockets: data both ways on two threads a side, keys renewed
//! past a cipher's record limit, and each kind of stranger refused with a
//! reason on both ends.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_tls::pki::{self, Validity};
use ferry_tls::{Credentials, Handshake, TlsError, TlsSocket};
use rustls::pki_types::ServerName;

use common::{fleet, issue, limited, pattern, scratch};

/// Handshakes a client with `client` credentials against a server with
/// `server` credentials; both ends' results.
fn pair(
    server: &Credentials,
    client: &Credentials,
) -> (Result<TlsSocket, TlsError>, Result<TlsSocket, TlsError>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let config = server.server_config();
    let accept = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        TlsSocket::handshake(s, Handshake::Server(config), Duration::from_secs(5))
    });
    let tcp = TcpStream::connect(at).unwrap();
    let name = ServerName::IpAddress(at.ip().into());
    let c = TlsSocket::handshake(
        tcp,
        Handshake::Client(client.client_config(), name),
        Duration::from_secs(5),
    );
    (accept.join().unwrap(), c)
}

/// Sends `data` from `a` to `b` and `b`'s own data back at the same time,
/// each side reading on one thread and writing on another.
fn both_ways(a: TlsSocket, b: TlsSocket, len: usize) {
    let (da, db) = (pattern(len, 1), pattern(len, 2));
    let run = |s: TlsSocket, out: Vec<u8>, expect: Vec<u8>| {
        std::thread::spawn(move || {
            let mut w = s.try_clone().unwrap();
            let writer = std::thread::spawn(move || {
                // Writes of every awkward size, each by copy and sealed in
                // place by turns (a record's edge, a burst's, and past).
                let sizes = [100_003, 1, 16_384, 16_385, 262_144, 262_145, (4 << 20) + 7];
                let (mut at, mut i) = (0, 0);
                while at < out.len() {
                    let end = (at + sizes[i % sizes.len()]).min(out.len());
                    if (i / sizes.len()) % 2 == 0 {
                        w.write_all(&out[at..end]).unwrap();
                    } else {
                        let mut scratch = out[at..end].to_vec();
                        w.send_in_place(&mut scratch).unwrap();
                    }
                    at = end;
                    i += 1;
                }
            });
            let mut r = s;
            let mut got = vec![0u8; expect.len()];
            r.read_exact(&mut got).unwrap();
            writer.join().unwrap();
            assert!(got == expect, "bytes differ after the trip");
        })
    };
    let ta = run(a, da.clone(), db.clone());
    let tb = run(b, db, da);
    ta.join().unwrap();
    tb.join().unwrap();
}

#[test]
fn two_hosts_of_a_fleet_exchange_data_both_ways_on_two_threads_a_side() {
    let (ca, a) = fleet("host-a", Validity::days(1));
    let b = issue(&ca, "host-b", Validity::days(1));
    let (ca_, cb) = (
        Credentials::load(&a).unwrap(),
        Credentials::load(&b).unwrap(),
    );
    let (s, c) = pair(&ca_, &cb);
    let (s, c) = (s.unwrap(), c.unwrap());
    assert!(s.peer().is("host-b"), "server sees {:?}", s.peer());
    assert!(c.peer().is("host-a"), "client sees {:?}", c.peer());
    assert!(c.peer().is("127.0.0.1"));
    assert!(!c.peer().is("host-b"));
    // AES-128-GCM, offered first: the cheapest of the three here.
    for end in [&s, &c] {
        assert_eq!(
            end.suite().suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
    }
    both_ways(s, c, 48 << 20);
}

#[test]
fn keys_are_renewed_before_a_ciphers_record_limit() {
    // A cipher that may seal only 64 records per key: 8 MiB is 512 records,
    // which rustls refuses to send under one key (EncryptExhausted).
    let p = limited(
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
        64,
    );
    let (ca, a) = fleet("host-a", Validity::days(1));
    let b = issue(&ca, "host-b", Validity::days(1));
    let (ca_, cb) = (
        Credentials::load_with(&a, p.clone()).unwrap(),
        Credentials::load_with(&b, p).unwrap(),
    );
    let (s, c) = pair(&ca_, &cb);
    let (s, c) = (s.unwrap(), c.unwrap());
    let (s2, c2) = (s.try_clone().unwrap(), c.try_clone().unwrap());
    both_ways(s, c, 8 << 20);
    // 8 MiB is at least 512 records of at most 16 KiB, a new key before
    // each 32 more: at least 15 key updates each way, each one followed by
    // the other end.
    let (ss, sf) = s2.key_updates();
    let (cs, cf) = c2.key_updates();
    assert!(ss >= 15 && cs >= 15, "sent {ss} and {cs}");
    assert_eq!((sf, cf), (cs, ss));
}

fn refused(r: Result<TlsSocket, TlsError>) -> String {
    match r {
        Ok(_) => panic!("the handshake succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_certificate_from_another_ca_is_refused_on_both_sides() {
    let (_, a) = fleet("host-a", Validity::days(1));
    let (_, stranger) = fleet("stranger", Validity::days(1));
    let (s, c) = pair(
        &Credentials::load(&a).unwrap(),
        &Credentials::load(&stranger).unwrap(),
    );
    // The client refuses the server first (it too is from another CA).
    let (s, c) = (refused(s), refused(c));
    assert!(c.contains("not from this fleet's CA"), "client: {c}");
    // Same CA name, another key: the signature does not verify.
    assert!(s.contains("refused this host's certificate"), "server: {s}");
}

#[test]
fn an_expired_client_certificate_is_refused_with_the_reason() {
    let (ca, a) = fleet("host-a", Validity::days(1));
    let past = time::OffsetDateTime::now_utc() - time::Duration::days(2);
    let old = issue(&ca, "host-old", Validity::until(past));
    let (s, c) = pair(
        &Credentials::load(&a).unwrap(),
        &Credentials::load(&old).unwrap(),
    );
    let s = refused(s);
    assert!(s.contains("expired"), "server: {s}");
    // TLS 1.3: the client learns on its first read after the handshake.
    if let Ok(mut c) = c {
        let mut b = [0u8; 1];
        let e = c
            .read(&mut b)
            .map(|n| n.to_string())
            .unwrap_or_else(|e| e.to_string());
        assert!(e.contains("expired") || e == "0", "client: {e}");
    }
}

#[test]
fn a_client_without_a_certificate_or_without_tls_is_refused() {
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    // No client certificate.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let config = creds.server_config();
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        TlsSocket::handshake(s, Handshake::Server(config.clone()), Duration::from_secs(5))
            .map(|_| ())
            .unwrap_err()
            .to_string()
            + " | "
            + &{
                let (s, _) = l.accept().unwrap();
                TlsSocket::handshake(s, Handshake::Server(config), Duration::from_secs(5))
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            }
    });
    let mut roots = rustls::RootCertStore::empty();
    let ca_pem = std::fs::read(a.join("ca.pem")).unwrap();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(&ca_pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let anon = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let c = TlsSocket::handshake(
        TcpStream::connect(at).unwrap(),
        Handshake::Client(Arc::new(anon), ServerName::IpAddress(at.ip().into())),
        Duration::from_secs(5),
    );
    if let Ok(mut c) = c {
        let _ = c.read(&mut [0u8; 1]);
    }
    // Plaintext: a ferry frame where a ClientHello should be.
    let mut plain = TcpStream::connect(at).unwrap();
    plain.write_all(b"FRY1\0\0\0\0hello, no tls here").unwrap();
    let s = server.join().unwrap();
    assert!(s.contains("presented no certificate"), "server: {s}");
    assert!(s.contains("does not speak TLS"), "server: {s}");
}

#[test]
fn a_silent_peer_is_dropped_at_the_handshake_deadline() {
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let _silent = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    let t = Instant::now();
    let e = TlsSocket::handshake(
        s,
        Handshake::Server(creds.server_config()),
        Duration::from_millis(300),
    )
    .unwrap_err();
    assert!(matches!(e, TlsError::HandshakeTimeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn credentials_are_reloaded_when_the_files_change() {
    let (ca, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    assert!(creds.me().is("host-a"));
    // Rotate: a new certificate for another name into the same directory.
    pki::issue(&ca, "host-a2", &a, &[], Validity::days(1)).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    assert!(creds.me().is("host-a2"), "{:?}", creds.me());
    // A broken file keeps the old credentials.
    std::fs::write(a.join("cert.pem"), "garbage").unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    assert!(creds.me().is("host-a2"));
}

#[test]
fn missing_credentials_say_how_to_make_them_and_a_ca_is_never_overwritten() {
    let e = Credentials::load(&scratch("none"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("ferry pki issue") && e.contains("--insecure"),
        "{e}"
    );
    let ca = scratch("ca");
    pki::init_ca(&ca, "fleet", Validity::days(1)).unwrap();
    let e = pki::init_ca(&ca, "fleet", Validity::days(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already"), "{e}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(ca.join("ca-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn data_sent_right_behind_the_handshake_is_read_after_it() {
    // A client writes as soon as its handshake is done (ferry's first
    // frame), so its last handshake records and its first data often
    // reach the server in one read: the handshake must leave that data to
    // the record layer.
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let config = creds.server_config();
    let server = std::thread::spawn(move || {
        for _ in 0..20 {
            let (s, _) = l.accept().unwrap();
            let mut s =
                TlsSocket::handshake(s, Handshake::Server(config.clone()), Duration::from_secs(5))
                    .expect("the server's handshake");
            let mut got = [0u8; 5];
            s.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"hello");
        }
    });
    for _ in 0..20 {
        let tcp = TcpStream::connect(at).unwrap();
        let name = ServerName::IpAddress(at.ip().into());
        let mut c = TlsSocket::handshake(
            tcp,
            Handshake::Client(creds.client_config(), name),
            Duration::from_secs(5),
        )
        .unwrap();
        c.write_all(b"hello").unwrap();
    }
    server.join().unwrap();
}

#[test]
fn a_peer_that_closes_without_a_word_is_told_apart() {
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    drop(TcpStream::connect(l.local_addr().unwrap()).unwrap());
    let (s, _) = l.accept().unwrap();
    let e = TlsSocket::handshake(
        s,
        Handshake::Server(creds.server_config()),
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(matches!(e, TlsError::Silent { .. }), "{e}");
    assert!(TlsError::is_silent(&std::io::Error::other(e)));
    // One byte and a close is not silent.
    let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    c.write_all(&[22]).unwrap();
    drop(c);
    let (s, _) = l.accept().unwrap();
    let e = TlsSocket::handshake(
        s,
        Handshake::Server(creds.server_config()),
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(matches!(e, TlsError::Handshake { .. }), "{e}");
}

/// A client whose handshake messages are cut into records of `frag` bytes;
/// `foreign` gives it a self-signed certificate whose name repeats a TLS
/// record header (the bytes rustls moves over the next record's header
/// when it joins the fragments). The server's result, as text.
fn fragmented_client(frag: usize, foreign: bool) -> String {
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let config = creds.server_config();
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        TlsSocket::handshake(s, Handshake::Server(config), Duration::from_secs(3))
            .map(|mut s| {
                let mut b = [0u8; 1];
                s.read_exact(&mut b).map(|_| b[0])
            })
            .map_err(|e| e.to_string())
    });
    let mut roots = rustls::RootCertStore::empty();
    for c in
        rustls::pki_types::pem::PemObject::pem_slice_iter(&std::fs::read(a.join("ca.pem")).unwrap())
    {
        roots.add(c.unwrap()).unwrap();
    }
    let (cert, key) = if foreign {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        let header = "\u{17}\u{3}\u{3}\u{40}\u{0}".repeat(80);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, header);
        let cert = params.self_signed(&key).unwrap();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der());
        (cert.der().clone(), key.into())
    } else {
        let certs: Vec<rustls::pki_types::CertificateDer<'static>> =
            rustls::pki_types::pem::PemObject::pem_slice_iter(
                &std::fs::read(a.join("cert.pem")).unwrap(),
            )
            .map(|c| c.unwrap())
            .collect();
        let key = rustls::pki_types::pem::PemObject::from_pem_slice(
            &std::fs::read(a.join("key.pem")).unwrap(),
        )
        .unwrap();
        (certs[0].clone(), key)
    };
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(vec![cert], key)
    .unwrap();
    cfg.max_fragment_size = Some(frag);
    let mut conn =
        rustls::ClientConnection::new(Arc::new(cfg), ServerName::IpAddress(at.ip().into()))
            .unwrap();
    let mut tcp = TcpStream::connect(at).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    while conn.is_handshaking() {
        if conn.complete_io(&mut tcp).is_err() {
            break;
        }
    }
    let _ = conn.writer().write_all(b"x");
    let _ = conn.complete_io(&mut tcp);
    match server.join() {
        Ok(Ok(Ok(b))) => format!("ok {}", b as char),
        Ok(Ok(Err(e))) => format!("read failed: {e}"),
        Ok(Err(e)) => format!("refused: {e}"),
        Err(_) => "PANIC".into(),
    }
}

#[test]
fn handshake_messages_cut_into_small_records_are_joined_and_never_crash_the_server() {
    // A fleet host with small records gets in and its data is read.
    for frag in [64, 100, 200] {
        assert_eq!(
            fragmented_client(frag, false),
            "ok x",
            "fragment size {frag}"
        );
    }
    // A stranger whose certificate carries record headers is refused, not
    // a panic (rustls rewrites what it was shown; headers are read only
    // past it).
    for frag in 100..110 {
        let r = fragmented_client(frag, true);
        assert!(r.starts_with("refused:"), "fragment size {frag}: {r}");
    }
}

#[test]
fn reads_of_every_size_through_a_link_that_cuts_records_apart_give_the_bytes_sent() {
    // A relay passes the client's bytes on in 7000-byte pieces with pauses,
    // so records arrive in parts; the server reads with a 1 ms timeout and
    // sizes from one byte (opened in its read-ahead) to megabytes (records
    // received straight into the caller's buffer), and a read that times
    // out mid-record must leave the record whole for the next.
    let (_, a) = fleet("host-a", Validity::days(1));
    let creds = Credentials::load(&a).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_at = relay.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut from_client, _) = relay.accept().unwrap();
        let mut to_server = TcpStream::connect(at).unwrap();
        let (mut back_from, mut back_to) = (
            to_server.try_clone().unwrap(),
            from_client.try_clone().unwrap(),
        );
        std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
        let mut piece = vec![0u8; 7000];
        loop {
            match from_client.read(&mut piece) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_server.write_all(&piece[..n]).is_err() {
                        break;
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(1500));
        }
        let _ = to_server.shutdown(std::net::Shutdown::Write);
    });
    let data = pattern(6 << 20, 9);
    let sent = data.clone();
    let config = creds.client_config();
    let client = std::thread::spawn(move || {
        let tcp = TcpStream::connect(relay_at).unwrap();
        let name = ServerName::IpAddress(at.ip().into());
        let mut c =
            TlsSocket::handshake(tcp, Handshake::Client(config, name), Duration::from_secs(5))
                .unwrap();
        let mut sizes = [1usize, 5000, 300_000, 3, 17_000].into_iter().cycle();
        let mut rest = &sent[..];
        while !rest.is_empty() {
            let k = sizes.next().unwrap().min(rest.len());
            c.write_all(&rest[..k]).unwrap();
            rest = &rest[k..];
        }
        c.close_notify();
    });
    let (s, _) = l.accept().unwrap();
    let mut s = TlsSocket::handshake(
        s,
        Handshake::Server(creds.server_config()),
        Duration::from_secs(5),
    )
    .unwrap();
    s.tcp()
        .set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    let mut got = Vec::new();
    let mut sizes = [1usize, 16_500, 2 << 20, 700, 17_000, 1 << 20]
        .into_iter()
        .cycle();
    let mut timeouts = 0;
    let mut want = sizes.next().unwrap();
    loop {
        let mut buf = vec![0u8; want];
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                want = sizes.next().unwrap();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => timeouts += 1,
            Err(e) => panic!("read failed after {} bytes: {e}", got.len()),
        }
    }
    client.join().unwrap();
    assert!(timeouts > 0, "no read waited past its timeout");
    assert_eq!(got.len(), data.len());
    assert!(got == data, "bytes differ after the trip");
}
