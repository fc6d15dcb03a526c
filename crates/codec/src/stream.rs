//! Batch encoding and its mirror: page codec choice, raw fallback, and the
//! lookup-then-touch order of the caches.

use zstd::bulk::{Compressor, Decompressor};

use crate::chunked::{self, ChunkOut, HDR_DEDUP_REF, HDR_LEN_MASK};
use crate::dedup::{ChunkCache, NO_SLOT};
use crate::error::{ChunkError, CodecError};
use crate::method::{CacheSizes, Method, PageCodec, ZSTD_LEVELS};
use crate::page::{chunk_at, chunks, is_zero_page, pages, pages_mut};
use crate::prefetch::prefetch;
use crate::sizes::{CHUNKS_PER_PAGE, MAX_BATCH_PAGES, PAGE};
use crate::xbzrle::PageCache;
use crate::{rle, superfasthash, xbzrle};

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
/// How many pages ahead (of any codec, zero pages included) a decoder asks
/// for the chunks a dedup page references.
const REFS_AHEAD: usize = 2;

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

/// The mirror of [`StreamEncoder`]: decodes a batch and updates its caches
/// exactly as the encoder did.
pub struct StreamDecoder {
    sizes: CacheSizes,
    xbzrle: Option<PageCache>,
    dedup: Option<ChunkCache>,
    zstd: Option<Decompressor<'static>>,
    /// Per chunk of each dedup-coded page of a batch: the cached chunk its
    /// reference named, if it was one.
    refs: Vec<ChunkRef>,
}

/// A decoded chunk that was a reference: the cached chunk's hash and slot
/// ([`NO_SLOT`]: the chunk was literal), so the cache's touch after the
/// batch neither hashes it again nor looks it up.
#[derive(Clone, Copy)]
struct ChunkRef {
    hash: u32,
    slot: u32,
}

impl ChunkRef {
    const LITERAL: ChunkRef = ChunkRef {
        hash: 0,
        slot: NO_SLOT,
    };

    fn is_ref(self) -> bool {
        self.slot != NO_SLOT
    }
}

impl StreamDecoder {
    /// A decoder whose caches (when first used) have these sizes; they must
    /// equal the encoder's.
    pub fn new(caches: CacheSizes) -> Self {
        StreamDecoder {
            sizes: caches,
            xbzrle: None,
            dedup: None,
            zstd: None,
            refs: Vec::new(),
        }
    }

    /// [`StreamDecoder::decode`] of an [`EncodedBatch`].
    pub fn decode_batch(
        &mut self,
        method: Method,
        pages: &[u64],
        batch: &EncodedBatch,
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        self.decode(
            method,
            pages,
            &batch.codecs,
            &batch.lens,
            &batch.payload,
            out,
        )
    }

    /// Decodes a batch into `out` (pages.len() * 4096 bytes). Any inconsistency
    /// is an error; on error the caches are unchanged and `out` is unspecified.
    pub fn decode(
        &mut self,
        method: Method,
        pages: &[u64],
        codecs: &[PageCodec],
        lens: &[u32],
        payload: &[u8],
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        check_batch(pages.len(), out.len())?;
        if codecs.len() != pages.len() || lens.len() != pages.len() {
            return Err(CodecError::MetaLength {
                pages: pages.len(),
                codecs: codecs.len(),
                lens: lens.len(),
            });
        }
        let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
        if total != payload.len() as u64 {
            return Err(CodecError::PayloadLength {
                expected: total,
                actual: payload.len(),
            });
        }
        let xbzrle_cache = match method {
            Method::Xbzrle => {
                let bytes = self.sizes.xbzrle_bytes;
                Some(&*lazy(&mut self.xbzrle, || PageCache::new(bytes))?)
            }
            _ => None,
        };
        let dedup_cache = match method {
            Method::Dedup => {
                let bytes = self.sizes.dedup_bytes;
                let cache = lazy(&mut self.dedup, || ChunkCache::new(bytes))?;
                cache.begin_batch();
                Some(&*cache)
            }
            _ => None,
        };
        let refs = &mut self.refs;
        refs.clear();
        // The references of the dedup page REFS_AHEAD pages on are fetched
        // while this one decodes: (position, payload offset) of that page.
        let mut ahead = (0, 0);

        // Every page is decoded against the caches as they were before the batch.
        let mut rest = payload;
        for (pos, (((&codec, &len), &index), dst)) in codecs
            .iter()
            .zip(lens)
            .zip(pages)
            .zip(pages_mut(out))
            .enumerate()
        {
            if !method.allows(codec) {
                return Err(CodecError::CodecNotAllowed {
                    page: pos,
                    codec,
                    method,
                });
            }
            let bad_len = CodecError::PageLength {
                page: pos,
                codec,
                len,
            };
            // The lengths add up to the payload, so this split always succeeds.
            let (src, tail) =
                rest.split_at_checked(len as usize)
                    .ok_or(CodecError::PayloadLength {
                        expected: total,
                        actual: payload.len(),
                    })?;
            rest = tail;
            match codec {
                PageCodec::Raw => {
                    if src.len() != PAGE {
                        return Err(bad_len);
                    }
                    dst.copy_from_slice(src);
                }
                PageCodec::Zero => {
                    if !src.is_empty() {
                        return Err(bad_len);
                    }
                    dst.fill(0);
                }
                PageCodec::Rle => chunked::decode_page(pos, src, dst, |chunk, header, body, d| {
                    if header > HDR_LEN_MASK {
                        return Err(chunk_error(pos, chunk, ChunkError::BadHeader(header)));
                    }
                    rle::decode_chunk(body, d).map_err(|e| chunk_error(pos, chunk, e))
                })?,
                PageCodec::Xbzrle => {
                    let old = xbzrle_cache
                        .and_then(|c| c.lookup(index))
                        .ok_or(CodecError::XbzrleMiss { page: pos, index })?;
                    chunked::decode_page(pos, src, dst, |chunk, header, body, d| {
                        if header > HDR_LEN_MASK {
                            return Err(chunk_error(pos, chunk, ChunkError::BadHeader(header)));
                        }
                        xbzrle::decode_chunk(body, chunk_at(old, chunk), d)
                            .map_err(|e| chunk_error(pos, chunk, e))
                    })?
                }
                PageCodec::Dedup => {
                    if let Some(cache) = dedup_cache {
                        while ahead.0 < codecs.len() && ahead.0 <= pos + REFS_AHEAD {
                            let len = lens.get(ahead.0).map_or(0, |&l| l as usize);
                            if codecs.get(ahead.0) == Some(&PageCodec::Dedup) {
                                let src = payload.get(ahead.1..ahead.1 + len).unwrap_or_default();
                                for index in chunked::dedup_refs(src) {
                                    cache.prefetch_index(index);
                                }
                            }
                            ahead = (ahead.0 + 1, ahead.1 + len);
                        }
                    }
                    let start = refs.len();
                    refs.resize(start + CHUNKS_PER_PAGE, ChunkRef::LITERAL);
                    let page_refs = refs.get_mut(start..).unwrap_or_default();
                    chunked::decode_page(pos, src, dst, |chunk, header, body, d| {
                        if header != HDR_DEDUP_REF {
                            return Err(chunk_error(pos, chunk, ChunkError::BadHeader(header)));
                        }
                        let index = match *body {
                            [a, b, c, e] => u32::from_le_bytes([a, b, c, e]),
                            _ => {
                                return Err(chunk_error(pos, chunk, ChunkError::BadHeader(header)))
                            }
                        };
                        let (hash, cached) = dedup_cache
                            .and_then(|c| c.get_with_hash(index))
                            .ok_or(CodecError::DedupIndex {
                                page: pos,
                                chunk,
                                index,
                            })?;
                        *d = *cached;
                        if let Some(r) = page_refs.get_mut(chunk) {
                            *r = ChunkRef { hash, slot: index };
                        }
                        Ok(())
                    })?
                }
                PageCodec::Lz4 => match lz4_flex::block::decompress_into(src, dst) {
                    Ok(PAGE) => {}
                    Ok(n) => {
                        return Err(CodecError::Lz4 {
                            page: pos,
                            reason: format!("{n} bytes, not {PAGE}"),
                        })
                    }
                    Err(e) => {
                        return Err(CodecError::Lz4 {
                            page: pos,
                            reason: e.to_string(),
                        })
                    }
                },
                PageCodec::Zstd => {
                    let zstd = lazy(&mut self.zstd, || {
                        Decompressor::new().map_err(CodecError::ZstdContext)
                    })?;
                    match zstd.decompress_to_buffer(src, &mut dst[..]) {
                        Ok(PAGE) => {}
                        Ok(n) => {
                            return Err(CodecError::Zstd {
                                page: pos,
                                reason: format!("{n} bytes, not {PAGE}"),
                            })
                        }
                        Err(e) => {
                            return Err(CodecError::Zstd {
                                page: pos,
                                reason: e.to_string(),
                            })
                        }
                    }
                }
            }
        }

        // Then the same touches as the encoder, in batch order.
        match method {
            Method::Xbzrle => {
                if let Some(cache) = self.xbzrle.as_mut() {
                    for (&index, page) in pages.iter().zip(self::pages(out)) {
                        cache.touch(index, page);
                    }
                }
            }
            Method::Dedup => {
                if let Some(cache) = self.dedup.as_mut() {
                    let mut refs = self.refs.chunks_exact(CHUNKS_PER_PAGE);
                    for (page, &codec) in self::pages(out).zip(codecs) {
                        if codec == PageCodec::Zero {
                            continue;
                        }
                        let page_refs = if codec == PageCodec::Dedup {
                            refs.next().unwrap_or_default()
                        } else {
                            &[]
                        };
                        // A page of references alone needs no hashing: each
                        // came with its cached chunk's hash.
                        let hashes = match page_refs {
                            r if r.len() == CHUNKS_PER_PAGE && r.iter().all(|r| r.is_ref()) => {
                                std::array::from_fn(|i| r.get(i).map_or(0, |r| r.hash))
                            }
                            _ => superfasthash::hash_chunks(page),
                        };
                        for (i, &hash) in hashes.iter().enumerate() {
                            if !page_refs.get(i).is_some_and(|r| r.is_ref()) {
                                cache.prefetch(hash);
                            }
                        }
                        for (i, (chunk, hash)) in chunks(page).zip(hashes).enumerate() {
                            let slot = page_refs.get(i).map_or(NO_SLOT, |r| r.slot);
                            cache.touch_found(hash, chunk, slot);
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn chunk_error(page: usize, chunk: usize, source: ChunkError) -> CodecError {
    CodecError::Chunk {
        page,
        chunk,
        source,
    }
}
