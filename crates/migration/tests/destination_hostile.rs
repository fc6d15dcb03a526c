//! A waiting destination driven by a hand-made source that speaks the
//! protocol but lies: each lie is refused with a clear reason, the VM is
//! never started, and the destination then takes a real migration.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fake_vm::FakeVm;
use ferry_migration::protocol::{self, Hello, Kind, PostcopyPlan, Role};
use ferry_migration::transport::Conn;
use ferry_migration::GpaPages;
use ferry_migration::{Endpoint, Listener, MigrateOptions};

const PAGE: u64 = 4096;
const LAYOUT: &[(u64, u64)] = &[(0, 256 * PAGE), (1 << 32, 128 * PAGE)];
const T: Duration = Duration::from_secs(5);

/// A control connection that got through the opening messages, and its
/// one bulk stream.
fn hand_made_source(at: &Endpoint) -> (Conn, Conn) {
    hand_made_source_hashing(at, false)
}

/// [`hand_made_source`], asking (`hash`) for pages hashed as they land.
fn hand_made_source_hashing(at: &Endpoint, hash: bool) -> (Conn, Conn) {
    let hello = Hello {
        version_min: 1,
        version_max: protocol::VERSION_MAX,
        role: Role::Control,
        session: 0x5eed,
        streams: 1,
    };
    let mut c = Conn::open(at, T, &hello).unwrap();
    c.flush().unwrap();
    let version: u16 = c.recv(Kind::HelloAck).unwrap();
    assert!(version >= protocol::VERSION_TRUST, "v{version}");
    common::send_opening_hashing(&mut c, None, LAYOUT, hash);
    let bulk = Hello {
        role: Role::Bulk(0),
        ..hello
    };
    let mut b = Conn::open(at, T, &bulk).unwrap();
    b.flush().unwrap();
    (c, b)
}

fn plan(pending: Vec<GpaPages>) -> PostcopyPlan {
    PostcopyPlan {
        pending,
        last: false,
        prefetch: 0,
        verify: false,
        guest_apf_base: None,
    }
}

/// Every page of the layout, one run per page (the longest honest plan).
fn every_page() -> Vec<GpaPages> {
    LAYOUT
        .iter()
        .flat_map(|&(g, s)| (0..s / PAGE).map(move |i| GpaPages::new(g + i * PAGE, 1)))
        .collect()
}

/// Sends `frames` (none says `last`) and returns the destination's answer
/// (its Abort's reason) and its own error.
fn lie(frames: Vec<PostcopyPlan>) -> (String, String) {
    let dst = FakeVm::new(LAYOUT);
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let at = listener.endpoint();
    let (said, derr) = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, T));
        let (mut c, _bulk) = hand_made_source(&at);
        for f in &frames {
            if protocol::send(c.writer(), Kind::PostcopyPlan, f).is_err() {
                break;
            }
        }
        let _ = c.flush();
        c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let said = match protocol::read_frame(c.reader()) {
            Ok(f) => format!("{:?}", f.kind),
            Err(e) => e.to_string(),
        };
        drop(c);
        (said, d.join().unwrap().unwrap_err().to_string())
    });
    assert_eq!(
        dst.started.load(Ordering::SeqCst),
        0,
        "the VM never started"
    );
    (said, derr)
}

#[test]
fn postcopy_plans_that_repeat_go_back_or_outgrow_the_vm_are_refused() {
    common::secure();
    // The same plan again and again, never `last`: the second frame is
    // refused (before the fix, each one grew the destination).
    let (said, derr) = lie(vec![plan(every_page()); 4]);
    assert!(said.contains("must not repeat"), "source saw: {said}");
    assert!(derr.contains("malformed PostcopyPlan"), "{derr}");
    // Runs that go back within one frame.
    let (said, _) = lie(vec![plan(vec![
        GpaPages::new(8 * PAGE, 1),
        GpaPages::new(0, 1),
    ])]);
    assert!(said.contains("address order"), "{said}");
    // More pages than the VM has, in one run that wraps.
    let (said, _) = lie(vec![plan(vec![GpaPages::new(0, (1 << 52) + 1)])]);
    assert!(said.contains("not in guest RAM"), "{said}");
}

#[test]
fn after_a_lying_source_the_destination_takes_a_real_one() {
    common::secure();
    let (said, _) = lie(vec![plan(every_page()); 2]);
    assert!(said.contains("must not repeat"), "{said}");
    // A fresh wait on a fresh VM takes a real precopy: every byte arrives.
    let src = FakeVm::new(LAYOUT).with_fill(|_, i| (i as u8).wrapping_mul(3) | 1);
    let dst = FakeVm::new(LAYOUT);
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let at = listener.endpoint();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, T));
        let opts = MigrateOptions {
            verify: true,
            ..MigrateOptions::default()
        };
        ferry_migration::migrate(&src, &at, &opts, &ferry_migration::Backend::cpu(), &|_| {})
            .unwrap();
        d.join().unwrap().unwrap();
    });
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert!(src.bytes(0) == dst.bytes(0) && src.bytes(1) == dst.bytes(1));
    eprintln!("real migration after the lie: {:?}", t0.elapsed());
}

/// A source that asked for pages hashed as they land, landed a page of
/// data, and then claims by its digests that it sent only zero pages: the
/// destination refuses before the VM starts.
#[test]
fn digests_that_deny_what_landed_are_refused_before_the_vm_starts() {
    common::secure();
    let dst = FakeVm::new(LAYOUT);
    let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let at = listener.endpoint();
    let (said, derr) = std::thread::scope(|s| {
        let d = s.spawn(|| ferry_migration::receive(&dst, &listener, T));
        let (mut c, mut b) = hand_made_source_hashing(&at, true);
        let data = vec![0x42u8; PAGE as usize];
        protocol::write_frame_parts(
            b.writer(),
            Kind::Pages,
            &[&1u32.to_le_bytes(), &(3 * PAGE).to_le_bytes(), &data],
        )
        .unwrap();
        b.flush().unwrap();
        let done = protocol::RoundDone {
            round: 0,
            frames: vec![1],
        };
        c.send(Kind::RoundDone, &done).unwrap();
        assert_eq!(c.recv::<u32>(Kind::RoundAck).unwrap(), 0);
        protocol::write_frame(c.writer(), Kind::State, b"vcpu state").unwrap();
        // 384 pages: one digest, which would be 0 had only zeros landed.
        c.send(Kind::VerifyDigests, &vec![0u64]).unwrap();
        c.send_frame(Kind::Complete, &[]).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let said = match protocol::read_frame(c.reader()) {
            Ok(f) => format!("{:?}", f.kind),
            Err(e) => e.to_string(),
        };
        (said, d.join().unwrap().unwrap_err().to_string())
    });
    assert!(
        said.contains("pages that landed differ"),
        "source saw: {said}"
    );
    assert!(derr.contains("pages that landed differ"), "{derr}");
    assert_eq!(
        dst.started.load(Ordering::SeqCst),
        0,
        "the VM never started"
    );
}
