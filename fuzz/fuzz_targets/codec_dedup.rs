//! ferry-codec's dedup decoder (`StreamDecoder::decode` of batches coded
//! with `Method::Dedup`), as a destination runs it on a hostile source's
//! batches. The check is ferry_fuzz::codec::lockstep: a refused batch
//! leaves the decoder's caches exactly as they were; an accepted one is
//! decoded deterministically, and its pages survive an honest round trip.
#![no_main]

use ferry_codec::Method;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    ferry_fuzz::codec::lockstep(Method::Dedup, data);
});
