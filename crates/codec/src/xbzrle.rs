//! xbzrle: XOR delta of a page against its previous version, zero-run encoded
//! per chunk, and the page cache that holds the previous versions.

use crate::error::{ChunkError, CodecError};
use crate::sets::{alloc, sets_for, SetState};
use crate::sizes::{CHUNK, PAGE};
use crate::zrle;

/// Encodes one chunk against its cached version, returning the length, or
/// `None` when the chunk overflows (it goes verbatim).
pub fn encode_chunk(src: &[u8; CHUNK], old: &[u8; CHUNK], out: &mut [u8; CHUNK]) -> Option<usize> {
    let mut x = [0u8; CHUNK];
    for ((x, &a), &b) in x.iter_mut().zip(src).zip(old) {
        *x = a ^ b;
    }
    zrle::encode(&x, out)
}

/// Decodes one chunk payload (not a verbatim one) against its cached version.
pub fn decode_chunk(
    src: &[u8],
    old: &[u8; CHUNK],
    out: &mut [u8; CHUNK],
) -> Result<(), ChunkError> {
    zrle::decode(src, out)?;
    for (o, &b) in out.iter_mut().zip(old) {
        *o ^= b;
    }
    Ok(())
}

/// 2-way set-associative cache of previous page versions.
///
/// entries = bytes / 4096, sets = entries / 2 (at least 1, so at least two
/// pages are held even when the size is smaller); set = page index % sets,
/// tag = page index; LRU within a set.
#[derive(Clone, Debug)]
pub struct PageCache {
    sets: usize,
    state: SetState,
    /// Tag of way w of set s at `s * 2 + w`.
    tags: Vec<u64>,
    /// Content of way w of set s at `s * 2 + w`.
    pages: Vec<[u8; PAGE]>,
}

impl PageCache {
    /// The number of sets of a cache of `bytes` bytes (see the type), or
    /// why there cannot be such a cache. The GPU backend uses the same rule.
    pub fn sets_for(bytes: u64) -> Result<usize, CodecError> {
        usize::try_from(sets_for(bytes, PAGE)).map_err(|_| CodecError::CacheSize {
            what: "xbzrle",
            bytes,
        })
    }

    /// An empty cache of `bytes` bytes (see the type for the geometry).
    pub fn new(bytes: u64) -> Result<Self, CodecError> {
        let too_big = || CodecError::CacheSize {
            what: "xbzrle",
            bytes,
        };
        let sets = Self::sets_for(bytes)?;
        let ways = sets.checked_mul(2).ok_or_else(too_big)?;
        Ok(PageCache {
            sets,
            state: SetState::new(sets).ok_or_else(too_big)?,
            tags: alloc(ways, 0).ok_or_else(too_big)?,
            pages: alloc(ways, [0; PAGE]).ok_or_else(too_big)?,
        })
    }

    /// Number of sets.
    pub fn sets(&self) -> usize {
        self.sets
    }

    /// The set a page index maps to.
    pub fn set_of(&self, index: u64) -> usize {
        // The remainder is below `sets`, which is a usize.
        (index % self.sets as u64) as usize
    }

    /// The way of the set holding `index`, if any.
    pub fn way_of(&self, index: u64) -> Option<usize> {
        let set = self.set_of(index);
        (0..2).find(|&w| self.state.valid(set, w) && self.tags.get(set * 2 + w) == Some(&index))
    }

    /// The cached version of page `index`.
    pub fn lookup(&self, index: u64) -> Option<&[u8; PAGE]> {
        let way = self.way_of(index)?;
        self.pages.get(self.set_of(index) * 2 + way)
    }

    /// Records `content` as the latest version of page `index`: overwrites the
    /// way holding it, else replaces the set's LRU way; that way becomes MRU.
    pub fn touch(&mut self, index: u64, content: &[u8; PAGE]) {
        let set = self.set_of(index);
        let way = self.way_of(index).unwrap_or_else(|| self.state.lru(set));
        let slot = set * 2 + way;
        if let (Some(tag), Some(page)) = (self.tags.get_mut(slot), self.pages.get_mut(slot)) {
            *tag = index;
            *page = *content;
        }
        self.state.make_mru(set, way);
    }
}
