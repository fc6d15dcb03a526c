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
mod tests;
