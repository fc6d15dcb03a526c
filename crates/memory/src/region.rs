//! One guest RAM region: a memfd mapped shared into the VMM.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::PAGE_SIZE;

/// Why a region could not be created or changed.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// Size zero or not a whole number of pages.
    #[error("region size {size:#x} must be a non-zero multiple of 4 KiB")]
    BadSize {
        /// Requested size.
        size: u64,
    },
    /// memfd_create or ftruncate failed.
    #[error("cannot create memfd '{name}' of {size} bytes: {source}")]
    Memfd {
        /// Region name.
        name: String,
        /// Requested size.
        size: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// mmap failed.
    #[error("cannot map {size} bytes of guest memory: {source}")]
    Mmap {
        /// Requested size.
        size: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// A range outside the region.
    #[error("range {offset:#x}+{len:#x} is outside the region of {size:#x} bytes")]
    OutOfRange {
        /// Offset into the region.
        offset: u64,
        /// Length.
        len: u64,
        /// Region size.
        size: u64,
    },
    /// fallocate or madvise failed.
    #[error("{op} on guest memory failed: {source}")]
    Advise {
        /// Which call.
        op: &'static str,
        /// OS error.
        source: std::io::Error,
    },
}

/// A memfd-backed guest RAM region mapped read-write and shared.
pub struct MemfdRegion {
    name: String,
    gpa: u64,
    size: u64,
    fd: OwnedFd,
    host: *mut u8,
}

// SAFETY: the mapping lives exactly as long as the struct and is only reached
// through raw pointers; concurrent access from vCPUs and VMM threads is guest
// memory semantics (racy by design, read with volatile loads where it matters).
unsafe impl Send for MemfdRegion {}
// SAFETY: see Send: no method hands out Rust references into the mapping.
unsafe impl Sync for MemfdRegion {}

impl MemfdRegion {
    /// Creates a memfd of `size` bytes for guest physical address `gpa` and maps it.
    pub fn new(name: &str, gpa: u64, size: u64) -> Result<Self, RegionError> {
        check_size(size)?;
        let memfd_err = |source| RegionError::Memfd {
            name: name.into(),
            size,
            source,
        };
        let cname = std::ffi::CString::new(name)
            .map_err(|_| memfd_err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        // SAFETY: cname is a valid NUL-terminated string; the result is checked.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(memfd_err(std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a valid memfd; the result is checked.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } < 0 {
            return Err(memfd_err(std::io::Error::last_os_error()));
        }
        Self::from_fd(name, gpa, size, fd)
    }

    /// Maps an existing memfd (e.g. one received from another VMM process).
    pub fn from_fd(name: &str, gpa: u64, size: u64, fd: OwnedFd) -> Result<Self, RegionError> {
        check_size(size)?;
        // SAFETY: mapping a file we own with a checked size at an address the
        // kernel chooses; the result is checked before use.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(RegionError::Mmap {
                size,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(MemfdRegion {
            name: name.into(),
            gpa,
            size,
            fd,
            host: host.cast(),
        })
    }

    /// Region name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Guest physical base address.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Start of the host mapping.
    pub fn host_addr(&self) -> *mut u8 {
        self.host
    }

    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// True if `[gpa, gpa+len)` lies inside this region.
    pub fn contains(&self, gpa: u64, len: u64) -> bool {
        gpa >= self.gpa
            && gpa
                .checked_add(len)
                .is_some_and(|end| end <= self.gpa + self.size)
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(RegionError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Frees the backing pages of a range; the next access reads zeros (or
    /// raises a userfaultfd MISSING fault where registered).
    pub fn punch_hole(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        self.check_range(offset, len)?;
        // SAFETY: fd is our memfd and the range was checked; the result is checked.
        let r = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r < 0 {
            return Err(RegionError::Advise {
                op: "fallocate(PUNCH_HOLE)",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// The populated parts of the memfd as (offset, length) runs, found with
    /// SEEK_DATA/SEEK_HOLE without touching the memory: reading a hole of a
    /// shared memfd would allocate a page for it.
    pub fn data_ranges(&self) -> Vec<(u64, u64)> {
        let fd = self.fd.as_raw_fd();
        let mut out = Vec::new();
        let mut pos: i64 = 0;
        let size = self.size as i64;
        while pos < size {
            // SAFETY: lseek on our own fd with a valid whence has no memory effects.
            let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
            if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                    // SEEK_DATA unsupported: report everything as data.
                    return vec![(0, self.size)];
                }
                break; // ENXIO: no data after pos
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) }.min(size);
            if hole <= data {
                return vec![(0, self.size)];
            }
            let start = data as u64 & !(PAGE_SIZE - 1);
            let end = (hole as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
            out.push((start, end.min(self.size) - start));
            pos = hole;
        }
        out
    }

    /// Drops this mapping's page table entries for a range (the memfd keeps the
    /// data); the next access maps them again (a MINOR fault under userfaultfd).
    pub fn discard(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        self.check_range(offset, len)?;
        // SAFETY: the range lies inside our own mapping (checked above).
        let r = unsafe {
            libc::madvise(
                self.host.add(offset as usize).cast(),
                len as usize,
                libc::MADV_DONTNEED,
            )
        };
        if r < 0 {
            return Err(RegionError::Advise {
                op: "madvise(DONTNEED)",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

impl Drop for MemfdRegion {
    fn drop(&mut self) {
        // SAFETY: host/size are the mapping created in from_fd and unmapped only here.
        unsafe { libc::munmap(self.host.cast(), self.size as usize) };
    }
}

fn check_size(size: u64) -> Result<(), RegionError> {
    if size == 0 || size % PAGE_SIZE != 0 || usize::try_from(size).is_err() {
        return Err(RegionError::BadSize { size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_and_punch() {
        let r = MemfdRegion::new("test", 0x1000, 4 * PAGE_SIZE).unwrap();
        // SAFETY: offset 4096 + 1 byte is inside the 16 KiB mapping.
        unsafe { *r.host_addr().add(4096) = 0xab };
        // SAFETY: as above.
        let before = unsafe { *r.host_addr().add(4096) };
        assert_eq!(before, 0xab);
        r.punch_hole(4096, 4096).unwrap();
        // SAFETY: as above.
        let after = unsafe { *r.host_addr().add(4096) };
        assert_eq!(after, 0, "a punched page reads back zero");
        assert!(r.contains(0x1000, 4 * PAGE_SIZE));
        assert!(!r.contains(0x1000, 4 * PAGE_SIZE + 1));
        assert!(matches!(
            r.punch_hole(3 * 4096, 8192),
            Err(RegionError::OutOfRange { .. })
        ));
        assert!(matches!(
            MemfdRegion::new("x", 0, 100),
            Err(RegionError::BadSize { .. })
        ));
        assert!(matches!(
            MemfdRegion::new("x", 0, 0),
            Err(RegionError::BadSize { .. })
        ));
    }

    #[test]
    fn data_ranges_skip_holes() {
        let r = MemfdRegion::new("holes", 0, 16 * PAGE_SIZE).unwrap();
        assert!(r.data_ranges().is_empty(), "a fresh memfd is all hole");
        for p in [2u64, 3, 9] {
            // SAFETY: page p < 16 of the mapping.
            unsafe { *r.host_addr().add((p * PAGE_SIZE) as usize) = 1 };
        }
        assert_eq!(
            r.data_ranges(),
            vec![(2 * PAGE_SIZE, 2 * PAGE_SIZE), (9 * PAGE_SIZE, PAGE_SIZE)]
        );
        r.punch_hole(2 * PAGE_SIZE, PAGE_SIZE).unwrap();
        assert_eq!(
            r.data_ranges(),
            vec![(3 * PAGE_SIZE, PAGE_SIZE), (9 * PAGE_SIZE, PAGE_SIZE)]
        );
    }

    #[test]
    fn discard_keeps_the_data() {
        let r = MemfdRegion::new("test", 0, PAGE_SIZE).unwrap();
        // SAFETY: byte 10 of a one-page mapping.
        unsafe { *r.host_addr().add(10) = 7 };
        r.discard(0, PAGE_SIZE).unwrap();
        // SAFETY: as above.
        let after = unsafe { *r.host_addr().add(10) };
        assert_eq!(after, 7, "shared memfd data survives MADV_DONTNEED");
    }
}
