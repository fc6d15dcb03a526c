//! The guest-physical view over a VM's RAM regions.

use crate::region::PAGE_SIZE;
use crate::region::{MemfdRegion, RegionError};

/// Why a guest memory operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The layout has no regions.
    #[error("guest memory needs at least one region")]
    Empty,
    /// A region starts off a page boundary.
    #[error("region at {gpa:#x} does not start on a 4 KiB boundary")]
    Misaligned {
        /// Its guest physical address.
        gpa: u64,
    },
    /// Two regions overlap.
    #[error("regions at {a:#x} and {b:#x} overlap")]
    Overlap {
        /// First region.
        a: u64,
        /// Second region.
        b: u64,
    },
    /// An access outside guest RAM (or across a region boundary).
    #[error("guest range {gpa:#x}+{len:#x} is not inside guest RAM")]
    OutOfRange {
        /// Start.
        gpa: u64,
        /// Length.
        len: u64,
    },
    /// A region could not be created.
    #[error(transparent)]
    Region(#[from] RegionError),
}

/// Plain data that [`GuestMemory::read_obj`] may build from any bytes the
/// guest left behind.
///
/// # Safety
///
/// Every bit pattern of `size_of::<Self>()` bytes must be a valid value
/// (no `bool`, `char`, enums, references or pointers with validity rules).
pub unsafe trait Plain: Copy {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        // SAFETY: integers are valid for every bit pattern.
        unsafe impl Plain for $t {}
    )*};
}
plain!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize);
// SAFETY: an array of plain values has no other bytes than its elements.
unsafe impl<T: Plain, const N: usize> Plain for [T; N] {}

/// A VM's RAM: non-overlapping memfd regions in address order.
pub struct GuestMemory {
    regions: Vec<MemfdRegion>,
}

impl GuestMemory {
    /// Creates one memfd region per `(gpa, size)`.
    pub fn new(layout: &[(u64, u64)]) -> Result<Self, MemoryError> {
        let mut sorted = layout.to_vec();
        sorted.sort_unstable();
        Self::check_layout(&sorted)?;
        let regions = sorted
            .iter()
            .enumerate()
            .map(|(i, &(gpa, size))| MemfdRegion::new(&format!("ferry-ram{i}"), gpa, size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GuestMemory { regions })
    }

    /// Builds guest memory from existing regions (e.g. received memfds).
    pub fn from_regions(mut regions: Vec<MemfdRegion>) -> Result<Self, MemoryError> {
        regions.sort_unstable_by_key(|r| r.gpa());
        let layout: Vec<(u64, u64)> = regions.iter().map(|r| (r.gpa(), r.size())).collect();
        Self::check_layout(&layout)?;
        Ok(GuestMemory { regions })
    }

    fn check_layout(sorted: &[(u64, u64)]) -> Result<(), MemoryError> {
        if sorted.is_empty() {
            return Err(MemoryError::Empty);
        }
        for &(gpa, _) in sorted {
            if gpa % PAGE_SIZE != 0 {
                return Err(MemoryError::Misaligned { gpa });
            }
        }
        for w in sorted.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0.checked_add(a.1).is_none_or(|end| end > b.0) {
                return Err(MemoryError::Overlap { a: a.0, b: b.0 });
            }
        }
        Ok(())
    }

    /// The regions, in address order.
    pub fn regions(&self) -> &[MemfdRegion] {
        &self.regions
    }

    /// Total RAM in bytes.
    pub fn total_size(&self) -> u64 {
        self.regions.iter().map(|r| r.size()).sum()
    }

    /// Number of 4 KiB pages.
    pub fn page_count(&self) -> u64 {
        self.total_size() / PAGE_SIZE
    }

    /// The region holding all of `[gpa, gpa+len)`.
    pub fn region_for(&self, gpa: u64, len: u64) -> Result<&MemfdRegion, MemoryError> {
        self.regions
            .iter()
            .find(|r| r.contains(gpa, len))
            .ok_or(MemoryError::OutOfRange { gpa, len })
    }

    /// Host address of `[gpa, gpa+len)`, which must lie inside one region.
    pub fn host_ptr(&self, gpa: u64, len: u64) -> Result<*mut u8, MemoryError> {
        let r = self.region_for(gpa, len)?;
        // SAFETY: contains() checked that gpa..gpa+len lies inside r's mapping.
        Ok(unsafe { r.host_addr().add((gpa - r.gpa()) as usize) })
    }

    /// True when every page of `gpa .. gpa + len` has backing (see
    /// [`MemfdRegion::holds_data`]); false outside guest RAM.
    pub fn holds_data(&self, gpa: u64, len: u64) -> bool {
        self.region_for(gpa, len)
            .is_ok_and(|r| r.holds_data(gpa - r.gpa(), len))
    }

    /// Copies `data` into guest memory at `gpa`.
    pub fn write_bytes(&self, gpa: u64, data: &[u8]) -> Result<(), MemoryError> {
        let p = self.host_ptr(gpa, data.len() as u64)?;
        // SAFETY: p..p+len is inside a live mapping (host_ptr); guest memory is
        // not a Rust object, so overlapping with `data` is impossible.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Copies guest memory at `gpa` into `buf`.
    pub fn read_bytes(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let p = self.host_ptr(gpa, buf.len() as u64)?;
        // SAFETY: as in write_bytes.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Writes a plain-data value at `gpa` (padding bytes, if `T` has any,
    /// land in guest memory unspecified: prefer `repr(C)` types without).
    pub fn write_obj<T: Copy>(&self, gpa: u64, value: &T) -> Result<(), MemoryError> {
        let p = self.host_ptr(gpa, std::mem::size_of::<T>() as u64)?;
        // SAFETY: the destination is inside a live mapping; unaligned is allowed.
        unsafe { std::ptr::write_unaligned(p.cast::<T>(), *value) };
        Ok(())
    }

    /// Reads a plain-data value at `gpa`. The guest controls these bytes,
    /// so `T` must be valid for any bit pattern ([`Plain`]).
    pub fn read_obj<T: Plain>(&self, gpa: u64) -> Result<T, MemoryError> {
        let p = self.host_ptr(gpa, std::mem::size_of::<T>() as u64)?;
        // SAFETY: the source is inside a live mapping (host_ptr) and any bytes
        // there form a valid T (Plain); unaligned reads are allowed.
        Ok(unsafe { std::ptr::read_unaligned(p.cast::<T>()) })
    }

    /// Writes an aligned 64-bit word the guest may be reading right now.
    pub fn write_u64_volatile(&self, gpa: u64, value: u64) -> Result<(), MemoryError> {
        if !gpa.is_multiple_of(8) {
            return Err(MemoryError::OutOfRange { gpa, len: 8 });
        }
        let p = self.host_ptr(gpa, 8)?;
        // SAFETY: aligned, inside a live mapping; volatile because the guest reads it concurrently.
        unsafe { std::ptr::write_volatile(p.cast::<u64>(), value) };
        Ok(())
    }

    /// Reads an aligned 32-bit word the guest may be writing right now.
    pub fn read_u32_volatile(&self, gpa: u64) -> Result<u32, MemoryError> {
        if !gpa.is_multiple_of(4) {
            return Err(MemoryError::OutOfRange { gpa, len: 4 });
        }
        let p = self.host_ptr(gpa, 4)?;
        // SAFETY: aligned, inside a live mapping; volatile as above.
        Ok(unsafe { std::ptr::read_volatile(p.cast::<u32>()) })
    }

    /// Writes an aligned 32-bit word the guest may be reading right now.
    pub fn write_u32_volatile(&self, gpa: u64, value: u32) -> Result<(), MemoryError> {
        if !gpa.is_multiple_of(4) {
            return Err(MemoryError::OutOfRange { gpa, len: 4 });
        }
        let p = self.host_ptr(gpa, 4)?;
        // SAFETY: aligned, inside a live mapping; volatile as above.
        unsafe { std::ptr::write_volatile(p.cast::<u32>(), value) };
        Ok(())
    }

    /// Reads an aligned 64-bit word the guest may be writing right now.
    pub fn read_u64_volatile(&self, gpa: u64) -> Result<u64, MemoryError> {
        if !gpa.is_multiple_of(8) {
            return Err(MemoryError::OutOfRange { gpa, len: 8 });
        }
        let p = self.host_ptr(gpa, 8)?;
        // SAFETY: aligned, inside a live mapping; volatile because the guest
        // changes it behind the compiler's back.
        Ok(unsafe { std::ptr::read_volatile(p.cast::<u64>()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_errors() {
        assert!(matches!(GuestMemory::new(&[]), Err(MemoryError::Empty)));
        assert!(matches!(
            GuestMemory::new(&[(0, 8192), (4096, 4096)]),
            Err(MemoryError::Overlap { .. })
        ));
        assert!(matches!(
            GuestMemory::new(&[(100, 4096)]),
            Err(MemoryError::Misaligned { .. })
        ));
        assert!(matches!(
            GuestMemory::new(&[(0, 100)]),
            Err(MemoryError::Region(_))
        ));
        assert!(matches!(
            GuestMemory::new(&[(0, 4096), (!4095u64, 4096)]),
            Err(MemoryError::Region(RegionError::AddressOverflow { .. }))
        ));
        assert!(matches!(
            GuestMemory::new(&[(0, 4096), (4096, 4096)]).map(|m| m.total_size()),
            Ok(8192)
        ));
    }

    #[test]
    fn access_inside_and_across_regions() {
        let m = GuestMemory::new(&[(1 << 20, 8192), (0, 8192)]).unwrap();
        assert_eq!(m.regions()[0].gpa(), 0, "regions are kept in address order");
        assert_eq!(m.total_size(), 16384);
        m.write_obj(8, &0x1122_3344_5566_7788u64).unwrap();
        assert_eq!(m.read_u64_volatile(8).unwrap(), 0x1122_3344_5566_7788);
        m.write_bytes((1 << 20) + 100, b"ferry").unwrap();
        let mut b = [0u8; 5];
        m.read_bytes((1 << 20) + 100, &mut b).unwrap();
        assert_eq!(&b, b"ferry");
        assert!(matches!(
            m.write_bytes(8190, b"abcd"),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(matches!(
            m.read_obj::<u64>(0x9000),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(m.read_u64_volatile(4).is_err());
        m.write_u32_volatile(12, 0xdead_beef).unwrap();
        assert_eq!(m.read_u32_volatile(12).unwrap(), 0xdead_beef);
        m.write_u64_volatile(16, 5).unwrap();
        assert_eq!(m.read_u64_volatile(16).unwrap(), 5);
        assert!(m.write_u32_volatile(13, 0).is_err());
        assert_eq!(m.read_obj::<[u32; 2]>(12).unwrap(), [0xdead_beef, 5]);
        assert_eq!(m.page_count(), 4);
        assert!(matches!(
            m.host_ptr(u64::MAX - 1, 8),
            Err(MemoryError::OutOfRange { len: 8, .. })
        ));
        assert!(
            m.write_bytes(8192, &[]).is_ok(),
            "empty range at a region's end"
        );
        assert!(
            m.write_bytes(0x9000, &[]).is_err(),
            "empty range outside RAM"
        );
    }
}
