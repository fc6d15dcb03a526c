//! The userfaultfd page sink on real memfd memory: threads fault on pages
//! while other threads land them, and every page arrives whole, exactly
//! once. Skips loudly where userfaultfd is not available.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_memory::{Features, MemfdRegion, RegisterMode, UffdError, Userfaultfd};
use ferry_migration::sink::{already_mapped, LandPolicy, PageSink, Placed, UffdPlacer, UffdSink};
use ferry_migration::transport::{Conn, Stream};
use ferry_migration::{GpaPages, OffsetBytes, RegionView};

const PAGE: u64 = 4096;
const PAGES: u64 = 512;
const BASE: u64 = 0x10_0000;

fn uffd() -> Option<Arc<Userfaultfd>> {
    match Userfaultfd::new(Features {
        missing_shmem: true,
        ..Default::default()
    }) {
        Ok(u) => Some(Arc::new(u)),
        Err(e @ (UffdError::Open { .. } | UffdError::MissingFeatures { .. })) => {
            eprintln!("SKIP: userfaultfd unavailable here: {e}");
            None
        }
        Err(e) => panic!("userfaultfd handshake: {e}"),
    }
}

/// Page i's content: every fifth page is zero, the others say who they are.
fn content(i: u64) -> Vec<u8> {
    if i.is_multiple_of(5) {
        return vec![0; PAGE as usize];
    }
    (0..PAGE)
        .map(|b| ((i * 131 + b * 7) % 251 + 1) as u8)
        .collect()
}

/// A registered region and a view of it.
fn region(u: &Userfaultfd) -> (Arc<MemfdRegion>, RegionView) {
    let r = Arc::new(MemfdRegion::new("uffd-sink", BASE, PAGES * PAGE).unwrap());
    u.register(
        r.host_addr() as u64,
        PAGES * PAGE,
        RegisterMode {
            missing: true,
            ..Default::default()
        },
    )
    .unwrap();
    // SAFETY: the Arc'd region outlives every use of the view in this test.
    let view = unsafe { RegionView::new(BASE, PAGES * PAGE, r.host_addr()) };
    (r, view)
}

/// A run of pages with their contents.
fn run_data(first: u64, n: u64) -> Vec<u8> {
    (first..first + n).flat_map(content).collect()
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn join_within<T>(h: std::thread::JoinHandle<T>, what: &str) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !h.is_finished() {
        assert!(
            Instant::now() < deadline,
            "{what} still blocked after 20 s: a page was lost"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    h.join().unwrap()
}

#[test]
fn pages_land_while_threads_fault_on_them() {
    let Some(u) = uffd() else { return };
    let (mem, view) = region(&u);
    let sink = Arc::new(UffdSink::new(
        u.clone(),
        vec![view],
        &[vec![]],
        LandPolicy::KeepFirst,
    ));

    // The fault thread reads the events, as postcopy's would (it does not
    // resolve them: landing a page wakes whoever waits on it).
    let stop = Arc::new(AtomicBool::new(false));
    let faults = Arc::new(AtomicU64::new(0));
    let fault_thread = {
        let (u, stop, faults) = (u.clone(), stop.clone(), faults.clone());
        std::thread::spawn(move || {
            let mut ev = Vec::new();
            while !stop.load(Ordering::Acquire) {
                if u.poll(Duration::from_millis(20)).unwrap() {
                    ev.clear();
                    faults.fetch_add(u.read_events(&mut ev).unwrap() as u64, Ordering::Relaxed);
                }
            }
        })
    };
    // Two threads touch every page in their own random order and check
    // what they read: a page is either missing (they wait) or whole.
    let touchers: Vec<_> = (0..2u64)
        .map(|t| {
            let mem = mem.clone();
            std::thread::spawn(move || {
                let mut order: Vec<u64> = (0..PAGES).collect();
                let mut x = 0x1234_5678 + t;
                for i in (1..order.len()).rev() {
                    order.swap(i, (xorshift(&mut x) % (i as u64 + 1)) as usize);
                }
                let mut wrong = 0;
                for p in order {
                    let at = (p * PAGE + 8 * (p % 500)) as usize;
                    // SAFETY: inside the Arc'd mapping; a volatile read,
                    // because another thread fills the page.
                    let got = unsafe { mem.host_addr().add(at).cast::<u64>().read_volatile() };
                    let want = u64::from_le_bytes(
                        content(p)[at % PAGE as usize..][..8].try_into().unwrap(),
                    );
                    wrong += u64::from(got != want);
                }
                wrong
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    // Two landers deliver runs of 1-16 pages in random order, zero pages as
    // zero ranges, each page exactly once.
    let mut runs = Vec::new();
    let mut x = 0x9e37_79b9u64;
    let mut p = 0;
    while p < PAGES {
        let n = (xorshift(&mut x) % 16 + 1).min(PAGES - p);
        runs.push((p, n));
        p += n;
    }
    for i in (1..runs.len()).rev() {
        runs.swap(i, (xorshift(&mut x) % (i as u64 + 1)) as usize);
    }
    let landers: Vec<_> = (0..2usize)
        .map(|k| {
            let sink = sink.clone();
            let mine: Vec<(u64, u64)> = runs.iter().copied().skip(k).step_by(2).collect();
            std::thread::spawn(move || {
                for (first, n) in mine {
                    for q in first..first + n {
                        let page = GpaPages::new(BASE + q * PAGE, 1);
                        if q.is_multiple_of(5) {
                            sink.zero(page).unwrap();
                        } else {
                            sink.write(page, &content(q)).unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for l in landers {
        join_within(l, "a lander");
    }
    for t in touchers {
        assert_eq!(
            join_within(t, "a faulting thread"),
            0,
            "a thread read a wrong page"
        );
    }
    stop.store(true, Ordering::Release);
    fault_thread.join().unwrap();

    let st = sink.stats();
    assert_eq!(st.copied + st.zero_filled, PAGES, "{st:?}");
    assert_eq!(st.zero_filled, PAGES.div_ceil(5), "{st:?}");
    assert_eq!(
        (st.overwritten, st.kept),
        (0, 0),
        "no page written twice: {st:?}"
    );
    assert_eq!(sink.missing_pages(), 0);
    assert!(faults.load(Ordering::Relaxed) > 0, "the touchers faulted");
    let mut all = vec![0u8; (PAGES * PAGE) as usize];
    assert!(view.read(BASE, &mut all));
    assert!(all == run_data(0, PAGES), "memory differs");

    // Landing everything again keeps what is there: the guest wrote page 3
    // after it arrived, and a late duplicate must not undo that.
    assert!(view.write(BASE + 3 * PAGE, &[0xaa; 16]));
    sink.write(GpaPages::new(BASE, PAGES), &run_data(0, PAGES))
        .unwrap();
    let st2 = sink.stats();
    assert_eq!(st2.kept, PAGES);
    assert_eq!(st2.copied, st.copied);
    let mut head = [0u8; 16];
    assert!(view.read(BASE + 3 * PAGE, &mut head));
    assert_eq!(head, [0xaa; 16], "a duplicate overwrote the guest's write");

    // Overwrite (precopy rounds into registered memory) writes present pages again.
    let again = UffdSink::new(
        u.clone(),
        vec![view],
        &[vec![OffsetBytes::new(0, PAGES * PAGE)]],
        LandPolicy::Overwrite,
    );
    again
        .write(GpaPages::new(BASE + 3 * PAGE, 1), &content(3))
        .unwrap();
    assert!(view.read(BASE + 3 * PAGE, &mut head));
    assert_eq!(head[..], content(3)[..16]);
    assert_eq!(again.stats().overwritten, 1);
    assert!(
        again
            .write(GpaPages::new(BASE + PAGES * PAGE, 1), &content(1))
            .is_err(),
        "outside the region"
    );
}

#[test]
fn a_corrupt_frame_never_lands_in_registered_memory() {
    let Some(u) = uffd() else { return };
    let (_mem, view) = region(&u);
    let sink = UffdSink::new(u.clone(), vec![view], &[vec![]], LandPolicy::KeepFirst);
    let gpas = [BASE, BASE + PAGE, BASE + 7 * PAGE];
    let data: Vec<u8> = [1u64, 2, 7].iter().flat_map(|&i| content(i)).collect();
    let body = ferry_migration::protocol::encode_pages(&gpas, &data);
    let mut frame = Vec::new();
    ferry_migration::protocol::write_frame(
        &mut frame,
        ferry_migration::protocol::Kind::Pages,
        &body,
    )
    .unwrap();
    let land = |bytes: &[u8]| {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(bytes).unwrap();
        drop(a);
        let conn = Conn::new(Stream::unix(b), None).unwrap();
        let (mut r, _) = conn.into_parts();
        let h = ferry_migration::protocol::read_header(&mut r).unwrap();
        let (mut s1, mut s2) = (Vec::new(), Vec::new());
        ferry_migration::fuzzing::read_pages(&mut r, &h, &[view], &sink, &mut s1, &mut s2)
    };
    let mut bad = frame.clone();
    *bad.last_mut().unwrap() ^= 1;
    let e = land(&bad).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    assert_eq!(sink.stats().copied, 0, "nothing of a corrupt frame landed");
    assert_eq!(land(&frame).unwrap(), 3);
    assert_eq!(sink.stats().copied, 3);
    assert!(sink.is_present(BASE + 7 * PAGE) && !sink.is_present(BASE + 2 * PAGE));
}

#[test]
fn the_placer_copies_runs_leaves_present_pages_and_zero_fills_only_holes() {
    let Some(u) = uffd() else { return };
    let (_mem, view) = region(&u);
    let placer = UffdPlacer::new(u.clone(), vec![view]);
    // Pages 1 and 3 are there first: a run over them goes page by page
    // (after the kernel stops at the first present page) and leaves them.
    for i in [1, 3] {
        placer
            .copy(GpaPages::new(BASE + i * PAGE, 1), &content(i), true)
            .unwrap();
    }
    let gpas: Vec<u64> = (1..6).map(|i| BASE + i * PAGE).collect();
    let mut data = run_data(1, 5);
    data[0] ^= 0xff; // different pages 1 and 3: must not land
    data[2 * PAGE as usize] ^= 0xff;
    let placed = placer.copy_pages(&gpas, &data, true).unwrap();
    assert_eq!(placed, Placed { new: 3, present: 2 });
    // A run whose prefix goes in before a present page (EAGAIN) completes.
    placer
        .copy(GpaPages::new(BASE + 12 * PAGE, 1), &content(12), true)
        .unwrap();
    let gpas: Vec<u64> = (10..14).map(|i| BASE + i * PAGE).collect();
    let placed = placer.copy_pages(&gpas, &run_data(10, 4), true).unwrap();
    assert_eq!(placed.new + placed.present, 4);
    let mut got = vec![0u8; (4 * PAGE) as usize];
    assert!(view.read(BASE + 10 * PAGE, &mut got));
    assert_eq!(got, run_data(10, 4));
    let again = placer
        .copy(GpaPages::new(BASE + 2 * PAGE, 1), &content(2), true)
        .unwrap_err();
    assert!(already_mapped(&again), "{again}");
    // Zeros only where the kernel has no page.
    let z = placer.zero_missing(GpaPages::new(BASE, 8)).unwrap();
    assert_eq!(z.new + z.present, 8);
    assert!(z.new >= 2, "{z:?}");
    let mut got = vec![0u8; (8 * PAGE) as usize];
    assert!(view.read(BASE, &mut got));
    let mut want = vec![0u8; PAGE as usize];
    want.extend(run_data(1, 5));
    want.extend(vec![0u8; 2 * PAGE as usize]);
    assert_eq!(got, want, "page 3 kept its first copy, holes read zero");
    // Outside guest RAM and a short buffer are refused, not placed.
    assert!(placer
        .copy_pages(&[BASE + PAGES * PAGE], &content(1), true)
        .is_err());
    assert!(placer
        .copy_pages(&[BASE + 9 * PAGE], &[0u8; 10], true)
        .is_err());
}
