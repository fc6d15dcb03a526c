//! Bookkeeping shared by the two 2-way set-associative caches.

/// Number of sets of a cache of `bytes` bytes with `entry`-byte entries:
/// entries = bytes / entry, sets = entries / 2, at least one set.
pub(crate) fn sets_for(bytes: u64, entry: usize) -> u64 {
    (bytes / entry as u64 / 2).max(1)
}

/// A vector of `n` copies of `fill`, or `None` when it cannot be allocated
/// (a cache size from a peer or a config file must not abort the process).
pub(crate) fn alloc<T: Clone>(n: usize, fill: T) -> Option<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(n).ok()?;
    huge_pages(
        v.as_ptr().cast(),
        n.saturating_mul(std::mem::size_of::<T>()),
    );
    v.resize(n, fill);
    Some(v)
}

/// Asks the kernel to back the 2 MiB-aligned part of `len` bytes at `start`
/// with huge pages (before they are first written). A cache's lookups land
/// anywhere in tens of MiB: with 4 KiB pages almost each one also misses the
/// TLB. A hint only: where the kernel says no, nothing changes.
fn huge_pages(start: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let first = (start as usize).next_multiple_of(HUGE);
        let end = (start as usize).saturating_add(len) / HUGE * HUGE;
        if end > first {
            // SAFETY: madvise(MADV_HUGEPAGE) on whole pages inside an
            // allocation this process owns changes how they are backed,
            // never their contents or their validity.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len);
}

const LRU_BIT: u8 = 1;
const VALID_BITS: [u8; 2] = [2, 4];

/// Per set: which way is least recently used (initially way 0) and which ways
/// hold an entry. Empty ways are always the LRU one, so replacing the LRU way
/// fills way 0, then way 1.
#[derive(Clone, Debug)]
pub(crate) struct SetState(Vec<u8>);

impl SetState {
    pub(crate) fn new(sets: usize) -> Option<Self> {
        alloc(sets, 0).map(SetState)
    }

    pub(crate) fn valid(&self, set: usize, way: usize) -> bool {
        self.0
            .get(set)
            .is_some_and(|s| s & VALID_BITS[way & 1] != 0)
    }

    pub(crate) fn lru(&self, set: usize) -> usize {
        self.0.get(set).map_or(0, |s| usize::from(s & LRU_BIT))
    }

    /// Marks `way` as holding an entry and most recently used.
    pub(crate) fn make_mru(&mut self, set: usize, way: usize) {
        if let Some(s) = self.0.get_mut(set) {
            let way = way & 1;
            let other = (way ^ 1) as u8;
            *s = (*s & !LRU_BIT) | other | VALID_BITS[way];
        }
    }
}
