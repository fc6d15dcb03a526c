//! ferry-codec end to end: an honest encoder and decoder over several
//! batches of pages drawn from the input (repeated indices, pages that
//! change a little between batches, zero pages), with every method,
//! sharing one cache state across batches as a stream does.
//!
//! Checks: every batch decodes to exactly the pages encoded, whatever the
//! caches hold, and no payload is larger than a page.
#![no_main]

use ferry_codec::{EncodedBatch, Method, StreamDecoder, StreamEncoder};
use ferry_fuzz::codec::{honest_batch, CACHES};
use ferry_fuzz::Input;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let mut input = Input::new(data);
    let methods = [
        Method::None,
        Method::Rle,
        Method::Xbzrle,
        Method::Dedup,
        Method::Lz4,
        Method::Zstd(1 + i32::from(input.u8() % 19)),
    ];
    let mut enc = StreamEncoder::new(CACHES);
    let mut dec = StreamDecoder::new(CACHES);
    let mut batch = EncodedBatch::default();
    while !input.is_empty() {
        let method = methods[usize::from(input.u8()) % methods.len()];
        let (pages, data) = honest_batch(&mut input, 12);
        enc.encode(method, &pages, &data, &mut batch)
            .expect("encodes");
        assert!(batch.lens.iter().all(|&l| l as usize <= 4096));
        let mut out = vec![0u8; data.len()];
        dec.decode_batch(method, &pages, &batch, &mut out)
            .expect("decodes");
        assert!(out == data, "{method} did not round-trip");
    }
});
