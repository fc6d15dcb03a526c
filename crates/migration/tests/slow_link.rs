//! A round longer than the step timeout: on a slow link the source's first
//! round may take minutes, and says nothing on the control connection until
//! it ends. The destination must wait while pages keep arriving, and give
//! up only when nothing arrives on any connection for a whole timeout (a
//! 256 MiB VM over a shared 100 Mbit lab link failed at exactly 30 s
//! before: bench/results/disk-shared.md).

mod common;

use std::time::{Duration, Instant};

use common::fake_vm::FakeVm;
use ferry_migration::{Backend, Listener, MigrateOptions};

/// 8 MiB of pages that do not compress or repeat.
const LAYOUT: &[(u64, u64)] = &[(0, 8 << 20)];

#[test]
fn a_round_longer_than_the_timeout_is_waited_for_while_pages_arrive() {
    common::secure();
    let src = FakeVm::new(LAYOUT).with_fill(|gpa, i| {
        let x = (gpa + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (x >> 56) as u8 ^ i as u8
    });
    let dst = FakeVm::new(LAYOUT);
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let to = listener.endpoint();
    // 8 MiB at 2 MiB/s: round 0 takes ~4 s; both sides' step timeout is 1 s.
    let opts = MigrateOptions {
        streams: 1,
        max_rounds: 1,
        downtime_ms: 0.0,
        verify: true,
        bandwidth: Some(2.0 * 1024.0 * 1024.0),
        timeout_ms: 1000,
        ..Default::default()
    };
    let t = Instant::now();
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(1)));
        let st = ferry_migration::migrate(&src, &to, &opts, &Backend::cpu(), &|_| {});
        d.join()
            .unwrap()
            .expect("the destination waited out the long round");
        common::done(st.expect("the migration finished"))
    });
    assert!(
        t.elapsed() > Duration::from_secs(2),
        "the round was not long: {:?}",
        t.elapsed()
    );
    assert_eq!(stats.verified_pages, 2048);
    assert!(src.bytes(0) == dst.bytes(0), "memory differs");
}
