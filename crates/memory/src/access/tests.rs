//! The tracker over real memfd memory: faults recorded, periods closed,
//! and (where userfaultfd MINOR faults exist here) sampled reads.

use super::*;
use crate::uffd::{Event, Features, RegisterMode, UffdError, Userfaultfd};
use std::sync::atomic::{AtomicBool, Ordering};

const PAGES: u64 = 2 * CHUNK_PAGES;

fn memory(pages: u64) -> Arc<GuestMemory> {
    let m = Arc::new(GuestMemory::new(&[(0, pages * PAGE_SIZE)]).unwrap());
    let r = &m.regions()[0];
    for p in 0..pages {
        // SAFETY: the first byte of page p < pages of the live mapping.
        unsafe {
            r.host_addr()
                .add((p * PAGE_SIZE) as usize)
                .write_volatile(p as u8 | 1)
        };
    }
    m
}

#[test]
fn a_fault_answers_for_its_group_and_sampling_arms_one_page_per_group() {
    let pages = 2 * CHUNK_PAGES;
    let m = memory(pages);
    let base = m.regions()[0].host_addr() as u64;
    assert!(matches!(
        AccessTracker::for_memory(&m, 2).unwrap().with_grain(48),
        Err(AccessError::BadGrain(48))
    ));
    let t = AccessTracker::for_memory(&m, 2)
        .unwrap()
        .with_grain(64)
        .unwrap();
    assert_eq!(t.grain(), 64);
    // Share 0 is the first 2 MiB chunk: 8 groups of 64, one page each.
    let mask = t.next_share_mask();
    assert_eq!(mask[0][..8], [u64::MAX; 8]);
    assert_eq!(mask[0][8..], [0; 8]);
    let report = t.arm_sampled().unwrap();
    assert_eq!((report.pages, report.runs), (8, 8));
    // A fault on page 70 marks pages 64..128 and hands them back.
    assert_eq!(
        t.record(base + 70 * PAGE_SIZE + 5),
        Some((base + 64 * PAGE_SIZE, 64 * PAGE_SIZE))
    );
    assert_eq!(t.record(0x10), None);
    // Writes count only inside the share armed last (pages 0..512):
    // page 3 counts, page 600's bit may be periods old and does not.
    let mut dirty = vec![0u64; (pages / 64) as usize];
    dirty[0] |= 1 << 3;
    dirty[600 / 64] |= 1 << (600 % 64);
    assert_eq!(t.end_period_sampled(&[dirty]), 64 + 1);
    let s = t.snapshot();
    assert_eq!(
        (s.clock[0][64], s.clock[0][127], s.clock[0][128]),
        (1, 1, 0)
    );
    assert_eq!((s.clock[0][3], s.clock[0][600]), (1, 0));
    // Unarmed since, the group keeps its sample; the next arm of its
    // share forgets it.
    assert_eq!(t.end_period(None), 65);
    t.arm_sampled().unwrap(); // share 1
    t.arm_sampled().unwrap(); // share 0 again
    assert_eq!(t.end_period(None), 0);
    assert_eq!(t.stats().grain_pages, 64);
}

#[test]
fn dirty_bitmaps_count_as_accesses_and_aging_shifts() {
    let m = memory(130);
    let t = AccessTracker::for_memory(&m, 4).unwrap();
    let dirty = |pages: &[u64]| {
        let mut words = vec![0u64; 3];
        for &p in pages {
            words[(p / 64) as usize] |= 1 << (p % 64);
        }
        vec![words]
    };
    assert_eq!(t.end_period(Some(&dirty(&[0, 65, 129]))), 3);
    assert_eq!(t.end_period(Some(&dirty(&[65]))), 1);
    assert_eq!(t.end_period(None), 0);
    let s = t.snapshot();
    assert_eq!(s.periods, 3);
    assert_eq!((s.clock[0][65], s.aging[0][65]), (0, 0b0110_0000));
    assert_eq!((s.clock[0][129], s.aging[0][129]), (0, 0b0010_0000));
    assert_eq!(s.aging[0][1], 0);
    assert_eq!(s.clock[0].len(), 130);
    // A fault outside the tracked memory is ignored.
    t.record(0x10);
    assert_eq!(t.stats().minor_faults_total, 0);
    assert!(matches!(
        // SAFETY: rejected before anything is mapped or advised.
        unsafe { AccessTracker::new(vec![(0x1001, 4096)], 1) },
        Err(AccessError::BadRegion { .. })
    ));
}

fn uffd() -> Option<Userfaultfd> {
    match Userfaultfd::new(Features {
        minor_shmem: true,
        ..Default::default()
    }) {
        Ok(u) => Some(u),
        Err(e @ (UffdError::Open { .. } | UffdError::MissingFeatures { .. })) => {
            eprintln!("SKIP: sampled-read test not run because access tracking needs userfaultfd MINOR faults on shmem: {e}");
            None
        }
        Err(e) => panic!("userfaultfd handshake: {e}"),
    }
}

/// Serves MINOR faults until stopped, as a VMM's tracking thread does.
fn serve(
    u: Arc<Userfaultfd>,
    t: Arc<AccessTracker>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut events = Vec::new();
        while !stop.load(Ordering::Acquire) {
            if !u.poll(Duration::from_millis(5)).unwrap() {
                continue;
            }
            let woke = Instant::now();
            events.clear();
            u.read_events(&mut events).unwrap();
            for ev in &events {
                let Event::PageFault {
                    addr, minor: true, ..
                } = *ev
                else {
                    panic!("unexpected event {ev:?}")
                };
                // Record before waking the reader, which may end the
                // period as soon as its read returns.
                t.record(addr);
                let page = addr & !(PAGE_SIZE - 1);
                match u.continue_range(page, PAGE_SIZE) {
                    Ok(_) | Err(UffdError::AlreadyMapped { .. }) => {}
                    Err(e) => panic!("continue: {e}"),
                }
                t.add_fault_cost(woke.elapsed().as_nanos() as u64);
            }
        }
    })
}

/// Reads the first byte of each page on another thread; fails rather
/// than hang if a fault is never served.
fn touch(m: &Arc<GuestMemory>, pages: &[u64]) {
    let (m2, pages) = (m.clone(), pages.to_vec());
    let h = std::thread::spawn(move || {
        let base = m2.regions()[0].host_addr();
        for p in pages {
            // SAFETY: page p of the live mapping, held by the Arc.
            let v = unsafe { base.add((p * PAGE_SIZE) as usize).read_volatile() };
            assert_eq!(v, p as u8 | 1, "page {p} keeps its data");
        }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while !h.is_finished() {
        assert!(
            Instant::now() < deadline,
            "a touched page stayed blocked 5 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    h.join().unwrap();
}

#[test]
fn sampled_reads_set_clock_and_aging() {
    let Some(u) = uffd() else { return };
    let m = memory(PAGES);
    let base = m.regions()[0].host_addr() as u64;
    let minor = RegisterMode {
        minor: true,
        ..Default::default()
    };
    if let Err(e) = u.register(base, PAGES * PAGE_SIZE, minor) {
        eprintln!("SKIP: this kernel cannot register memfd memory for MINOR faults: {e}");
        return;
    }
    let u = Arc::new(u);
    let t = Arc::new(AccessTracker::for_memory(&m, 2).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let server = serve(u.clone(), t.clone(), stop.clone());

    // Period 1: share 0 (the first chunk) is armed. Reads there fault;
    // reads of the other chunk (still mapped) do not.
    let arm = t.arm().unwrap();
    assert_eq!((arm.pages, arm.runs), (CHUNK_PAGES, 1));
    touch(&m, &[3, 100, 511, 600, 700]);
    assert_eq!(t.end_period(None), 3);
    let s = t.snapshot();
    for p in 0..PAGES as usize {
        let hit = [3, 100, 511].contains(&p);
        assert_eq!(s.clock[0][p], u8::from(hit), "clock of page {p}");
        assert_eq!(
            s.aging[0][p],
            if hit { 0x80 } else { 0 },
            "aging of page {p}"
        );
    }

    // Period 2: nothing armed; a write from the dirty log counts, and
    // the read pages keep their sample.
    let mut dirty = vec![vec![0u64; (PAGES / 64) as usize]];
    dirty[0][700 / 64] |= 1 << (700 % 64);
    assert_eq!(t.end_period(Some(&dirty)), 4);
    let s = t.snapshot();
    assert_eq!((s.clock[0][700], s.aging[0][700]), (1, 0x80));
    assert_eq!((s.clock[0][3], s.aging[0][3]), (1, 0xc0));
    assert_eq!((s.clock[0][600], s.aging[0][600]), (0, 0));

    // Period 3: share 1 is armed, but for 700, just written (so it
    // stays mapped and its read below raises no fault); 600 is read.
    let arm = t.arm().unwrap();
    assert_eq!((arm.pages, arm.skipped), (CHUNK_PAGES - 1, 1));
    touch(&m, &[600, 3, 700]);
    t.end_period(None);
    let s = t.snapshot();
    assert_eq!((s.clock[0][600], s.aging[0][600]), (1, 0x80));
    assert_eq!((s.clock[0][700], s.aging[0][700]), (0, 0x40));
    assert_eq!((s.clock[0][3], s.aging[0][3]), (1, 0xe0));

    // Period 4: share 0 again, untouched: its pages age out.
    t.arm().unwrap();
    t.end_period(None);
    let s = t.snapshot();
    assert_eq!((s.clock[0][3], s.aging[0][3]), (0, 0x70));
    assert_eq!((s.clock[0][600], s.aging[0][600]), (1, 0xc0));
    assert_eq!(s.periods, 4);

    stop.store(true, Ordering::Release);
    server.join().unwrap();
    let st = t.stats();
    assert_eq!(st.minor_faults_total, 4, "{st:?}");
    assert_eq!(
        (
            st.arms,
            st.pages_armed_total,
            st.pages_skipped_total,
            st.periods
        ),
        (3, 3 * CHUNK_PAGES - 1, 1, 4)
    );
    assert!(
        st.fault_service_us_total > 0.0 && st.arm_us_mean > 0.0,
        "{st:?}"
    );
    eprintln!("access tracker on {PAGES} pages: {st:?}");
}

/// Shares are taken in turn and wrap; the mask of the next one follows,
/// and a share count of 0 counts as 1 (everything armed every period).
#[test]
fn shares_rotate_and_the_next_mask_follows() {
    let m = memory(3 * CHUNK_PAGES);
    let t = AccessTracker::for_memory(&m, 3).unwrap();
    let words_per_chunk = (CHUNK_PAGES / 64) as usize;
    let mut order = Vec::new();
    for _ in 0..4 {
        let mask = t.next_share_mask();
        let first = mask[0].iter().position(|&w| w != 0).unwrap();
        assert!(mask[0][first..first + words_per_chunk]
            .iter()
            .all(|&w| w == u64::MAX));
        assert_eq!(mask[0].iter().filter(|&&w| w != 0).count(), words_per_chunk);
        let report = t.arm().unwrap();
        assert_eq!(
            (report.pages, report.skipped, report.runs),
            (CHUNK_PAGES, 0, 1)
        );
        let armed = t.lock().armed_share;
        assert_eq!(armed, Some((first / words_per_chunk) as u32));
        order.push(first / words_per_chunk);
    }
    assert_eq!(order, vec![0, 1, 2, 0]);

    let all = AccessTracker::for_memory(&m, 0).unwrap();
    assert_eq!(all.stats().share, 1);
    assert!(all.next_share_mask()[0].iter().all(|&w| w == u64::MAX));
    assert_eq!(all.arm().unwrap().pages, 3 * CHUNK_PAGES);
    assert_eq!(all.arm().unwrap().pages, 3 * CHUNK_PAGES, "and again");

    // A region smaller than its shares sits some of them out.
    let small = memory(100);
    let t = AccessTracker::for_memory(&small, 2).unwrap();
    assert_eq!(t.arm().unwrap().pages, 100);
    let idle = t.arm().unwrap();
    assert_eq!((idle.pages, idle.runs), (0, 0), "share 1 holds no page");
    assert_eq!(t.stats().arms, 2);
}

/// Means divide by what they average over (0, not NaN, before any), and
/// rates by tracked time, which leaves out a pause.
#[test]
fn stats_average_over_arms_and_faults_and_rate_over_tracked_time() {
    let m = memory(2 * CHUNK_PAGES);
    let base = m.regions()[0].host_addr() as u64;
    let t = AccessTracker::for_memory(&m, 2).unwrap();
    let s = t.stats();
    assert_eq!(
        (
            s.pages,
            s.share,
            s.grain_pages,
            s.arms,
            s.minor_faults_total
        ),
        (2 * CHUNK_PAGES, 2, 1, 0, 0)
    );
    assert_eq!(
        [
            s.pages_armed_per_arm,
            s.arm_us_mean,
            s.fault_service_us_mean,
            s.minor_faults_per_s,
            s.vcpu_time_lost_pct
        ],
        [0.0; 5]
    );

    t.arm().unwrap();
    t.arm().unwrap();
    assert!(t.record_timed(base + 5 * PAGE_SIZE, 3_000).is_some());
    assert!(t.record_timed(base + 600 * PAGE_SIZE, 5_000).is_some());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(t.end_period(None), 2);
    let s = t.stats();
    assert_eq!(
        (s.arms, s.pages_armed_total, s.pages_armed_per_arm),
        (2, 2 * CHUNK_PAGES, CHUNK_PAGES as f64)
    );
    assert!(
        s.arm_us_mean > 0.0 && 2.0 * s.arm_us_mean >= s.arm_us_last,
        "{s:?}"
    );
    assert_eq!(
        (s.minor_faults_total, s.accessed_last_period, s.periods),
        (2, 2, 1)
    );
    assert_eq!(
        (s.fault_service_us_total, s.fault_service_us_mean),
        (8.0, 4.0)
    );
    assert!(s.tracked_s >= 0.02, "{s:?}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    assert!(close(s.minor_faults_per_s, 2.0 / s.tracked_s), "{s:?}");
    assert!(
        close(s.vcpu_time_lost_pct, 100.0 * 8e-6 / s.tracked_s),
        "{s:?}"
    );

    // A pause the caller announces with restart_period is not tracked.
    std::thread::sleep(Duration::from_millis(200));
    t.restart_period();
    t.end_period(None);
    let after = t.stats();
    assert_eq!(after.periods, 2);
    assert!(after.tracked_s - s.tracked_s < 0.2, "{after:?}");
}
