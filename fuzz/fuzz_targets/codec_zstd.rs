//! ferry-codec's zstd decoder (`StreamDecoder::decode` of batches coded
//! with `Method::Zstd`: one zstd frame per page, decompressed into exactly
//! one page), as a destination runs it on a hostile source's batches. The
//! first byte picks the level. The check is ferry_fuzz::codec::lockstep: a
//! refused batch leaves the decoder exactly as it was; an accepted one is
//! decoded deterministically, and its pages survive an honest round trip.
#![no_main]

use ferry_codec::Method;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let Some((&level, rest)) = data.split_first() else {
        return;
    };
    ferry_fuzz::codec::lockstep(Method::Zstd(1 + i32::from(level % 19)), rest);
});
