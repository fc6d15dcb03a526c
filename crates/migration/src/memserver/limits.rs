//! What one memory server grants its peers, all of whom may be hostile:
//! how many connections at once, how long a connection may stay silent,
//! how large a request may be, and how much memory all connections'
//! buffers may take together ([`Budget`]). Every cap is checked before
//! anything is allocated for the request it limits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The server's limits (see [`Limits::default`] for the values and why).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once; one more gets an Abort and is closed.
    pub max_connections: usize,
    /// A new connection must have said Hello and opened its store by then.
    pub handshake: Duration,
    /// An open connection that sends no request for this long is closed
    /// (its owner's client reopens it transparently: StoreAck says how
    /// long the server waits).
    pub idle: Duration,
    /// A read or write inside a frame that makes no progress for this long
    /// ends the connection (a trickling peer).
    pub stall: Duration,
    /// Bytes that every connection's request and answer buffers may hold
    /// together; a request waits for room (up to `stall`), then is refused.
    pub buffer_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Each connection is a thread and two descriptors: 256 serve a
            // fleet's main hosts, sources and gatherers many times over.
            max_connections: 256,
            handshake: Duration::from_secs(10),
            idle: Duration::from_secs(300),
            stall: Duration::from_secs(30),
            // Eight 32 MiB requests, or sixty 4 MiB Pages frames, at once.
            buffer_bytes: 256 << 20,
        }
    }
}

/// Most VM id bytes (the session id in hex is 16).
pub const MAX_VM_ID: usize = 128;
/// Most runs in one StoreFetch, StoreDrop or ZeroRanges request, and most
/// addresses in one PageRequest (clients cut longer lists into several).
pub const MAX_RUNS: usize = 1 << 16;
/// Largest body of a request that names runs or addresses (MAX_RUNS of
/// them at their longest encoding, 20 bytes, and room for the rest).
pub const MAX_LIST_BODY: u32 = (MAX_RUNS as u32) * 20 + 64;
/// Largest body of Hello, StoreOpen and the requests without a list.
pub const MAX_SMALL_BODY: u32 = 4 << 10;
/// Guest pages of layout (the address space of all stores together, whose
/// bitmaps cost a bit per page) a server maps per page of its capacity: a
/// VM split over up to this many servers fits.
pub const LAYOUT_PER_CAPACITY: u64 = 64;

/// The count a postcard list starts with (a varint), read before the
/// list is decoded; None if the body holds no whole count.
pub fn list_len(body: &[u8]) -> Option<u64> {
    let mut n: u64 = 0;
    for (i, b) in body.iter().take(10).enumerate() {
        n |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(n);
        }
    }
    None
}

/// Bytes of buffers all connections may hold together.
pub struct Budget {
    left: Mutex<u64>,
    freed: Condvar,
}

/// Bytes taken from a [`Budget`], given back when dropped.
pub struct Taken {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Budget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Arc<Self> {
        Arc::new(Budget {
            left: Mutex::new(bytes),
            freed: Condvar::new(),
        })
    }

    /// Bytes not taken now.
    pub fn left(&self) -> u64 {
        *self.left.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` more into `held`, waiting up to `wait` for another
    /// connection to give some back; false if there is still no room.
    pub fn grow(self: &Arc<Self>, held: &mut Option<Taken>, bytes: u64, wait: Duration) -> bool {
        if bytes == 0 {
            return true;
        }
        let deadline = Instant::now() + wait;
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        while *left < bytes {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            left = self
                .freed
                .wait_timeout(left, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *left -= bytes;
        drop(left);
        match held {
            Some(t) => t.bytes += bytes,
            None => {
                *held = Some(Taken {
                    budget: self.clone(),
                    bytes,
                })
            }
        }
        true
    }
}

impl Taken {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut left = self.budget.left.lock().unwrap_or_else(|e| e.into_inner());
        *left += self.bytes;
        self.budget.freed.notify_all();
    }
}

/// Connection slots: at most `max` taken at once.
pub struct Slots {
    used: AtomicUsize,
    max: usize,
}

/// One connection's slot, given back when dropped.
pub struct Slot(Arc<Slots>);

impl Slots {
    /// `max` slots.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Slots {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Slots taken now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A slot, if one is free.
    pub fn take(self: &Arc<Self>) -> Option<Slot> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u < self.max).then_some(u + 1)
            })
            .ok()
            .map(|_| Slot(self.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.used.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_gives_what_it_has_and_waits_for_the_rest() {
        let b = Budget::new(100);
        let mut a = None;
        assert!(b.grow(&mut a, 60, Duration::ZERO));
        assert!(b.grow(&mut a, 30, Duration::ZERO));
        assert_eq!((b.left(), a.as_ref().unwrap().bytes()), (10, 90));
        let mut c = None;
        assert!(!b.grow(&mut c, 20, Duration::from_millis(20)), "no room");
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let mut c = None;
            b2.grow(&mut c, 20, Duration::from_secs(5))
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(a);
        assert!(t.join().unwrap(), "room came back");
        assert_eq!(b.left(), 100);
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let s = Slots::new(2);
        let a = s.take().unwrap();
        let _b = s.take().unwrap();
        assert!(s.take().is_none());
        drop(a);
        assert!(s.take().is_some());
    }
}
