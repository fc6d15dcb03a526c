//! The gate: stops every reader of the device's connections between two
//! frames and holds them there, so the connections can be handed to
//! another VMM process (docs/handover.md) or moved with the VM; it keeps
//! what each stopped reader had read but not handled.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::devices::service::lock;
/// Where the readers are.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fate {
    /// Reading and posting.
    Running,
    /// Stopped between frames until thawed or handed off.
    Frozen,
    /// Another process serves the connections: leave without touching them.
    HandedOff,
}

struct GateState {
    fate: Fate,
    /// Readers alive (counted before their thread starts).
    readers: usize,
    /// Frozen readers and what each had not handled.
    parked: HashMap<u64, Vec<u8>>,
    /// Readers asleep in poll on a socket with nothing to handle but a
    /// partial frame (kept here): a freeze counts them as parked without
    /// waking them.
    asleep: HashMap<u64, Vec<u8>>,
    /// Those a freeze counted as parked while they slept.
    claimed: HashSet<u64>,
}

/// Stops every reader between two frames and holds them there.
///
/// Most readers of a busy service sleep in poll on their socket, waiting
/// for the next request. A freeze does not wake them (on these hosts each
/// wake-up costs 50-200 µs, and 128 of them filled the pause): a sleeping
/// reader has nothing half-handled, so it is parked where it sleeps. If its
/// socket wakes it while frozen it parks properly, without reading.
pub(in crate::devices::service) struct Gate {
    frozen: AtomicBool,
    /// Written when the readers must leave (handed off): wakes the ones
    /// asleep in poll.
    pub(super) wake: EventFd,
    state: Mutex<GateState>,
    /// Every reader parked (or one ended): wakes the freezer. Separate from
    /// `fate_changed` so parking readers do not wake each other.
    all_parked: Condvar,
    /// Thawed or handed off: wakes the parked readers.
    fate_changed: Condvar,
}

/// What a reader that slept in poll does next.
pub(super) enum Woken {
    /// Read its socket, with its buffer as it left it.
    Read,
    /// Leave without touching the socket (another process serves it).
    Leave,
}

impl Gate {
    pub fn new() -> std::io::Result<Self> {
        Ok(Gate {
            frozen: AtomicBool::new(false),
            wake: EventFd::new(EFD_NONBLOCK | libc::EFD_CLOEXEC)?,
            state: Mutex::new(GateState {
                fate: Fate::Running,
                readers: 0,
                parked: HashMap::new(),
                asleep: HashMap::new(),
                claimed: HashSet::new(),
            }),
            all_parked: Condvar::new(),
            fate_changed: Condvar::new(),
        })
    }

    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
    }

    pub fn handed_off(&self) -> bool {
        lock(&self.state).fate == Fate::HandedOff
    }

    pub(super) fn reader_started(&self) {
        lock(&self.state).readers += 1;
    }

    pub(super) fn reader_ended(&self) {
        lock(&self.state).readers -= 1;
        self.all_parked.notify_all();
    }

    /// Stops the readers: the sleeping ones count as parked at once, the
    /// others park at their next frame boundary.
    pub fn close(&self) {
        let mut st = lock(&self.state);
        st.fate = Fate::Frozen;
        self.frozen.store(true, Ordering::Release);
        let asleep = std::mem::take(&mut st.asleep);
        for (id, buf) in asleep {
            st.claimed.insert(id);
            st.parked.insert(id, buf);
        }
    }

    /// Waits until every reader is parked between frames.
    pub fn wait_parked(&self, timeout: Duration) -> Result<(), usize> {
        let mut st = lock(&self.state);
        let deadline = Instant::now() + timeout;
        while st.parked.len() < st.readers {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(st.readers - st.parked.len());
            }
            st = self
                .all_parked
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// What each parked reader had not handled, by connection id.
    pub fn pending(&self) -> HashMap<u64, Vec<u8>> {
        lock(&self.state).parked.clone()
    }

    /// Frozen readers go on where they stopped; the ones parked asleep
    /// sleep on (a handed-off gate stays so).
    pub fn thaw(&self) {
        let mut st = lock(&self.state);
        if st.fate != Fate::Frozen {
            return;
        }
        st.fate = Fate::Running;
        self.frozen.store(false, Ordering::Release);
        let claimed = std::mem::take(&mut st.claimed);
        for id in claimed {
            if let Some(buf) = st.parked.remove(&id) {
                st.asleep.insert(id, buf);
            }
        }
        self.fate_changed.notify_all();
    }

    /// Readers leave without touching their sockets (the ones asleep in
    /// poll are woken for it).
    pub fn hand_off(&self) {
        lock(&self.state).fate = Fate::HandedOff;
        let _ = self.wake.write(1);
        self.fate_changed.notify_all();
    }

    /// Called by a reader at the gate: parks with what it has not handled;
    /// gives it back when thawed, None when handed off.
    pub(super) fn park(&self, id: u64, buf: Vec<u8>) -> Option<Vec<u8>> {
        let mut st = lock(&self.state);
        st.parked.insert(id, buf);
        if st.parked.len() >= st.readers {
            self.all_parked.notify_all();
        }
        while st.fate == Fate::Frozen {
            st = self
                .fate_changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        let buf = st.parked.remove(&id).unwrap_or_default();
        (st.fate == Fate::Running).then_some(buf)
    }

    /// A reader with nothing to handle but the partial frame `buf` is
    /// about to sleep in poll: false if the gate is closed (park instead).
    pub(super) fn sleep(&self, id: u64, buf: &[u8]) -> bool {
        let mut st = lock(&self.state);
        if st.fate != Fate::Running {
            return false;
        }
        st.asleep.insert(id, buf.to_vec());
        true
    }

    /// A reader woke from poll. If a freeze parked it while it slept, it
    /// stays parked (without reading) until thawed or handed off.
    pub(super) fn woke(&self, id: u64) -> Woken {
        let mut st = lock(&self.state);
        loop {
            if st.asleep.remove(&id).is_some() {
                return Woken::Read;
            }
            match st.fate {
                Fate::HandedOff => {
                    st.parked.remove(&id);
                    st.claimed.remove(&id);
                    return Woken::Leave;
                }
                // Parked asleep by the freeze: still counted as parked.
                Fate::Frozen if st.claimed.contains(&id) => {}
                // Neither asleep nor claimed: nothing to wait for.
                _ => return Woken::Read,
            }
            st = self
                .fate_changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
impl Gate {
    /// Readers asleep in poll now (the tests wait for them all).
    pub(super) fn asleep(&self) -> usize {
        lock(&self.state).asleep.len()
    }
}
