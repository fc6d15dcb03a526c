//! A destination's bulk stream, whole: the frames a source sends on a bulk
//! connection, read by the engine's receiver (`receiver::bulk_loop`: Pages
//! landed in place, ZeroRanges, a Codec frame and then Encoded batches on
//! a decode thread) into the real precopy sink (`DirectSink`).
//!
//! Two kinds of input (the first byte's low bit):
//! - honest: one round of an honest sender's stream (pages, zero runs,
//!   batches coded with one of the codecs by ferry-codec's encoder, over
//!   one or two encoder shards, each page in one frame); the stream must be
//!   taken whole, and memory must then hold exactly what was sent;
//! - hostile: frames of any kind, shape and checksum, and raw bytes; the
//!   receiver must end (never hang) with pages only inside guest memory.
#![no_main]

use ferry_codec::{EncodedBatch, Method, StreamEncoder};
use ferry_fuzz::codec::CACHES;
use ferry_fuzz::{frame, init, kind_of, Input, Memory, Peer};
use ferry_migration::fuzzing::{write_encoded, CodecSetup};
use ferry_migration::protocol::{self, Kind};
use ferry_migration::sink::DirectSink;
use ferry_migration::GpaPages;
use libfuzzer_sys::fuzz_target;

const METHODS: [Method; 7] = [
    Method::None,
    Method::Rle,
    Method::Xbzrle,
    Method::Dedup,
    Method::Lz4,
    Method::Zstd(1),
    Method::Zstd(3),
];

/// An honest stream and the memory it must leave (and the pages it sends).
fn honest(input: &mut Input, memory: &Memory) -> (Vec<u8>, Memory, u64) {
    let model = Memory::standard();
    let addrs = memory.page_addrs();
    let mut wire = Vec::new();
    let coded = input.bool();
    let method = METHODS[usize::from(input.u8()) % METHODS.len()];
    let shards = 1 + usize::from(input.u8() % 2);
    let mut encoders: Vec<StreamEncoder> =
        (0..shards).map(|_| StreamEncoder::new(CACHES)).collect();
    if coded {
        let setup = CodecSetup {
            xbzrle_bytes: CACHES.xbzrle_bytes,
            dedup_bytes: CACHES.dedup_bytes,
            shards: shards as u8,
        };
        protocol::send(&mut wire, Kind::Codec, &setup).expect("to a Vec");
    }
    let mut sent = 0;
    // One round: a page goes in one frame at most (the receiver lands
    // Encoded batches on another thread than Pages and zero runs, and only
    // a round's end orders them; an honest source sends a page once a
    // round). Within a frame a page may repeat: the last copy wins.
    let mut used: Vec<u64> = Vec::new();
    for _ in 0..(input.u8() % 8) {
        let n = 1 + usize::from(input.u8() % 6);
        let gpas: Vec<u64> = (0..n)
            .map(|_| addrs[usize::from(input.u8()) % addrs.len()])
            .filter(|g| !used.contains(g))
            .collect();
        if gpas.is_empty() {
            continue;
        }
        used.extend(&gpas);
        let n = gpas.len();
        match input.u8() % 3 {
            0 => {
                // Zero runs: one page each, from these addresses.
                let runs: Vec<GpaPages> = gpas.iter().map(|&g| GpaPages::new(g, 1)).collect();
                protocol::write_holes(&mut wire, &runs).expect("to a Vec");
                for g in gpas {
                    model.write(g, &[0u8; 4096]);
                }
            }
            1 if coded => {
                let mut data = Vec::new();
                for _ in &gpas {
                    data.extend(input.page());
                }
                let shard = usize::from(input.u8()) % shards;
                let pages: Vec<u64> = gpas.iter().map(|g| g / 4096).collect();
                let mut batch = EncodedBatch::default();
                encoders[shard]
                    .encode(method, &pages, &data, &mut batch)
                    .expect("an honest batch encodes");
                write_encoded(&mut wire, method, shard as u8, &gpas, &batch).expect("to a Vec");
                for (i, g) in gpas.iter().enumerate() {
                    model.write(*g, &data[i * 4096..][..4096]);
                }
                sent += n as u64;
            }
            _ => {
                let mut data = Vec::new();
                for _ in &gpas {
                    data.extend(input.page());
                }
                protocol::write_frame(
                    &mut wire,
                    Kind::Pages,
                    &protocol::encode_pages(&gpas, &data),
                )
                .expect("to a Vec");
                for (i, g) in gpas.iter().enumerate() {
                    model.write(*g, &data[i * 4096..][..4096]);
                }
                sent += n as u64;
            }
        }
    }
    (wire, model, sent)
}

/// Frames and bytes of any kind.
fn hostile(input: &mut Input) -> Vec<u8> {
    let mut wire = Vec::new();
    while !input.is_empty() {
        let sel = input.u8();
        let body = input.chunk();
        let kind = match sel % 6 {
            0 => Kind::Pages,
            1 => Kind::ZeroRanges,
            2 => Kind::Codec,
            3 => Kind::Encoded,
            4 => kind_of(input.u8()),
            _ => {
                wire.extend_from_slice(body);
                continue;
            }
        };
        let mut f = frame(kind, body);
        if sel & 0x80 != 0 {
            f[12] ^= 1; // a wrong checksum
        }
        wire.extend(f);
    }
    wire
}

fuzz_target!(|data: &[u8]| {
    init();
    let mut input = Input::new(data);
    let memory = Memory::standard();
    let is_honest = input.u8() & 1 == 0;
    let (wire, expect) = if is_honest {
        let (wire, model, sent) = honest(&mut input, &memory);
        (wire, Some((model, sent)))
    } else {
        (hostile(&mut input), None)
    };
    let wire_len = wire.len() as u64;
    let regions = memory.views();
    let sink = DirectSink::new(&memory);
    let (conn, peer) = Peer::connect(wire);
    let (reader, writer) = conn.into_parts();
    let got = ferry_migration::fuzzing::bulk_stream(&regions, &sink, reader);
    drop(writer);
    drop(peer);
    match expect {
        Some((model, sent)) => {
            let (pages, _zeros) = got.expect("an honest stream refused");
            assert_eq!(pages, sent, "pages counted");
            assert!(
                memory.snapshot() == model.snapshot(),
                "memory differs from what was sent"
            );
        }
        None => {
            if let Ok((pages, zeros)) = got {
                // Every page landed came in a frame of its own bytes.
                assert!(pages * 8 <= wire_len);
                let _ = zeros;
            }
        }
    }
});
