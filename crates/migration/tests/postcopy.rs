//! Postcopy and hybrid on plain memory over loopback: the destination's
//! memory is memfd under real userfaultfd, and its "vCPUs" are threads that
//! touch every page in random order as soon as the VM starts (writing some
//! of them), so every page is either fetched on demand or pushed.

mod common;

use common::postcopy_rig::*;
use ferry_migration::{MigrateOptions, Mode, PostcopyAfter};

#[test]
fn a_postcopy_link_cut_midway_reconnects_and_loses_nothing() {
    common::secure();
    if !uffd_usable() {
        return;
    }
    let opts = MigrateOptions {
        mode: Mode::Postcopy,
        verify: true,
        reconnect_timeout_ms: 10_000,
        ..Default::default()
    };
    // ~2.5 MB of pending pages: the cut comes in the middle of them.
    let (stats, _, _) = run_through(&opts, Some(Cut::After(1 << 20)));
    let p = stats.postcopy.unwrap();
    eprintln!("cut and reconnected: {p:?}");
    // Whichever epoch brought it, each pending page landed once.
    assert_eq!(p.faults.supplied_pages, p.pending_pages);
    assert!(p.paused_s > 0.0);
}

#[test]
fn postcopy_moves_memory_on_demand_with_and_without_prefetch() {
    common::secure();
    if !uffd_usable() {
        return;
    }
    for prefetch in [0, 8] {
        let opts = MigrateOptions {
            mode: Mode::Postcopy,
            prefetch,
            verify: true,
            // With prefetch, the push waits: otherwise on a busy host it
            // could send every page before the first fault asks for one,
            // leaving nothing to prefetch (it did, about once in 50 runs).
            push_delay_ms: if prefetch > 0 { 5_000 } else { 0 },
            ..Default::default()
        };
        let (stats, _, _) = run(&opts);
        let p = stats.postcopy.unwrap();
        let f = &p.faults;
        eprintln!("prefetch {prefetch}: {p:?}");
        // Data pages are pending; zero pages (holes) never travel.
        let holes = 512u64.div_ceil(5) + 256u64.div_ceil(5);
        assert_eq!(p.pending_pages, 768 - holes, "{p:?}");
        assert_eq!(p.pushed_zero_pages, 0);
        assert!(f.major > 0 && f.zero > 0, "{f:?}");
        assert_eq!(f.faults, f.major + f.minor + f.zero + f.duplicate);
        assert_eq!(f.vcpu_thread + f.async_worker + f.host, f.faults, "{f:?}");
        assert!(
            f.vcpu_thread > 0 && f.async_worker == 0 && f.blocked == f.vcpu_thread,
            "only the two threads faulted: {f:?}"
        );
        assert_eq!(
            f.supplied_pages, p.pending_pages,
            "each pending page landed once"
        );
        // A request per page waited for, unless its landing had begun.
        assert!(
            p.requests > 0 && p.requests <= f.major,
            "{} requests, {} major",
            p.requests,
            f.major
        );
        if prefetch == 0 {
            assert_eq!(p.prefetched_pages, 0);
        } else {
            assert!(p.prefetched_pages > 0);
        }
        assert!(f.latency_us.count == f.major && f.latency_us.p50 > 0.0);
        assert!(!f.series.is_empty());
    }
}

/// Hybrid that never converges (no downtime allowed) and switches after
/// two dirty rounds, verified.
fn hybrid_after_two_rounds() -> MigrateOptions {
    MigrateOptions {
        mode: Mode::Hybrid,
        downtime_ms: 0.0,
        postcopy_after: PostcopyAfter::Rounds(2),
        verify: true,
        ..Default::default()
    }
}

#[test]
fn hybrid_switches_to_postcopy_when_precopy_does_not_converge() {
    common::secure();
    if !uffd_usable() {
        return;
    }
    let opts = hybrid_after_two_rounds();
    let (stats, _, _) = run(&opts);
    assert_eq!(stats.rounds.len(), 3, "the full copy and two dirty rounds");
    assert!(
        stats.converged.contains("switched to postcopy"),
        "{}",
        stats.converged
    );
    let p = stats.postcopy.unwrap();
    // The pages dirtied in the last round.
    assert_eq!(p.pending_pages, 100);
}

#[test]
fn a_hybrid_switch_has_the_destination_drop_dirtied_pages_ahead_of_the_pause() {
    common::secure();
    if !uffd_usable() {
        return;
    }
    let opts = hybrid_after_two_rounds();
    // 350 pages dirtied every round: enough to drop ahead (the run's
    // checks then find every page the source's, so none dropped ahead was
    // left stale, and none came twice).
    let (stats, src, _) = run_from(source_writing((100..450).collect()), &opts, None);
    assert!(stats.converged.contains("switched to postcopy"));
    // Switched off once the VM ran there (outside the pause), not left on.
    assert!(!src.dirty_log_on.load(std::sync::atomic::Ordering::SeqCst));
    let p = stats.postcopy.unwrap();
    assert_eq!(p.pending_pages, 350, "{p:?}");
    // Dropped ahead; the pause's own harvest found the same pages again,
    // so it had nothing left to drop.
    assert_eq!(p.dropped_ahead_pages, 350, "{p:?}");
    assert_eq!(p.faults.supplied_pages, p.pending_pages);
}

#[test]
fn a_held_push_leaves_the_pages_to_demand_and_ends_once_nothing_is_left() {
    common::secure();
    if !uffd_usable() {
        return;
    }
    let opts = MigrateOptions {
        mode: Mode::Postcopy,
        push_delay_ms: 5_000,
        verify: true,
        ..Default::default()
    };
    let (stats, _, _) = run(&opts);
    let p = stats.postcopy.unwrap();
    eprintln!("push held: {p:?}");
    // The "vCPUs" touch every page long before the hold ends: all of them
    // came by demand, and the pushers gave up waiting once none was left.
    assert_eq!(p.pushed_pages + p.pushed_zero_pages, 0, "{p:?}");
    // (A page asked for twice goes twice: the second copy is dropped.)
    assert!(p.demand_pages >= p.pending_pages, "{p:?}");
    assert_eq!(p.faults.supplied_pages, p.pending_pages);
    assert!(
        p.secs < 4.0,
        "the held pushers did not wait out the hold: {p:?}"
    );
}
