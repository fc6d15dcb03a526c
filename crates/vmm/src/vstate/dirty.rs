//! KVM's dirty page log, shared by its consumers: an outgoing migration
//! (its dirty rounds) and the access tracker (writes count as accesses).
//!
//! KVM keeps one log per memslot and clears it when read, so two readers
//! would steal each other's pages. Here the memslots log while any
//! consumer is interested; a consumer's take reads KVM's log once, adds
//! the new pages to every other interested consumer's pending bitmap, and
//! returns (and clears) its own: no consumer loses a write another read.

use std::sync::{Arc, Mutex, MutexGuard};

use ferry_memory::GuestMemory;
use kvm_ioctls::VmFd;

use super::kvm::KvmError;
use super::vm;

/// Who reads the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consumer {
    /// An outgoing migration's dirty rounds.
    Migration,
    /// The access tracker.
    Access,
}

impl Consumer {
    const ALL: usize = 2;

    fn index(self) -> usize {
        match self {
            Consumer::Migration => 0,
            Consumer::Access => 1,
        }
    }
}

/// Why the log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    /// KVM refused.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// The consumer did not start (or already stopped) its interest.
    #[error("the dirty log is not started for {0:?}")]
    NotStarted(Consumer),
}

/// Per region, a bitmap of pages (bit i of word i/64 = page i).
pub type Bitmaps = Vec<Vec<u64>>;

/// Where the pages come from: KVM's memslots (tests use a fake).
pub trait LogSource: Send + Sync {
    /// Turns logging on or off on every memslot.
    fn set_logging(&self, on: bool) -> Result<(), KvmError>;
    /// The pages written since the last call, clearing them.
    fn take(&self) -> Result<Bitmaps, KvmError>;
}

/// KVM's classic dirty log on a VM's memslots.
pub struct KvmLog {
    vm: Arc<VmFd>,
    memory: Arc<GuestMemory>,
}

impl KvmLog {
    /// The log of `vm`, whose memslots map `memory`.
    pub fn new(vm: Arc<VmFd>, memory: Arc<GuestMemory>) -> Self {
        KvmLog { vm, memory }
    }
}

impl LogSource for KvmLog {
    fn set_logging(&self, on: bool) -> Result<(), KvmError> {
        vm::register_memory(&self.vm, &self.memory, on)
    }

    fn take(&self) -> Result<Bitmaps, KvmError> {
        vm::take_dirty_log(&self.vm, &self.memory)
    }
}

/// The shared log; see the module documentation.
pub struct DirtyLog {
    source: Box<dyn LogSource>,
    /// Per consumer: Some(pages it has not taken yet) while interested.
    pending: Mutex<[Option<Bitmaps>; Consumer::ALL]>,
}

impl DirtyLog {
    /// A log over `source`, with nobody interested yet (logging off).
    pub fn new(source: Box<dyn LogSource>) -> Self {
        DirtyLog {
            source,
            pending: Mutex::new([None, None]),
        }
    }

    fn lock(&self) -> MutexGuard<'_, [Option<Bitmaps>; Consumer::ALL]> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `who` wants the pages written from now on (what it had pending is
    /// dropped). The first interested consumer turns logging on.
    pub fn start(&self, who: Consumer) -> Result<(), DirtyLogError> {
        let mut pending = self.lock();
        if pending.iter().all(Option::is_none) {
            self.source.set_logging(true)?;
            // Whatever the log held is older than anyone's interest.
            if let Err(e) = self.source.take() {
                let _ = self.source.set_logging(false);
                return Err(e.into());
            }
        } else {
            let new = self.source.take()?;
            for p in pending.iter_mut().flatten() {
                or_into(p, &new);
            }
        }
        pending[who.index()] = Some(Vec::new());
        Ok(())
    }

    /// The pages written since `who` last took (or started), clearing them.
    pub fn take(&self, who: Consumer) -> Result<Bitmaps, DirtyLogError> {
        let mut pending = self.lock();
        if pending[who.index()].is_none() {
            return Err(DirtyLogError::NotStarted(who));
        }
        let new = self.source.take()?;
        for (i, p) in pending.iter_mut().enumerate() {
            if let Some(p) = p.as_mut().filter(|_| i != who.index()) {
                or_into(p, &new);
            }
        }
        let mut mine = pending[who.index()].replace(Vec::new()).unwrap_or_default();
        or_into(&mut mine, &new);
        // Same shape as KVM's answer even when nothing was pending.
        Ok(mine)
    }

    /// `who` loses interest; the last one turns logging off.
    pub fn stop(&self, who: Consumer) -> Result<(), DirtyLogError> {
        let mut pending = self.lock();
        if pending[who.index()].take().is_none() {
            return Ok(());
        }
        if pending.iter().all(Option::is_none) {
            self.source.set_logging(false)?;
        }
        Ok(())
    }

    /// Whether `who` is interested now.
    pub fn is_started(&self, who: Consumer) -> bool {
        self.lock()[who.index()].is_some()
    }
}

/// dst |= src, growing dst to src's shape.
fn or_into(dst: &mut Bitmaps, src: &[Vec<u64>]) {
    if dst.len() < src.len() {
        dst.resize(src.len(), Vec::new());
    }
    for (d, s) in dst.iter_mut().zip(src) {
        if d.len() < s.len() {
            d.resize(s.len(), 0);
        }
        for (d, s) in d.iter_mut().zip(s) {
            *d |= s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log whose "guest" writes are set by the test.
    #[derive(Default)]
    struct Fake {
        written: Mutex<Bitmaps>,
        logging: Mutex<Vec<bool>>,
    }

    impl Fake {
        fn write(&self, page: u64) {
            let mut w = self.written.lock().unwrap();
            if w.is_empty() {
                *w = vec![vec![0; 2]];
            }
            w[0][(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    impl LogSource for Arc<Fake> {
        fn set_logging(&self, on: bool) -> Result<(), KvmError> {
            self.logging.lock().unwrap().push(on);
            Ok(())
        }
        fn take(&self) -> Result<Bitmaps, KvmError> {
            let mut w = self.written.lock().unwrap();
            let out = std::mem::take(&mut *w);
            *w = vec![vec![0; 2]];
            Ok(if out.is_empty() {
                vec![vec![0; 2]]
            } else {
                out
            })
        }
    }

    fn pages(b: &Bitmaps) -> Vec<u64> {
        let mut out = Vec::new();
        for (w, word) in b[0].iter().enumerate() {
            for bit in 0..64 {
                if word & (1 << bit) != 0 {
                    out.push(w as u64 * 64 + bit);
                }
            }
        }
        out
    }

    #[test]
    fn consumers_never_lose_each_others_pages() {
        use Consumer::{Access, Migration};
        let fake = Arc::new(Fake::default());
        let log = DirtyLog::new(Box::new(fake.clone()));
        assert!(matches!(
            log.take(Access),
            Err(DirtyLogError::NotStarted(Access))
        ));
        fake.write(1); // before anyone listens: nobody gets it
        log.start(Access).unwrap();
        fake.write(2);
        log.start(Migration).unwrap(); // page 2 stays the tracker's only
        fake.write(3);
        assert_eq!(pages(&log.take(Migration).unwrap()), vec![3]);
        fake.write(4);
        assert_eq!(pages(&log.take(Access).unwrap()), vec![2, 3, 4]);
        assert_eq!(pages(&log.take(Migration).unwrap()), vec![4]);
        assert!(pages(&log.take(Access).unwrap()).is_empty());
        // Logging stays on until the last consumer stops.
        log.stop(Access).unwrap();
        fake.write(70);
        assert_eq!(pages(&log.take(Migration).unwrap()), vec![70]);
        log.stop(Migration).unwrap();
        log.stop(Migration).unwrap();
        assert_eq!(*fake.logging.lock().unwrap(), vec![true, false]);
        // A restart drops what was pending.
        log.start(Migration).unwrap();
        log.start(Access).unwrap();
        fake.write(5);
        assert_eq!(pages(&log.take(Access).unwrap()), vec![5]);
        fake.write(6);
        log.start(Migration).unwrap();
        assert!(pages(&log.take(Migration).unwrap()).is_empty());
        assert_eq!(pages(&log.take(Access).unwrap()), vec![6]);
        assert!(log.is_started(Access) && log.is_started(Migration));
    }
}
