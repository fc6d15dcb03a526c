//! dedup: 256-byte chunks found in the chunk cache travel as 4-byte references.

use crate::error::CodecError;
use crate::prefetch::{prefetch, prefetch_l2};
use crate::sets::{alloc, sets_for, SetState};
use crate::sizes::CHUNK;

/// Most sets a chunk cache may have, so that every reference `set * 2 + way` fits a u32.
const MAX_SETS: u64 = 1 << 31;

/// A slot hint that names no slot (the chunk was not found by its lookup).
pub const NO_SLOT: u32 = u32::MAX;

/// 2-way set-associative cache of chunks, keyed by their SuperFastHash.
///
/// entries = bytes / 256, sets = entries / 2 (at least 1, at most 2^31);
/// set = hash % sets; each way holds (hash, content); LRU within a set. A chunk
/// is found only when a way has the same hash *and* the same 256 bytes.
#[derive(Clone, Debug)]
pub struct ChunkCache {
    sets: usize,
    state: SetState,
    /// Hash of way w of set s at `s * 2 + w`.
    hashes: Vec<u32>,
    /// Content of way w of set s at `s * 2 + w`.
    chunks: Vec<[u8; CHUNK]>,
    /// Per set: the batch in which a touch last replaced one of its ways. A
    /// set not replaced in this batch still holds what the batch's lookups
    /// found, so its touches need not compare the chunk again.
    replaced_in: Vec<u32>,
    /// The current batch (see [`ChunkCache::begin_batch`]); never 0.
    batch: u32,
}

impl ChunkCache {
    /// The number of sets of a cache of `bytes` bytes (see the type), or
    /// why there cannot be such a cache. The GPU backend uses the same rule.
    pub fn sets_for(bytes: u64) -> Result<usize, CodecError> {
        let sets = sets_for(bytes, CHUNK);
        if sets > MAX_SETS {
            return Err(CodecError::CacheSize {
                what: "dedup",
                bytes,
            });
        }
        usize::try_from(sets).map_err(|_| CodecError::CacheSize {
            what: "dedup",
            bytes,
        })
    }

    /// An empty cache of `bytes` bytes (see the type for the geometry).
    pub fn new(bytes: u64) -> Result<Self, CodecError> {
        let too_big = || CodecError::CacheSize {
            what: "dedup",
            bytes,
        };
        let sets = Self::sets_for(bytes)?;
        let ways = sets.checked_mul(2).ok_or_else(too_big)?;
        Ok(ChunkCache {
            sets,
            state: SetState::new(sets).ok_or_else(too_big)?,
            hashes: alloc(ways, 0).ok_or_else(too_big)?,
            chunks: alloc(ways, [0; CHUNK]).ok_or_else(too_big)?,
            replaced_in: alloc(sets, 0).ok_or_else(too_big)?,
            batch: 1,
        })
    }

    /// Number of sets.
    pub fn sets(&self) -> usize {
        self.sets
    }

    /// The set a hash maps to.
    pub fn set_of(&self, hash: u32) -> usize {
        // sets >= 1, and u32 -> usize is lossless on the 64-bit hosts ferry runs on.
        hash as usize % self.sets
    }

    fn way_of(&self, hash: u32, chunk: &[u8; CHUNK]) -> Option<usize> {
        let set = self.set_of(hash);
        (0..2).find(|&w| {
            let slot = set * 2 + w;
            self.state.valid(set, w)
                && self.hashes.get(slot) == Some(&hash)
                && self.chunks.get(slot) == Some(chunk)
        })
    }

    /// The reference (`set * 2 + way`) of a cached chunk equal to `chunk`, whose hash is `hash`.
    pub fn lookup(&self, hash: u32, chunk: &[u8; CHUNK]) -> Option<u32> {
        let way = self.way_of(hash, chunk)?;
        // set * 2 + way < 2 * MAX_SETS = 2^32.
        u32::try_from(self.set_of(hash) * 2 + way).ok()
    }

    /// Starts loading what a lookup or touch of `hash` will read (its set's
    /// hashes and both ways' chunks), so a page's 16 chunks miss together.
    pub fn prefetch(&self, hash: u32) {
        let slot = self.set_of(hash) * 2;
        if let Some(hashes) = self.hashes.get(slot..slot + 2) {
            prefetch(hashes);
        }
        for chunk in self.chunks.get(slot..slot + 2).into_iter().flatten() {
            prefetch(chunk);
        }
    }

    /// Starts loading the line of a set's two hashes: the first of the two
    /// steps of [`ChunkCache::prefetch_match`], taken a few pages ahead.
    pub fn prefetch_hashes(&self, hash: u32) {
        let slot = self.set_of(hash) * 2;
        if let Some(hashes) = self.hashes.get(slot..slot + 2) {
            prefetch(hashes);
        }
    }

    /// Starts loading the way whose hash is `hash`, the only one a lookup
    /// compares (half the lines of [`ChunkCache::prefetch`]); the set's
    /// hashes should have been prefetched a while before.
    pub fn prefetch_match(&self, hash: u32) {
        let slot = self.set_of(hash) * 2;
        for way in slot..slot + 2 {
            if self.hashes.get(way) == Some(&hash) {
                if let Some(chunk) = self.chunks.get(way) {
                    // Into the second level: 16 chunks a page, 4 lines
                    // each, are more misses than the first level can wait
                    // on at once (the prefetches themselves stalled).
                    prefetch_l2(chunk);
                }
            }
        }
    }

    /// Starts loading the chunk a reference points at.
    pub fn prefetch_index(&self, index: u32) {
        if let Some(chunk) = usize::try_from(index).ok().and_then(|i| self.chunks.get(i)) {
            prefetch(chunk);
        }
    }

    /// The chunk a reference points at; `None` when out of range or empty.
    pub fn get(&self, index: u32) -> Option<&[u8; CHUNK]> {
        self.get_with_hash(index).map(|(_, chunk)| chunk)
    }

    /// The chunk a reference points at and its hash; `None` when out of
    /// range or empty.
    pub fn get_with_hash(&self, index: u32) -> Option<(u32, &[u8; CHUNK])> {
        let slot = usize::try_from(index).ok()?;
        if !self.state.valid(slot / 2, slot % 2) {
            return None;
        }
        Some((*self.hashes.get(slot)?, self.chunks.get(slot)?))
    }

    /// Starts a batch: its lookups see the cache as it is now, and its
    /// touches may take their slot hints from those lookups.
    pub fn begin_batch(&mut self) {
        self.batch = self.batch.wrapping_add(1);
        if self.batch == 0 {
            // Once in 2^32 batches: forget which batch replaced what.
            self.replaced_in.fill(0);
            self.batch = 1;
        }
    }

    /// [`ChunkCache::touch`] of a chunk that this batch's lookup found at
    /// `slot` (or [`NO_SLOT`]): when no touch of the batch has replaced a
    /// way of that set since, the slot still holds the chunk (a set never
    /// holds the same chunk twice), so it becomes MRU without comparing the
    /// 256 bytes again. The result is always that of `touch`.
    pub fn touch_found(&mut self, hash: u32, chunk: &[u8; CHUNK], slot: u32) {
        // (NO_SLOT is also the last slot of a cache of 2^31 sets: that slot
        // just takes the full touch.)
        if let Some(slot) = (slot != NO_SLOT)
            .then(|| usize::try_from(slot).ok())
            .flatten()
        {
            let (set, way) = (slot / 2, slot % 2);
            if set == self.set_of(hash)
                && self.replaced_in.get(set) != Some(&self.batch)
                && self.state.valid(set, way)
                && self.hashes.get(slot) == Some(&hash)
            {
                self.state.make_mru(set, way);
                return;
            }
        }
        self.touch(hash, chunk);
    }

    /// Records a chunk just sent: the way holding it (same hash and content)
    /// becomes MRU, else it replaces the set's LRU way and becomes MRU.
    pub fn touch(&mut self, hash: u32, chunk: &[u8; CHUNK]) {
        let set = self.set_of(hash);
        let way = match self.way_of(hash, chunk) {
            Some(way) => way,
            None => {
                let way = self.state.lru(set);
                let slot = set * 2 + way;
                if let (Some(h), Some(c)) = (self.hashes.get_mut(slot), self.chunks.get_mut(slot)) {
                    *h = hash;
                    *c = *chunk;
                }
                if let Some(batch) = self.replaced_in.get_mut(set) {
                    *batch = self.batch;
                }
                way
            }
        };
        self.state.make_mru(set, way);
    }
}
