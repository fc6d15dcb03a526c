// ferry's page codecs on CUDA: zero detection, GM-RLE, XBZRLE and dedup.
//
// The byte format is docs/codecs.md; the output must equal ferry-codec's CPU
// encoder byte for byte. Compiled at run time by NVRTC (no CUDA toolkit is
// needed to build ferry), and on the host as C++ by the emulation tests, so
// every kernel is a plain per-thread function: one thread per chunk (or page,
// or cache set), no shared memory, no barriers, and no thread reads what
// another thread of the same launch writes.
//
// Buffers, for a batch of n pages (chunk k = page p * 16 + chunk c):
//   data[n*4096]          the pages
//   chdr[k] (u16)         chunk header (0x8000 verbatim, 1..255 zrle, 0x4004 ref)
//   clen[k] (u16)         chunk payload bytes (256, 1..255 or 4)
//   cbuf[k*256]           chunk payload when it is not the chunk itself
//   czero[k] (u8)         the chunk is all zero
//   pcodec[p] (u8)        page codec id (0 Raw, 1 Zero, 2 Rle, 3 Xbzrle, 4 Dedup)
//   plen[p], poff[p]      page payload bytes and offset in the batch payload
//   coff[k] (u16)         chunk payload offset inside its page's payload
// Cache set state (one byte per set): bit 0 = LRU way, bits 1/2 = way 0/1 valid.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define PAGE 4096
#define CHUNK 256
#define CHUNKS 16
#define HDR_OVERFLOW 0x8000
#define HDR_REF 0x4004
#define NO_HIT 0xffffffffu

enum { RAW = 0, ZERO = 1, RLE = 2, XBZRLE = 3, DEDUP = 4 };
enum { M_NONE = 0, M_RLE = 1, M_XBZRLE = 2, M_DEDUP = 3 };

__device__ __forceinline__ u32 thread_index() { return blockIdx.x * blockDim.x + threadIdx.x; }

__device__ bool chunk_is_zero(const u8 *p) {
    for (int i = 0; i < CHUNK; i++)
        if (p[i]) return false;
    return true;
}

// Zero-run encoding; returns the length or -1 when it would reach 256 bytes.
__device__ int zrle(const u8 *src, u8 *out) {
    int i = 0, o = 0;
    while (i < CHUNK) {
        u8 b = src[i];
        if (b) {
            if (o + 1 > CHUNK - 1) return -1;
            out[o++] = b;
            i++;
        } else {
            int j = i;
            while (j < CHUNK && src[j] == 0) j++;
            if (o + 2 > CHUNK - 1) return -1;
            out[o] = 0;
            out[o + 1] = (u8)(j - i - 1);
            o += 2;
            i = j;
        }
    }
    return o;
}

__device__ u32 superfasthash(const u8 *p, u32 n) {
    // Dedup hashes whole 256-byte chunks: no tail.
    u32 h = n;
    for (u32 q = 0; q < n / 4; q++, p += 4) {
        h += (u32)p[0] | ((u32)p[1] << 8);
        u32 tmp = (((u32)p[2] | ((u32)p[3] << 8)) << 11) ^ h;
        h = (h << 16) ^ tmp;
        h += h >> 11;
    }
    h ^= h << 3;
    h += h >> 5;
    h ^= h << 4;
    h += h >> 17;
    h ^= h << 25;
    h += h >> 6;
    return h;
}

__device__ bool valid(u8 state, u32 way) { return (state & (2u << way)) != 0; }
__device__ u8 make_mru(u8 state, u32 way) { return (u8)((state & ~1u) | (way ^ 1u) | (2u << way)); }

__device__ bool same_chunk(const u8 *a, const u8 *b) {
    for (int i = 0; i < CHUNK; i++)
        if (a[i] != b[i]) return false;
    return true;
}

// Method none: only which chunks are zero.
extern "C" __global__ void zero_chunks(u32 nchunks, const u8 *data, u8 *czero) {
    u32 k = thread_index();
    if (k >= nchunks) return;
    czero[k] = chunk_is_zero(data + (u64)k * CHUNK);
}

// xbzrle lookup, one thread per page: the slot holding page idx[p], or NO_HIT.
extern "C" __global__ void xbz_lookup(u32 npages, const u64 *idx, u64 sets, const u8 *state,
                                      const u64 *tags, u32 *hit) {
    u32 p = thread_index();
    if (p >= npages) return;
    u64 set = idx[p] % sets;
    hit[p] = NO_HIT;
    for (u32 w = 0; w < 2; w++) {
        if (valid(state[set], w) && tags[set * 2 + w] == idx[p]) {
            hit[p] = (u32)(set * 2 + w);
            return;
        }
    }
}

// GM-RLE, or XBZRLE for a page that hit (use_hit != 0), one thread per chunk.
extern "C" __global__ void rle_chunks(u32 nchunks, const u8 *data, u32 use_hit, const u32 *hit,
                                      const u8 *cache, u16 *chdr, u16 *clen, u8 *cbuf, u8 *czero) {
    u32 k = thread_index();
    if (k >= nchunks) return;
    const u8 *src = data + (u64)k * CHUNK;
    czero[k] = chunk_is_zero(src);
    u8 d[CHUNK];
    u32 slot = use_hit ? hit[k / CHUNKS] : NO_HIT;
    if (slot != NO_HIT) {
        const u8 *old = cache + (u64)slot * PAGE + (u64)(k % CHUNKS) * CHUNK;
        for (int i = 0; i < CHUNK; i++) d[i] = src[i] ^ old[i];
    } else {
        d[0] = src[0];
        for (int i = 1; i < CHUNK; i++) d[i] = (u8)(src[i] - src[i - 1]);
    }
    int n = zrle(d, cbuf + (u64)k * CHUNK);
    chdr[k] = n < 0 ? HDR_OVERFLOW : (u16)n;
    clen[k] = n < 0 ? CHUNK : (u16)n;
}

// dedup, one thread per chunk: hash, then look the chunk up in the cache as
// it was before the batch.
extern "C" __global__ void dedup_chunks(u32 nchunks, const u8 *data, u32 sets, const u8 *state,
                                        const u32 *hashes, const u8 *cache, u32 *chash, u16 *chdr,
                                        u16 *clen, u8 *cbuf, u8 *czero) {
    u32 k = thread_index();
    if (k >= nchunks) return;
    const u8 *src = data + (u64)k * CHUNK;
    czero[k] = chunk_is_zero(src);
    u32 h = superfasthash(src, CHUNK);
    chash[k] = h;
    u32 set = h % sets;
    chdr[k] = HDR_OVERFLOW;
    clen[k] = CHUNK;
    for (u32 w = 0; w < 2; w++) {
        u64 slot = (u64)set * 2 + w;
        if (valid(state[set], w) && hashes[slot] == h && same_chunk(cache + slot * CHUNK, src)) {
            u8 *out = cbuf + (u64)k * CHUNK;
            out[0] = (u8)slot;
            out[1] = (u8)(slot >> 8);
            out[2] = (u8)(slot >> 16);
            out[3] = (u8)(slot >> 24);
            chdr[k] = HDR_REF;
            clen[k] = 4;
            return;
        }
    }
}

// One thread per page: its codec, payload size and chunk offsets. A chunked
// page that would not be smaller than a page goes Raw.
extern "C" __global__ void page_sizes(u32 npages, u32 method, const u32 *hit, const u8 *czero,
                                      const u16 *clen, u8 *pcodec, u32 *plen, u16 *coff) {
    u32 p = thread_index();
    if (p >= npages) return;
    u32 zero = 1;
    for (u32 c = 0; c < CHUNKS; c++) zero &= czero[p * CHUNKS + c];
    if (zero) {
        pcodec[p] = ZERO;
        plen[p] = 0;
        return;
    }
    if (method == M_NONE) {
        pcodec[p] = RAW;
        plen[p] = PAGE;
        return;
    }
    u32 total = 2 * CHUNKS;
    for (u32 c = 0; c < CHUNKS; c++) {
        coff[p * CHUNKS + c] = (u16)(total - 2 * CHUNKS);
        total += clen[p * CHUNKS + c];
    }
    if (total >= PAGE) {
        pcodec[p] = RAW;
        plen[p] = PAGE;
        return;
    }
    pcodec[p] = method == M_RLE ? RLE : method == M_DEDUP ? DEDUP : hit[p] != NO_HIT ? XBZRLE : RLE;
    plen[p] = total;
}

// Exclusive prefix sum of the page sizes (one thread: 1024 additions at most,
// less than a kernel launch costs). poff[npages] is the batch payload size.
extern "C" __global__ void scan_offsets(u32 npages, const u32 *plen, u32 *poff) {
    if (thread_index() != 0) return;
    u32 at = 0;
    for (u32 p = 0; p < npages; p++) {
        poff[p] = at;
        at += plen[p];
    }
    poff[npages] = at;
}

// One thread per chunk: its header and payload into the batch payload.
extern "C" __global__ void pack(u32 nchunks, const u8 *data, const u8 *pcodec, const u32 *poff,
                                const u16 *coff, const u16 *chdr, const u16 *clen, const u8 *cbuf,
                                u8 *out) {
    u32 k = thread_index();
    if (k >= nchunks) return;
    u32 p = k / CHUNKS, c = k % CHUNKS;
    const u8 *src = data + (u64)k * CHUNK;
    u8 *page = out + poff[p];
    if (pcodec[p] == ZERO) return;
    if (pcodec[p] == RAW) {
        for (int i = 0; i < CHUNK; i++) page[c * CHUNK + i] = src[i];
        return;
    }
    page[2 * c] = (u8)chdr[k];
    page[2 * c + 1] = (u8)(chdr[k] >> 8);
    u8 *dst = page + 2 * CHUNKS + coff[k];
    const u8 *from = chdr[k] == HDR_OVERFLOW ? src : cbuf + (u64)k * CHUNK;
    for (u32 i = 0; i < clen[k]; i++) dst[i] = from[i];
}

// xbzrle touches, one thread per cache set: the pages of the batch that map
// to the set (order[gstart[g] .. gstart[g+1]], in batch order) become its
// latest versions, as PageCache::touch does one after another.
extern "C" __global__ void xbz_touch(u32 ngroups, const u32 *gstart, const u32 *order,
                                     const u64 *idx, const u8 *data, u64 sets, u8 *state,
                                     u64 *tags, u8 *cache) {
    u32 g = thread_index();
    if (g >= ngroups) return;
    for (u32 i = gstart[g]; i < gstart[g + 1]; i++) {
        u32 p = order[i];
        u64 set = idx[p] % sets;
        u32 way = state[set] & 1u;
        for (u32 w = 0; w < 2; w++) {
            if (valid(state[set], w) && tags[set * 2 + w] == idx[p]) {
                way = w;
                break;
            }
        }
        u64 slot = set * 2 + way;
        tags[slot] = idx[p];
        const u8 *src = data + (u64)p * PAGE;
        u8 *dst = cache + slot * PAGE;
        for (int b = 0; b < PAGE; b++) dst[b] = src[b];
        state[set] = make_mru(state[set], way);
    }
}

// dedup touches, one thread per cache set: the chunks order[gstart[g] ..
// gstart[g+1]] (of non-zero pages, in batch order), as ChunkCache::touch.
// All zero chunks share one hash, so one set can get thousands of them; a
// touch right after a touch of the same chunk changes nothing, so a zero
// chunk that follows a zero chunk is skipped.
extern "C" __global__ void dedup_touch(u32 ngroups, const u32 *gstart, const u32 *order,
                                       const u8 *data, const u32 *chash, const u8 *czero,
                                       u32 sets, u8 *state, u32 *hashes, u8 *cache) {
    u32 g = thread_index();
    if (g >= ngroups) return;
    for (u32 i = gstart[g]; i < gstart[g + 1]; i++) {
        u32 k = order[i];
        if (i > gstart[g] && czero[k] && czero[order[i - 1]]) continue;
        u32 h = chash[k];
        u32 set = h % sets;
        const u8 *src = data + (u64)k * CHUNK;
        u32 way = 2;
        for (u32 w = 0; w < 2 && way == 2; w++) {
            u64 slot = (u64)set * 2 + w;
            if (valid(state[set], w) && hashes[slot] == h && same_chunk(cache + slot * CHUNK, src))
                way = w;
        }
        if (way == 2) {
            way = state[set] & 1u;
            u64 slot = (u64)set * 2 + way;
            hashes[slot] = h;
            for (int b = 0; b < CHUNK; b++) cache[slot * CHUNK + b] = src[b];
        }
        state[set] = make_mru(state[set], way);
    }
}
