//! The text form of a disk on the command line: `PATH[,size=SIZE][,create]`
//! for a raw image, or an NBD address (`nbd://HOST[:PORT]/EXPORT`,
//! `nbds://…`, `nbd+unix:///EXPORT?socket=PATH`) for shared storage
//! ([`DiskSpec`]), checked without touching the file or the server.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Bytes in one virtio-blk sector: sizes and offsets are counted in them.
pub const SECTOR: u64 = 512;

/// Where a disk's blocks live.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DiskSource {
    /// A raw image file on this host (a path with no comma in it).
    Image(PathBuf),
    /// An export of an NBD server (its address, as given; it parses).
    Nbd(String),
}

impl fmt::Display for DiskSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskSource::Image(p) => write!(f, "{}", p.display()),
            DiskSource::Nbd(uri) => f.write_str(uri),
        }
    }
}

/// A disk as given to `ferry run --disk`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskSpec {
    /// The image or the NBD export.
    pub source: DiskSource,
    /// The disk's size; `None` = the file's (or export's) length. One
    /// shorter than this is refused.
    pub size: Option<u64>,
    /// Create the file (of `size` bytes, sparse) if it does not exist.
    pub create: bool,
}

/// Why a disk spec was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiskSpecError {
    /// Nothing before the first comma.
    #[error("a disk needs a path to a raw image: PATH[,size=SIZE][,create]")]
    NoPath,
    /// An option this spec does not know.
    #[error("unknown disk option '{0}' (valid: size=SIZE, create)")]
    UnknownOption(String),
    /// A size that is not a positive multiple of 512 bytes.
    #[error("bad disk size '{0}': expected a positive number of bytes with an optional K, M, G or T suffix, a multiple of 512")]
    BadSize(String),
    /// `create` without a size.
    #[error("'create' needs a size: PATH,size=SIZE,create")]
    CreateWithoutSize,
    /// `create` on an NBD export (the server makes its exports).
    #[error("'create' is for image files; an NBD export is made by its server")]
    CreateOnNbd,
    /// An NBD address that does not parse.
    #[error("{0}")]
    BadNbd(String),
}

/// Parses `4096`, `64M`, `1G`, `2GiB` (binary multiples).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        't' | 'T' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1u64 << shift)
}

impl FromStr for DiskSpec {
    type Err = DiskSpecError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut parts = text.split(',');
        let path = parts.next().unwrap_or("").trim();
        if path.is_empty() {
            return Err(DiskSpecError::NoPath);
        }
        let source = if path.starts_with("nbd") && path.contains("://") {
            ferry_nbd::NbdUri::parse(path).map_err(|e| DiskSpecError::BadNbd(e.to_string()))?;
            DiskSource::Nbd(path.to_string())
        } else {
            DiskSource::Image(PathBuf::from(path))
        };
        let mut spec = DiskSpec {
            source,
            size: None,
            create: false,
        };
        for opt in parts.map(str::trim).filter(|o| !o.is_empty()) {
            match opt.split_once('=') {
                Some(("size", v)) => {
                    let size = parse_size(v)
                        .filter(|s| *s > 0 && s % SECTOR == 0)
                        .ok_or_else(|| DiskSpecError::BadSize(v.into()))?;
                    spec.size = Some(size);
                }
                None if opt == "create" => spec.create = true,
                _ => return Err(DiskSpecError::UnknownOption(opt.into())),
            }
        }
        if spec.create && matches!(spec.source, DiskSource::Nbd(_)) {
            return Err(DiskSpecError::CreateOnNbd);
        }
        if spec.create && spec.size.is_none() {
            return Err(DiskSpecError::CreateWithoutSize);
        }
        Ok(spec)
    }
}

impl fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.source)?;
        if let Some(s) = self.size {
            write!(f, ",size={s}")?;
        }
        if self.create {
            write!(f, ",create")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        let s: DiskSpec = "/tmp/d.img,size=64M,create".parse().unwrap();
        assert_eq!(s.source, DiskSource::Image(PathBuf::from("/tmp/d.img")));
        assert_eq!(s.size, Some(64 << 20));
        assert!(s.create);
        assert_eq!(s.to_string().parse::<DiskSpec>().unwrap(), s);
        let s: DiskSpec = "d.img".parse().unwrap();
        assert_eq!((s.size, s.create), (None, false));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        let s: DiskSpec = "nbd://10.0.0.9/vm1,size=1G".parse().unwrap();
        assert_eq!(s.source, DiskSource::Nbd("nbd://10.0.0.9/vm1".into()));
        assert_eq!(s.to_string().parse::<DiskSpec>().unwrap(), s);
        let s: DiskSpec = "nbd+unix:///d?socket=/run/n.sock".parse().unwrap();
        assert_eq!(s.to_string(), "nbd+unix:///d?socket=/run/n.sock");
        assert_eq!(parse_size("4096"), Some(4096));
    }

    #[test]
    fn bad_specs_are_refused_with_the_reason() {
        assert_eq!("".parse::<DiskSpec>(), Err(DiskSpecError::NoPath));
        assert_eq!(
            "d.img,create".parse::<DiskSpec>(),
            Err(DiskSpecError::CreateWithoutSize)
        );
        assert_eq!(
            "d.img,size=1000".parse::<DiskSpec>(),
            Err(DiskSpecError::BadSize("1000".into()))
        );
        assert_eq!(
            "d.img,size=0".parse::<DiskSpec>(),
            Err(DiskSpecError::BadSize("0".into()))
        );
        assert_eq!(
            "d.img,ro".parse::<DiskSpec>(),
            Err(DiskSpecError::UnknownOption("ro".into()))
        );
        assert_eq!(
            "nbd://h/x,size=1M,create".parse::<DiskSpec>(),
            Err(DiskSpecError::CreateOnNbd)
        );
        assert!(matches!(
            "nbd://h:notaport/x".parse::<DiskSpec>(),
            Err(DiskSpecError::BadNbd(_))
        ));
    }
}
