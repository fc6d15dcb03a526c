//! Compressed batches as a destination lands them: Encoded bodies (method,
//! shard, addresses, per-page codec and length, payloads) parsed by
//! `encoded::parse_encoded` and decoded by a compressed stream's decode
//! stage (`receiver::decode_loop`: one ferry-codec decoder per shard, each
//! address checked, pages landed through the real precopy sink).
//!
//! Checks: a parsed body re-encodes (`write_encoded`) to exactly itself;
//! pages land only at page addresses of guest memory; the stage reports
//! as many pages as the bodies it took carried.
#![no_main]

use ferry_codec::{EncodedBatch, StreamDecoder};
use ferry_fuzz::codec::CACHES;
use ferry_fuzz::{init, Input, Memory};
use ferry_migration::fuzzing::{parse_encoded, write_encoded};
use ferry_migration::protocol::{self, Kind};
use ferry_migration::sink::DirectSink;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    init();
    let mut input = Input::new(data);
    let shards = 1 + usize::from(input.u8() % 3);
    let mut bodies = Vec::new();
    let mut parsed_pages = Vec::new();
    while !input.is_empty() {
        let body = input.chunk().to_vec();
        match parse_encoded(&body) {
            Ok(e) => {
                let batch = EncodedBatch {
                    codecs: e.codecs.clone(),
                    lens: e.lens.clone(),
                    payload: e.payload.to_vec(),
                };
                let mut wire = Vec::new();
                write_encoded(&mut wire, e.method, e.shard, &e.gpas, &batch).expect("to a Vec");
                let f = protocol::read_frame(&mut &wire[..]).expect("reads back");
                assert_eq!(f.kind, Kind::Encoded);
                assert_eq!(f.body, body, "a parsed Encoded body re-encodes differently");
                parsed_pages.push(e.gpas.len() as u64);
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        bodies.push(body);
    }
    let memory = Memory::standard();
    let regions = memory.views();
    let sink = DirectSink::new(&memory);
    let decoders = (0..shards).map(|_| StreamDecoder::new(CACHES)).collect();
    let n = bodies.len();
    match ferry_migration::fuzzing::encoded(&regions, &sink, decoders, bodies) {
        Ok(pages) => {
            // Every body was taken: all parsed, and their pages counted.
            assert_eq!(parsed_pages.len(), n);
            assert_eq!(pages, parsed_pages.iter().sum::<u64>());
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
