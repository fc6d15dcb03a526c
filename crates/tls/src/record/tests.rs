use super::*;
use rustls::crypto::cipher::{AeadKey, Iv};

fn keys(k: u8) -> Keys {
    let secrets = ConnectionTrafficSecrets::Aes256Gcm {
        key: AeadKey::from([k; 32]),
        iv: Iv::from([k; 12]),
    };
    Keys::new(0, secrets).unwrap()
}

fn sealed(plain: &[u8]) -> Vec<u8> {
    let mut s = Sealer::new(keys(1), 1 << 20);
    let mut out = Vec::new();
    let at = Sealer::begin(&mut out);
    out.extend_from_slice(plain);
    s.seal(&mut out, at).unwrap();
    out
}

#[test]
fn a_sealed_record_opens_in_place_to_its_plaintext() {
    let mut rec = sealed(b"pages");
    assert_eq!(complete(&rec).unwrap(), Some(rec.len()));
    assert_eq!(complete(&rec[..rec.len() - 1]).unwrap(), None);
    let got = Opener::new(keys(1)).open(&mut rec).unwrap();
    let Opened::Data(r) = got else {
        panic!("{got:?}")
    };
    assert_eq!(&rec[r], b"pages");
}

#[test]
fn a_record_sealed_where_its_data_lies_is_the_record_sealed_by_copy() {
    let data = b"four pages, or a few bytes of them";
    // The data, then the byte lent for the content type (its value is
    // overwritten).
    let mut inner = data.to_vec();
    inner.push(0xee);
    let (header, tag) = Sealer::new(keys(1), 1 << 20)
        .seal_in_place(&mut inner)
        .unwrap();
    let mut wire = header.to_vec();
    wire.extend_from_slice(&inner);
    wire.extend_from_slice(tag.as_ref());
    assert_eq!(wire, sealed(data));
    let too_long = &mut vec![0; MAX_PLAIN + 2];
    assert!(matches!(
        Sealer::new(keys(1), 1 << 20).seal_in_place(too_long),
        Err(RecordError::TooLong(_))
    ));
}

#[test]
fn a_flipped_bit_a_wrong_key_or_a_replay_is_refused() {
    let mut rec = sealed(b"pages");
    rec[HEADER + 1] ^= 1;
    assert_eq!(
        Opener::new(keys(1)).open(&mut rec),
        Err(RecordError::Decrypt)
    );
    let mut rec = sealed(b"pages");
    assert_eq!(
        Opener::new(keys(2)).open(&mut rec),
        Err(RecordError::Decrypt)
    );
    // The same record twice: the second is opened with the next nonce.
    let rec = sealed(b"pages");
    let mut o = Opener::new(keys(1));
    assert!(o.open(&mut rec.clone()).is_ok());
    assert_eq!(o.open(&mut rec.clone()), Err(RecordError::Decrypt));
}

#[test]
fn headers_that_cannot_be_sealed_records_are_refused_before_waiting() {
    assert_eq!(
        complete(&[22, 3, 3, 0, 40]),
        Err(RecordError::OuterType(22))
    );
    assert_eq!(
        complete(&[23, 3, 3, 0xff, 0xff]),
        Err(RecordError::TooLong(0xffff))
    );
    assert_eq!(complete(&[23, 3, 3, 0, 16]), Err(RecordError::TooShort(16)));
    assert_eq!(complete(&[23, 3]), Ok(None));
}

#[test]
fn key_updates_and_close_notify_are_read_and_other_messages_refused() {
    let mut s = Sealer::new(keys(1), 2);
    let mut o = Opener::new(keys(1));
    let mut out = Vec::new();
    s.seal_key_update(&mut out).unwrap();
    assert_eq!(
        o.open(&mut out).unwrap(),
        Opened::KeyUpdate { asked: false }
    );
    out.clear();
    s.seal_close_notify(&mut out).unwrap();
    assert!(s.wants_new_keys(), "two records sealed, renewal due");
    assert_eq!(o.open(&mut out).unwrap(), Opened::Closed);
    for (content, ty, want) in [
        (
            &[1u8, 42][..],
            ALERT,
            RecordError::Alert(AlertDescription::BadCertificate),
        ),
        (&[1, 0, 0][..], ALERT, RecordError::Malformed("alert")),
        (
            &[4, 0, 0, 0][..],
            HANDSHAKE,
            RecordError::Unexpected(HANDSHAKE),
        ),
        (
            &[KEY_UPDATE, 0, 0, 1, 2][..],
            HANDSHAKE,
            RecordError::Malformed("key update"),
        ),
        (&[0][..], 20, RecordError::Unexpected(20)),
    ] {
        let mut out = Vec::new();
        let at = Sealer::begin(&mut out);
        out.extend_from_slice(content);
        s.seal_as(&mut out, at, ty).unwrap();
        assert_eq!(o.open(&mut out), Err(want));
    }
}

#[test]
fn padding_is_stripped_and_all_padding_is_refused() {
    let mut s = Sealer::new(keys(1), 10);
    let mut o = Opener::new(keys(1));
    let mut out = Vec::new();
    let at = Sealer::begin(&mut out);
    out.extend_from_slice(b"ab");
    s.seal(&mut out, at).unwrap();
    // Re-seal by hand with zeros after the content type: padding.
    let mut padded = Vec::new();
    let at = Sealer::begin(&mut padded);
    padded.extend_from_slice(&[b'a', b'b', APPLICATION_DATA, 0, 0]);
    s.seal_as(&mut padded, at, 0).unwrap();
    let _ = o.open(&mut out).unwrap();
    // The record's last byte is the `0` given as type: rposition finds
    // APPLICATION_DATA before the zeros.
    let Opened::Data(r) = o.open(&mut padded).unwrap() else {
        panic!()
    };
    assert_eq!(&padded[r], b"ab");
    let mut empty = Vec::new();
    let at = Sealer::begin(&mut empty);
    empty.extend_from_slice(&[0, 0]);
    s.seal_as(&mut empty, at, 0).unwrap();
    assert_eq!(o.open(&mut empty), Err(RecordError::NoContentType));
}

/// `n` application data records, `piece{i}` each, sealed in a row by
/// one sealer: one stream, and where each record lies in it.
fn stream_of(n: usize) -> (Vec<u8>, Vec<Range<usize>>) {
    let mut s = Sealer::new(keys(1), 1 << 20);
    let mut out = Vec::new();
    let mut at = Vec::new();
    for i in 0..n {
        let start = Sealer::begin(&mut out);
        out.extend_from_slice(format!("piece{i}").as_bytes());
        s.seal(&mut out, start).unwrap();
        at.push(start..out.len());
    }
    (out, at)
}

/// What a reader makes of `stream`, record by record as the socket
/// reads it (`complete` measures, then one of the two ways of opening
/// in place), until a record is refused: the data of each record
/// opened, then the refusal if any, and how many bytes are left
/// waiting for the rest of a record.
fn read_stream(stream: &[u8], within: bool) -> (Vec<Vec<u8>>, Option<RecordError>, usize) {
    let mut buf = stream.to_vec();
    let mut o = Opener::new(keys(1));
    let (mut at, mut got) = (0, Vec::new());
    loop {
        let len = match complete(&buf[at..]) {
            Ok(Some(len)) => len,
            Ok(None) => return (got, None, buf.len() - at),
            Err(e) => return (got, Some(e), buf.len() - at),
        };
        let rec = &mut buf[at..at + len];
        let opened = if within {
            let header = rec[..HEADER].try_into().unwrap();
            // As the socket's direct read does: the data goes to the
            // front of the slice, the record starts after it.
            o.open_within(header, rec, HEADER)
        } else {
            o.open(rec)
        };
        match opened {
            Ok(Opened::Data(d)) => got.push(rec[d].to_vec()),
            Ok(other) => panic!("not data: {other:?}"),
            Err(e) => return (got, Some(e), buf.len() - at - len),
        }
        at += len;
    }
}

fn pieces(range: Range<usize>) -> Vec<Vec<u8>> {
    range.map(|i| format!("piece{i}").into_bytes()).collect()
}

#[test]
fn the_record_counter_stops_before_it_could_wrap_and_never_repeats_a_nonce() {
    // A key two records short of 2^64 - 1 (Keys::new takes any start,
    // as rustls hands over where its counter stands).
    let near = |k| {
        let secrets = ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([k; 32]),
            iv: Iv::from([k; 12]),
        };
        Keys::new(u64::MAX - 2, secrets).unwrap()
    };
    let mut s = Sealer::new(near(1), u64::MAX);
    let mut o = Opener::new(near(1));
    let seal = |s: &mut Sealer| {
        let mut out = Vec::new();
        let at = Sealer::begin(&mut out);
        out.extend_from_slice(b"same plaintext");
        s.seal(&mut out, at).map(|()| out)
    };
    let (mut a, mut b) = (seal(&mut s).unwrap(), seal(&mut s).unwrap());
    // Two counter values, two nonces: the same plaintext seals apart.
    assert_ne!(a, b);
    assert!(matches!(o.open(&mut a), Ok(Opened::Data(_))));
    assert!(matches!(o.open(&mut b), Ok(Opened::Data(_))));
    // 2^64 - 1 would be next: refused, and stays refused (the counter
    // does not move, nothing is sealed with a spent or wrapped value).
    for _ in 0..3 {
        assert_eq!(seal(&mut s), Err(RecordError::Exhausted));
        assert_eq!(
            s.seal_key_update(&mut Vec::new()),
            Err(RecordError::Exhausted)
        );
        assert_eq!(o.open(&mut a.clone()), Err(RecordError::Exhausted));
    }
    // The sealer had asked for new keys long before.
    assert!(Sealer::new(near(1), 1 << 20).wants_new_keys());
    // A key update gives a counter from 0 again, under another key.
    s.rekey(keys(1));
    let mut c = seal(&mut s).unwrap();
    assert!(Opener::new(keys(1)).open(&mut c).is_ok());
}

#[test]
fn each_record_spends_exactly_one_counter_value() {
    // Three records from counter 5 open with an opener at 5, in order;
    // one at 6 refuses the first (a counter value was skipped).
    let at = |seq| {
        let secrets = ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([1; 32]),
            iv: Iv::from([1; 12]),
        };
        Keys::new(seq, secrets).unwrap()
    };
    let mut s = Sealer::new(at(5), 8);
    let mut recs = Vec::new();
    for i in 0..3u8 {
        let mut out = Vec::new();
        let start = Sealer::begin(&mut out);
        out.push(i);
        s.seal(&mut out, start).unwrap();
        // A record refused before sealing (too long) spends nothing.
        let mut big = Vec::new();
        let start = Sealer::begin(&mut big);
        big.resize(big.len() + MAX_PLAIN + 1, 0);
        assert_eq!(
            s.seal(&mut big, start),
            Err(RecordError::TooLong(MAX_PLAIN + 1))
        );
        recs.push(out);
    }
    // 5 + 3 = 8: renewal due exactly now.
    assert!(s.wants_new_keys());
    let mut o = Opener::new(at(5));
    for (i, r) in recs.iter().enumerate() {
        let mut r = r.clone();
        let Ok(Opened::Data(d)) = o.open(&mut r) else {
            panic!("record {i}")
        };
        assert_eq!(r[d], [i as u8]);
    }
    assert_eq!(
        Opener::new(at(6)).open(&mut recs[0].clone()),
        Err(RecordError::Decrypt)
    );
}

#[test]
fn tampering_with_any_bit_of_a_record_is_refused_with_a_typed_error() {
    let (stream, at) = stream_of(1);
    assert_eq!(at[0].len(), HEADER + 6 + 1 + TAG);
    for within in [false, true] {
        for i in 0..stream.len() {
            for bit in 0..8 {
                let mut t = stream.clone();
                t[i] ^= 1 << bit;
                let (got, err, _) = read_stream(&t, within);
                assert!(got.is_empty(), "byte {i} bit {bit}: opened {got:?}");
                match (i, err) {
                    // The outer type: not a sealed record at all.
                    (0, Some(RecordError::OuterType(t))) => assert_ne!(t, 23),
                    // The legacy version is not checked, but it is
                    // authenticated (additional data).
                    (1 | 2, Some(RecordError::Decrypt)) => {}
                    // The length: too long or too short for any
                    // record, shorter than the record (its tag is then
                    // read from elsewhere), or longer (then it waits
                    // for the rest).
                    (
                        3 | 4,
                        Some(
                            RecordError::TooLong(_)
                            | RecordError::TooShort(_)
                            | RecordError::Decrypt,
                        )
                        | None,
                    ) => {}
                    // The ciphertext (5..12) and the tag (12..).
                    (5.., Some(RecordError::Decrypt)) => {}
                    (_, other) => panic!("byte {i} bit {bit}: {other:?}"),
                }
            }
        }
    }
    // A header length cut by one, against a buffer of the whole
    // record: open refuses the mismatch either way.
    let mut t = stream.clone();
    t[4] -= 1;
    assert_eq!(
        Opener::new(keys(1)).open(&mut t),
        Err(RecordError::TooLong(stream.len()))
    );
}

#[test]
fn a_record_cut_short_is_never_opened() {
    let (stream, at) = stream_of(2);
    for within in [false, true] {
        // Every cut inside the second record: the first is read, the
        // second waits for the rest (the socket turns an end of stream
        // there into an error).
        for cut in at[1].start..at[1].end {
            let (got, err, left) = read_stream(&stream[..cut], within);
            assert_eq!(got, pieces(0..1), "cut at {cut}");
            assert_eq!(err, None, "cut at {cut}");
            assert_eq!(left, cut - at[1].start);
        }
    }
    // Given to open as if whole, a cut record is refused.
    for cut in 0..at[0].end {
        assert!(matches!(
            Opener::new(keys(1)).open(&mut stream[..cut].to_vec()),
            Err(RecordError::TooShort(_))
        ));
    }
    // A cut record whose header is changed to match what is left: the
    // tag is then read from the ciphertext, and fails.
    let mut t = stream[..at[0].end - 1].to_vec();
    t[4] -= 1;
    assert_eq!(Opener::new(keys(1)).open(&mut t), Err(RecordError::Decrypt));
}

#[test]
fn a_record_sent_twice_is_refused_the_second_time() {
    let (stream, at) = stream_of(3);
    for within in [false, true] {
        // 0 1 1 2: the replayed 1 is opened with 2's nonce.
        let mut t = stream[..at[1].end].to_vec();
        t.extend_from_slice(&stream[at[1].clone()]);
        t.extend_from_slice(&stream[at[2].clone()]);
        let (got, err, _) = read_stream(&t, within);
        assert_eq!(got, pieces(0..2));
        assert_eq!(err, Some(RecordError::Decrypt));
        // 0 0: the first again, at once.
        let mut t = stream[at[0].clone()].to_vec();
        t.extend_from_slice(&stream[at[0].clone()]);
        let (got, err, _) = read_stream(&t, within);
        assert_eq!(got, pieces(0..1));
        assert_eq!(err, Some(RecordError::Decrypt));
    }
    // A record of the old key after a key update: refused too.
    let mut s = Sealer::new(keys(1), 1 << 20);
    let mut o = Opener::new(keys(1));
    let mut old = Vec::new();
    let at = Sealer::begin(&mut old);
    old.extend_from_slice(b"old");
    s.seal(&mut old, at).unwrap();
    assert!(o.open(&mut old.clone()).is_ok());
    let mut ku = Vec::new();
    s.seal_key_update(&mut ku).unwrap();
    assert_eq!(o.open(&mut ku).unwrap(), Opened::KeyUpdate { asked: false });
    o.rekey(keys(2));
    assert_eq!(o.open(&mut old), Err(RecordError::Decrypt));
}

#[test]
fn two_records_swapped_are_refused() {
    let (stream, at) = stream_of(3);
    for within in [false, true] {
        // 0 2 1: 2 is opened with 1's nonce.
        let mut t = stream[at[0].clone()].to_vec();
        t.extend_from_slice(&stream[at[2].clone()]);
        t.extend_from_slice(&stream[at[1].clone()]);
        let (got, err, left) = read_stream(&t, within);
        assert_eq!(got, pieces(0..1));
        assert_eq!(err, Some(RecordError::Decrypt));
        assert_eq!(left, at[1].len());
        // 1 0: refused from the start.
        let mut t = stream[at[1].clone()].to_vec();
        t.extend_from_slice(&stream[at[0].clone()]);
        let (got, err, _) = read_stream(&t, within);
        assert!(got.is_empty());
        assert_eq!(err, Some(RecordError::Decrypt));
        // A record dropped (0 2): the same.
        let mut t = stream[at[0].clone()].to_vec();
        t.extend_from_slice(&stream[at[2].clone()]);
        let (got, err, _) = read_stream(&t, within);
        assert_eq!(got, pieces(0..1));
        assert_eq!(err, Some(RecordError::Decrypt));
    }
}
