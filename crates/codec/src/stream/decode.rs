//! The decoder, the encoder's mirror: checks a batch against its method
//! and lengths, decodes every page against the caches as they were before
//! the batch, then touches them in batch order as the encoder did.

use zstd::bulk::Decompressor;

use super::{check_batch, lazy, EncodedBatch};
use crate::chunked::{self, HDR_DEDUP_REF, HDR_LEN_MASK};
use crate::dedup::{ChunkCache, NO_SLOT};
use crate::error::{ChunkError, CodecError};
use crate::method::{CacheSizes, Method, PageCodec};
use crate::page::{chunk_at, chunks, pages, pages_mut};
use crate::sizes::{CHUNKS_PER_PAGE, PAGE};
use crate::xbzrle::PageCache;
use crate::{rle, superfasthash, xbzrle};

/// How many pages ahead (of any codec, zero pages included) a decoder asks
/// for the chunks a dedup page references.
const REFS_AHEAD: usize = 2;

/// The mirror of [`StreamEncoder`](super::StreamEncoder): decodes a batch
/// and updates its caches exactly as the encoder did.
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
