//! Wire ids and names of page codecs and batch methods, and cache sizes.

use std::fmt;
use std::ops::RangeInclusive;

/// How one page of a batch is coded (one byte on the wire).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PageCodec {
    /// 4096 bytes verbatim.
    Raw = 0,
    /// An all-zero page; empty payload.
    Zero = 1,
    /// GM-RLE chunked page (delta + zero runs per chunk).
    Rle = 2,
    /// XOR delta against the cached previous version, zero runs per chunk.
    Xbzrle = 3,
    /// Chunks verbatim or as references into the chunk cache.
    Dedup = 4,
    /// One lz4 block.
    Lz4 = 5,
    /// One zstd frame.
    Zstd = 6,
}

/// zstd levels a [`Method::Zstd`] may carry.
pub const ZSTD_LEVELS: RangeInclusive<i32> = 1..=19;
/// The level of a bare "zstd".
pub const ZSTD_DEFAULT_LEVEL: i32 = 3;

/// Method ids below this are fixed; zstd takes `ZSTD_ID_BASE + level`.
pub(crate) const ZSTD_ID_BASE: u8 = 0x40;

/// What a batch is encoded with (chosen by a policy per batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Method {
    /// Every page Raw (or Zero).
    None,
    /// GM-RLE.
    Rle,
    /// XOR delta against a page cache; misses go as rle.
    Xbzrle,
    /// 256-byte chunk deduplication against a chunk cache.
    Dedup,
    /// lz4 block per page.
    Lz4,
    /// zstd frame per page at this level (1..=19).
    Zstd(i32),
}

impl Method {
    /// The one-byte wire id: none 0, rle 1, xbzrle 2, dedup 3, lz4 4,
    /// zstd 0x40 + level (0x41..=0x53), so the level travels in the same byte.
    ///
    /// A zstd level outside 1..=19 is clamped into it here; the encoder refuses
    /// such a method, so a clamped id never describes an encoded batch.
    pub fn id(self) -> u8 {
        match self {
            Method::None => 0,
            Method::Rle => 1,
            Method::Xbzrle => 2,
            Method::Dedup => 3,
            Method::Lz4 => 4,
            Method::Zstd(level) => {
                let level = level.clamp(*ZSTD_LEVELS.start(), *ZSTD_LEVELS.end());
                ZSTD_ID_BASE + level as u8
            }
        }
    }

    /// The name without a level: "none", "rle", "xbzrle", "dedup", "lz4", "zstd".
    pub fn name(self) -> &'static str {
        match self {
            Method::None => "none",
            Method::Rle => "rle",
            Method::Xbzrle => "xbzrle",
            Method::Dedup => "dedup",
            Method::Lz4 => "lz4",
            Method::Zstd(_) => "zstd",
        }
    }

    /// Whether a page of a batch coded with this method may carry `codec`.
    pub fn allows(self, codec: PageCodec) -> bool {
        matches!(codec, PageCodec::Raw | PageCodec::Zero)
            || matches!(
                (self, codec),
                (Method::Rle, PageCodec::Rle)
                    | (Method::Xbzrle, PageCodec::Rle | PageCodec::Xbzrle)
                    | (Method::Dedup, PageCodec::Dedup)
                    | (Method::Lz4, PageCodec::Lz4)
                    | (Method::Zstd(_), PageCodec::Zstd)
            )
    }
}

impl fmt::Display for Method {
    /// The name `FromStr` reads back; zstd always shows its level ("zstd:3").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Method::Zstd(level) => write!(f, "zstd:{level}"),
            other => f.write_str(other.name()),
        }
    }
}

/// Sizes of the per-stream caches, in bytes; encoder and decoder must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CacheSizes {
    /// xbzrle page cache: size / 4096 entries in 2-way sets (at least one set).
    pub xbzrle_bytes: u64,
    /// dedup chunk cache: size / 256 entries in 2-way sets (at least one set).
    pub dedup_bytes: u64,
}

impl Default for CacheSizes {
    /// 64 MiB each.
    fn default() -> Self {
        CacheSizes {
            xbzrle_bytes: 64 << 20,
            dedup_bytes: 64 << 20,
        }
    }
}
