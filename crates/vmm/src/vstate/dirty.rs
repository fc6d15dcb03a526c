//! KVM's dirty page log, shared by its consumers: an outgoing migration
//! (its dirty rounds), the access tracker (writes count as accesses) and a
//! dirty-rate probe (how fast the guest writes, asked before a move).
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
    /// A short measurement of the guest's dirty rate.
    Probe,
}

impl Consumer {
    const ALL: usize = 3;

    fn index(self) -> usize {
        match self {
            Consumer::Migration => 0,
            Consumer::Access => 1,
            Consumer::Probe => 2,
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
    /// The pages written since the last call, clearing them (and
    /// write-protecting them, so their next write is logged).
    fn take(&self) -> Result<Bitmaps, KvmError>;
    /// Whether [`take_some`](Self::take_some) can leave pages unprotected.
    fn partial(&self) -> bool {
        false
    }
    /// The pages logged dirty, clearing (and re-protecting) only those
    /// inside `keep`; the rest stay logged dirty and writable, so their
    /// writes cost the guest nothing and later reads report them again.
    /// Where the log cannot do that, the same as [`take`](Self::take).
    fn take_some(&self, keep: &Bitmaps) -> Result<Bitmaps, KvmError> {
        let _ = keep;
        self.take()
    }
}

/// KVM's dirty log on a VM's memslots: manual-protect mode where KVM has
/// it (a read re-protects only what the reader clears), else classic.
pub struct KvmLog {
    vm: Arc<VmFd>,
    memory: Arc<GuestMemory>,
    manual: bool,
}

impl KvmLog {
    /// The log of `vm`, whose memslots map `memory`; switches the VM to
    /// manual protection where KVM offers it (call before logging starts).
    pub fn new(vm: Arc<VmFd>, memory: Arc<GuestMemory>) -> Self {
        let manual = vm::enable_manual_dirty_log(&vm).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "KVM's dirty log stays classic (every read re-protects)");
            false
        });
        KvmLog { vm, memory, manual }
    }
}

impl LogSource for KvmLog {
    fn set_logging(&self, on: bool) -> Result<(), KvmError> {
        vm::register_memory(&self.vm, &self.memory, on)
    }

    fn take(&self) -> Result<Bitmaps, KvmError> {
        let dirty = vm::take_dirty_log(&self.vm, &self.memory)?;
        if self.manual {
            vm::clear_dirty_log(&self.vm, &self.memory, &dirty)?;
        }
        Ok(dirty)
    }

    fn partial(&self) -> bool {
        self.manual
    }

    fn take_some(&self, keep: &Bitmaps) -> Result<Bitmaps, KvmError> {
        if !self.manual {
            return self.take();
        }
        let dirty = vm::take_dirty_log(&self.vm, &self.memory)?;
        let mut clear = dirty.clone();
        and_into(&mut clear, keep);
        vm::clear_dirty_log(&self.vm, &self.memory, &clear)?;
        Ok(dirty)
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
            pending: Mutex::new([None, None, None]),
        }
    }

    fn lock(&self) -> MutexGuard<'_, [Option<Bitmaps>; Consumer::ALL]> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `who` wants the pages written from now on (what it had pending is
    /// dropped). The first interested consumer turns logging on.
    pub fn start(&self, who: Consumer) -> Result<(), DirtyLogError> {
        self.start_with(who, true)
    }

    /// [`start`](Self::start) for a consumer that reads with
    /// [`take_some`](Self::take_some) alone: when it is the first, the log
    /// is not cleared, so pages stay writable until a take_some asks for
    /// them (KVM's INITIALLY_SET mode logs every page dirty at the start
    /// rather than write-protecting all of guest RAM at once). What comes
    /// back outside `keep` is stale anyway.
    pub fn start_sampled(&self, who: Consumer) -> Result<(), DirtyLogError> {
        let clear = !self.source.partial();
        self.start_with(who, clear)
    }

    fn start_with(&self, who: Consumer, clear: bool) -> Result<(), DirtyLogError> {
        let mut pending = self.lock();
        if pending.iter().all(Option::is_none) {
            self.source.set_logging(true)?;
            // Whatever the log held is older than anyone's interest.
            let cleared = if clear {
                self.source.take().map(drop)
            } else {
                Ok(())
            };
            if let Err(e) = cleared {
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
        self.take_with(who, |source| source.take())
    }

    /// Like [`take`](Self::take), but KVM re-protects only the pages in
    /// `keep`: the others stay logged dirty and writable (no fault on
    /// their next write), so what comes back outside `keep` may be stale,
    /// pages written any time since they were last cleared. Every page
    /// returned still reaches the other consumers, so nothing a migration
    /// needs is lost (it may see a page twice). See
    /// [`partial`](Self::partial).
    pub fn take_some(&self, who: Consumer, keep: &Bitmaps) -> Result<Bitmaps, DirtyLogError> {
        self.take_with(who, |source| source.take_some(keep))
    }

    /// Reads the log with `read`, hands what it returned to every other
    /// interested consumer, and gives `who` its pending pages with it.
    fn take_with(
        &self,
        who: Consumer,
        read: impl FnOnce(&dyn LogSource) -> Result<Bitmaps, KvmError>,
    ) -> Result<Bitmaps, DirtyLogError> {
        let mut pending = self.lock();
        if pending[who.index()].is_none() {
            return Err(DirtyLogError::NotStarted(who));
        }
        let new = read(self.source.as_ref())?;
        for (i, p) in pending.iter_mut().enumerate() {
            if let Some(p) = p.as_mut().filter(|_| i != who.index()) {
                or_into(p, &new);
            }
        }
        let mut mine = pending[who.index()].replace(Vec::new()).unwrap_or_default();
        if mine.iter().all(Vec::is_empty) {
            // Nothing pending (the usual case): KVM's answer is the result,
            // without a fresh zeroed copy to OR it into.
            mine = new;
        } else {
            or_into(&mut mine, &new);
        }
        // Same shape as KVM's answer even when nothing was pending.
        Ok(mine)
    }

    /// Whether [`take_some`](Self::take_some) leaves pages outside `keep`
    /// unprotected (KVM's manual-protect mode); else it clears everything.
    pub fn partial(&self) -> bool {
        self.source.partial()
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

    /// Pages `first..first + pages` of region `region` were written by the
    /// VMM itself (a device's DMA: KVM logs only the guest's own writes):
    /// every interested consumer gets them with its next take. Nothing to
    /// do while nobody is interested.
    pub fn mark(&self, region: usize, first: u64, pages: u64) {
        let mut pending = self.lock();
        for p in pending.iter_mut().flatten() {
            if p.len() <= region {
                p.resize(region + 1, Vec::new());
            }
            let words = &mut p[region];
            for page in first..first + pages {
                let w = (page / 64) as usize;
                if words.len() <= w {
                    words.resize(w + 1, 0);
                }
                words[w] |= 1 << (page % 64);
            }
        }
    }

    /// Whether `who` is interested now.
    pub fn is_started(&self, who: Consumer) -> bool {
        self.lock()[who.index()].is_some()
    }
}

/// dst &= mask (pages past the mask's end are cleared).
fn and_into(dst: &mut Bitmaps, mask: &Bitmaps) {
    for (i, d) in dst.iter_mut().enumerate() {
        let m = mask.get(i).map(Vec::as_slice).unwrap_or(&[]);
        for (j, d) in d.iter_mut().enumerate() {
            *d &= m.get(j).copied().unwrap_or(0);
        }
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
        for (w, word) in b.iter().flatten().enumerate() {
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

    #[test]
    fn pages_the_vmm_wrote_reach_every_interested_consumer() {
        use Consumer::{Access, Migration};
        let fake = Arc::new(Fake::default());
        let log = DirtyLog::new(Box::new(fake.clone()));
        log.mark(0, 9, 1); // nobody listens: dropped
        log.start(Migration).unwrap();
        log.start(Access).unwrap();
        log.mark(0, 62, 3); // across a word
        fake.write(5);
        assert_eq!(pages(&log.take(Migration).unwrap()), vec![5, 62, 63, 64]);
        assert_eq!(pages(&log.take(Access).unwrap()), vec![5, 62, 63, 64]);
        log.mark(1, 2, 1); // another region
        let b = log.take(Migration).unwrap();
        assert!(
            pages(&b[..1].to_vec()).is_empty() && b[1][0] == 1 << 2,
            "{b:?}"
        );
    }

    /// A manual-protect log: bits stay set until cleared.
    #[derive(Default)]
    struct Manual(Mutex<Bitmaps>);

    impl Manual {
        fn write(&self, page: u64) {
            let mut w = self.0.lock().unwrap();
            if w.is_empty() {
                *w = vec![vec![0; 2]];
            }
            w[0][(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    impl LogSource for Arc<Manual> {
        fn set_logging(&self, _on: bool) -> Result<(), KvmError> {
            Ok(())
        }
        fn take(&self) -> Result<Bitmaps, KvmError> {
            Ok(std::mem::take(&mut *self.0.lock().unwrap()))
        }
        fn partial(&self) -> bool {
            true
        }
        fn take_some(&self, keep: &Bitmaps) -> Result<Bitmaps, KvmError> {
            let mut w = self.0.lock().unwrap();
            let out = w.clone();
            for (d, k) in w.iter_mut().zip(keep) {
                for (d, k) in d.iter_mut().zip(k) {
                    *d &= !k;
                }
            }
            Ok(out)
        }
    }

    #[test]
    fn a_partial_take_clears_only_what_it_keeps_and_loses_nothing() {
        use Consumer::{Access, Migration};
        let m = Arc::new(Manual::default());
        let log = DirtyLog::new(Box::new(m.clone()));
        assert!(log.partial());
        m.write(1); // logged before the sampled start: not cleared by it
        log.start_sampled(Access).unwrap();
        m.write(2);
        m.write(70);
        let keep = vec![vec![u64::MAX, 0]]; // pages 0..64
        assert_eq!(
            pages(&log.take_some(Access, &keep).unwrap()),
            vec![1, 2, 70]
        );
        // Pages 1 and 2 were cleared; 70 stays logged and comes again.
        assert_eq!(pages(&log.take_some(Access, &keep).unwrap()), vec![70]);
        // A migration starting now clears everything (page 70 goes to the
        // tracker's pending, a harmless repeat); its own takes clear in
        // full and see what the tracker read since.
        log.start(Migration).unwrap();
        m.write(3);
        assert_eq!(pages(&log.take_some(Access, &keep).unwrap()), vec![3, 70]);
        assert_eq!(pages(&log.take(Migration).unwrap()), vec![3]);
        assert!(pages(&log.take(Migration).unwrap()).is_empty());
    }
}
