//! Raw bytes on a real connection after a real handshake: records
//! sealed with the sender's keys, then sent as they are or tampered
//! with, replayed, reordered, reflected or cut, as a man in the
//! middle could; the receiver reads them with small reads (opened in
//! the read-ahead) and with large ones (opened in the caller's
//! buffer), which are the two ways records are opened.

use super::*;
use crate::pki::{self, Validity};
use crate::Credentials;
use std::net::TcpListener;
use std::sync::OnceLock;

/// Read sizes: a byte and a small read (the read-ahead), and one that
/// holds several records (received straight into the caller's buffer).
const SIZES: [usize; 3] = [1, 1000, 64 << 10];

fn creds() -> Arc<Credentials> {
    static CREDS: OnceLock<Arc<Credentials>> = OnceLock::new();
    CREDS
        .get_or_init(|| {
            let dir =
                std::env::temp_dir().join(format!("ferry-tls-socket-unit-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let ca = dir.join("ca");
            pki::init_ca(&ca, "unit fleet", Validity::days(1)).unwrap();
            let host = dir.join("host");
            pki::issue(&ca, "host", &host, &["127.0.0.1".into()], Validity::days(1)).unwrap();
            Credentials::load(&host).unwrap()
        })
        .clone()
}

/// A client and a server after a mutual handshake over loopback.
fn pair() -> (TlsSocket, TlsSocket) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let config = creds().server_config();
    let server = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        TlsSocket::handshake(s, Handshake::Server(config), Duration::from_secs(5)).unwrap()
    });
    let name = ServerName::IpAddress(at.ip().into());
    let client = TlsSocket::handshake(
        TcpStream::connect(at).unwrap(),
        Handshake::Client(creds().client_config(), name),
        Duration::from_secs(5),
    )
    .unwrap();
    let server = server.join().unwrap();
    for end in [&client, &server] {
        // A bug that waits shows as a timeout, not a hung test.
        end.tcp()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
    }
    (client, server)
}

/// `pieces` sealed as `from` sends them, one record each.
fn sealed(from: &TlsSocket, pieces: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut tx = TlsSocket::lock(&from.shared.tx);
    pieces
        .iter()
        .map(|p| {
            let mut out = Vec::new();
            let at = Sealer::begin(&mut out);
            out.extend_from_slice(p);
            tx.sealer.seal(&mut out, at).unwrap();
            out
        })
        .collect()
}

/// Puts `records` on the wire at `from`'s end, then ends that
/// direction (a FIN, no close_notify) if `end`.
fn inject(from: &TlsSocket, records: &[&[u8]], end: bool) {
    (&from.tcp).write_all(&records.concat()).unwrap();
    if end {
        from.tcp.shutdown(std::net::Shutdown::Write).unwrap();
    }
}

/// Reads `to` with reads of `size` bytes until an end or an error.
fn drain(to: &TlsSocket, size: usize) -> (Vec<u8>, io::Result<()>) {
    let (mut got, mut buf) = (Vec::new(), vec![0u8; size]);
    loop {
        match (&mut &*to).read(&mut buf) {
            Ok(0) => return (got, Ok(())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return (got, Err(e)),
        }
    }
}

/// `r` is a refusal of the stream that says `why`, and a second read
/// says it again (a refused stream stays refused).
fn refused(to: &TlsSocket, r: io::Result<()>, why: &str) {
    let e = r.expect_err("the stream was read to its end");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains(why), "{e}");
    let again = (&mut &*to).read(&mut [0u8; 64 << 10]).unwrap_err();
    assert_eq!(again.to_string(), e.to_string());
}

const TAMPERED: &str = "corrupted or tampered with";

#[test]
fn records_as_a_peer_sends_them_are_read_whole_by_reads_of_every_size() {
    let big = vec![7u8; MAX_PLAIN];
    for size in SIZES {
        let (c, s) = pair();
        let recs = sealed(&c, &[b"first", &big, b"", b"last"]);
        let mut close = Vec::new();
        TlsSocket::lock(&c.shared.tx)
            .sealer
            .seal_close_notify(&mut close)
            .unwrap();
        // Bytes after close_notify are never read.
        inject(&c, &[&recs.concat(), &close, b"after the end"], true);
        let (got, end) = drain(&s, size);
        end.unwrap();
        assert_eq!(got, [&b"first"[..], &big, b"last"].concat(), "size {size}");
    }
}

#[test]
fn a_flipped_bit_in_a_header_the_ciphertext_or_the_tag_is_refused() {
    // Header: outer type, legacy version, length; then ciphertext; then
    // the tag's last byte.
    let body = b"target".len() + 1 + record::TAG;
    for (pos, why) in [
        (0, "outer type 22"),
        (2, TAMPERED),
        (4, TAMPERED),
        (record::HEADER + 2, TAMPERED),
        (record::HEADER + body - 1, TAMPERED),
    ] {
        for size in SIZES {
            let (c, s) = pair();
            let mut recs = sealed(&c, &[b"before", b"target", b"after"]);
            recs[1][pos] ^= 1;
            inject(&c, &[&recs[0], &recs[1], &recs[2]], false);
            let (got, r) = drain(&s, size);
            assert_eq!(got, b"before", "byte {pos}, size {size}");
            refused(&s, r, why);
        }
    }
}

#[test]
fn a_record_sent_twice_is_refused() {
    for size in SIZES {
        let (c, s) = pair();
        let recs = sealed(&c, &[b"one", b"two"]);
        inject(&c, &[&recs[0], &recs[1], &recs[1]], false);
        let (got, r) = drain(&s, size);
        assert_eq!(got, b"onetwo", "size {size}");
        refused(&s, r, TAMPERED);
    }
}

#[test]
fn records_swapped_or_dropped_are_refused() {
    for size in SIZES {
        for order in [[0, 2, 1], [1, 0, 2], [0, 2, 2]] {
            let (c, s) = pair();
            let recs = sealed(&c, &[b"one", b"two", b"three"]);
            inject(&c, &order.map(|i| &recs[i][..]), false);
            let (got, r) = drain(&s, size);
            let want: &[u8] = if order[0] == 0 { b"one" } else { b"" };
            assert_eq!(got, want, "order {order:?}, size {size}");
            refused(&s, r, TAMPERED);
        }
    }
}

#[test]
fn a_record_sent_back_to_its_sender_is_refused() {
    for size in SIZES {
        let (c, s) = pair();
        let recs = sealed(&c, &[b"mine"]);
        // The server's end sends the client's own record back to it.
        inject(&s, &[&recs[0]], false);
        let (got, r) = drain(&c, size);
        assert!(got.is_empty());
        refused(&c, r, TAMPERED);
    }
}

#[test]
fn a_stream_cut_inside_a_record_is_an_error_and_between_records_an_end() {
    for size in SIZES {
        let recs = |c: &TlsSocket| sealed(c, &[b"one", b"two"]);
        // Cut in the second record's header, and in its body.
        for cut in [3, record::HEADER + 4] {
            let (c, s) = pair();
            let r = recs(&c);
            inject(&c, &[&r[0], &r[1][..cut]], true);
            let (got, end) = drain(&s, size);
            assert_eq!(got, b"one", "cut at {cut}, size {size}");
            refused(&s, end, "ended in the middle of a record");
        }
        // Between records, without close_notify: an end (ferry's frames
        // say where a stream ends; a cut frame is theirs to refuse).
        let (c, s) = pair();
        let r = recs(&c);
        inject(&c, &[&r[0], &r[1]], true);
        let (got, end) = drain(&s, size);
        assert_eq!(got, b"onetwo");
        end.unwrap();
        assert_eq!((&mut &s).read(&mut [0u8; 8]).unwrap(), 0);
    }
}

#[test]
fn a_fatal_alert_from_the_peer_ends_the_stream_with_its_reason() {
    for size in SIZES {
        let (c, s) = pair();
        let mut alert = Vec::new();
        {
            let mut tx = TlsSocket::lock(&c.shared.tx);
            let at = Sealer::begin(&mut alert);
            // Fatal, bad_certificate.
            alert.extend_from_slice(&[2, 42]);
            tx.sealer.seal_as(&mut alert, at, 21).unwrap();
        }
        let recs = sealed(&c, &[b"never read"]);
        inject(&c, &[&alert, &recs[0]], false);
        let (got, r) = drain(&s, size);
        assert!(got.is_empty());
        refused(&s, r, "refused this host's certificate");
    }
}

#[test]
fn a_key_update_from_the_peer_is_followed_and_answered_if_it_asks() {
    for asked in [false, true] {
        for size in SIZES {
            let (c, s) = pair();
            // The client's key update, sealed with its old keys, then
            // data under the next ones, which rustls derives.
            let mut update = Vec::new();
            {
                let mut tx = TlsSocket::lock(&c.shared.tx);
                let at = Sealer::begin(&mut update);
                update.extend_from_slice(&[24, 0, 0, 1, u8::from(asked)]);
                tx.sealer.seal_as(&mut update, at, 22).unwrap();
                let (seq, next) = TlsSocket::lock(&c.shared.kernel).update_tx().unwrap();
                tx.sealer.rekey(Keys::new(seq, next).unwrap());
            }
            let recs = sealed(&c, &[b"new key"]);
            inject(&c, &[&update, &recs[0]], true);
            let (got, end) = drain(&s, size);
            end.unwrap();
            assert_eq!(got, b"new key");
            assert_eq!(s.key_updates(), (0, 1));
            // The server's next write renews its own keys first, if
            // asked; the client follows.
            s.try_clone().unwrap().write_all(b"reply").unwrap();
            s.tcp().shutdown(std::net::Shutdown::Write).unwrap();
            let (got, end) = drain(&c, size);
            end.unwrap();
            assert_eq!(got, b"reply");
            assert_eq!(s.key_updates(), (u64::from(asked), 1), "asked {asked}");
            assert_eq!(c.key_updates(), (0, u64::from(asked)));
        }
    }
}
