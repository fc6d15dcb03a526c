//! The postcopy tests' rig: a source whose pages say who they are, a
//! destination under real userfaultfd whose "vCPUs" touch every page, a
//! relay that cuts the link at a chosen point, and the checks every run
//! must pass.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use super::fake_vm::FakeVm;
use ferry_migration::{Backend, Listener, MigrateOptions, MigrationStats};

pub const PAGE: usize = 4096;
pub const LAYOUT: &[(u64, u64)] = &[(0, 512 * PAGE as u64), (0x1_0000_0000, 256 * PAGE as u64)];
/// Every 7th page a "vCPU" touches, it writes.
pub const WRITE_EVERY: u64 = 7;

/// Byte `i` of a region: every fifth page stays zero (a hole).
pub fn content(_: u64, i: usize) -> u8 {
    if (i / PAGE).is_multiple_of(5) {
        0
    } else {
        (i as u64).wrapping_mul(2654435761).to_le_bytes()[2] | 1
    }
}

/// A source with 2 vCPUs whose zero pages are holes, as in a memfd, and
/// whose guest changes 100 pages of region 0 every round: precopy never
/// converges.
pub fn source() -> FakeVm {
    source_writing((100..200).collect())
}

/// [`source`], its guest changing `pages` of region 0 every round.
pub fn source_writing(pages: Vec<u64>) -> FakeVm {
    FakeVm::new(LAYOUT)
        .with_vcpus(2)
        .with_holes()
        .with_fill(content)
        .with_guest_writing(pages, |b| b.wrapping_add(1))
}

/// A destination on memfd memory whose start runs two page-touching
/// threads (the first writes every WRITE_EVERY-th page it touches).
pub fn dest() -> FakeVm {
    FakeVm::new(LAYOUT)
        .with_vcpus(2)
        .with_holes()
        .with_touchers(2, WRITE_EVERY)
}

pub fn uffd_usable() -> bool {
    let f = ferry_memory::Features {
        missing_shmem: true,
        thread_id: true,
        ..Default::default()
    };
    super::uffd_usable(f, "postcopy needs userfaultfd on memfd")
}

/// When a [`Relay`] breaks the link.
#[derive(Clone, Copy)]
pub enum Cut {
    /// After this many bytes went from the source to the destination.
    After(u64),
    /// When the destination sends Finished: that frame is dropped (the
    /// link broke with it on the wire).
    AtFinished,
    /// When the source sends its last Complete (the one after every page
    /// landed): that frame is dropped, and the link stays down for good.
    AtLastComplete,
}

impl Cut {
    /// The header whose sight cuts, and in which direction (true: from
    /// the source).
    fn header(self) -> Option<([u8; 6], bool)> {
        let m = ferry_migration::protocol::MAGIC.to_le_bytes();
        match self {
            Cut::After(_) => None,
            Cut::AtFinished => Some(([m[0], m[1], m[2], m[3], 17, 0], false)),
            Cut::AtLastComplete => Some(([m[0], m[1], m[2], m[3], 9, 0], true)),
        }
    }
}

/// A TCP relay that breaks every connection it carries once (see [`Cut`]),
/// and relays new connections normally from then on.
pub struct Relay {
    at: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn start(to: std::net::SocketAddr, when: Cut) -> Relay {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, AtomicU64};
        use std::sync::Arc;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        // Completes seen (the first one starts the VM at the destination).
        let completes = Arc::new(AtomicU64::new(0));
        let c = cut.clone();
        std::thread::spawn(move || {
            for a in l.incoming() {
                let Ok(a) = a else { return };
                if matches!(when, Cut::AtLastComplete) && c.load(Ordering::SeqCst) {
                    continue; // down for good: dropped unanswered
                }
                let Ok(b) = TcpStream::connect(to) else {
                    continue;
                };
                live.lock()
                    .unwrap()
                    .extend([a.try_clone().unwrap(), b.try_clone().unwrap()]);
                for (mut from, mut into, counted) in [
                    (a.try_clone().unwrap(), b.try_clone().unwrap(), true),
                    (b, a, false),
                ] {
                    let (c, sent, live, completes) =
                        (c.clone(), sent.clone(), live.clone(), completes.clone());
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 16 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            let seen = when.header().is_some_and(|(h, from_source)| {
                                from_source == counted
                                    && !c.load(Ordering::SeqCst)
                                    && buf[..n].windows(6).any(|w| w == h)
                            });
                            let at_header = seen
                                && (!matches!(when, Cut::AtLastComplete)
                                    || completes.fetch_add(1, Ordering::SeqCst) >= 1);
                            if n == 0 || (!at_header && into.write_all(&buf[..n]).is_err()) {
                                break;
                            }
                            let over = match when {
                                Cut::After(limit) => {
                                    counted
                                        && sent.fetch_add(n as u64, Ordering::SeqCst) + n as u64
                                            >= limit
                                }
                                Cut::AtFinished | Cut::AtLastComplete => at_header,
                            };
                            if over && !c.swap(true, Ordering::SeqCst) {
                                for s in live.lock().unwrap().drain(..) {
                                    let _ = s.shutdown(Shutdown::Both);
                                }
                            }
                        }
                        let _ = into.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Relay { at, cut }
    }
}

pub fn run(opts: &MigrateOptions) -> (MigrationStats, FakeVm, FakeVm) {
    run_through(opts, None)
}

/// Like [`run`], through a relay that breaks the link once (when given).
pub fn run_through(opts: &MigrateOptions, cut: Option<Cut>) -> (MigrationStats, FakeVm, FakeVm) {
    run_from(source(), opts, cut)
}

/// Like [`run_through`], from `src` (a source made like [`source`]).
pub fn run_from(
    src: FakeVm,
    opts: &MigrateOptions,
    cut: Option<Cut>,
) -> (MigrationStats, FakeVm, FakeVm) {
    let dst = dest();
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let relay = cut.map(|n| {
        let ferry_migration::Endpoint::Tcp(at) = listener.endpoint() else {
            unreachable!()
        };
        Relay::start(at, n)
    });
    let to = match &relay {
        Some(r) => ferry_migration::Endpoint::Tcp(r.at),
        None => listener.endpoint(),
    };
    // A link down for good: the destination waits 2 s for its source.
    let reconnect = match cut {
        Some(Cut::AtLastComplete) => Duration::from_secs(2),
        _ => Duration::from_secs(300),
    };
    let (stats, istats) = std::thread::scope(|s| {
        let d = s.spawn(|| {
            ferry_migration::receive_with_reconnect(
                &dst,
                &listener,
                Duration::from_secs(10),
                reconnect,
            )
        });
        let st = ferry_migration::migrate(&src, &to, opts, &Backend::cpu(), &|_| {});
        (super::done(st.unwrap()), d.join().unwrap().unwrap())
    });
    assert_eq!(*dst.state.lock().unwrap(), b"vcpu state");
    let seen = dst.join_touchers();
    let total = LAYOUT.iter().map(|r| r.1 / PAGE as u64).sum::<u64>();
    assert_eq!(
        seen.len() as u64,
        2 * total,
        "every thread touched every page"
    );
    // What a thread read is the source's final content (byte 17 is never
    // written by the "guest").
    for &(gpa, v) in &seen {
        assert_eq!(v, src.byte(gpa, 17), "page {gpa:#x} read wrong content");
    }
    // Guest writes survived the pages' later arrival (first copy wins),
    // and every page holds the source's bytes otherwise.
    for (i, &(base, size)) in LAYOUT.iter().enumerate() {
        let m = src.bytes(i);
        for p in 0..size as usize / PAGE {
            let gpa = base + (p * PAGE) as u64;
            // SAFETY: every page has landed; reading the mapping cannot block.
            let dst_page = unsafe { std::slice::from_raw_parts(dst.host(gpa), PAGE) };
            let src_page = &m[p * PAGE..(p + 1) * PAGE];
            assert!(
                dst_page[1] == src_page[1] || dst_page[1] == 0xAB,
                "page {gpa:#x}"
            );
            assert_eq!(dst_page[2..], src_page[2..], "page {gpa:#x}");
        }
    }
    assert_eq!(
        src.resumes.load(Ordering::SeqCst),
        0,
        "the source never runs again"
    );
    let p = stats.postcopy.as_ref().expect("a postcopy phase");
    if let Some(end @ (Cut::AtFinished | Cut::AtLastComplete)) = cut {
        // The report never reached the source: it says so (no faults, not
        // verified). The destination has every page and its report.
        assert!(relay.as_ref().unwrap().cut.load(Ordering::SeqCst));
        assert_eq!(p.faults, Default::default());
        assert_eq!(stats.verified_pages, 0);
        let f = istats.postcopy.as_ref().expect("the destination's report");
        assert_eq!(f.supplied_pages, p.pending_pages);
        if matches!(end, Cut::AtFinished) {
            // It verified every page before it sent Finished.
            assert_eq!(istats.verified_pages, total);
        } else {
            assert_eq!(istats.postcopy_pauses, 1);
        }
        return (stats, src, dst);
    }
    assert_eq!(istats.postcopy.as_ref(), Some(&p.faults));
    assert_eq!(stats.verified_pages, total);
    if let Some(r) = relay {
        assert!(r.cut.load(Ordering::SeqCst), "the link was cut");
        assert_eq!(p.pauses, 1, "{p:?}");
        assert_eq!(istats.postcopy_pauses, 1);
    }
    (stats, src, dst)
}
