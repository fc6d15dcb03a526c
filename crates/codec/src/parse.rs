//! Reading codec and method ids and names from untrusted input (the wire,
//! the command line): every way in is fallible and names what was wrong.
//! Apart from `method.rs` so the types there need no error type, and the
//! error type can name them.

use std::str::FromStr;

use crate::error::CodecError;
use crate::method::{Method, PageCodec, ZSTD_DEFAULT_LEVEL, ZSTD_ID_BASE, ZSTD_LEVELS};

impl TryFrom<u8> for PageCodec {
    type Error = CodecError;

    fn try_from(id: u8) -> Result<Self, CodecError> {
        Ok(match id {
            0 => PageCodec::Raw,
            1 => PageCodec::Zero,
            2 => PageCodec::Rle,
            3 => PageCodec::Xbzrle,
            4 => PageCodec::Dedup,
            5 => PageCodec::Lz4,
            6 => PageCodec::Zstd,
            _ => return Err(CodecError::BadCodecId(id)),
        })
    }
}

impl Method {
    /// The method of a wire id (see [`Method::id`]).
    pub fn from_id(id: u8) -> Result<Method, CodecError> {
        Ok(match id {
            0 => Method::None,
            1 => Method::Rle,
            2 => Method::Xbzrle,
            3 => Method::Dedup,
            4 => Method::Lz4,
            _ => {
                let level = i32::from(id.wrapping_sub(ZSTD_ID_BASE));
                if id < ZSTD_ID_BASE || !ZSTD_LEVELS.contains(&level) {
                    return Err(CodecError::BadMethodId(id));
                }
                Method::Zstd(level)
            }
        })
    }
}

impl FromStr for Method {
    type Err = CodecError;

    /// "none", "rle", "xbzrle", "dedup", "lz4", "zstd" (level 3) or "zstd:N", N in 1..=19.
    fn from_str(s: &str) -> Result<Method, CodecError> {
        let bad = || CodecError::BadMethodName(s.to_string());
        Ok(match s {
            "none" => Method::None,
            "rle" => Method::Rle,
            "xbzrle" => Method::Xbzrle,
            "dedup" => Method::Dedup,
            "lz4" => Method::Lz4,
            "zstd" => Method::Zstd(ZSTD_DEFAULT_LEVEL),
            _ => {
                let level = s.strip_prefix("zstd:").ok_or_else(bad)?;
                let level: i32 = level.parse().map_err(|_| bad())?;
                if !ZSTD_LEVELS.contains(&level) {
                    return Err(CodecError::BadZstdLevel(level));
                }
                Method::Zstd(level)
            }
        })
    }
}
