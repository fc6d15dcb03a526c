//! Raw page bodies: Pages (a fixed binary layout, not postcard, so page
//! data is never copied through serde), ZeroRanges and the holes writer
//! built on it, and the page hash that Verify compares.

use std::io::Write;

use super::{write_frame, Kind, ProtocolError, HEADER};
use crate::ranges::GpaPages;

/// Guest page size, the unit of transfer (as a buffer length).
pub const PAGE: usize = crate::ranges::PAGE as usize;
/// Most pages in one Pages frame.
pub const MAX_BATCH: usize = 1024;

/// Encodes a Pages body: `count:u32 | count x gpa:u64 | count x 4096 bytes`.
pub fn encode_pages(gpas: &[u64], data: &[u8]) -> Vec<u8> {
    debug_assert_eq!(data.len(), gpas.len() * PAGE);
    let mut b = Vec::with_capacity(4 + gpas.len() * (8 + PAGE));
    b.extend_from_slice(&(gpas.len() as u32).to_le_bytes());
    for g in gpas {
        b.extend_from_slice(&g.to_le_bytes());
    }
    b.extend_from_slice(data);
    b
}

/// Splits a Pages body into (addresses, page data), checking its shape.
pub fn decode_pages(body: &[u8]) -> Result<(Vec<u64>, &[u8]), ProtocolError> {
    let bad = |reason: String| ProtocolError::Malformed {
        kind: Kind::Pages,
        reason,
    };
    if body.len() < 4 {
        return Err(bad("shorter than its count".into()));
    }
    let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if n > MAX_BATCH || body.len() != 4 + n * (8 + PAGE) {
        return Err(bad(format!("{n} pages do not match {} bytes", body.len())));
    }
    let gpas = body[4..4 + 8 * n]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    Ok((gpas, &body[4 + 8 * n..]))
}

/// Hash of one page for end-to-end verification.
pub fn page_hash(page: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}

/// Writes a ZeroRanges frame of runs; returns its wire bytes.
pub fn write_zero_ranges(w: &mut impl Write, ranges: &[GpaPages]) -> Result<u64, ProtocolError> {
    let body = postcard::to_stdvec(ranges).map_err(|e| ProtocolError::Malformed {
        kind: Kind::ZeroRanges,
        reason: e.to_string(),
    })?;
    write_frame(w, Kind::ZeroRanges, &body)?;
    Ok((HEADER + body.len()) as u64)
}

/// Writes known-zero holes as ZeroRanges frames (4096 runs each); returns
/// (frames, wire bytes).
pub fn write_holes(w: &mut impl Write, holes: &[GpaPages]) -> Result<(u64, u64), ProtocolError> {
    let (mut frames, mut bytes) = (0, 0);
    for chunk in holes.chunks(4096) {
        bytes += write_zero_ranges(w, chunk)?;
        frames += 1;
    }
    Ok((frames, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, read_frame, Frame};

    #[test]
    fn a_pages_body_round_trips() {
        let gpas = [0x1000u64, 0x5000, 0xffff_f000];
        let data: Vec<u8> = (0..3 * PAGE).map(|i| (i % 253) as u8).collect();
        let body = encode_pages(&gpas, &data);
        assert_eq!(body.len(), 4 + 3 * (8 + PAGE));
        let (g, d) = decode_pages(&body).unwrap();
        assert_eq!((g.as_slice(), d), (&gpas[..], &data[..]));
        let empty = encode_pages(&[], &[]);
        let (g, d) = decode_pages(&empty).unwrap();
        assert!(g.is_empty() && d.is_empty());
    }

    #[test]
    fn a_pages_body_of_the_wrong_shape_is_malformed() {
        let body = encode_pages(&[0x1000], &[1; PAGE]);
        for bad in [
            &[1u8, 0, 0][..],        // shorter than its count
            &[1, 0, 0, 0, 1],        // one page announced, none there
            &[0xff, 0xff, 0, 0],     // more pages than a batch holds
            &body[..body.len() - 1], // the last page cut short
        ] {
            assert!(
                matches!(
                    decode_pages(bad),
                    Err(ProtocolError::Malformed {
                        kind: Kind::Pages,
                        ..
                    })
                ),
                "{:?}",
                &bad[..bad.len().min(8)]
            );
        }
        let mut long = body.clone();
        long.push(0);
        assert!(decode_pages(&long).is_err(), "a byte past the last page");
    }

    #[test]
    fn a_full_batch_fits_and_one_page_more_does_not() {
        let gpas: Vec<u64> = (0..MAX_BATCH as u64 + 1).map(|i| i * 4096).collect();
        let data = vec![0u8; (MAX_BATCH + 1) * PAGE];
        let full = encode_pages(&gpas[..MAX_BATCH], &data[..MAX_BATCH * PAGE]);
        assert_eq!(decode_pages(&full).unwrap().0.len(), MAX_BATCH);
        assert!(decode_pages(&encode_pages(&gpas, &data)).is_err());
    }

    #[test]
    fn holes_go_out_in_zero_ranges_frames_of_4096_runs() {
        let holes: Vec<GpaPages> = (0..4097u64)
            .map(|i| GpaPages::new(i * 2 * 4096, 1))
            .collect();
        let mut wire = Vec::new();
        let (frames, bytes) = write_holes(&mut wire, &holes).unwrap();
        assert_eq!((frames, bytes), (2, wire.len() as u64));
        let mut r = &wire[..];
        let mut back = Vec::new();
        for want in [4096, 1] {
            let f: Frame = read_frame(&mut r).unwrap();
            let runs: Vec<GpaPages> = decode(&f, Kind::ZeroRanges).unwrap();
            assert_eq!(runs.len(), want);
            back.extend(runs);
        }
        assert!(r.is_empty());
        assert_eq!(back, holes);
        let mut none = Vec::new();
        assert_eq!(write_holes(&mut none, &[]).unwrap(), (0, 0));
        assert!(none.is_empty());
    }

    #[test]
    fn a_zero_ranges_frame_counts_its_wire_bytes() {
        let mut wire = Vec::new();
        let n = write_zero_ranges(&mut wire, &[GpaPages::new(0x2000, 5)]).unwrap();
        assert_eq!(n as usize, wire.len());
        // (gpa, pages) as postcard varints: 0x2000 is [0x80, 0x40].
        assert_eq!(&wire[HEADER..], [1, 0x80, 0x40, 5]);
    }

    #[test]
    fn page_hash_is_xxh3_64() {
        // Verify compares hashes made on two hosts, possibly two builds:
        // the function is part of the wire. XXH3-64's value for no input:
        assert_eq!(page_hash(&[]), 0x2d06_8005_38d3_94c2);
        let page: Vec<u8> = (0..PAGE).map(|i| (i * 13) as u8).collect();
        let mut other = page.clone();
        other[PAGE - 1] ^= 1;
        assert_ne!(page_hash(&page), page_hash(&other));
    }
}
