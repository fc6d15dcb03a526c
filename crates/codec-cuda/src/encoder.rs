//! One batch on the GPU: upload, code every chunk, size and place the pages,
//! pack, fetch; then update the caches. Mirrors ferry-codec's StreamEncoder
//! for none, rle, xbzrle and dedup.

use ferry_codec::dedup::ChunkCache;
use ferry_codec::xbzrle::PageCache;
use ferry_codec::{
    CacheSizes, CodecError, EncodedBatch, Method, PageCodec, CHUNK, CHUNKS_PER_PAGE,
    MAX_BATCH_PAGES, PAGE,
};

use crate::device::{Arg, Device, Kernel};
use crate::GpuError;

const MAX_CHUNKS: usize = MAX_BATCH_PAGES * CHUNKS_PER_PAGE;

/// The method ids of kernels.cu.
fn method_id(method: Method) -> Result<u32, GpuError> {
    match method {
        Method::None => Ok(0),
        Method::Rle => Ok(1),
        Method::Xbzrle => Ok(2),
        Method::Dedup => Ok(3),
        other => Err(GpuError::NotOnGpu(other)),
    }
}

/// Per-batch device buffers, sized for the largest batch.
struct Batch<B> {
    data: B,
    idx: B,
    hit: B,
    chdr: B,
    clen: B,
    cbuf: B,
    czero: B,
    chash: B,
    pcodec: B,
    plen: B,
    poff: B,
    coff: B,
    out: B,
    gstart: B,
    order: B,
}

struct XbzCache<B> {
    sets: u64,
    state: B,
    tags: B,
    pages: B,
}

struct DedupCache<B> {
    sets: u32,
    state: B,
    hashes: B,
    chunks: B,
}

/// The GPU encoder of one stream: owns its device buffers and the xbzrle and
/// dedup caches (in GPU memory, allocated on first use).
pub struct GpuEncoder<D: Device> {
    dev: D,
    sizes: CacheSizes,
    b: Batch<D::Buf>,
    xbz: Option<XbzCache<D::Buf>>,
    dedup: Option<DedupCache<D::Buf>>,
    /// Host copies of the per-page results and of the chunk hashes.
    pcodec: Vec<u8>,
    plen: Vec<u8>,
    poff: Vec<u8>,
    chash: Vec<u8>,
}

fn u32s(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Groups `items` (key, item) by key, keeping item order within a key:
/// `order` lists the items group by group, `gstart[g]..gstart[g+1]` is group g.
fn group(mut items: Vec<(u64, u32)>, order: &mut Vec<u8>, gstart: &mut Vec<u8>) -> u32 {
    items.sort_unstable();
    order.clear();
    gstart.clear();
    let mut groups = 0u32;
    for (i, &(key, item)) in items.iter().enumerate() {
        if i == 0 || items[i - 1].0 != key {
            gstart.extend_from_slice(&(i as u32).to_le_bytes());
            groups += 1;
        }
        order.extend_from_slice(&item.to_le_bytes());
    }
    gstart.extend_from_slice(&(items.len() as u32).to_le_bytes());
    groups
}

impl<D: Device> GpuEncoder<D> {
    /// An encoder on `dev` whose caches (when first used) have these sizes.
    pub fn new(dev: D, sizes: CacheSizes) -> Result<Self, GpuError> {
        let b = Batch {
            data: dev.alloc(MAX_BATCH_PAGES * PAGE)?,
            idx: dev.alloc(MAX_BATCH_PAGES * 8)?,
            hit: dev.alloc(MAX_BATCH_PAGES * 4)?,
            chdr: dev.alloc(MAX_CHUNKS * 2)?,
            clen: dev.alloc(MAX_CHUNKS * 2)?,
            cbuf: dev.alloc(MAX_CHUNKS * CHUNK)?,
            czero: dev.alloc(MAX_CHUNKS)?,
            chash: dev.alloc(MAX_CHUNKS * 4)?,
            pcodec: dev.alloc(MAX_BATCH_PAGES)?,
            plen: dev.alloc(MAX_BATCH_PAGES * 4)?,
            poff: dev.alloc((MAX_BATCH_PAGES + 1) * 4)?,
            coff: dev.alloc(MAX_CHUNKS * 2)?,
            out: dev.alloc(MAX_BATCH_PAGES * PAGE)?,
            gstart: dev.alloc((MAX_CHUNKS + 1) * 4)?,
            order: dev.alloc(MAX_CHUNKS * 4)?,
        };
        Ok(GpuEncoder {
            dev,
            sizes,
            b,
            xbz: None,
            dedup: None,
            pcodec: Vec::new(),
            plen: Vec::new(),
            poff: Vec::new(),
            chash: Vec::new(),
        })
    }

    /// The device this encoder runs on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Allocates the xbzrle cache on first use (the CPU's geometry).
    fn ensure_xbz_cache(&mut self) -> Result<(), GpuError> {
        if self.xbz.is_none() {
            let bytes = self.sizes.xbzrle_bytes;
            let sets = PageCache::sets_for(bytes)?;
            let too_big = || CodecError::CacheSize {
                what: "xbzrle",
                bytes,
            };
            let ways = sets.checked_mul(2).ok_or_else(too_big)?;
            self.xbz = Some(XbzCache {
                sets: sets as u64,
                state: self.dev.alloc(sets)?,
                tags: self.dev.alloc(ways.checked_mul(8).ok_or_else(too_big)?)?,
                pages: self
                    .dev
                    .alloc(ways.checked_mul(PAGE).ok_or_else(too_big)?)?,
            });
        }
        Ok(())
    }

    /// Allocates the dedup cache on first use (the CPU's geometry).
    fn ensure_dedup_cache(&mut self) -> Result<(), GpuError> {
        if self.dedup.is_none() {
            let bytes = self.sizes.dedup_bytes;
            // At most 2^31 sets, so the count and every reference fit a u32.
            let sets = ChunkCache::sets_for(bytes)?;
            let too_big = || CodecError::CacheSize {
                what: "dedup",
                bytes,
            };
            let ways = sets.checked_mul(2).ok_or_else(too_big)?;
            self.dedup = Some(DedupCache {
                sets: u32::try_from(sets).map_err(|_| too_big())?,
                state: self.dev.alloc(sets)?,
                hashes: self.dev.alloc(ways.checked_mul(4).ok_or_else(too_big)?)?,
                chunks: self
                    .dev
                    .alloc(ways.checked_mul(CHUNK).ok_or_else(too_big)?)?,
            });
        }
        Ok(())
    }

    /// Encodes a batch exactly as `StreamEncoder::encode` would (methods none,
    /// rle, xbzrle and dedup): `pages` are page indices, `data` their
    /// contents. `out` is cleared first.
    pub fn encode(
        &mut self,
        method: Method,
        pages: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), GpuError> {
        out.clear();
        let n = pages.len();
        ferry_codec::check_batch(n, data.len())?;
        let m = method_id(method)?;
        if n == 0 {
            return Ok(());
        }
        if method == Method::Xbzrle {
            self.ensure_xbz_cache()?;
        }
        if method == Method::Dedup {
            self.ensure_dedup_cache()?;
        }
        let nchunks = (n * CHUNKS_PER_PAGE) as u32;
        let n32 = n as u32;
        let (dev, b) = (&self.dev, &mut self.b);
        dev.upload_pages(data, &mut b.data)?;
        match (method, &self.xbz, &self.dedup) {
            (Method::None, _, _) => {
                dev.launch(
                    Kernel::ZeroChunks,
                    nchunks,
                    &[Arg::U32(nchunks), Arg::Buf(&b.data), Arg::Buf(&b.czero)],
                )?;
            }
            (Method::Rle, _, _) => {
                dev.launch(
                    Kernel::RleChunks,
                    nchunks,
                    &[
                        Arg::U32(nchunks),
                        Arg::Buf(&b.data),
                        Arg::U32(0),
                        Arg::Buf(&b.hit),
                        Arg::Buf(&b.cbuf), // unread without hits
                        Arg::Buf(&b.chdr),
                        Arg::Buf(&b.clen),
                        Arg::Buf(&b.cbuf),
                        Arg::Buf(&b.czero),
                    ],
                )?;
            }
            (Method::Xbzrle, Some(x), _) => {
                let idx: Vec<u8> = pages.iter().flat_map(|p| p.to_le_bytes()).collect();
                dev.upload(&idx, &mut b.idx)?;
                dev.launch(
                    Kernel::XbzLookup,
                    n32,
                    &[
                        Arg::U32(n32),
                        Arg::Buf(&b.idx),
                        Arg::U64(x.sets),
                        Arg::Buf(&x.state),
                        Arg::Buf(&x.tags),
                        Arg::Buf(&b.hit),
                    ],
                )?;
                dev.launch(
                    Kernel::RleChunks,
                    nchunks,
                    &[
                        Arg::U32(nchunks),
                        Arg::Buf(&b.data),
                        Arg::U32(1),
                        Arg::Buf(&b.hit),
                        Arg::Buf(&x.pages),
                        Arg::Buf(&b.chdr),
                        Arg::Buf(&b.clen),
                        Arg::Buf(&b.cbuf),
                        Arg::Buf(&b.czero),
                    ],
                )?;
            }
            (Method::Dedup, _, Some(d)) => {
                dev.launch(
                    Kernel::DedupChunks,
                    nchunks,
                    &[
                        Arg::U32(nchunks),
                        Arg::Buf(&b.data),
                        Arg::U32(d.sets),
                        Arg::Buf(&d.state),
                        Arg::Buf(&d.hashes),
                        Arg::Buf(&d.chunks),
                        Arg::Buf(&b.chash),
                        Arg::Buf(&b.chdr),
                        Arg::Buf(&b.clen),
                        Arg::Buf(&b.cbuf),
                        Arg::Buf(&b.czero),
                    ],
                )?;
            }
            _ => return Err(GpuError::Inconsistent(format!("no cache for {method}"))),
        }
        dev.launch(
            Kernel::PageSizes,
            n32,
            &[
                Arg::U32(n32),
                Arg::U32(m),
                Arg::Buf(&b.hit),
                Arg::Buf(&b.czero),
                Arg::Buf(&b.clen),
                Arg::Buf(&b.pcodec),
                Arg::Buf(&b.plen),
                Arg::Buf(&b.coff),
            ],
        )?;
        dev.launch(
            Kernel::ScanOffsets,
            1,
            &[Arg::U32(n32), Arg::Buf(&b.plen), Arg::Buf(&b.poff)],
        )?;
        dev.launch(
            Kernel::Pack,
            nchunks,
            &[
                Arg::U32(nchunks),
                Arg::Buf(&b.data),
                Arg::Buf(&b.pcodec),
                Arg::Buf(&b.poff),
                Arg::Buf(&b.coff),
                Arg::Buf(&b.chdr),
                Arg::Buf(&b.clen),
                Arg::Buf(&b.cbuf),
                Arg::Buf(&b.out),
            ],
        )?;
        // The batch's shape, then its payload.
        self.pcodec.resize(n, 0);
        self.plen.resize(n * 4, 0);
        self.poff.resize((n + 1) * 4, 0);
        dev.fetch(&b.pcodec, &mut self.pcodec)?;
        dev.fetch(&b.plen, &mut self.plen)?;
        dev.fetch(&b.poff, &mut self.poff)?;
        let total = u32s(&self.poff).nth(n).unwrap_or(0) as usize;
        for (i, len) in u32s(&self.plen).enumerate() {
            let codec = PageCodec::try_from(self.pcodec[i])
                .map_err(|e| GpuError::Inconsistent(e.to_string()))?;
            if len as usize > PAGE {
                return Err(GpuError::Inconsistent(format!("page {i} has {len} bytes")));
            }
            out.codecs.push(codec);
            out.lens.push(len);
        }
        if out.lens.iter().map(|&l| l as usize).sum::<usize>() != total {
            return Err(GpuError::Inconsistent("page sizes do not add up".into()));
        }
        out.payload.resize(total, 0);
        dev.fetch(&b.out, &mut out.payload)?;
        // Then the caches, in batch order within each set (they run on the
        // GPU while the caller sends this batch).
        match (method, &self.xbz, &self.dedup) {
            (Method::Xbzrle, Some(x), _) => {
                let items = pages
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| (p % x.sets, i as u32))
                    .collect();
                let (mut order, mut gstart) = (Vec::new(), Vec::new());
                let groups = group(items, &mut order, &mut gstart);
                dev.upload(&order, &mut b.order)?;
                dev.upload(&gstart, &mut b.gstart)?;
                dev.launch(
                    Kernel::XbzTouch,
                    groups,
                    &[
                        Arg::U32(groups),
                        Arg::Buf(&b.gstart),
                        Arg::Buf(&b.order),
                        Arg::Buf(&b.idx),
                        Arg::Buf(&b.data),
                        Arg::U64(x.sets),
                        Arg::Buf(&x.state),
                        Arg::Buf(&x.tags),
                        Arg::Buf(&x.pages),
                    ],
                )?;
            }
            (Method::Dedup, _, Some(d)) => {
                self.chash.resize(n * CHUNKS_PER_PAGE * 4, 0);
                dev.fetch(&b.chash, &mut self.chash)?;
                // Every chunk of every page that is not Zero, pages in batch order.
                let items = u32s(&self.chash)
                    .enumerate()
                    .filter(|(k, _)| out.codecs[k / CHUNKS_PER_PAGE] != PageCodec::Zero)
                    .map(|(k, h)| (u64::from(h % d.sets), k as u32))
                    .collect();
                let (mut order, mut gstart) = (Vec::new(), Vec::new());
                let groups = group(items, &mut order, &mut gstart);
                if groups > 0 {
                    dev.upload(&order, &mut b.order)?;
                    dev.upload(&gstart, &mut b.gstart)?;
                    dev.launch(
                        Kernel::DedupTouch,
                        groups,
                        &[
                            Arg::U32(groups),
                            Arg::Buf(&b.gstart),
                            Arg::Buf(&b.order),
                            Arg::Buf(&b.data),
                            Arg::Buf(&b.chash),
                            Arg::Buf(&b.czero),
                            Arg::U32(d.sets),
                            Arg::Buf(&d.state),
                            Arg::Buf(&d.hashes),
                            Arg::Buf(&d.chunks),
                        ],
                    )?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_keep_batch_order_within_a_set() {
        let (mut order, mut gstart) = (Vec::new(), Vec::new());
        let groups = group(
            vec![(5, 0), (2, 1), (5, 2), (2, 3), (9, 4)],
            &mut order,
            &mut gstart,
        );
        assert_eq!(groups, 3);
        assert_eq!(u32s(&order).collect::<Vec<_>>(), [1, 3, 0, 2, 4]);
        assert_eq!(u32s(&gstart).collect::<Vec<_>>(), [0, 2, 4, 5]);
    }
}
