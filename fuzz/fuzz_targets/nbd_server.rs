//! What an NBD server says to ferry's client (crates/nbd): its greeting,
//! a STARTTLS answer when the first byte says so, its answers to GO, then
//! a simple reply header; every byte hostile.
//!
//! Checks: no panic, no hang, no allocation past the option-reply limit;
//! an export that GO accepts is at most 2^63 bytes with sane block sizes;
//! a reply that decodes carries the magic of a simple reply.
#![no_main]

use std::io::{Cursor, Read, Write};

use ferry_nbd::{handshake, wire};
use libfuzzer_sys::fuzz_target;

/// The server's bytes; what the client writes is dropped.
struct Said(Cursor<Vec<u8>>);

impl Read for Said {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(b)
    }
}
impl Write for Said {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut s = Said(Cursor::new(rest.to_vec()));
    if handshake::greet(&mut s, "fuzz").is_err() {
        return;
    }
    if mode & 1 == 1 && handshake::starttls(&mut s, "fuzz").is_err() {
        return;
    }
    let Ok(info) = handshake::go(&mut s, "disk", mode & 1 == 1, "fuzz") else {
        return;
    };
    assert!(info.size <= i64::MAX as u64);
    if let Some((min, pref, _)) = info.block {
        assert!(min.is_power_of_two() && pref >= min);
    }
    let mut r = [0u8; 16];
    if s.read_exact(&mut r).is_ok() && wire::simple_reply(&r).is_ok() {
        assert_eq!(r[0..4], wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
    }
});
