use super::*;
use crate::protocol::PAGE;
use crate::transport::{tls_pair, Stream};

/// Pushes 301 pages (one of them zero) over `(a, b)`; (sealed,
/// checksum holds) for each Pages frame read at `b`, whose pages must
/// hold what the source had.
fn pushed_frames(a: Stream, b: Stream, may_seal: bool) -> Vec<(bool, bool)> {
    let t = Some(Duration::from_secs(5));
    let mut conn = Conn::new(a, t).unwrap();
    let mut peer = Conn::new(b, t).unwrap();
    let byte_of = |i: usize| {
        if i / PAGE == 7 {
            0
        } else {
            (i % 241) as u8 | 1
        }
    };
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        while let Ok(h) = protocol::read_header(peer.reader()) {
            let mut body = vec![0u8; h.len as usize];
            std::io::Read::read_exact(peer.reader(), &mut body).unwrap();
            if h.kind == Kind::Pages {
                seen.push((h.sealed, crate::checksum::crc32c(&body) == h.crc));
                let (gpas, data) = protocol::decode_pages(&body).unwrap();
                for (gpa, page) in gpas.iter().zip(data.chunks_exact(PAGE)) {
                    let at = *gpa as usize;
                    let want: Vec<u8> = (at..at + PAGE).map(byte_of).collect();
                    assert!(page == &want[..], "page {gpa:#x} arrived changed");
                }
            }
        }
        seen
    });
    let n = 301u64;
    let mut mem: Vec<u8> = (0..n as usize * PAGE).map(byte_of).collect();
    // SAFETY: `mem` outlives the push and nothing else touches it.
    let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
    let out = SourcePages::new(regions, &[GpaPages::new(0, n)], 0, None, Instant::now())
        .sealing(may_seal);
    out.push(&mut conn).unwrap();
    assert_eq!(out.pushed_pages.load(Ordering::Relaxed), n - 1);
    assert_eq!(out.pushed_zero_pages.load(Ordering::Relaxed), 1);
    drop(conn);
    reader.join().unwrap()
}

#[test]
fn a_held_push_measures_its_rate_from_when_it_starts_sending() {
    // A push held for a while (a net copying first, `--push-delay`)
    // sends one batch once released: its governor measures that batch
    // over the time it took to send, not over the hold (which read as
    // a crawl, and capped the rest of the push to it).
    let n = 128u64;
    let mut mem = vec![1u8; n as usize * PAGE];
    // SAFETY: `mem` outlives the push and nothing else touches it.
    let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
    let out = SourcePages::new(regions, &[GpaPages::new(0, n)], 0, None, Instant::now())
        .yielding(1, None);
    out.net_copies.store(true, Ordering::Release);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut b, _) = l.accept().unwrap();
    let drain = std::thread::spawn(move || {
        std::io::copy(&mut b, &mut std::io::sink()).unwrap();
    });
    let mut conn = Conn::new(Stream::tcp(a), Some(Duration::from_secs(5))).unwrap();
    let hold = Duration::from_secs(2);
    std::thread::scope(|sc| {
        let pusher = sc.spawn(|| out.push(&mut conn));
        std::thread::sleep(hold);
        out.net_copies.store(false, Ordering::Release);
        pusher.join().unwrap().unwrap();
    });
    drop(conn);
    drain.join().unwrap();
    assert_eq!(out.pushed_pages.load(Ordering::Relaxed), n);
    let best = out.governor.as_ref().unwrap().best_rate();
    let over_the_hold = (n as usize * PAGE) as f64 / hold.as_secs_f64();
    // No rate window closed yet (0), or one over the sending alone.
    assert!(
        best == 0.0 || best > 4.0 * over_the_hold,
        "{best} B/s: the hold ({over_the_hold} B/s) was taken for sending time"
    );
    drop(mem);
}

#[test]
fn neighbours_go_only_with_requests_that_look_sequential() {
    let n = 4096u64;
    let mut mem = vec![0u8; n as usize * PAGE];
    // SAFETY: `mem` outlives `out` and nothing else touches it.
    let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
    let pending = [GpaPages::new(0, n)];
    // With room on the link (no governor holding the push back): every
    // request takes its ±8 unsent neighbours.
    let room = SourcePages::new(regions.clone(), &pending, 8, None, Instant::now());
    let mut w = Vec::new();
    room.window(2000, &mut w);
    w.sort_unstable();
    assert_eq!(w, (1992..=2008).collect::<Vec<_>>());
    // The link full: the push's governor caps it (a slow start does).
    let mut out = SourcePages::new(regions, &pending, 8, None, Instant::now());
    let g = Governor::for_push(1);
    let path = crate::governor::PathSample {
        srtt_us: 100,
        rttvar_us: 5,
        min_rtt_us: 100,
        receiver_limited: false,
        to_loopback: false,
    };
    g.observe(path, 0, Instant::now());
    assert!(g.capped());
    out.governor = Some(g);
    let window = |p: u64| {
        let mut w = Vec::new();
        out.window(p, &mut w);
        w.sort_unstable();
        w
    };
    // Requests far from the last few: alone.
    assert_eq!(window(2000), vec![2000]);
    assert_eq!(window(100), vec![100]);
    assert_eq!(window(3000), vec![3000]);
    // The page after one: alone still (a value across two pages).
    assert_eq!(window(101), vec![101]);
    assert_eq!(window(2999), vec![2999]);
    // The third of a scan (either way): with its unsent neighbours.
    assert_eq!(
        window(102),
        (94..=110)
            .filter(|&p| p != 100 && p != 101)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        window(2998),
        (2990..=3006)
            .filter(|&p| p != 2999 && p != 3000)
            .collect::<Vec<_>>()
    );
    // And on: the scan's next fault is past the window sent.
    assert_eq!(window(111), (111..=119).collect::<Vec<_>>());
    // Random again: alone; and next to a lone request, alone.
    assert_eq!(window(1500), vec![1500]);
    assert_eq!(window(2001), vec![2001]);
    drop((room, out));
    drop(mem);
}

#[test]
fn pushed_pages_go_sealed_over_a_link_that_seals_to_a_peer_that_reads_them() {
    let dir = std::env::temp_dir().join(format!("ferry-push-{}", std::process::id()));
    let (a, b) = tls_pair(&dir);
    let tls = pushed_frames(a, b, true);
    assert!(
        !tls.is_empty() && tls.iter().all(|&(sealed, _)| sealed),
        "{tls:?}"
    );
    let (a, b) = tls_pair(&dir);
    let old_peer = pushed_frames(a, b, false);
    assert!(
        !old_peer.is_empty() && old_peer.iter().all(|&f| f == (false, true)),
        "{old_peer:?}"
    );
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let plain = pushed_frames(Stream::unix(a), Stream::unix(b), true);
    assert!(
        !plain.is_empty() && plain.iter().all(|&f| f == (false, true)),
        "{plain:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pages_used_lately_are_pushed_before_the_rest() {
    let n = 1024u64;
    let mut mem = vec![0u8; n as usize * PAGE];
    // SAFETY: `mem` outlives `out` and nothing else touches it.
    let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
    // Pages 500.. 700 seen used (one period ago or eight), 600 already
    // sent at the switch (not pending), the rest never.
    let mut aging = vec![0u8; n as usize];
    for (p, age) in aging.iter_mut().enumerate().take(700).skip(500) {
        *age = if p % 2 == 0 { 0x80 } else { 0x01 };
    }
    let history = AccessHistory {
        clock: vec![vec![0; n as usize]],
        aging: vec![aging],
        periods: 8,
    };
    let pending = [
        GpaPages::new(0, 600),
        GpaPages::new(601 * PAGE as u64, n - 601),
    ];
    let out = SourcePages::new(regions.clone(), &pending, 0, None, Instant::now())
        .hot_first(Some(&history));
    let mut order = Vec::new();
    let mut batch = Vec::new();
    loop {
        out.next_batch(&mut batch);
        if batch.is_empty() {
            break;
        }
        order.extend_from_slice(&batch);
    }
    assert_eq!(order.len() as u64, n - 1, "every pending page once");
    let hot: Vec<u64> = (500..700).filter(|&p| p != 600).collect();
    assert_eq!(order[..hot.len()], hot[..], "the hot pages first");
    assert_eq!(out.hot_pages.load(Ordering::Relaxed), hot.len() as u64);
    // A fault's hint moves the pushers, inside the hot pages too.
    let out = SourcePages::new(regions.clone(), &pending, 0, None, Instant::now())
        .hot_first(Some(&history));
    out.hint.store(650, Ordering::Release);
    out.next_batch(&mut batch);
    assert_eq!(batch[..3], [650, 651, 652]);
    // No history, or one of another shape: address order.
    let other = AccessHistory {
        aging: vec![],
        ..history.clone()
    };
    for h in [None, Some(&other)] {
        let out = SourcePages::new(regions.clone(), &pending, 0, None, Instant::now()).hot_first(h);
        out.next_batch(&mut batch);
        assert_eq!(batch[..3], [0, 1, 2]);
    }
    drop(mem);
}
