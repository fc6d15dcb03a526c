//! A memory layout from a peer: the Layout a source announces (checked
//! against the waiting VM's) and the regions of a StoreOpen, which a memory
//! server makes a store of (`VmStore::new`: sparse memfds and a bitmap).
//!
//! Checks: a decoded Layout re-encodes stably; a store is made only of a layout a VM can have
//! (1 to 16 regions, page-aligned, not empty), takes that shape, holds
//! nothing, and knows each of its pages and none outside.
#![no_main]

use ferry_fuzz::{frame, init, postcard_round_trip, Peer};
use ferry_migration::memserver::store::Capacity;
use ferry_migration::memserver::VmStore;
use ferry_migration::protocol::{Kind, Layout};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    init();
    let (mut conn, peer) = Peer::connect(frame(Kind::Layout, data));
    let got = conn.recv::<Layout>(Kind::Layout);
    drop(conn);
    drop(peer);
    let Ok(layout) = got else { return };
    postcard_round_trip::<Layout>(data).expect("decodes as it did");

    // The destination's check (session/destination.rs) is equality with
    // its own layout: nothing to reach beyond the decode.

    // A memory server's store of it.
    let secret = ferry_migration::memserver::StoreSecret([0; 32]);
    let Ok(store) = VmStore::new("fuzz", &layout.regions, Capacity::new(1 << 20), secret) else {
        return;
    };
    let regions = &layout.regions;
    assert!(!regions.is_empty() && regions.len() <= 16);
    assert!(regions
        .iter()
        .all(|&(g, s)| s > 0 && g % 4096 == 0 && s % 4096 == 0));
    assert_eq!(store.layout(), *regions);
    assert_eq!(store.held(), 0);
    for &(g, s) in regions {
        let mut page = vec![0u8; 4096];
        // First and last page: inside, not held.
        assert!(!store.holds(g));
        assert!(!store.read_page(g + s - 4096, &mut page));
    }
    assert!(store.held_runs().is_empty());
});
