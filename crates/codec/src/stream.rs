//! Batch encoding and its mirror: page codec choice, raw fallback, and the
//! lookup-then-touch order of the caches. The encoder is here, the decoder
//! in `stream/decode.rs`.

use zstd::bulk::Compressor;

use crate::chunked::{self, ChunkOut};
use crate::dedup::{ChunkCache, NO_SLOT};
use crate::error::CodecError;
use crate::method::{CacheSizes, Method, PageCodec, ZSTD_LEVELS};
use crate::page::{chunk_at, chunks, is_zero_page, pages};
use crate::prefetch::prefetch;
use crate::sizes::{CHUNKS_PER_PAGE, MAX_BATCH_PAGES, PAGE};
use crate::xbzrle::PageCache;
use crate::{rle, superfasthash, xbzrle};

mod decode;
pub use decode::StreamDecoder;

/// One encoded batch; reused across batches (`clear()` keeps capacity).
///
/// Page i has codec `codecs[i]` and a payload of `lens[i]` bytes; the payloads
/// are concatenated in page order in `payload`.
#[derive(Default, Clone, Debug)]
pub struct EncodedBatch {
    /// Codec of each page.
    pub codecs: Vec<PageCodec>,
    /// Payload length of each page.
    pub lens: Vec<u32>,
    /// The page payloads, concatenated.
    pub payload: Vec<u8>,
}

impl EncodedBatch {
    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.codecs.clear();
        self.lens.clear();
        self.payload.clear();
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.codecs.len()
    }

    /// True when the batch holds no page.
    pub fn is_empty(&self) -> bool {
        self.codecs.is_empty()
    }

    /// Records a page whose payload starts at `start` in `payload`.
    fn push(&mut self, codec: PageCodec, start: usize) {
        self.codecs.push(codec);
        // A page payload is at most PAGE bytes.
        self.lens.push((self.payload.len() - start) as u32);
    }

    /// Codes one page: Zero if all zero, else `code` appends its payload and
    /// names the codec, or returns `None` and the page goes Raw.
    fn page(
        &mut self,
        page: &[u8; PAGE],
        code: impl FnOnce(&[u8; PAGE], &mut Vec<u8>) -> Option<PageCodec>,
    ) {
        if is_zero_page(page) {
            return self.zero_page();
        }
        self.coded(page, code);
    }

    /// Records a page known to be all zero.
    fn zero_page(&mut self) {
        self.push(PageCodec::Zero, self.payload.len());
    }

    /// [`EncodedBatch::page`] of a page known not to be all zero.
    fn coded(
        &mut self,
        page: &[u8; PAGE],
        code: impl FnOnce(&[u8; PAGE], &mut Vec<u8>) -> Option<PageCodec>,
    ) {
        let start = self.payload.len();
        match code(page, &mut self.payload) {
            Some(codec) => self.push(codec, start),
            None => {
                self.payload.truncate(start);
                self.payload.extend_from_slice(page);
                self.push(PageCodec::Raw, start);
            }
        }
    }
}

/// Refuses a batch that is too large or whose buffer is not pages * 4096
/// bytes (every encoder and decoder checks this first).
pub fn check_batch(pages: usize, bytes: usize) -> Result<(), CodecError> {
    if pages > MAX_BATCH_PAGES {
        return Err(CodecError::BatchTooLarge(pages));
    }
    if bytes != pages * PAGE {
        return Err(CodecError::DataLength {
            expected: pages * PAGE,
            actual: bytes,
        });
    }
    Ok(())
}

/// The cache in `slot`, created by `make` on first use.
fn lazy<T>(
    slot: &mut Option<T>,
    make: impl FnOnce() -> Result<T, CodecError>,
) -> Result<&mut T, CodecError> {
    let value = match slot.take() {
        Some(value) => value,
        None => make()?,
    };
    Ok(slot.insert(value))
}

/// Appends the rle form of a page; false when it would not beat Raw.
fn encode_rle(page: &[u8; PAGE], out: &mut Vec<u8>) -> bool {
    chunked::encode_page(page, out, |_, chunk, scratch| {
        match rle::encode_chunk(chunk, scratch) {
            Some(n) => ChunkOut::Encoded(n),
            None => ChunkOut::Verbatim,
        }
    })
}

/// The per-stream encoder: owns the xbzrle and dedup caches (allocated lazily
/// on first use) and encodes a batch with the method given.
///
/// Page indices may repeat within a batch: every page is still coded against
/// the cache state before the batch, and the touches in batch order leave the
/// last copy cached; the decoder does the same, so the result is well defined.
pub struct StreamEncoder {
    sizes: CacheSizes,
    xbzrle: Option<PageCache>,
    dedup: Option<ChunkCache>,
    zstd: Option<(i32, Compressor<'static>)>,
    /// A dedup batch's per-page and per-chunk working state.
    scratch: DedupScratch,
}

/// What a dedup batch's lookups leave for its touches (kept between batches
/// for their allocations).
#[derive(Default)]
struct DedupScratch {
    /// Per page of the batch: all zero (no hashes, no slots).
    zero: Vec<bool>,
    /// The chunk hashes of the non-zero pages, 16 a page.
    hashes: Vec<u32>,
    /// Where the lookups found each of those chunks ([`NO_SLOT`]: not found).
    slots: Vec<u32>,
}

/// How many non-zero pages ahead an encoder asks for the sets' hashes, and
/// for the way a hash matches. Far enough that a miss has landed when it is
/// read; near enough that 16 chunks' lines a page stay in the cache.
const HASHES_AHEAD: usize = 4;
const MATCH_AHEAD: usize = 2;
/// How many pages ahead of its hashing an encoder asks for a page's data.
const PAGES_AHEAD: usize = 2;

/// The 16 entries of the k-th page of a per-chunk vector (empty past its end).
fn page_slice<T>(v: &[T], k: usize) -> &[T] {
    v.get(k * CHUNKS_PER_PAGE..(k + 1) * CHUNKS_PER_PAGE)
        .unwrap_or_default()
}

impl StreamEncoder {
    /// An encoder whose caches (when first used) have these sizes.
    pub fn new(caches: CacheSizes) -> Self {
        StreamEncoder {
            sizes: caches,
            xbzrle: None,
            dedup: None,
            zstd: None,
            scratch: DedupScratch::default(),
        }
    }

    /// Encodes a batch: `pages` are page indices, `data` their contents
    /// (pages.len() * 4096 bytes). `out` is cleared first. On error the caches
    /// are unchanged.
    pub fn encode(
        &mut self,
        method: Method,
        pages: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), CodecError> {
        out.clear();
        check_batch(pages.len(), data.len())?;
        out.codecs.reserve(pages.len());
        out.lens.reserve(pages.len());
        match method {
            Method::None => {
                for page in self::pages(data) {
                    out.page(page, |_, _| None);
                }
            }
            Method::Rle => {
                for page in self::pages(data) {
                    out.page(page, |p, buf| encode_rle(p, buf).then_some(PageCodec::Rle));
                }
            }
            Method::Xbzrle => self.encode_xbzrle(pages, data, out)?,
            Method::Dedup => self.encode_dedup(data, out)?,
            Method::Lz4 => {
                let bound = lz4_flex::block::get_maximum_output_size(PAGE);
                for page in self::pages(data) {
                    out.page(page, |p, buf| {
                        let start = buf.len();
                        buf.resize(start + bound, 0);
                        match lz4_flex::block::compress_into(p, &mut buf[start..]) {
                            Ok(n) if n < PAGE => {
                                buf.truncate(start + n);
                                Some(PageCodec::Lz4)
                            }
                            _ => None,
                        }
                    });
                }
            }
            Method::Zstd(level) => self.encode_zstd(level, data, out)?,
        }
        Ok(())
    }

    fn encode_xbzrle(
        &mut self,
        indices: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), CodecError> {
        let bytes = self.sizes.xbzrle_bytes;
        let cache = lazy(&mut self.xbzrle, || PageCache::new(bytes))?;
        // Every page is coded against the cache as it was before the batch...
        for (&index, page) in indices.iter().zip(pages(data)) {
            out.page(page, |p, buf| match cache.lookup(index) {
                Some(old) => chunked::encode_page(p, buf, |i, chunk, scratch| {
                    match xbzrle::encode_chunk(chunk, chunk_at(old, i), scratch) {
                        Some(n) => ChunkOut::Encoded(n),
                        None => ChunkOut::Verbatim,
                    }
                })
                .then_some(PageCodec::Xbzrle),
                None => encode_rle(p, buf).then_some(PageCodec::Rle),
            });
        }
        // ...then every page, whatever its codec, touches it in batch order.
        for (&index, page) in indices.iter().zip(pages(data)) {
            cache.touch(index, page);
        }
        Ok(())
    }

    fn encode_dedup(&mut self, data: &[u8], out: &mut EncodedBatch) -> Result<(), CodecError> {
        let bytes = self.sizes.dedup_bytes;
        let cache = lazy(&mut self.dedup, || ChunkCache::new(bytes))?;
        cache.begin_batch();
        let DedupScratch {
            zero,
            hashes,
            slots,
        } = &mut self.scratch;
        zero.clear();
        hashes.clear();
        slots.clear();
        // The chunk hashes of every non-zero page first (zero pages have none)...
        for (k, page) in pages(data).enumerate() {
            // The hash reads a page as 16 rows a block apart, which the
            // CPU's own prefetchers follow poorly: asked for ahead.
            if let Some(ahead) = data.get((k + PAGES_AHEAD) * PAGE..(k + PAGES_AHEAD + 1) * PAGE) {
                prefetch(ahead);
            }
            let is_zero = is_zero_page(page);
            zero.push(is_zero);
            if !is_zero {
                hashes.extend(superfasthash::hash_chunks(page));
            }
        }
        let hashes_of = |k: usize| page_slice(hashes, k);
        // ...then lookups against the cache as it was before the batch. What
        // a lookup reads is asked for a few non-zero pages ahead (a set's
        // hashes, then the way that matches), so the cache misses of several
        // pages overlap instead of each page waiting for its own.
        for k in 0..HASHES_AHEAD {
            hashes_of(k).iter().for_each(|&h| cache.prefetch_hashes(h));
        }
        for k in 0..MATCH_AHEAD {
            hashes_of(k).iter().for_each(|&h| cache.prefetch_match(h));
        }
        let mut k = 0;
        for (page, &is_zero) in pages(data).zip(zero.iter()) {
            if is_zero {
                out.zero_page();
                continue;
            }
            hashes_of(k + HASHES_AHEAD)
                .iter()
                .for_each(|&h| cache.prefetch_hashes(h));
            hashes_of(k + MATCH_AHEAD)
                .iter()
                .for_each(|&h| cache.prefetch_match(h));
            let page_hashes = hashes_of(k);
            k += 1;
            // Where each chunk was found (the touch's hint), NO_SLOT if not.
            let start = slots.len();
            slots.resize(start + CHUNKS_PER_PAGE, NO_SLOT);
            let page_slots = slots.get_mut(start..).unwrap_or_default();
            out.coded(page, |p, buf| {
                chunked::encode_page(p, buf, |i, chunk, _| {
                    let hash = page_hashes.get(i).copied().unwrap_or_default();
                    match cache.lookup(hash, chunk) {
                        Some(slot) => {
                            if let Some(s) = page_slots.get_mut(i) {
                                *s = slot;
                            }
                            ChunkOut::Ref(slot)
                        }
                        None => ChunkOut::Verbatim,
                    }
                })
                .then_some(PageCodec::Dedup)
            });
        }
        // ...then every chunk of every non-zero page touches it in batch
        // order; a chunk the lookups found needs no second comparison.
        // (Asking for a found chunk's set bookkeeping ahead, as the lookups
        // do, measured slower: the lines are mostly in the cache by now.)
        let mut k = 0;
        for (page, &is_zero) in pages(data).zip(zero.iter()) {
            if is_zero {
                continue;
            }
            let page_slots = page_slice(slots, k);
            for (&hash, _) in hashes_of(k)
                .iter()
                .zip(page_slots)
                .filter(|(_, &slot)| slot == NO_SLOT)
            {
                cache.prefetch(hash);
            }
            for ((chunk, &hash), &slot) in chunks(page).zip(hashes_of(k)).zip(page_slots) {
                cache.touch_found(hash, chunk, slot);
            }
            k += 1;
        }
        Ok(())
    }

    fn encode_zstd(
        &mut self,
        level: i32,
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), CodecError> {
        if !ZSTD_LEVELS.contains(&level) {
            return Err(CodecError::BadZstdLevel(level));
        }
        let (current, compressor) = lazy(&mut self.zstd, || {
            Compressor::new(level)
                .map(|c| (level, c))
                .map_err(CodecError::ZstdContext)
        })?;
        if *current != level {
            compressor
                .set_compression_level(level)
                .map_err(CodecError::ZstdContext)?;
            *current = level;
        }
        let bound = zstd::zstd_safe::compress_bound(PAGE);
        for page in pages(data) {
            out.page(page, |p, buf| {
                let start = buf.len();
                buf.resize(start + bound, 0);
                // A zstd failure on our own page is not expected; Raw is still correct.
                match compressor.compress_to_buffer(p, &mut buf[start..]) {
                    Ok(n) if n < PAGE => {
                        buf.truncate(start + n);
                        Some(PageCodec::Zstd)
                    }
                    _ => None,
                }
            });
        }
        Ok(())
    }
}
