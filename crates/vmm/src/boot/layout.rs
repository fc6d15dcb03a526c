//! Guest RAM layout: how a RAM size becomes memory regions.
//!
//! RAM up to 3 GiB sits at 0; the rest continues at 4 GiB, leaving the usual
//! 32-bit hole free for device addresses (LAPIC, later MMIO devices).

use crate::guest_abi::{ARENA_BASE, HIGH_RAM_BASE, LOW_RAM_MAX};

/// Smallest guest: the kernel area (16 MiB) plus room for workloads.
pub const MIN_MEM: u64 = 32 << 20;
/// Largest guest: the boot page tables map 64 GiB of guest physical space.
pub const MAX_MEM: u64 = 60 << 30;
/// Unit of guest memory accounting.
pub const PAGE_SIZE: u64 = 4096;

/// Why a RAM size was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// Below [`MIN_MEM`].
    #[error("--mem {bytes} bytes is too small: the guest needs at least {} MiB", MIN_MEM >> 20)]
    TooSmall {
        /// What was asked for.
        bytes: u64,
    },
    /// Above [`MAX_MEM`].
    #[error("--mem {bytes} bytes is too large: at most {} GiB", MAX_MEM >> 30)]
    TooLarge {
        /// What was asked for.
        bytes: u64,
    },
    /// Not a whole number of pages.
    #[error("--mem {bytes} bytes is not a multiple of the 4 KiB page size")]
    NotPageAligned {
        /// What was asked for.
        bytes: u64,
    },
}

/// The guest's RAM as (guest physical address, size) ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLayout {
    ranges: Vec<(u64, u64)>,
}

impl MemoryLayout {
    /// Lays out `bytes` of RAM.
    pub fn for_size(bytes: u64) -> Result<Self, LayoutError> {
        if !bytes.is_multiple_of(PAGE_SIZE) {
            return Err(LayoutError::NotPageAligned { bytes });
        }
        if bytes < MIN_MEM {
            return Err(LayoutError::TooSmall { bytes });
        }
        if bytes > MAX_MEM {
            return Err(LayoutError::TooLarge { bytes });
        }
        let low = bytes.min(LOW_RAM_MAX);
        let mut ranges = vec![(0, low)];
        if bytes > low {
            ranges.push((HIGH_RAM_BASE, bytes - low));
        }
        Ok(MemoryLayout { ranges })
    }

    /// The RAM ranges, in address order.
    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    /// Total RAM in bytes.
    pub fn total(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// Highest guest physical address plus one.
    pub fn end(&self) -> u64 {
        self.ranges.last().map_or(0, |r| r.0 + r.1)
    }

    /// Bytes the workloads may use (RAM above the kernel area).
    pub fn arena_bytes(&self) -> u64 {
        self.total() - ARENA_BASE
    }
}

/// Parses sizes such as `512M`, `4G`, `65536K` or a plain byte count.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = match t.char_indices().last()? {
        (i, 'K' | 'k') => (&t[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&t[..i], 1 << 20),
        (i, 'G' | 'g') => (&t[..i], 1 << 30),
        (i, 'T' | 't') => (&t[..i], 1 << 40),
        _ => (t, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_around_the_hole() {
        let l = MemoryLayout::for_size(512 << 20).unwrap();
        assert_eq!(l.ranges(), &[(0, 512 << 20)]);
        let l = MemoryLayout::for_size(4 << 30).unwrap();
        assert_eq!(l.ranges(), &[(0, 3 << 30), (4 << 30, 1 << 30)]);
        assert_eq!(l.total(), 4 << 30);
        assert_eq!(l.end(), 5 << 30);
    }

    #[test]
    fn refuses_bad_sizes() {
        assert!(matches!(
            MemoryLayout::for_size(16 << 20),
            Err(LayoutError::TooSmall { .. })
        ));
        assert!(matches!(
            MemoryLayout::for_size((64 << 20) + 1),
            Err(LayoutError::NotPageAligned { .. })
        ));
        assert!(matches!(
            MemoryLayout::for_size(100 << 30),
            Err(LayoutError::TooLarge { .. })
        ));
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("512M"), Some(512 << 20));
        assert_eq!(parse_size("4G"), Some(4 << 30));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("12x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999T"), None);
    }
}
