//! TLS records after the handshake, as ferry's own record layer opens them
//! (`ferry_tls::record`): a peer's bytes, which hold sealed records only
//! if the peer has the keys.
//!
//! Two halves of each input:
//! - raw bytes read as a stream of records (`complete`, then `open`):
//!   refused, never a panic;
//! - records sealed with the right keys from the input's own pieces (any
//!   inner content type, padding, lengths up to the limit), one byte of
//!   the stream then flipped where the input says: what opens is exactly
//!   what was sealed, a record of another kind is refused as the RFC
//!   says, and the flipped record (if any) is refused.
#![no_main]

use ferry_tls::record::{complete, Keys, Opened, Opener, RecordError, Sealer, MAX_PLAIN};
use ferry_tls::rustls::crypto::cipher::{AeadKey, Iv};
use ferry_tls::rustls::ConnectionTrafficSecrets;
use libfuzzer_sys::fuzz_target;

fn keys() -> Keys {
    let secrets = ConnectionTrafficSecrets::Aes256Gcm {
        key: AeadKey::from([7u8; 32]),
        iv: Iv::from([9u8; 12]),
    };
    Keys::new(0, secrets).expect("keys")
}

/// Reads `stream` as records until one is refused or it ends.
fn read_all(stream: &mut [u8], mut o: Opener) -> (Vec<Result<Opened, RecordError>>, usize) {
    let mut at = 0;
    let mut out = Vec::new();
    loop {
        match complete(&stream[at..]) {
            Ok(None) => return (out, at),
            Err(e) => {
                out.push(Err(e));
                return (out, at);
            }
            Ok(Some(len)) => {
                let r = o.open(&mut stream[at..at + len]);
                let refused = r.is_err();
                if let Ok(Opened::Data(ref d)) = r {
                    assert!(d.end <= len, "data past its record");
                }
                out.push(r);
                at += len;
                if refused {
                    return (out, at);
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (raw, rest) = data.split_at(data.len() / 2);
    let mut raw = raw.to_vec();
    let _ = read_all(&mut raw, Opener::new(keys()));

    // Pieces: [type, len_hi, len_lo, fill] -> a record of that inner type
    // holding `len` (capped) bytes of `fill`.
    let mut sealer = Sealer::new(keys(), u64::MAX);
    let mut stream = Vec::new();
    let mut sealed = Vec::new();
    let mut pieces = rest.chunks_exact(4);
    let flip = pieces
        .next()
        .map(|p| u32::from_le_bytes([p[0], p[1], p[2], p[3]]));
    for p in pieces.take(32) {
        let len = usize::from(u16::from_be_bytes([p[1], p[2]])) % (MAX_PLAIN + 1);
        let start = stream.len();
        let at = Sealer::begin(&mut stream);
        stream.resize(stream.len() + len, p[3]);
        sealer
            .seal_as(&mut stream, at, p[0])
            .expect("sealing up to MAX_PLAIN works");
        sealed.push((p[0], len, p[3], start..stream.len()));
    }
    let mut flipped = None;
    if let (Some(f), false) = (flip, stream.is_empty()) {
        let i = f as usize % stream.len();
        stream[i] ^= 1 << (f >> 29);
        flipped = sealed.iter().position(|s| s.3.contains(&i));
    }
    let mut copy = stream.clone();
    let (opened, _) = read_all(&mut copy, Opener::new(keys()));
    for (k, got) in opened.iter().enumerate() {
        if Some(k) == flipped {
            assert!(got.is_err(), "a flipped record opened: {got:?}");
            return;
        }
        let (ty, len, fill, ref range) = sealed[k];
        // The inner plaintext is `len` bytes of `fill`, then `ty`: its type
        // is the last byte that is not zero.
        let (ty, len) = if ty != 0 {
            (ty, len)
        } else if fill != 0 && len > 0 {
            (fill, len - 1)
        } else {
            assert_eq!(got, &Err(RecordError::NoContentType));
            return;
        };
        match (ty, got) {
            (23, Ok(Opened::Data(d))) => {
                assert_eq!(d.len(), len);
                assert!(copy[range.start..range.end][d.clone()]
                    .iter()
                    .all(|&b| b == fill));
            }
            (21, Ok(Opened::Closed)) => assert_eq!(len, 2),
            (21, Err(RecordError::Alert(_) | RecordError::Malformed(_))) => {}
            (22, Ok(Opened::KeyUpdate { .. })) => assert_eq!(len, 5),
            (22, Err(RecordError::Unexpected(22) | RecordError::Malformed(_))) => {}
            (t, Err(RecordError::Unexpected(u))) if t == *u && ![21, 22, 23].contains(&t) => {}
            other => panic!("record {k} of type {ty}, {len} bytes: {other:?}"),
        }
        if got.is_err() {
            return;
        }
    }
});
