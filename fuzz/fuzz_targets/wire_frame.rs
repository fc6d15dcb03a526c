//! Frames off the wire: the bytes a peer sends, read through the engine's
//! own connection (`Conn::read_frame`: header checks, then body and
//! checksum) until it refuses or the stream ends.
//!
//! Checks: reading the same bytes from memory (`protocol::read_frame`)
//! gives the same frames and the same refusal; every frame read
//! re-encodes to exactly the bytes it came from (the header's `flags`
//! aside, which the reader does not check yet).
#![no_main]

use ferry_fuzz::{init, Peer};
use ferry_migration::protocol::{self, Frame, HEADER};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    init();
    let (mut conn, peer) = Peer::connect(data.to_vec());
    let mut frames: Vec<Frame> = Vec::new();
    let end = loop {
        match conn.read_frame() {
            Ok(f) => frames.push(f),
            Err(e) => break e.to_string(),
        }
    };
    drop(conn);
    drop(peer);

    // The same bytes from memory.
    let mut r = data;
    let mut from_memory = Vec::new();
    let end_memory = loop {
        match protocol::read_frame(&mut r) {
            Ok(f) => from_memory.push(f),
            Err(e) => break e.to_string(),
        }
    };
    assert_eq!(frames, from_memory, "a socket and memory read differently");
    assert_eq!(end, end_memory, "a socket and memory end differently");

    // Each frame is the bytes it came from.
    let mut at = 0;
    for f in &frames {
        let wire = ferry_fuzz::frame(f.kind, &f.body);
        let mut came = data[at..at + wire.len()].to_vec();
        came[6..8].fill(0); // flags
        assert_eq!(came, wire, "a frame does not re-encode to its bytes");
        at += HEADER + f.body.len();
    }
});
