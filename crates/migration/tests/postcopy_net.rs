//! The postcopy safety net (`--safety-net`, with and without
//! `--net-finishes`) when its standby stalls: a relay between the source
//! and a real `Standby` stops carrying the copy partway (a link cut, a
//! SIGSTOPped standby). The standby gives the copy up; the source must
//! drop the net and finish the postcopy itself (every page pushed,
//! Finished, verified), in bounded time.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postcopy_rig::*;
use ferry_migration::{Backend, Endpoint, Listener, MigrateOptions, Mode, Standby};

/// A TCP relay to `to` that carries `before` bytes from the source, then
/// carries nothing either way for `stall` (it stops reading: the source's
/// writes back up as over a cut link), then carries on.
struct StallingRelay {
    at: std::net::SocketAddr,
    /// Connections it carried.
    conns: Arc<AtomicU64>,
    /// The stall began.
    stalled: Arc<AtomicBool>,
}

impl StallingRelay {
    fn start(to: std::net::SocketAddr, before: u64, stall: Duration) -> StallingRelay {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let conns = Arc::new(AtomicU64::new(0));
        let stalled = Arc::new(AtomicBool::new(false));
        let (n, st) = (conns.clone(), stalled.clone());
        std::thread::spawn(move || {
            for a in l.incoming() {
                let Ok(a) = a else { return };
                let Ok(b) = TcpStream::connect(to) else {
                    continue;
                };
                n.fetch_add(1, Ordering::SeqCst);
                // When the stall ends, once it began.
                let until: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
                for (mut from, mut into, counted) in [
                    (a.try_clone().unwrap(), b.try_clone().unwrap(), true),
                    (b, a, false),
                ] {
                    let (st, until) = (st.clone(), until.clone());
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 4096];
                        let mut sent = 0u64;
                        loop {
                            // Nothing is read (nor a close passed on)
                            // while the link carries nothing.
                            let wait = until
                                .lock()
                                .unwrap()
                                .map(|t| t.saturating_duration_since(Instant::now()));
                            if let Some(w) = wait.filter(|w| !w.is_zero()) {
                                std::thread::sleep(w);
                            }
                            let k = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(k) => k,
                            };
                            if counted && sent < before && sent + k as u64 >= before {
                                st.store(true, Ordering::SeqCst);
                                *until.lock().unwrap() = Some(Instant::now() + stall);
                                std::thread::sleep(stall);
                            }
                            sent += k as u64;
                            if into.write_all(&buf[..k]).is_err() {
                                break;
                            }
                        }
                        let wait = until
                            .lock()
                            .unwrap()
                            .map(|t| t.saturating_duration_since(Instant::now()));
                        if let Some(w) = wait {
                            std::thread::sleep(w);
                        }
                        let _ = into.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        StallingRelay { at, conns, stalled }
    }
}

/// A postcopy from the rig's source to its destination with a safety net
/// on a standby behind a relay that stalls after `before` bytes for
/// `stall`, the push within `bandwidth`. Returns the move's figures and
/// how long it took.
fn stalled_net(
    finishes: bool,
    before: u64,
    stall: Duration,
    bandwidth: Option<f64>,
) -> (ferry_migration::MigrationStats, Duration) {
    common::secure();
    let standby = Standby::new(1 << 30);
    let sl = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let Endpoint::Tcp(standby_at) = sl.endpoint() else {
        unreachable!()
    };
    {
        let s = standby.clone();
        std::thread::spawn(move || s.serve(&sl));
    }
    let relay = StallingRelay::start(standby_at, before, stall);
    let opts = MigrateOptions {
        mode: Mode::Postcopy,
        verify: true,
        safety_net: Some(Endpoint::Tcp(relay.at)),
        net_finishes: finishes,
        bandwidth,
        // (The default: the push holds for a net that copies at most
        // half of it, 15 s.)
        // ~3 MB pending: about 3 s of push.
        ..Default::default()
    };
    let src = source();
    // No vCPU touches a page: the push brings them all.
    let dst = ferry_migration_dest();
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let to = listener.endpoint();
    let t = Instant::now();
    let (stats, istats) = std::thread::scope(|s| {
        let d = s.spawn(|| {
            ferry_migration::receive_with_reconnect(
                &dst,
                &listener,
                Duration::from_secs(30),
                Duration::from_secs(30),
            )
        });
        let st = ferry_migration::migrate(&src, &to, &opts, &Backend::cpu(), &|_| {});
        (st, d.join().unwrap())
    });
    let took = t.elapsed();
    let stats = common::done(stats.expect("the move succeeds without its net"));
    let istats = istats.expect("the destination finished");
    standby.stop();
    assert!(
        relay.stalled.load(Ordering::SeqCst),
        "the relay never stalled"
    );
    assert_eq!(relay.conns.load(Ordering::SeqCst), 1);
    let total = LAYOUT.iter().map(|r| r.1 / PAGE as u64).sum::<u64>();
    assert_eq!(
        stats.verified_pages, total,
        "the source verified every page"
    );
    assert_eq!(istats.verified_pages, total);
    let p = stats.postcopy.as_ref().expect("a postcopy phase");
    assert!(!p.handed_over, "{p:?}");
    assert!(!p.safety_net_armed, "{p:?}");
    assert_eq!(p.faults.supplied_pages, p.pending_pages, "{p:?}");
    assert_eq!(
        src.resumes.load(Ordering::SeqCst),
        0,
        "the source never runs again"
    );
    assert_eq!(
        standby.stats.finished.load(Ordering::SeqCst),
        0,
        "the standby never took the move"
    );
    eprintln!("net finishes {finishes}: done in {took:?}: {p:?}");
    (stats, took)
}

/// The rig's destination without its touching "vCPUs": every page comes
/// by the push (the move lasts as long as the push does).
fn ferry_migration_dest() -> common::fake_vm::FakeVm {
    common::fake_vm::FakeVm::new(LAYOUT)
        .with_vcpus(2)
        .with_holes()
}

#[test]
fn a_standby_that_stalls_mid_copy_is_dropped_and_the_source_finishes_the_move() {
    if !uffd_usable() {
        return;
    }
    // The standby's link carries nothing for 20 s from its first 8 KiB
    // (its copy barely started). The move must not wait for it: with
    // `--net-finishes` the push stops waiting for a copy that does not
    // move (3 s) and pushes every page itself; without it the push never
    // waited, and the move's end does not wait on the stalled link either.
    for finishes in [true, false] {
        // Without --net-finishes nothing holds the push: paced to last
        // ~3 s, the move is still under way when the net's link stalls.
        let bandwidth = (!finishes).then_some(1e6);
        let (stats, took) = stalled_net(finishes, 8 << 10, Duration::from_secs(20), bandwidth);
        let p = stats.postcopy.unwrap();
        // The destination never took the source for gone (it did when the
        // push crawled after a hold), and the move ended in bounded time.
        assert_eq!(p.pauses, 0, "{p:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
    }
}
