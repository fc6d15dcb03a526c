//! `--compress`: what the user asked of the codecs, `auto` (the policy in
//! `compress.rs` decides per batch) or one method always.

use ferry_codec::Method;

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compress {
    /// Let the policy decide per batch.
    Auto,
    /// Always this method (`Method::None` = no compression at all).
    Fixed(Method),
}

impl std::str::FromStr for Compress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Compress::Auto);
        }
        s.parse::<Method>()
            .map(Compress::Fixed)
            .map_err(|e| format!("{e} (or 'auto')"))
    }
}

impl serde::Serialize for Compress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Compress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for Compress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compress::Auto => f.write_str("auto"),
            Compress::Fixed(m) => write!(f, "{m}"),
        }
    }
}
