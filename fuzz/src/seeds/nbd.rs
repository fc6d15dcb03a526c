//! What an NBD server says, for the `nbd_server` target: a greeting, the
//! answers to GO (and to STARTTLS), then a simple reply.

use ferry_nbd::wire;

use wire::server_option_reply as reply;

/// A server's whole transcript; `tls`: STARTTLS is answered first.
fn transcript(tls: bool, block: bool, error: u32) -> Vec<u8> {
    let mut b = vec![u8::from(tls)];
    b.extend_from_slice(&wire::NBDMAGIC.to_be_bytes());
    b.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES).to_be_bytes());
    if tls {
        b.extend(reply(wire::OPT_STARTTLS, wire::REP_ACK, &[]));
    }
    let mut export = vec![0, 0];
    export.extend_from_slice(&(64u64 << 20).to_be_bytes());
    export.extend_from_slice(&0x017du16.to_be_bytes());
    b.extend(reply(wire::OPT_GO, wire::REP_INFO, &export));
    if block {
        let mut sizes = vec![0, 3];
        for w in [512u32, 4096, 32 << 20] {
            sizes.extend_from_slice(&w.to_be_bytes());
        }
        b.extend(reply(wire::OPT_GO, wire::REP_INFO, &sizes));
    }
    b.extend(reply(wire::OPT_GO, wire::REP_ACK, &[]));
    b.extend_from_slice(&wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&1u64.to_be_bytes());
    b
}

pub(super) fn nbd_server() -> Vec<super::Seed> {
    let refused = {
        let mut b = transcript(false, false, 0);
        let cut = 1 + 18;
        b.truncate(cut);
        b.extend(reply(
            wire::OPT_GO,
            wire::REP_FLAG_ERROR | 6,
            b"no such export",
        ));
        b
    };
    vec![
        super::named("nbd_server", "plain", transcript(false, false, 0)),
        super::named("nbd_server", "tls_block_sizes", transcript(true, true, 5)),
        super::named("nbd_server", "refused", refused),
    ]
}
