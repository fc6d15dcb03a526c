//! Registry records: what `ferry` reads back about other hosts, from
//! files in the embedded registry's directory (`embedded::Record` JSON)
//! or from etcd's range answer (`etcd::entries_of_range`: JSON with
//! base64 values of `HostEntry` JSON), then handed to the placement of a
//! split VM (`placement::place`).
//!
//! The first byte picks the source (a file, or an etcd answer); the rest
//! is the record's bytes, then the placement's request.
//!
//! Checks: a decoded record writes back as JSON that reads as the same
//! record; a placement puts every chunk somewhere: on the main host, or
//! on `replicas` distinct memory servers that have the room, never over a
//! server's free space, and the main host is a VMM from the records.
#![no_main]

use ferry_fuzz::Input;
use ferry_registry::embedded::Record;
use ferry_registry::placement::{place, Request};
use ferry_registry::{HostEntry, HostKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    ferry_fuzz::init();
    let mut input = Input::new(bytes);
    let from_etcd = input.bool();
    let record = input.chunk();
    let hosts: Vec<HostEntry> = if from_etcd {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(record) else {
            return;
        };
        match ferry_registry::etcd::entries_of_range(&v) {
            Ok(h) => h,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        }
    } else {
        let mut hosts = Vec::new();
        for line in record.split(|&b| b == b'\n') {
            if let Ok(r) = serde_json::from_slice::<Record>(line) {
                let text = serde_json::to_vec(&r).expect("writes");
                let again: Record = serde_json::from_slice(&text).expect("reads back");
                assert_eq!(again.entry, r.entry);
                hosts.push(r.entry);
            }
        }
        hosts
    };
    for h in &hosts {
        let text = serde_json::to_vec(h).expect("writes");
        let again: HostEntry = serde_json::from_slice(&text).expect("reads back");
        assert_eq!(&again, h);
    }
    let chunk_bytes = 1 + u64::from(input.u32());
    let req = Request {
        chunks: u64::from(input.u16()),
        chunk_bytes,
        main: None,
        main_budget: input.bool().then(|| input.u64()),
        replicas: u32::from(input.u8() % 4),
    };
    let Ok(p) = place(&hosts, &req) else { return };
    // The main host is a VMM record (names need not be unique in a
    // hostile registry: any record of that name, address and kind).
    let main_free = hosts
        .iter()
        .filter(|h| h.kind == HostKind::Vmm && h.name == p.main_name && h.addr == p.main_addr)
        .map(|h| h.free)
        .max()
        .expect("the main host is a VMM of the records");
    assert!(p.main_chunks <= req.chunks);
    assert!(p.main_chunks.saturating_mul(chunk_bytes) <= main_free);
    let replicas = u64::from(req.replicas.max(1));
    let on_servers: u64 = p.subs.iter().map(|s| s.chunks).sum();
    assert_eq!(
        on_servers,
        (req.chunks - p.main_chunks) * replicas,
        "chunks lost or doubled"
    );
    for s in &p.subs {
        assert!(
            hosts.iter().any(|h| h.kind == HostKind::Memserver
                && h.name == s.name
                && h.addr == s.addr
                && h.free / chunk_bytes >= s.chunks),
            "{} holds {} chunks, more than a server of the records has room for",
            s.name,
            s.chunks
        );
    }
});
