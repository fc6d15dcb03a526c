//! A connection's first message: a Hello body from a stranger, read as a
//! destination, a memory server and a listener read it (`Conn::recv` of a
//! Hello frame, then `protocol::negotiate`).
//!
//! Checks: a decoded Hello re-encodes stably; a negotiated version is one
//! both sides speak, the highest such; a refusal means there is none.
#![no_main]

use ferry_fuzz::{frame, init, postcard_round_trip, Peer};
use ferry_migration::protocol::{self, Hello, Kind, VERSION_MAX, VERSION_MIN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    init();
    let (mut conn, peer) = Peer::connect(frame(Kind::Hello, data));
    let got = conn.recv::<Hello>(Kind::Hello);
    drop(conn);
    drop(peer);
    let Ok(hello) = got else {
        assert!(postcard_round_trip::<Hello>(data).is_none());
        return;
    };
    let again = postcard_round_trip::<Hello>(data).expect("decodes as it did");
    assert_eq!(again, hello);
    let lo = hello.version_min.max(VERSION_MIN);
    let hi = hello.version_max.min(VERSION_MAX);
    match protocol::negotiate(&hello) {
        Ok(v) => {
            assert!(lo <= v && v <= hi, "v{v} outside both ranges");
            assert_eq!(v, hi, "not the highest common version");
            assert!(!hello.role.link_name().is_empty());
        }
        Err(e) => {
            assert!(lo > hi, "refused a Hello with a common version: {e}");
            assert!(!e.to_string().is_empty());
        }
    }
});
