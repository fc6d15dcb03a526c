//! Split migration on plain memory over loopback: a source whose access
//! history marks some chunks hot moves to a main host (memfd under real
//! userfaultfd) holding a quarter of its memory, and two memory servers
//! holding the rest. After the switch a "vCPU" thread reads every page and
//! writes some, twice over, so chunks are paged in and out many times;
//! every byte must be the source's, every write must survive page-out and
//! page-in, and the main host must stay within its budget.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fake_vm::FakeVm;
use ferry_migration::memserver::MemServer;
use ferry_migration::{
    AccessHistory, Backend, Endpoint, Listener, MigrateOptions, MigrationStats, Mode, Rank,
    SplitOptions,
};

const PAGE: usize = 4096;
const LAYOUT: &[(u64, u64)] = &[(0, 1024 * PAGE as u64), (0x1_0000_0000, 512 * PAGE as u64)];
const CHUNK: u32 = 16;

/// Byte `i` of the region at `base`: every third page stays zero (a hole).
fn content(base: u64, i: usize) -> u8 {
    let gpa = base + (i / PAGE * PAGE) as u64;
    if (gpa / PAGE as u64).is_multiple_of(3) {
        0
    } else {
        (gpa >> 12) as u8 ^ ((i % PAGE) as u8).wrapping_mul(13) | 1
    }
}

/// The second region's first 8 chunks are hot.
fn hot_history() -> AccessHistory {
    let mut clock: Vec<Vec<u8>> = LAYOUT
        .iter()
        .map(|&(_, s)| vec![0; s as usize / PAGE])
        .collect();
    clock[1][..8 * CHUNK as usize].fill(1);
    let aging = clock
        .iter()
        .map(|r| r.iter().map(|&b| b * 0x80).collect())
        .collect();
    AccessHistory {
        clock,
        aging,
        periods: 1,
    }
}

/// The VM to split: its zero pages are holes, its access history marks
/// some chunks hot, and every round pages 200..260 of region 0 change
/// (they span main and remote chunks) and page 3 (zero) gets data.
fn source() -> FakeVm {
    FakeVm::new(LAYOUT)
        .with_holes()
        .with_fill(content)
        .with_access_history(hot_history())
        .with_guest_writing((200..260).chain([3]).collect(), |b| b.wrapping_add(1) | 1)
}

/// A main host, or a gather's destination: memfd memory whose holes are
/// zero pages. (A split VM's main host is in turn the source of a
/// gather; the test's readers only read, so it reports nothing dirty.)
fn dest() -> FakeVm {
    FakeVm::new(LAYOUT).with_holes()
}

fn server() -> (Arc<MemServer>, Endpoint) {
    common::mem_server(1 << 20)
}

fn usable() -> bool {
    let f = ferry_memory::Features {
        missing_shmem: true,
        wp_shmem: true,
        ..Default::default()
    };
    common::uffd_usable(f, "split paging needs userfaultfd MISSING+WP on memfd")
}

/// A TCP relay in front of a memory server whose links can be broken:
/// for a while (every connection through it ends, and new ones are closed
/// at once until the break is over: a link down for a while) or for good
/// (new connections are refused: the server died).
struct Relay {
    at: Endpoint,
    live: Arc<Mutex<Vec<std::net::TcpStream>>>,
    dead: Arc<std::sync::atomic::AtomicBool>,
    broken_until: Arc<Mutex<Option<std::time::Instant>>>,
}

impl Relay {
    fn start(to: &Endpoint) -> Relay {
        use std::net::{Shutdown, TcpListener, TcpStream};
        let Endpoint::Tcp(to) = to.clone() else {
            unreachable!()
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let at = Endpoint::Tcp(l.local_addr().unwrap());
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let broken_until: Arc<Mutex<Option<std::time::Instant>>> = Arc::default();
        let (live2, dead2, broken2) = (live.clone(), dead.clone(), broken_until.clone());
        std::thread::spawn(move || loop {
            // Dead: the listener goes, and connecting is refused.
            if dead2.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let a = match l.accept() {
                Ok((a, _)) => a,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(_) => return,
            };
            a.set_nonblocking(false).unwrap();
            if broken2
                .lock()
                .unwrap()
                .is_some_and(|t| std::time::Instant::now() < t)
            {
                let _ = a.shutdown(Shutdown::Both);
                continue;
            }
            let b = TcpStream::connect(to).unwrap();
            live2
                .lock()
                .unwrap()
                .extend([a.try_clone().unwrap(), b.try_clone().unwrap()]);
            for (mut from, mut into) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut into);
                    let _ = into.shutdown(Shutdown::Write);
                });
            }
        });
        Relay {
            at,
            live,
            dead,
            broken_until,
        }
    }

    fn end_links(&self) {
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Every link ends, and new ones are closed at once for `d`.
    fn break_for(&self, d: Duration) {
        *self.broken_until.lock().unwrap() = Some(std::time::Instant::now() + d);
        self.end_links();
    }

    /// The server is gone: links end, new ones are refused.
    fn cut(&self) {
        self.dead.store(true, std::sync::atomic::Ordering::SeqCst);
        self.end_links();
        // The listener is dropped within one accept poll.
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Moves a fresh source VM to a fresh main host (a quarter of its memory)
/// and the memory servers `subs`.
fn move_vm(subs: Vec<Endpoint>, rank: Rank, replicas: u8) -> (FakeVm, FakeVm, MigrationStats) {
    let src = source();
    let dst = dest();
    let total: u64 = LAYOUT.iter().map(|r| r.1).sum();
    let opts = MigrateOptions {
        mode: Mode::Split,
        verify: true,
        streams: 2,
        max_rounds: 2,
        downtime_ms: 0.0,
        split: SplitOptions {
            subs,
            main_budget: total / 4,
            chunk_pages: CHUNK,
            rank,
            replicas,
        },
        ..Default::default()
    };
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let to = listener.endpoint();
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, Duration::from_secs(10)));
        let st = ferry_migration::migrate(&src, &to, &opts, &Backend::cpu(), &|_| {});
        d.join().unwrap().unwrap();
        common::done(st.unwrap())
    });
    assert_eq!(*dst.state.lock().unwrap(), b"vcpu state");
    (src, dst, stats)
}

/// Reads byte 17 of every page of `dst` on another thread (faults served
/// by the pager); the bytes come back on the channel once all are read.
fn read_all(dst: &FakeVm) -> std::sync::mpsc::Receiver<Vec<(u64, u8)>> {
    let pages: Vec<(u64, usize)> = LAYOUT
        .iter()
        .flat_map(|&(gpa, size)| (0..size / PAGE as u64).map(move |i| gpa + i * PAGE as u64))
        .map(|g| (g, dst.host(g) as usize))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: each address points into a live memfd mapping of `dst`,
        // which outlives the read (the test keeps it until the end).
        let seen = pages
            .iter()
            .map(|&(g, h)| (g, unsafe { (h as *const u8).add(17).read_volatile() }))
            .collect();
        let _ = tx.send(seen);
    });
    rx
}

fn split(rank: Rank) {
    if !usable() {
        return;
    }
    let (s1, a1) = server();
    let (s2, a2) = server();
    let (src, dst, stats) = move_vm(vec![a1, a2], rank, 1);
    let total: u64 = LAYOUT.iter().map(|r| r.1).sum();
    let sp = stats.split.clone().expect("split stats");
    let chunks = total / (u64::from(CHUNK) * PAGE as u64);
    assert_eq!(sp.chunks, chunks);
    assert_eq!(sp.budget_chunks, chunks / 4);
    assert_eq!(sp.main_chunks, chunks / 4);
    assert_eq!(sp.history_periods, 1);
    assert!(sp.servers.iter().all(|s| s.pages > 0), "{sp:?}");
    assert!(stats.verified_pages > 0);
    // The hot chunks went to the main host: they hold data before any
    // fault (nothing paged in yet).
    let r1 = &dst.regions[1];
    assert!(r1.holds_data(PAGE as u64, PAGE as u64));
    {
        let pager = dst.pager.lock().unwrap();
        let st = pager.as_ref().expect("the VM keeps its pager").stats();
        assert_eq!(st.page_ins, 0);
        assert_eq!(st.resident_chunks, chunks / 4);
    }
    // Three passes over every page: read it, and write the first page of
    // every third chunk; backwards (so the chunks held here come first,
    // some of them clean and sampled since: mapped back write-protected),
    // read it, zero every 11th page whole, and write byte 2 of every 7th
    // page; then read it all back after every chunk was paged around again.
    // Chunks only read are paged out by a drop (their servers keep them): a
    // write the pager missed would read back as the old byte, and a page
    // zeroed as its server's old copy.
    let pages: Vec<u64> = LAYOUT
        .iter()
        .flat_map(|&(gpa, size)| (0..size / PAGE as u64).map(move |i| gpa + i * PAGE as u64))
        .collect();
    let hosts: Vec<usize> = pages.iter().map(|&g| dst.host(g) as usize).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for pass in 0..3 {
            if pass == 1 {
                // Past a sampling period: the pager has unmapped a share
                // of the chunks it holds, which the next pass pages out.
                std::thread::sleep(Duration::from_millis(1300));
            }
            let order: Vec<usize> = if pass == 1 {
                (0..hosts.len()).rev().collect()
            } else {
                (0..hosts.len()).collect()
            };
            for k in order {
                let p = hosts[k] as *mut u8;
                // SAFETY: `h` points into a live memfd mapping; a page held
                // by a memory server blocks this thread until it is in.
                unsafe {
                    seen.push((
                        k,
                        pass,
                        p.add(17).read_volatile(),
                        p.add(1).read_volatile(),
                        p.add(2).read_volatile(),
                    ));
                    if pass == 0 && k.is_multiple_of(3 * CHUNK as usize) {
                        p.add(1).write_volatile(0xAB);
                    }
                    if pass == 1 && k.is_multiple_of(11) {
                        std::ptr::write_bytes(p, 0, PAGE);
                    }
                    if pass == 1 && k.is_multiple_of(7) {
                        p.add(2).write_volatile(0xCD);
                    }
                }
            }
        }
        let _ = tx.send(seen);
    });
    // A pager that deadlocks would leave the toucher blocked for good.
    let seen = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the toucher finished: paging went on");
    // What byte `off` of page `k` holds when pass `pass` reads it.
    let expect = |k: usize, pass: usize, off: usize| {
        let mut v = src.byte(pages[k], off);
        if pass >= 1 && off == 1 && k.is_multiple_of(3 * CHUNK as usize) {
            v = 0xAB;
        }
        if pass >= 2 && k.is_multiple_of(11) {
            v = 0;
        }
        if pass >= 2 && off == 2 && k.is_multiple_of(7) {
            v = 0xCD;
        }
        v
    };
    for (k, pass, b17, b1, b2) in seen {
        let gpa = pages[k];
        for (off, got) in [(17, b17), (1, b1), (2, b2)] {
            assert_eq!(
                got,
                expect(k, pass, off),
                "byte {off} of {gpa:#x}, pass {pass}: every write survives paging"
            );
        }
    }
    let pager = dst.pager.lock().unwrap().take().unwrap();
    let pager = Arc::try_unwrap(pager).ok().unwrap();
    // The last fault's vCPU runs as soon as its page is in; the rest of
    // that chunk and the page-out it brings may still be on their way.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let st = loop {
        let st = pager.stats();
        if st.resident_chunks <= st.budget_chunks || std::time::Instant::now() > deadline {
            break st;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(st.failure.is_none(), "{:?}", st.failure);
    assert!(st.page_ins >= chunks / 2, "{st:?}");
    assert!(st.page_outs >= chunks / 2, "{st:?}");
    assert!(st.resident_chunks <= chunks / 4, "{st:?}");
    assert!(st.page_in_p50_us > 0.0);
    // Chunks paged in and only read went out again by a drop, and not
    // all of them: some were written.
    assert!(st.clean_drops > 0, "{st:?}");
    assert!(st.clean_drops < st.page_outs, "{st:?}");
    let held = (s1.capacity_pages() - s1.free_pages()) + (s2.capacity_pages() - s2.free_pages());
    // Paged-in chunks stay on their servers (the clean drops read them
    // back): what they hold is bounded by all chunks, not the remote ones.
    assert!(
        held > 0 && held <= st.chunks * u64::from(CHUNK),
        "{held} pages held for {} chunks",
        st.chunks
    );
    eprintln!("{rank}: {st:?}, servers hold {held} pages");
    drop(pager);
}

#[test]
fn split_with_clock_pages_chunks_in_and_out_and_loses_nothing() {
    common::secure();
    split(Rank::Clock);
}

#[test]
fn split_with_aging_pages_chunks_in_and_out_and_loses_nothing() {
    common::secure();
    split(Rank::Aging);
}

#[test]
fn with_two_replicas_the_vm_survives_a_dead_memory_server() {
    common::secure();
    if !usable() {
        return;
    }
    let (_s1, a1) = server();
    let (_s2, a2) = server();
    let relay = Relay::start(&a1);
    let (src, dst, stats) = move_vm(vec![relay.at.clone(), a2], Rank::Clock, 2);
    let sp = stats.split.unwrap();
    // Both servers hold a copy of every chunk not on the main host.
    let remote = sp.chunks - sp.main_chunks;
    assert!(sp.servers.iter().all(|m| m.chunks == remote), "{sp:?}");
    relay.cut();
    let seen = read_all(&dst)
        .recv_timeout(Duration::from_secs(60))
        .expect("every page came from the surviving copies");
    for (gpa, b) in seen {
        assert_eq!(b, src.byte(gpa, 17), "byte 17 of {gpa:#x}");
    }
    let st = dst.pager.lock().unwrap().as_ref().unwrap().stats();
    assert_eq!(st.lost_servers, vec![relay.at.to_string()], "{st:?}");
    assert!(st.failure.is_none(), "{st:?}");
    assert!(st.page_ins > 0 && st.page_outs > 0, "{st:?}");
}

#[test]
fn a_memory_server_cut_off_for_a_while_is_reconnected_not_lost() {
    common::secure();
    if !usable() {
        return;
    }
    let (_s1, a1) = server();
    let (_s2, a2) = server();
    let relay = Relay::start(&a1);
    let (src, dst, _) = move_vm(vec![relay.at.clone(), a2], Rank::Clock, 1);
    // Every link to the first server ends, and it answers nothing for a
    // second: without replicas, its chunks have no other copy.
    relay.break_for(Duration::from_secs(1));
    let t = std::time::Instant::now();
    let seen = read_all(&dst)
        .recv_timeout(Duration::from_secs(60))
        .expect("every page came back once the server answered again");
    for (gpa, b) in seen {
        assert_eq!(b, src.byte(gpa, 17), "byte 17 of {gpa:#x}");
    }
    let st = dst.pager.lock().unwrap().as_ref().unwrap().stats();
    assert!(st.lost_servers.is_empty(), "{st:?}");
    assert!(st.failure.is_none(), "{st:?}");
    assert!(st.reconnects >= 1, "{st:?}");
    assert!(st.page_ins > 0, "{st:?}");
    // The faults on its chunks waited out the break (and no more than the
    // reconnect window).
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

#[test]
fn without_replicas_a_dead_memory_server_stops_the_vm_and_says_which() {
    common::secure();
    if !usable() {
        return;
    }
    let (_s1, a1) = server();
    let (_s2, a2) = server();
    let relay = Relay::start(&a1);
    let (_src, dst, _) = move_vm(vec![relay.at.clone(), a2], Rank::Clock, 1);
    let told = Arc::new(Mutex::new(Vec::<String>::new()));
    let t2 = told.clone();
    dst.pager
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .on_failure(move |why| t2.lock().unwrap().push(why.to_string()));
    relay.cut();
    let reader = read_all(&dst);
    // A page held by the dead server cannot come back: the reader waits,
    // and the pager says why.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let failure = loop {
        let pager = dst.pager.lock().unwrap();
        if let Some(f) = pager.as_ref().unwrap().failure() {
            break f;
        }
        drop(pager);
        assert!(std::time::Instant::now() < deadline, "no failure reported");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(failure.contains(&relay.at.to_string()), "{failure}");
    assert!(failure.contains("out of reach"), "{failure}");
    assert_eq!(
        *told.lock().unwrap(),
        vec![failure.clone()],
        "the VMM was told once"
    );
    assert!(reader.recv_timeout(Duration::from_millis(300)).is_err());
    // Giving the VM up releases what waits on its memory (before the
    // memory itself goes).
    drop(dst.pager.lock().unwrap().take());
    reader
        .recv_timeout(Duration::from_secs(20))
        .expect("the reader was released");
}

#[test]
fn gather_brings_a_split_vm_back_whole_while_it_pages() {
    common::secure();
    if !usable() {
        return;
    }
    let (_s1, a1) = server();
    let (_s2, a2) = server();
    let (src, main, _) = move_vm(vec![a1, a2], Rank::Clock, 1);
    // The guest reads all its memory while it is gathered.
    let reader = read_all(&main);
    let whole = dest();
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let to = listener.endpoint();
    let opts = MigrateOptions {
        mode: Mode::Gather,
        verify: true,
        streams: 2,
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&whole, &listener, Duration::from_secs(10)));
        let st = ferry_migration::migrate(&main, &to, &opts, &Backend::cpu(), &|_| {});
        d.join().unwrap().unwrap();
        common::done(st.unwrap())
    });
    assert_eq!(*whole.state.lock().unwrap(), b"vcpu state");
    let g = stats.gather.expect("gather stats");
    assert!(g.pulled_pages > 0 && g.remote_chunks > 0, "{g:?}");
    assert_eq!(
        stats.verified_pages,
        LAYOUT.iter().map(|r| r.1 / PAGE as u64).sum::<u64>()
    );
    reader
        .recv_timeout(Duration::from_secs(60))
        .expect("the main host paged on during the gather");
    // The reader pages out until the gather begins; never after.
    assert_eq!(g.page_outs, 0, "nothing paged out while gathering: {g:?}");
    // Every byte is at the destination, none under userfaultfd there.
    for &(gpa, size) in LAYOUT {
        for p in 0..size / PAGE as u64 {
            let g = gpa + p * PAGE as u64;
            // SAFETY: `g` lies in the destination's live memfd mapping.
            let b = unsafe { whole.host(g).add(17).read_volatile() };
            assert_eq!(b, src.byte(g, 17), "byte 17 of {g:#x}");
        }
    }
    eprintln!("gather: {g:?}");
}
