//! Protocol v2 frames for compressed bulk streams.
//!
//! A compressed bulk stream starts with a Codec frame (the cache sizes the
//! destination must mirror and how many encoder shards feed the stream).
//! Each Encoded frame then carries one batch:
//!
//! ```text
//! method u8 | shard u8 | count u32 | count x gpa u64 | count x codec u8
//!           | count x len u32 | payload (sum of len bytes)
//! ```
//!
//! `method` is ferry-codec's method id, `shard` the encoder (and so the
//! decoder cache) the batch belongs to. Batches of one shard are decoded in
//! the order they arrive on their stream.

use std::io::{self, Write};

use ferry_codec::{CacheSizes, EncodedBatch, Method, PageCodec};

use crate::protocol::{self, Kind, ProtocolError, MAX_BATCH, PAGE};

/// Most encoder shards per stream.
pub const MAX_SHARDS: u8 = 16;
/// Largest cache a source may ask the destination to keep, per cache and
/// shard (a hostile source must not make it allocate without bound).
pub const MAX_CACHE_BYTES: u64 = 1 << 30;

/// First frame of a compressed bulk stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CodecSetup {
    /// xbzrle page cache bytes, per shard.
    pub xbzrle_bytes: u64,
    /// dedup chunk cache bytes, per shard.
    pub dedup_bytes: u64,
    /// Encoder shards feeding this stream.
    pub shards: u8,
}

impl CodecSetup {
    /// Checks what a peer asked for.
    pub fn check(&self) -> Result<CacheSizes, ProtocolError> {
        if self.shards == 0
            || self.shards > MAX_SHARDS
            || self.xbzrle_bytes > MAX_CACHE_BYTES
            || self.dedup_bytes > MAX_CACHE_BYTES
        {
            return Err(malformed(
                Kind::Codec,
                format!(
                    "{} shards with caches of {} and {} bytes exceed the limits ({} shards, {} bytes)",
                    self.shards, self.xbzrle_bytes, self.dedup_bytes, MAX_SHARDS, MAX_CACHE_BYTES
                ),
            ));
        }
        Ok(CacheSizes {
            xbzrle_bytes: self.xbzrle_bytes,
            dedup_bytes: self.dedup_bytes,
        })
    }
}

fn malformed(kind: Kind, reason: String) -> ProtocolError {
    ProtocolError::Malformed { kind, reason }
}

/// Writes one Encoded frame; returns the bytes it put on the wire.
pub fn write_encoded(
    w: &mut impl Write,
    method: Method,
    shard: u8,
    gpas: &[u64],
    batch: &EncodedBatch,
) -> io::Result<u64> {
    let mut meta = Vec::with_capacity(6 + gpas.len() * 13);
    meta.push(method.id());
    meta.push(shard);
    meta.extend_from_slice(&(gpas.len() as u32).to_le_bytes());
    for g in gpas {
        meta.extend_from_slice(&g.to_le_bytes());
    }
    meta.extend(batch.codecs.iter().map(|c| *c as u8));
    for l in &batch.lens {
        meta.extend_from_slice(&l.to_le_bytes());
    }
    protocol::write_frame_parts(w, Kind::Encoded, &[&meta, &batch.payload])?;
    Ok((protocol::HEADER + meta.len() + batch.payload.len()) as u64)
}

/// An Encoded frame body, checked for shape (not yet decoded).
pub struct EncodedFrame<'a> {
    /// Method of the batch.
    pub method: Method,
    /// Encoder shard.
    pub shard: u8,
    /// Page addresses.
    pub gpas: Vec<u64>,
    /// Codec of each page.
    pub codecs: Vec<PageCodec>,
    /// Payload bytes of each page.
    pub lens: Vec<u32>,
    /// The payloads.
    pub payload: &'a [u8],
}

/// Splits an Encoded body, checking every count and length.
pub fn parse_encoded(body: &[u8]) -> Result<EncodedFrame<'_>, ProtocolError> {
    let bad = |r: String| malformed(Kind::Encoded, r);
    if body.len() < 6 {
        return Err(bad("shorter than its header".into()));
    }
    let method = Method::from_id(body[0]).map_err(|e| bad(e.to_string()))?;
    let shard = body[1];
    let n = u32::from_le_bytes([body[2], body[3], body[4], body[5]]) as usize;
    if n == 0 || n > MAX_BATCH {
        return Err(bad(format!("{n} pages in a batch (1..={MAX_BATCH})")));
    }
    let meta = 6 + n * 13;
    if body.len() < meta {
        return Err(bad(format!("{n} pages need {meta} bytes of metadata")));
    }
    let gpas: Vec<u64> = body[6..6 + 8 * n]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let codecs = body[6 + 8 * n..6 + 9 * n]
        .iter()
        .map(|&c| PageCodec::try_from(c))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let lens: Vec<u32> = body[6 + 9 * n..meta]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
    if lens.iter().any(|&l| l as usize > PAGE) || total != (body.len() - meta) as u64 {
        return Err(bad(format!(
            "page lengths add up to {total}, the payload holds {}",
            body.len() - meta
        )));
    }
    Ok(EncodedFrame {
        method,
        shard,
        gpas,
        codecs,
        lens,
        payload: &body[meta..],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_codec::StreamEncoder;

    #[test]
    fn an_encoded_frame_round_trips_and_bad_ones_are_refused() {
        let mut data = vec![0u8; 3 * PAGE];
        data[PAGE..2 * PAGE].fill(7);
        data[2 * PAGE..]
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 31 % 251) as u8);
        let gpas = [0x1000, 0x2000, 0x9000];
        let mut enc = StreamEncoder::new(CacheSizes::default());
        let mut batch = EncodedBatch::default();
        enc.encode(Method::Rle, &[1, 2, 9], &data, &mut batch)
            .unwrap();
        let mut wire = Vec::new();
        let n = write_encoded(&mut wire, Method::Rle, 3, &gpas, &batch).unwrap();
        assert_eq!(n as usize, wire.len());
        let f = protocol::read_frame(&mut &wire[..]).unwrap();
        let e = parse_encoded(&f.body).unwrap();
        assert_eq!(
            (e.method, e.shard, &e.gpas[..]),
            (Method::Rle, 3, &gpas[..])
        );
        assert_eq!(e.codecs, batch.codecs);
        assert_eq!(e.payload, &batch.payload[..]);
        // Truncated metadata, lengths that do not add up, unknown ids.
        assert!(parse_encoded(&f.body[..10]).is_err());
        assert!(parse_encoded(&f.body[..f.body.len() - 1]).is_err());
        let mut bad = f.body.clone();
        bad[0] = 0x3f;
        assert!(parse_encoded(&bad).is_err());
        let mut bad = f.body.clone();
        bad[6 + 8 * 3] = 200;
        assert!(parse_encoded(&bad).is_err());
        assert!(CodecSetup {
            xbzrle_bytes: 1 << 40,
            dedup_bytes: 0,
            shards: 1
        }
        .check()
        .is_err());
        assert!(CodecSetup {
            xbzrle_bytes: 1 << 20,
            dedup_bytes: 1 << 20,
            shards: 0
        }
        .check()
        .is_err());
    }
}
