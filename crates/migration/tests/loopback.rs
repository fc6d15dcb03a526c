//! The engine on plain memory over loopback TCP and a Unix socket: no KVM
//! involved.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

mod common;

use common::fake_vm::FakeVm;
use ferry_migration::{
    Backend, ClientsAnswer, ClientsPlan, DestinationStats, Endpoint, GpaBytes, Listener,
    MigrateOptions, MigrationError, MigrationStats, OffsetBytes, Progress,
};

const PAGE: usize = 4096;

/// How the two sides are connected.
#[derive(Clone, Copy, Debug)]
enum Via {
    Tcp,
    Unix,
}

/// A destination listener and the endpoint a source dials.
fn listen(via: Via) -> (Listener, Endpoint) {
    let at = match via {
        Via::Tcp => "tcp:127.0.0.1:0".parse().unwrap(),
        Via::Unix => {
            static N: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "ferry-loopback-{}-{}.sock",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            Endpoint::Unix(path)
        }
    };
    let l = Listener::bind(&at).unwrap();
    let ep = l.endpoint();
    (l, ep)
}

fn migrate(
    vm: &FakeVm,
    to: &Endpoint,
    opts: &MigrateOptions,
    progress: &dyn Fn(&Progress),
) -> Result<MigrationStats, MigrationError> {
    ferry_migration::migrate(vm, to, opts, &Backend::cpu(), progress).map(common::done)
}

/// Migrates `src` into `dst`, which waits on `listener` (at `addr`), with
/// `opts`; both sides must succeed. Returns both sides' figures.
fn migrate_whole(
    src: &FakeVm,
    dst: &FakeVm,
    listener: &Listener,
    addr: &Endpoint,
    opts: &MigrateOptions,
) -> (MigrationStats, DestinationStats) {
    std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(dst, listener, Duration::from_secs(10)));
        let st = migrate(src, addr, opts, &|_| {}).unwrap();
        (st, d.join().unwrap().unwrap())
    })
}

/// Every region of `dst` holds what the same region of `src` holds.
fn assert_same_memory(src: &FakeVm, dst: &FakeVm) {
    for i in 0..src.regions.len() {
        assert!(src.bytes(i) == dst.bytes(i), "memory differs");
    }
}

/// Every third page stays zero; the others hold data.
fn filled(_: u64, i: usize) -> u8 {
    if (i / PAGE).is_multiple_of(3) {
        0
    } else {
        (i as u64).wrapping_mul(2654435761).to_le_bytes()[3]
    }
}

/// A source on filled memory whose VMM writes region 0's first page.
fn source(layout: &[(u64, u64)]) -> FakeVm {
    FakeVm::new(layout)
        .with_fill(filled)
        .with_host_written(vec![GpaBytes::new(layout[0].0, PAGE as u64)])
}

const LAYOUT: &[(u64, u64)] = &[(0, 64 * PAGE as u64), (0x10_0000, 200 * PAGE as u64)];

#[test]
fn precopy_moves_every_page_and_the_state() {
    common::secure();
    for via in [Via::Tcp, Via::Unix] {
        precopy_moves_every_page_and_the_state_via(via);
    }
}

fn precopy_moves_every_page_and_the_state_via(via: Via) {
    let src = source(LAYOUT).with_dirty_script(vec![vec![], vec![1, 2, 3], (0..40).collect()]);
    let dst = FakeVm::new(LAYOUT);
    // Garbage the destination must overwrite, including where the source has zeros.
    dst.fill(1, 0..LAYOUT[1].1 as usize, 0xee);
    let (listener, addr) = listen(via);
    let opts = MigrateOptions {
        streams: 3,
        downtime_ms: 0.0,
        max_rounds: 2,
        verify: true,
        ..Default::default()
    };
    let (stats, istats) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_same_memory(&src, &dst);
    assert_eq!(*dst.state.lock().unwrap(), b"vcpu state");
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            src.pauses.load(Ordering::SeqCst),
            src.resumes.load(Ordering::SeqCst)
        ),
        (1, 0)
    );
    assert_eq!(stats.verified_pages, 264);
    assert_eq!(istats.verified_pages, 264);
    // Round 0 sends 2/3 of the pages as data and 1/3 as zero ranges.
    assert_eq!(stats.rounds[0].pages + stats.rounds[0].zero_pages, 264);
    assert!(stats.rounds[0].zero_pages >= 80);
    assert!(
        stats.rounds.len() >= 3,
        "max_rounds 2 plus stop-and-copy: {:?}",
        stats.rounds.len()
    );
}

/// A page the guest wrote that no dirty log reported: the destination got
/// the old copy. The pause compares only what was sent with what landed
/// (they agree), so the VM starts there; then the source, hashing its
/// frozen memory against what it sent, fails the migration naming the page
/// and keeps the VM paused with all its memory.
#[test]
fn a_page_the_dirty_log_missed_fails_verification_after_the_switch() {
    common::secure();
    let src = source(LAYOUT)
        .with_dirty_script(vec![vec![], vec![1, 2, 3]])
        .with_unlogged_write(7);
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 1,
        verify: true,
        ..Default::default()
    };
    let (r, d) = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        (migrate(&src, &addr, &opts, &|_| {}), d.join().unwrap())
    });
    let e = r.unwrap_err();
    assert!(
        matches!(
            e,
            MigrationError::VerifyAfterSwitch { bad: 1, total: 264, first } if first == 7 * PAGE as u64
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("stays paused here"), "{e}");
    // What landed is what was sent: the destination verified and started.
    assert_eq!(d.unwrap().verified_pages, 264);
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            src.pauses.load(Ordering::SeqCst),
            src.resumes.load(Ordering::SeqCst)
        ),
        (1, 0),
        "the source never resumes a VM that runs at the destination"
    );
}

#[test]
fn zero_ranges_clear_only_pages_that_may_hold_data() {
    common::secure();
    let src = source(LAYOUT).with_dirty_script(vec![vec![], vec![5]]);
    // Page 5 holds one byte; the scripted dirtying flips it back to zero,
    // so a later round sends it as a zero range over a page round 0 wrote.
    src.fill(0, 5 * PAGE..6 * PAGE, 0);
    src.fill(0, 5 * PAGE..5 * PAGE + 1, 0xff);
    // The destination's VMM wrote region 1's pages 10..20 before the
    // migration; everything else reads as zeros.
    let dst = FakeVm::new(LAYOUT).with_nonzero(vec![
        vec![],
        vec![OffsetBytes::new(10 * PAGE as u64, 10 * PAGE as u64)],
    ]);
    dst.fill(1, 10 * PAGE..20 * PAGE, 0xee);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 2,
        verify: true,
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_same_memory(&src, &dst);
    assert!(
        stats.zero_pages >= 80,
        "zero ranges were sent: {}",
        stats.zero_pages
    );
    // Cleared: region 1's zero pages among 10..20 (12, 15, 18) and page 5.
    assert_eq!(dst.zeroed.load(Ordering::SeqCst), 4);
}

#[test]
fn a_mismatched_source_is_refused_untouched_and_the_destination_waits_for_the_right_one() {
    common::secure();
    let src = source(LAYOUT);
    let dst = FakeVm::new(&LAYOUT[..1]);
    let right = source(&LAYOUT[..1]);
    let (listener, addr) = listen(Via::Tcp);
    let before = src.bytes(0);
    let (err, stats) = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
        // The wrong source did not end the wait: the right one gets in.
        let st = migrate(&right, &addr, &MigrateOptions::default(), &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        (e, st)
    });
    assert!(err.to_string().contains("does not match"), "{err}");
    assert_eq!(src.pauses.load(Ordering::SeqCst), 0);
    assert!(src.bytes(0) == before);
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert!(stats.pages > 0);
    assert!(dst.bytes(0) == right.bytes(0));
}

#[test]
fn a_dead_destination_is_a_clear_error() {
    common::secure();
    let src = source(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    drop(listener);
    let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
    assert!(matches!(e, MigrationError::Connect { .. }), "{e}");
}

#[test]
fn auto_converge_throttles_a_guest_that_outruns_the_link() {
    common::secure();
    // The same 48 pages dirtied every round: the guest never lets up.
    let src = source(LAYOUT).with_dirty_script((0..8).map(|_| (0..48).collect()).collect());
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        downtime_ms: 0.0,
        max_rounds: 4,
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    let t = src.throttles.lock().unwrap().clone();
    assert_eq!(
        &t[..2],
        &[20, 30],
        "20% first, then 10% more per round: {t:?}"
    );
    assert!(stats.rounds.iter().any(|r| r.throttle_pct > 0));
    assert_same_memory(&src, &dst);
}

#[test]
fn bandwidth_limit_paces_the_copy() {
    common::secure();
    let src = source(LAYOUT);
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    // About 0.7 MiB of non-zero pages at 1 MiB/s.
    let opts = MigrateOptions {
        bandwidth: Some(1024.0 * 1024.0),
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    let r0 = &stats.rounds[0];
    assert!(
        r0.throughput < 1.3 * 1024.0 * 1024.0,
        "round 0 at {:.0} B/s",
        r0.throughput
    );
    assert!(
        stats.total_secs > 0.5,
        "paced copy took {:.3} s",
        stats.total_secs
    );
}

/// 3 blocks of 1024 pages and a small region, so batches spread over
/// streams and shards.
const BIG: &[(u64, u64)] = &[(0, 3000 * PAGE as u64), (0x100_0000, 64 * PAGE as u64)];

fn migrate_compressed(compress: &str, pipeline: bool) -> MigrationStats {
    migrate_compressed_via(compress, pipeline, Via::Tcp)
}

fn migrate_compressed_via(compress: &str, pipeline: bool, via: Via) -> MigrationStats {
    // Round after round the same pages change a little: xbzrle's case.
    let src = source(BIG).with_dirty_script(vec![
        (0..2000).step_by(7).collect(),
        (0..3000).step_by(5).collect(),
        (100..900).collect(),
    ]);
    let dst = FakeVm::new(BIG);
    dst.fill(0, 0..BIG[0].1 as usize, 0xee);
    let (listener, addr) = listen(via);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 3,
        verify: true,
        bandwidth: Some(4e9),
        compression: ferry_migration::CompressOptions {
            compress: compress.parse().unwrap(),
            pipeline,
            workers: 2,
            caches: ferry_codec::CacheSizes {
                xbzrle_bytes: 8 << 20,
                dedup_bytes: 1 << 20,
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {});
        let got = d.join().unwrap();
        let st = st.unwrap_or_else(|e| panic!("{compress} pipeline={pipeline}: {e}"));
        got.unwrap();
        st
    });
    for i in 0..src.regions.len() {
        assert!(
            src.bytes(i) == dst.bytes(i),
            "{compress} pipeline={pipeline}: memory differs"
        );
    }
    assert_eq!(stats.verified_pages, 3064);
    assert_eq!(stats.compression.pipeline, pipeline);
    stats
}

#[test]
fn every_codec_moves_memory_exactly_with_and_without_the_pipeline() {
    common::secure();
    for compress in ["rle", "xbzrle", "dedup", "lz4", "zstd:3", "auto"] {
        for pipeline in [true, false] {
            let st = migrate_compressed(compress, pipeline);
            if compress != "auto" {
                assert!(
                    st.compression.encoded_in > 0,
                    "{compress}: nothing went through the codec"
                );
            }
        }
    }
    // The compressed path over a Unix socket, too.
    migrate_compressed_via("zstd:3", true, Via::Unix);
    // xbzrle codes the re-sent pages as small deltas: dirty rounds shrink.
    let st = migrate_compressed("xbzrle", true);
    let resent: Vec<_> = st.rounds[1..].iter().filter(|r| r.pages > 0).collect();
    assert!(!resent.is_empty());
    for r in resent {
        assert!(
            r.encoded_out * 10 < r.encoded_in,
            "round {}: {} page bytes became {}",
            r.round,
            r.encoded_in,
            r.encoded_out
        );
    }
}

/// A destination that got everything but never confirms the start: the
/// source cannot know whether the VM runs there, so it keeps it paused
/// rather than risk two running copies.
#[test]
fn no_confirmation_after_complete_keeps_the_source_paused() {
    common::secure();
    let src = source(LAYOUT);
    let dst = FakeVm::new(LAYOUT).with_start_delay(Duration::from_millis(1500));
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        downtime_ms: 1000.0,
        timeout_ms: 500,
        ..Default::default()
    };
    let err = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &opts, &|_| {}).unwrap_err();
        let _ = d.join();
        e
    });
    assert!(matches!(err, MigrationError::InDoubt(_)), "{err}");
    assert!(err.to_string().contains("stays paused"), "{err}");
    assert_eq!(src.pauses.load(Ordering::SeqCst), 1);
    assert_eq!(
        src.resumes.load(Ordering::SeqCst),
        0,
        "resumed an in-doubt VM"
    );
}

fn with_clients(src: FakeVm) -> FakeVm {
    src.with_clients(ClientsPlan {
        ip: std::net::Ipv4Addr::new(10, 77, 0, 100),
        port: 7000,
        connections: 3,
    })
}

/// Protocol v5: a destination that takes the clients gets their checkpoint
/// before its vCPUs start, and the source reports them moved with the
/// destination's words. From v15 they come in the pause beside the state,
/// and are restored (parked) before Complete, while the destination still
/// receives.
#[test]
fn clients_move_when_the_destination_takes_them() {
    common::secure();
    let src = with_clients(source(LAYOUT));
    let dst = FakeVm::new(LAYOUT)
        .with_clients_answer(Ok(()))
        .with_telemetry();
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions::default();
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_eq!(*src.decided.lock().unwrap(), Some(ClientsAnswer::Move));
    assert_eq!(src.clients_saved.load(Ordering::SeqCst), 1);
    let (blob, started) = dst.restored_clients.lock().unwrap().clone().unwrap();
    assert_eq!(blob, b"checkpointed connections");
    assert_eq!(started, 0, "restored before the vCPUs started");
    assert_eq!(*dst.clients_restored_in.lock().unwrap(), Some("running"));
    assert!(stats.downtime_parts.clients > 0.0, "{stats:?}");
    let c = stats.clients.unwrap();
    assert!(c.moved);
    assert_eq!(c.detail, "3 connections restored");
}

/// A destination that refuses the clients: they stay (the source forwards
/// them), nothing is checkpointed, and the reason reaches the report.
#[test]
fn clients_stay_when_the_destination_refuses_them() {
    common::secure();
    let src = with_clients(source(LAYOUT));
    let dst =
        FakeVm::new(LAYOUT).with_clients_answer(Err("no interface for 10.77.0.100 here".into()));
    let (listener, addr) = listen(Via::Tcp);
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &MigrateOptions::default());
    assert_eq!(
        *src.decided.lock().unwrap(),
        Some(ClientsAnswer::Stay(
            "no interface for 10.77.0.100 here".into()
        ))
    );
    assert_eq!(src.clients_saved.load(Ordering::SeqCst), 0);
    assert!(dst.restored_clients.lock().unwrap().is_none());
    let c = stats.clients.unwrap();
    assert!(!c.moved);
    assert!(c.detail.contains("no interface"), "{}", c.detail);
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
}

/// A destination whose restore of the clients fails aborts at once (it
/// does not wait for its bulk streams to time out), and the source runs
/// the VM on: resumed once, never in doubt.
#[test]
fn a_failed_client_restore_aborts_at_once_and_the_source_resumes() {
    common::secure();
    let src = with_clients(source(LAYOUT));
    let dst = FakeVm::new(LAYOUT)
        .with_clients_answer(Ok(()))
        .with_failing_client_restore();
    let (listener, addr) = listen(Via::Tcp);
    let t = std::time::Instant::now();
    let err = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
        assert!(d.join().unwrap().is_err());
        e
    });
    assert!(err.is_peer_abort(), "{err}");
    assert!(
        err.to_string().contains("cannot restore its clients"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(src.resumes.load(Ordering::SeqCst), 1);
    assert_eq!(dst.started.load(Ordering::SeqCst), 0);
}

/// v15: State goes out as the pause begins and the destination restores
/// it before Complete (while still receiving); the VM runs with it.
#[test]
fn the_state_is_restored_while_the_last_round_arrives_not_after_complete() {
    common::secure();
    let src = source(LAYOUT);
    *src.state.lock().unwrap() = b"the source's vCPUs".to_vec();
    let dst = FakeVm::new(LAYOUT).with_telemetry();
    let (listener, addr) = listen(Via::Tcp);
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &MigrateOptions::default());
    assert_eq!(*dst.restored_in.lock().unwrap(), Some("running"));
    assert_eq!(*dst.state.lock().unwrap(), b"the source's vCPUs");
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert!(stats.state_bytes > 0, "{stats:?}");
    let parts = &stats.downtime_parts;
    let sum = parts.pause + parts.last_round + parts.save_state + parts.verify + parts.destination;
    assert!(
        (sum - stats.downtime_ms).abs() < 0.5,
        "the parts add up to the downtime: {parts:?} against {} ms",
        stats.downtime_ms
    );
}

/// A verified hybrid that converges checks its pages as a precopy does:
/// hashed as they go and land, compared after the VM ran there, memory not
/// hashed in the pause. (Found in a drain: hybrid moves with --verify
/// paused 40-62 ms hashing all of memory on both sides.)
#[test]
fn a_verified_hybrid_that_converges_hashes_nothing_in_its_pause() {
    common::secure();
    let src = source(LAYOUT);
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        mode: ferry_migration::Mode::Hybrid,
        verify: true,
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_same_memory(&src, &dst);
    assert!(stats.postcopy.is_none(), "converged: {}", stats.converged);
    assert!(stats.verified_pages > 0, "{stats:?}");
    let parts = &stats.downtime_parts;
    // Memory was checked after the VM ran there (a hybrid that hashed in
    // the pause never did this)...
    assert!(stats.verify_after_ms > 0.0, "{stats:?}");
    // ...and the pause only sent the digests of what went and landed.
    assert!(parts.verify < 1.0, "{parts:?}");
    assert!(parts.destination_verify < 1.0, "{parts:?}");
}

/// Both sides' live figures follow a migration to its end: the source
/// counted every page and the bytes of the VM, the connections were
/// metered, and both phases end in success.
#[test]
fn telemetry_follows_the_migration_on_both_sides() {
    common::secure();
    let src = source(LAYOUT).with_telemetry();
    let dst = FakeVm::new(LAYOUT).with_telemetry();
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        streams: 2,
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    let tel = src.telemetry.as_ref().unwrap();
    let s = tel.snapshot();
    assert_eq!(s.phase, "succeeded");
    assert_eq!(s.total_bytes, LAYOUT.iter().map(|r| r.1).sum::<u64>());
    // Round 0 counts every page, zero ranges included.
    assert!(s.processed_bytes >= 264 * PAGE as u64, "{s:?}");
    for name in ["control", "bulk0", "bulk1"] {
        assert!(
            s.links.iter().any(|(n, sent, _)| n == name && *sent > 0),
            "{name} metered: {s:?}"
        );
    }
    let events: Vec<String> = tel.take_events().into_iter().map(|e| e.what).collect();
    for what in ["open", "round", "started"] {
        assert!(events.iter().any(|e| e == what), "{what} in {events:?}");
    }
    let d = dst.telemetry.as_ref().unwrap().snapshot();
    assert_eq!(d.phase, "succeeded");
    // Which bulk stream carries a 1 MiB VM's few batches is up to timing:
    // the destination must have metered the pages on one of them.
    assert!(
        d.links
            .iter()
            .any(|(n, _, received)| n.starts_with("bulk") && *received > 0),
        "{d:?}"
    );
    assert!(stats.rounds.len() >= 2, "{}", stats.rounds.len());
}

/// What the VMM wrote itself goes in the last round, but its holes go as
/// zero ranges and are never read at the source: reading a hole of guest
/// memory allocates it (a service ring is mostly holes, and reading them
/// cost the pause 5 ms). The destination's copy is exact all the same.
#[test]
fn the_holes_of_what_the_vmm_wrote_are_never_read_in_the_pause() {
    common::secure();
    let ring = GpaBytes::new(LAYOUT[1].0, 8 * PAGE as u64);
    let src = FakeVm::new(LAYOUT)
        .with_holes()
        .with_fill(filled)
        .with_host_written(vec![ring]);
    // Pages 0, 3 and 6 of each region are holes (filled() is zero there).
    let has_data = |p: u64| src.regions[1].holds_data(p * PAGE as u64, PAGE as u64);
    assert!(!has_data(0) && !has_data(3) && !has_data(6) && has_data(1));
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Tcp);
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &MigrateOptions::default());
    assert!(
        !has_data(0) && !has_data(3) && !has_data(6),
        "a hole of the written range was read at the source"
    );
    assert!(stats.pages > 0, "{stats:?}");
    assert_same_memory(&src, &dst);
}

/// The fake VM does what its options say: filled pages are data and zero
/// pages holes, the dirty script runs its last list first and flips byte
/// 0, a guest that keeps writing changes byte 9 on every read of the dirty
/// log, and a discard clears and counts its pages.
#[test]
fn the_fake_vm_does_what_its_options_say() {
    common::secure();
    use ferry_migration::{GpaPages, MigratableVm, PageStore};
    let vm = FakeVm::new(LAYOUT)
        .with_holes()
        .with_fill(filled)
        .with_dirty_script(vec![vec![], vec![1, 63]])
        .with_guest_writing(vec![2], |b| b.wrapping_add(1));
    // Pages 0, 3, 6... of each region are holes.
    let data = MigratableVm::data_ranges(&vm, 0);
    assert_eq!(
        data[..2],
        [
            OffsetBytes::new(PAGE as u64, 2 * PAGE as u64),
            OffsetBytes::new(4 * PAGE as u64, 2 * PAGE as u64)
        ]
    );
    let before = vm.bytes(0);
    let round1 = vm.take_dirty().unwrap();
    assert_eq!(round1.len(), 2);
    assert_eq!(round1[0], vec![(1 << 1) | (1 << 2) | (1 << 63)]);
    assert!(round1[1].iter().all(|&w| w == 0));
    let after = vm.bytes(0);
    assert_eq!(after[PAGE], before[PAGE] ^ 0xff);
    assert_eq!(after[63 * PAGE], before[63 * PAGE] ^ 0xff);
    assert_eq!(after[2 * PAGE + 9], before[2 * PAGE + 9].wrapping_add(1));
    // Then the script's empty list, then nothing: only the guest writes.
    assert_eq!(vm.take_dirty().unwrap()[0], vec![1 << 2]);
    assert_eq!(vm.take_dirty().unwrap()[0], vec![1 << 2]);
    assert_eq!(
        vm.byte(2 * PAGE as u64, 9),
        before[2 * PAGE + 9].wrapping_add(3)
    );
    // A discard reads as zeros and leaves a hole.
    vm.discard(GpaPages::new(PAGE as u64, 2)).unwrap();
    assert_eq!(vm.zeroed.load(Ordering::SeqCst), 2);
    // (Asked before reading it: reading a memfd's hole fills it.)
    assert!(!vm.regions[0].holds_data(PAGE as u64, PAGE as u64));
    assert!(vm.bytes(0)[PAGE..3 * PAGE].iter().all(|&b| b == 0));
    assert!(vm.discard(GpaPages::new(63 * PAGE as u64, 2)).is_err());
}

/// Pages another VM on the destination's host holds go as references
/// (v14) and land whole; a page that VM changed after the offer misses,
/// and goes again (as data by the last round at the latest), so memory
/// still verifies page for page.
#[test]
fn pages_another_vm_holds_go_by_reference_and_a_changed_one_goes_again() {
    common::secure();
    // Page 5 of region 0 changes at the source after round 0 and changes
    // back after round 1 (byte 0 flipped twice): round 2 sends it as a
    // reference again, after the other VM wrote its copy.
    let sibling = FakeVm::new(LAYOUT).with_fill(filled);
    // The fill depends on the offset in a region only: page 5 of each
    // region holds the same content, and both copies change.
    let sib_page5: Vec<usize> = sibling
        .regions
        .iter()
        .map(|r| r.host_addr().wrapping_add(5 * PAGE) as usize)
        .collect();
    let src = source(LAYOUT)
        .with_dirty_script(vec![vec![], vec![], vec![5], vec![5]])
        .with_dirty_hooks(vec![
            None,
            None,
            Some(Box::new(move || {
                for &p in &sib_page5 {
                    // SAFETY: byte 100 of page 5 of one of the sibling's
                    // live regions (it outlives the migration below).
                    unsafe { *(p as *mut u8).add(100) ^= 1 };
                }
            })),
            None,
        ]);
    let dst = FakeVm::new(LAYOUT).with_sibling(&sibling);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 3,
        verify: true,
        ..Default::default()
    };
    let (stats, istats) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_same_memory(&src, &dst);
    assert_eq!(stats.verified_pages, 264);
    // 2/3 of the 264 pages hold data, and the sibling holds them all (some
    // alike: the offer has each content once); the source's VMM wrote its
    // first page as it was (the same content).
    let data_pages = 264 - 264 / 3;
    assert!(
        (1..=data_pages as u64).contains(&stats.shared_offered),
        "{stats:?}"
    );
    assert!(
        stats.rounds[0].pages <= 1,
        "round 0 sent data: {:?}",
        stats.rounds[0]
    );
    assert!(stats.shared_pages >= data_pages as u64, "{stats:?}");
    // Page 5 missed in round 2, and went as data in round 3.
    assert_eq!(stats.shared_missed, 1, "{stats:?}");
    assert_eq!(istats.shared_missed, stats.shared_missed);
    assert_eq!(
        istats.shared_pages + istats.shared_missed,
        stats.shared_pages
    );
    drop(sibling);
}

/// A destination that does not share offers nothing, and everything goes
/// as data as before.
#[test]
fn a_destination_that_does_not_share_gets_every_page_as_data() {
    common::secure();
    let src = source(LAYOUT);
    let dst = FakeVm::new(LAYOUT);
    let (listener, addr) = listen(Via::Unix);
    let opts = MigrateOptions {
        verify: true,
        ..Default::default()
    };
    let (stats, _) = migrate_whole(&src, &dst, &listener, &addr, &opts);
    assert_eq!((stats.shared_offered, stats.shared_pages), (0, 0));
    assert_eq!(stats.verified_pages, 264);
    assert!(src.bytes(0) == dst.bytes(0) && src.bytes(1) == dst.bytes(1));
}
