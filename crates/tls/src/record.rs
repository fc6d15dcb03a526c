//! The TLS 1.3 record layer once the handshake is done (RFC 8446 §5):
//! records are sealed in the sender's batch buffer and opened where they
//! were received (the caller's buffer, or the read-ahead for small reads),
//! so each byte is copied once by the sender and not at all by the
//! receiver (rustls's buffered API copies it four times, and that, not the
//! cipher, was most of what TLS cost a migration).
//!
//! rustls still runs the handshake and derives every key, the new ones
//! after a key update too (its kernel API, the one made for kernel TLS
//! offload). This module only seals and opens records with those keys,
//! using ring's AEADs, and reads the few messages that may follow a
//! handshake: application data, alerts and key updates.

use std::ops::Range;

use ring::aead::{
    Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305,
};
use rustls::{AlertDescription, ConnectionTrafficSecrets};

/// A record's header: outer type, legacy version, length.
pub const HEADER: usize = 5;
/// The AEAD tag every sealed record ends with.
pub const TAG: usize = 16;
/// Most plaintext one record carries (2^14).
pub const MAX_PLAIN: usize = 1 << 14;
/// Most a sealed record's body may be (2^14 + 256).
pub const MAX_BODY: usize = MAX_PLAIN + 256;
/// Most one record takes on the wire.
pub const MAX_RECORD: usize = HEADER + MAX_BODY;

const APPLICATION_DATA: u8 = 23;
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const KEY_UPDATE: u8 = 24;

/// Why a record could not be sealed or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The header announces more than TLS allows.
    #[error("a TLS record of {0} bytes is longer than TLS allows (the stream is corrupt)")]
    TooLong(usize),
    /// Too short to hold a content type and a tag.
    #[error("a TLS record of {0} bytes is too short to be sealed (the stream is corrupt)")]
    TooShort(usize),
    /// After the handshake only sealed records may come.
    #[error("a TLS record of outer type {0} after the handshake (the stream is corrupt)")]
    OuterType(u8),
    /// The tag did not verify.
    #[error("cannot decrypt a record: it was corrupted or tampered with on the way")]
    Decrypt,
    /// The opened record is all padding.
    #[error("a TLS record holds no content type")]
    NoContentType,
    /// A message that has no place after the handshake.
    #[error("an unexpected TLS message (content type {0}) after the handshake")]
    Unexpected(u8),
    /// A key update or alert that is not well formed.
    #[error("a malformed TLS {0}")]
    Malformed(&'static str),
    /// The peer sent a fatal alert.
    #[error("the peer sent the TLS alert {0:?}")]
    Alert(AlertDescription),
    /// A key was used for 2^64 records.
    #[error("a TLS key's record counter is exhausted")]
    Exhausted,
    /// Keys of a cipher this layer does not implement.
    #[error("the negotiated TLS cipher has no record layer here")]
    Unsupported,
}

/// One direction's traffic key, IV and record counter.
///
/// A nonce never repeats under a key, by construction:
/// - the only nonce made is [`next_nonce`](Self::next_nonce)'s, which
///   takes `&mut self` and advances the counter before it returns one;
///   ring's `Nonce` is neither `Clone` nor `Copy` and each seal or open
///   consumes it, so one counter value protects exactly one record (one
///   that fails to open spends its value too: a replay is then opened
///   with the next nonce, and refused);
/// - the counter only grows, with `checked_add`: at 2^64 - 1 nothing is
///   sealed or opened any more ([`RecordError::Exhausted`]), so it cannot
///   wrap to a value used before;
/// - the key, IV and counter are private and change together: a key
///   update replaces the whole `Keys` (new secret from rustls, counter
///   from 0), and a [`Sealer`] asks for one after `renew_after` records
///   (half the cipher's confidentiality limit), long before that bound.
pub struct Keys {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Keys {
    /// The keys rustls derived, starting at record `seq`.
    pub fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Keys, RecordError> {
        let (alg, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err(RecordError::Unsupported),
        };
        let key = UnboundKey::new(alg, key.as_ref()).map_err(|_| RecordError::Unsupported)?;
        let iv: [u8; 12] = iv
            .as_ref()
            .try_into()
            .map_err(|_| RecordError::Unsupported)?;
        Ok(Keys {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The next record's nonce: the IV with the record counter mixed in.
    fn next_nonce(&mut self) -> Result<Nonce, RecordError> {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq = self.seq.checked_add(1).ok_or(RecordError::Exhausted)?;
        Ok(Nonce::assume_unique_for_key(n))
    }
}

/// The sending direction: seals records into a buffer.
pub struct Sealer {
    keys: Keys,
    /// Records a key may seal before it is renewed.
    renew_after: u64,
}

impl Sealer {
    /// Seals with `keys`, renewing them after `renew_after` records (half
    /// the cipher's confidentiality limit, so there is room to spare).
    pub fn new(keys: Keys, renew_after: u64) -> Sealer {
        Sealer {
            keys,
            renew_after: renew_after.max(1),
        }
    }

    /// True once the key has sealed its share and must be renewed before
    /// the next record.
    pub fn wants_new_keys(&self) -> bool {
        self.keys.seq >= self.renew_after
    }

    /// Takes the keys a key update gave.
    pub fn rekey(&mut self, keys: Keys) {
        self.keys = keys;
    }

    /// Starts a record at the end of `out`; its plaintext is what is
    /// appended to `out` until [`seal`](Self::seal) (at most
    /// [`MAX_PLAIN`] bytes).
    pub fn begin(out: &mut Vec<u8>) -> usize {
        let at = out.len();
        out.extend_from_slice(&[0; HEADER]);
        at
    }

    /// Seals the application data record begun at `at`.
    pub fn seal(&mut self, out: &mut Vec<u8>, at: usize) -> Result<(), RecordError> {
        self.seal_as(out, at, APPLICATION_DATA)
    }

    /// Appends a record that tells the peer this side's keys change now
    /// (a KeyUpdate that asks nothing of the peer), sealed with the old
    /// keys; the caller then [`rekey`](Self::rekey)s.
    pub fn seal_key_update(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        let at = Self::begin(out);
        out.extend_from_slice(&[KEY_UPDATE, 0, 0, 1, 0]);
        self.seal_as(out, at, HANDSHAKE)
    }

    /// Appends a close_notify alert.
    pub fn seal_close_notify(&mut self, out: &mut Vec<u8>) -> Result<(), RecordError> {
        let at = Self::begin(out);
        out.extend_from_slice(&[1, 0]);
        self.seal_as(out, at, ALERT)
    }

    /// Seals the record begun at `at` as inner content type `content`
    /// (tests and the fuzzer make every kind of record with it).
    #[doc(hidden)]
    pub fn seal_as(
        &mut self,
        out: &mut Vec<u8>,
        at: usize,
        content: u8,
    ) -> Result<(), RecordError> {
        out.push(content);
        let (header, tag) = self.seal_inner(&mut out[at + HEADER..])?;
        out[at..at + HEADER].copy_from_slice(&header);
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Seals one application data record where its data lies: `inner` is
    /// the data followed by one byte the caller lends for the content type
    /// (this writes it). Returns the header and tag that go around
    /// `inner` on the wire; `inner` is left as ciphertext.
    pub fn seal_in_place(&mut self, inner: &mut [u8]) -> Result<([u8; HEADER], Tag), RecordError> {
        let Some(last) = inner.last_mut() else {
            return Err(RecordError::TooShort(0));
        };
        *last = APPLICATION_DATA;
        self.seal_inner(inner)
    }

    /// Seals `inner` (data, then its content type) in place.
    fn seal_inner(&mut self, inner: &mut [u8]) -> Result<([u8; HEADER], Tag), RecordError> {
        let plain = inner.len().saturating_sub(1);
        if plain > MAX_PLAIN {
            return Err(RecordError::TooLong(plain));
        }
        let body = inner.len() + TAG;
        let header = [APPLICATION_DATA, 3, 3, (body >> 8) as u8, body as u8];
        let nonce = self.keys.next_nonce()?;
        let tag = self
            .keys
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(header), inner)
            .map_err(|_| RecordError::Exhausted)?;
        Ok((header, tag))
    }
}

/// What one opened record held.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    /// Application data at this range of the record (possibly empty).
    Data(Range<usize>),
    /// The peer's keys change after this record; `asked` if it wants this
    /// side's renewed too.
    KeyUpdate {
        /// The peer asked for this side's keys to change as well.
        asked: bool,
    },
    /// close_notify: the peer sends nothing more.
    Closed,
}

/// The length of the record at the front of `buf` if all of it has
/// arrived; an error if its header cannot be a sealed record's.
pub fn complete(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    let Some(h) = buf.get(..HEADER) else {
        return Ok(None);
    };
    if h[0] != APPLICATION_DATA {
        return Err(RecordError::OuterType(h[0]));
    }
    // The legacy version field is ignored, as RFC 8446 says.
    let body = usize::from(u16::from_be_bytes([h[3], h[4]]));
    if body > MAX_BODY {
        return Err(RecordError::TooLong(body));
    }
    if body < 1 + TAG {
        return Err(RecordError::TooShort(body));
    }
    Ok((buf.len() >= HEADER + body).then_some(HEADER + body))
}

/// The receiving direction: opens records in place.
pub struct Opener {
    keys: Keys,
}

impl Opener {
    /// Opens with `keys`.
    pub fn new(keys: Keys) -> Opener {
        Opener { keys }
    }

    /// Takes the keys after the peer's key update.
    pub fn rekey(&mut self, keys: Keys) {
        self.keys = keys;
    }

    /// Opens `record` (exactly one whole record, as [`complete`] measured
    /// it) in place.
    pub fn open(&mut self, record: &mut [u8]) -> Result<Opened, RecordError> {
        let Some(len) = complete(record)? else {
            return Err(RecordError::TooShort(record.len()));
        };
        if len != record.len() {
            return Err(RecordError::TooLong(record.len()));
        }
        let (h, body) = record.split_at_mut(HEADER);
        let header: [u8; HEADER] = [h[0], h[1], h[2], h[3], h[4]];
        let (inner, tag) = body.split_at_mut(body.len() - TAG);
        let tag: [u8; TAG] = (&*tag).try_into().map_err(|_| RecordError::Decrypt)?;
        Ok(match self.open_parts(header, inner, tag)? {
            Opened::Data(r) => Opened::Data(HEADER + r.start..HEADER + r.end),
            other => other,
        })
    }

    /// Opens the record whose header is `header` and whose body (sealed
    /// content and tag) is `in_out[from..]`, writing its content to the
    /// front of `in_out`: a reader opens a run of records received into
    /// its caller's buffer this way, each one's data moved up against the
    /// last one's as it is opened. A range of `in_out` is the data.
    pub fn open_within(
        &mut self,
        header: [u8; HEADER],
        in_out: &mut [u8],
        from: usize,
    ) -> Result<Opened, RecordError> {
        let nonce = self.keys.next_nonce()?;
        let plain = self
            .keys
            .key
            .open_within(nonce, Aad::from(header), in_out, from..)
            .map_err(|_| RecordError::Decrypt)?;
        Self::content(plain)
    }

    /// Opens a record whose parts lie apart: its `header` (checked by
    /// [`complete`]), its sealed content in `inner` (opened in place there:
    /// a range of `inner` is the data) and its `tag`.
    fn open_parts(
        &mut self,
        header: [u8; HEADER],
        inner: &mut [u8],
        tag: [u8; TAG],
    ) -> Result<Opened, RecordError> {
        let nonce = self.keys.next_nonce()?;
        let plain = self
            .keys
            .key
            .open_in_place_separate_tag(nonce, Aad::from(header), Tag::from(tag), inner, 0..)
            .map_err(|_| RecordError::Decrypt)?;
        Self::content(plain)
    }

    /// What an opened record's plaintext (content, type, padding) holds.
    fn content(plain: &[u8]) -> Result<Opened, RecordError> {
        // The content type is the last byte that is not padding.
        let typed = plain
            .iter()
            .rposition(|&b| b != 0)
            .ok_or(RecordError::NoContentType)?;
        // RFC 8446 5.4: content, type and padding at most 2^14 + 1 bytes.
        if plain.len() > MAX_PLAIN + 1 {
            return Err(RecordError::TooLong(plain.len()));
        }
        let content = &plain[..typed];
        match plain[typed] {
            APPLICATION_DATA => Ok(Opened::Data(0..typed)),
            ALERT => match content {
                [_, 0] => Ok(Opened::Closed),
                [_, d] => Err(RecordError::Alert(AlertDescription::from(*d))),
                _ => Err(RecordError::Malformed("alert")),
            },
            // Only a key update may follow a handshake here: the server
            // sends no session tickets and ferry never renegotiates.
            HANDSHAKE => match content {
                [KEY_UPDATE, 0, 0, 1, asked @ (0 | 1)] => {
                    Ok(Opened::KeyUpdate { asked: *asked == 1 })
                }
                [KEY_UPDATE, ..] => Err(RecordError::Malformed("key update")),
                _ => Err(RecordError::Unexpected(HANDSHAKE)),
            },
            other => Err(RecordError::Unexpected(other)),
        }
    }
}

#[cfg(test)]
mod tests {
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
}
