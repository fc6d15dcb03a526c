//! Bookkeeping shared by the two 2-way set-associative caches.

/// Number of sets of a cache of `bytes` bytes with `entry`-byte entries:
/// entries = bytes / entry, sets = entries / 2, at least one set.
pub(crate) fn sets_for(bytes: u64, entry: usize) -> u64 {
    (bytes / entry as u64 / 2).max(1)
}

/// A vector of `n` copies of `fill`, or `None` when it cannot be allocated
/// (a cache size from a peer or a config file must not abort the process).
pub(crate) fn alloc<T: Clone>(n: usize, fill: T) -> Option<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, fill);
    Some(v)
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
