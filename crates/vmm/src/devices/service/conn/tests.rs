//! The gate on real sockets: a freeze parks readers asleep in poll without
//! waking them, a client's write while frozen wakes one that stays parked,
//! and a handoff wakes the sleepers to leave.

use super::*;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicUsize;

/// A reader as `read_requests` sleeps: announce, poll the socket and the
/// gate's eventfd, then ask the gate what to do; counts its wake-ups.
fn sleeper(gate: Arc<Gate>, id: u64, sock: UnixStream, woke: Arc<AtomicUsize>) -> Woken {
    assert!(gate.sleep(id, b"half"));
    let _ = wait_readable(sock.as_fd(), &gate.wake, -1);
    woke.fetch_add(1, Ordering::SeqCst);
    gate.woke(id)
}

#[test]
fn a_freeze_parks_sleeping_readers_without_waking_them() {
    let gate = Arc::new(Gate::new().unwrap());
    let woke = Arc::new(AtomicUsize::new(0));
    let mut peers = Vec::new();
    let mut readers = Vec::new();
    for id in 1..=8u64 {
        let (a, b) = UnixStream::pair().unwrap();
        peers.push(b);
        gate.reader_started();
        let (g, w) = (gate.clone(), woke.clone());
        readers.push(std::thread::spawn(move || sleeper(g, id, a, w)));
    }
    // Every reader announced its sleep (the test's sleeper does so first).
    while gate.asleep() < 8 {
        std::thread::sleep(Duration::from_millis(1));
    }
    gate.close();
    gate.wait_parked(Duration::from_secs(5)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(woke.load(Ordering::SeqCst), 0, "no reader was woken");
    let pending = gate.pending();
    assert_eq!(pending.len(), 8);
    assert!(pending.values().all(|b| b == b"half"));
    // A client writes while frozen: its reader wakes but stays parked.
    peers[0].write_all(b"x").unwrap();
    while woke.load(Ordering::SeqCst) < 1 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(!readers[0].is_finished(), "it waits for the gate, unread");
    // Thawed: that reader reads; the others sleep on.
    gate.thaw();
    let first = readers.remove(0).join().unwrap();
    assert!(matches!(first, Woken::Read));
    assert_eq!(gate.asleep(), 7);
    // Frozen again and handed off: the sleepers are woken to leave.
    gate.close();
    gate.hand_off();
    for r in readers {
        assert!(matches!(r.join().unwrap(), Woken::Leave));
    }
}
