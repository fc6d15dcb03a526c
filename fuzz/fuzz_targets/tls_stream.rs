//! A stream of TLS records after the handshake, read the two ways ferry's
//! socket reads them (`ferry_tls::record`): record by record where each
//! lies (`Opener::open`, the read-ahead's way), and into the front of one
//! buffer, each record's data moved up against the last one's as it is
//! opened (`Opener::open_within`, the way a large read lands records in
//! its caller's buffer).
//!
//! Input: a byte choosing the cipher (AES-256-GCM or ChaCha20-Poly1305:
//! rustls makes 32-byte keys only), four bytes choosing what a man in the middle does,
//! then two halves:
//! - raw bytes, read both ways;
//! - pieces `[kind, len_hi, len_lo, fill]`: application data records of
//!   any length up to 2^14 and key updates (the sealer and the opener
//!   both take the next keys after one), sealed honestly, then tampered
//!   with as chosen: a bit flipped, a record sent twice, two swapped, one
//!   dropped, or the stream cut.
//!
//! Checks: the two ways always agree (the same records, data, key updates
//! and refusal, and the data moved to the front is intact); what opens is
//! exactly what was sealed, in order; the first record tampered with,
//! replayed, out of order or after a gap is refused (a cut stream only
//! waits for the rest; a dropped last record is a cut at a boundary,
//! which only the stream's own framing can tell).
#![no_main]

use ferry_tls::record::{complete, Keys, Opened, Opener, RecordError, Sealer, HEADER, MAX_PLAIN};
use ferry_tls::rustls::crypto::cipher::{AeadKey, Iv};
use ferry_tls::rustls::ConnectionTrafficSecrets;
use libfuzzer_sys::fuzz_target;

/// The keys of generation `gen` (each key update moves to the next) for
/// cipher `suite`.
fn keys(suite: u8, gen: usize) -> Keys {
    let k = gen as u8;
    let iv = Iv::from([k ^ 0x5a; 12]);
    let key = AeadKey::from([k; 32]);
    let secrets = match suite % 2 {
        0 => ConnectionTrafficSecrets::Aes256Gcm { key, iv },
        _ => ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv },
    };
    Keys::new(0, secrets).expect("keys")
}

/// What a reader got from one record.
#[derive(Debug, PartialEq, Eq, Clone)]
enum Got {
    Data(Vec<u8>),
    KeyUpdate(bool),
    Closed,
    Refused(RecordError),
}

/// Follows one opened record: its outcome, and whether reading goes on.
fn follow(o: &mut Opener, suite: u8, gen: &mut usize, r: &Result<Opened, RecordError>) -> bool {
    match r {
        Ok(Opened::KeyUpdate { .. }) => {
            *gen += 1;
            o.rekey(keys(suite, *gen));
            true
        }
        Ok(Opened::Data(_)) => true,
        Ok(Opened::Closed) | Err(_) => false,
    }
}

/// The read-ahead's way: each whole record opened where it lies.
fn read_in_place(stream: &[u8], suite: u8) -> Vec<Got> {
    let mut buf = stream.to_vec();
    let (mut o, mut gen, mut at) = (Opener::new(keys(suite, 0)), 0, 0);
    let mut got = Vec::new();
    loop {
        let len = match complete(&buf[at..]) {
            Ok(Some(len)) => len,
            Ok(None) => return got,
            Err(e) => {
                got.push(Got::Refused(e));
                return got;
            }
        };
        let rec = &mut buf[at..at + len];
        let r = o.open(rec);
        got.push(match &r {
            Ok(Opened::Data(d)) => {
                assert!(d.start >= HEADER && d.end <= len, "data outside its record");
                Got::Data(rec[d.clone()].to_vec())
            }
            Ok(Opened::KeyUpdate { asked }) => Got::KeyUpdate(*asked),
            Ok(Opened::Closed) => Got::Closed,
            Err(e) => Got::Refused(e.clone()),
        });
        if !follow(&mut o, suite, &mut gen, &r) {
            return got;
        }
        at += len;
    }
}

/// The direct read's way: records opened into the front of the buffer,
/// each one's data against the last one's, as `TlsSocket::read_direct`.
fn read_within(stream: &[u8], suite: u8) -> Vec<Got> {
    let mut buf = stream.to_vec();
    let (mut o, mut gen) = (Opener::new(keys(suite, 0)), 0);
    let (mut w, mut r) = (0, 0);
    let (mut got, mut all) = (Vec::new(), Vec::new());
    loop {
        let len = match complete(&buf[r..]) {
            Ok(Some(len)) => len,
            Ok(None) => break,
            Err(e) => {
                got.push(Got::Refused(e));
                break;
            }
        };
        let header: [u8; HEADER] = buf[r..r + HEADER].try_into().expect("a header");
        let res = o.open_within(header, &mut buf[w..r + len], r + HEADER - w);
        r += len;
        got.push(match &res {
            Ok(Opened::Data(d)) => {
                assert_eq!(d.start, 0, "data not at the front");
                let data = buf[w..w + d.end].to_vec();
                all.extend_from_slice(&data);
                w += d.end;
                Got::Data(data)
            }
            Ok(Opened::KeyUpdate { asked }) => Got::KeyUpdate(*asked),
            Ok(Opened::Closed) => Got::Closed,
            Err(e) => Got::Refused(e.clone()),
        });
        if !follow(&mut o, suite, &mut gen, &res) {
            break;
        }
    }
    // Opening a record never touched the data moved up before it.
    assert!(buf[..w] == all[..], "data opened earlier was overwritten");
    got
}

/// Both ways, which must agree.
fn read(stream: &[u8], suite: u8) -> Vec<Got> {
    let a = read_in_place(stream, suite);
    let b = read_within(stream, suite);
    assert_eq!(a, b, "the two ways of opening disagree");
    a
}

fuzz_target!(|data: &[u8]| {
    let Some((&suite, data)) = data.split_first() else {
        return;
    };
    let Some((mitm, data)) = data.split_first_chunk::<4>() else {
        return;
    };
    let (raw, rest) = data.split_at(data.len() / 2);
    let _ = read(raw, suite);

    // Honest records from the pieces.
    let mut sealer = Sealer::new(keys(suite, 0), u64::MAX);
    let mut gen = 0;
    let mut recs: Vec<(Vec<u8>, Got)> = Vec::new();
    for p in rest.chunks_exact(4).take(24) {
        let mut out = Vec::new();
        if p[0] % 4 == 3 {
            sealer
                .seal_key_update(&mut out)
                .expect("sealing a key update");
            gen += 1;
            sealer.rekey(keys(suite, gen));
            recs.push((out, Got::KeyUpdate(false)));
        } else {
            let len = usize::from(u16::from_be_bytes([p[1], p[2]])) % (MAX_PLAIN + 1);
            let at = Sealer::begin(&mut out);
            out.resize(out.len() + len, p[3]);
            sealer.seal(&mut out, at).expect("sealing up to MAX_PLAIN");
            recs.push((out, Got::Data(vec![p[3]; len])));
        }
    }
    let n = recs.len();
    let whole: Vec<u8> = recs.iter().flat_map(|r| r.0.clone()).collect();
    let want: Vec<Got> = recs.iter().map(|r| r.1.clone()).collect();
    assert_eq!(read(&whole, suite), want, "an honest stream");
    if n == 0 {
        return;
    }

    // What the man in the middle does, and from which record on the
    // reader must stop: refused there (Some), or only left waiting
    // (None) with the records before it read exactly.
    let word = u32::from_le_bytes(*mitm);
    let (i, j) = ((word >> 8) as usize % n, (word >> 20) as usize % n);
    let (stream, good, refused) = match mitm[0] % 5 {
        // A bit flipped anywhere: that record is never opened.
        0 => {
            let bit = (word >> 8) as usize % (whole.len() * 8);
            let mut s = whole.clone();
            s[bit / 8] ^= 1 << (bit % 8);
            let mut k = 0;
            let mut end = recs[0].0.len();
            while end <= bit / 8 {
                k += 1;
                end += recs[k].0.len();
            }
            // Refused, or (a length made longer) left waiting.
            let got = read(&s, suite);
            assert!(got.len() <= k + 1, "records after a tampered one were read");
            assert_eq!(got[..got.len().min(k)], want[..got.len().min(k)]);
            assert!(
                got.len() == k || matches!(got[k], Got::Refused(_)),
                "a tampered record opened: {:?}",
                got[k]
            );
            return;
        }
        // Record i sent twice.
        1 => {
            let mut order: Vec<usize> = (0..n).collect();
            order.insert(i + 1, i);
            (order, i + 1, true)
        }
        // Records i and j swapped.
        2 if i != j => {
            let mut order: Vec<usize> = (0..n).collect();
            order.swap(i, j);
            (order, i.min(j), true)
        }
        // Record i dropped (the last one: a cut between records).
        3 => {
            let mut order: Vec<usize> = (0..n).collect();
            order.remove(i);
            (order, i, i + 1 < n)
        }
        // The stream cut inside record i.
        4 => {
            let start: usize = recs[..i].iter().map(|r| r.0.len()).sum();
            let cut = start + (word >> 20) as usize % recs[i].0.len();
            let got = read(&whole[..cut], suite);
            assert_eq!(got, want[..i], "a cut stream");
            return;
        }
        _ => return,
    };
    let s: Vec<u8> = stream.iter().flat_map(|&k| recs[k].0.clone()).collect();
    let got = read(&s, suite);
    assert_eq!(
        got[..good],
        want[..good],
        "records before the first one out of place"
    );
    if refused {
        assert_eq!(
            got.len(),
            good + 1,
            "records after one out of place were read"
        );
        assert!(
            matches!(got[good], Got::Refused(RecordError::Decrypt)),
            "a record out of place opened: {:?}",
            got[good]
        );
    } else {
        assert_eq!(got.len(), good);
    }
});
