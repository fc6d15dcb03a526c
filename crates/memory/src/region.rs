//! One guest RAM region: a memfd mapped shared into the VMM.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

pub use crate::mapping::PAGE_SIZE;

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
    /// The file handed to [`MemfdRegion::from_fd`] is shorter than the region.
    #[error("memfd holds {file_size:#x} bytes, the region needs {size:#x}")]
    FileTooSmall {
        /// Region size.
        size: u64,
        /// The file's size.
        file_size: u64,
    },
    /// The region would end past the top of the guest physical address space.
    #[error("region at {gpa:#x} of {size:#x} bytes ends past 2^64")]
    AddressOverflow {
        /// Guest physical base.
        gpa: u64,
        /// Size.
        size: u64,
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
    /// The file must hold at least `size` bytes (checked): touching a
    /// mapping past its file's end raises SIGBUS.
    pub fn from_fd(name: &str, gpa: u64, size: u64, fd: OwnedFd) -> Result<Self, RegionError> {
        check_size(size)?;
        if gpa.checked_add(size).is_none() {
            return Err(RegionError::AddressOverflow { gpa, size });
        }
        let file_size = file_size(&fd).map_err(|source| RegionError::Mmap { size, source })?;
        if file_size < size {
            return Err(RegionError::FileTooSmall { size, file_size });
        }
        // SAFETY: mapping a file we own with a checked size at an address the
        // kernel chooses; the result is checked before use. MAP_NORESERVE:
        // guest RAM is sparse, so no swap is reserved up front (a memfd is
        // created without accounting anyway; this keeps received fds alike).
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
        // No overflow: from_fd checked that gpa + size fits.
        let end = self.gpa + self.size;
        gpa >= self.gpa && gpa.checked_add(len).is_some_and(|e| e <= end)
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
        data_ranges_of(self.fd.as_fd(), self.size)
    }

    /// As [`data_ranges`](Self::data_ranges), only within `offset ..
    /// offset + len` (clipped to the region), so a small window of a large,
    /// fragmented region costs a few lseeks, not one per run of the whole.
    pub fn data_ranges_in(&self, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let end = offset.saturating_add(len).min(self.size);
        data_ranges_within(self.fd.as_fd(), offset.min(end), end)
    }

    /// True when every page of a range has backing in the memfd, asked with
    /// SEEK_DATA so a hole is never touched: a thread that must not fault
    /// (memory under userfaultfd whose pages may still be missing) reads the
    /// range only after this says yes. One lseek a page, so meant for a few
    /// pages (the metrics page, 100 times a second): a SEEK_HOLE from the
    /// range's start would walk the whole run of data after it, every page
    /// of a populated VM (2 GiB preallocated: ~60% of a core).
    pub fn holds_data(&self, offset: u64, len: u64) -> bool {
        if self.check_range(offset, len).is_err() {
            return false;
        }
        let fd = self.fd.as_raw_fd();
        let end = offset + len;
        let mut page = offset & !(PAGE_SIZE - 1);
        while page < end {
            // SAFETY: lseek on our own fd with a valid whence has no memory effects.
            let data = unsafe { libc::lseek(fd, page as i64, libc::SEEK_DATA) };
            if data < 0 {
                // ENXIO: no data from here on; anything else: SEEK_DATA is
                // not supported, so everything counts as data (as in
                // data_ranges).
                return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
            }
            if data as u64 != page {
                return false;
            }
            page += PAGE_SIZE;
        }
        true
    }

    /// Allocates and maps every page of a range now (the guest's or an
    /// incoming migration's first touch then costs nothing). Contents are
    /// unchanged: missing pages become zero pages, present ones stay.
    pub fn populate(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        self.check_range(offset, len)?;
        // SAFETY: the range lies inside our own mapping (checked above).
        unsafe { crate::mapping::populate_write(self.host.add(offset as usize) as u64, len) }
            .map_err(|source| RegionError::Advise {
                op: "madvise(POPULATE_WRITE)",
                source,
            })
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

/// The size of the file behind `fd`.
/// The page-aligned (offset, length) ranges of the first `size` bytes of
/// `fd` that hold data, asked with SEEK_DATA/SEEK_HOLE (all of it where
/// the file system cannot tell).
pub(crate) fn data_ranges_of(fd: BorrowedFd<'_>, size: u64) -> Vec<(u64, u64)> {
    data_ranges_within(fd, 0, size)
}

/// The populated runs of `fd` between byte offsets `from` and `to` (whole
/// pages; `to` at most the file's size), clipped to that window; everything
/// in it where SEEK_DATA is not supported.
fn data_ranges_within(fd: BorrowedFd<'_>, from: u64, to: u64) -> Vec<(u64, u64)> {
    let fd = fd.as_raw_fd();
    let mut out = Vec::new();
    let (from, size) = (from & !(PAGE_SIZE - 1), to);
    if from >= size {
        return out;
    }
    let mut pos = from as i64;
    let end = size as i64;
    while pos < end {
        // SAFETY: lseek on an open fd with a valid whence has no memory effects.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                // SEEK_DATA unsupported: report everything as data.
                return vec![(from, size - from)];
            }
            break; // ENXIO: no data after pos
        }
        if data >= end {
            break; // the next data lies past the window
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) }.min(end);
        if hole <= data {
            return vec![(from, size - from)];
        }
        let start = data as u64 & !(PAGE_SIZE - 1);
        let stop = (hole as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        out.push((start, stop.min(size) - start));
        pos = hole;
    }
    out
}

pub(crate) fn file_size(fd: &OwnedFd) -> Result<u64, std::io::Error> {
    // SAFETY: all-zero is a valid `struct stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open and `st` is a live, writable struct stat.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::try_from(st.st_size).unwrap_or(0))
}

pub(crate) fn check_size(size: u64) -> Result<(), RegionError> {
    if size == 0 || !size.is_multiple_of(PAGE_SIZE) || usize::try_from(size).is_err() {
        return Err(RegionError::BadSize { size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residency_follows_writes_and_removal() {
        let r = MemfdRegion::new("mapping-test", 0, 8 * PAGE_SIZE).unwrap();
        let base = r.host_addr() as u64;
        // SAFETY: page 2 and 5 lie inside the region's mapping.
        unsafe {
            r.host_addr().add(2 * PAGE_SIZE as usize).write(1);
            r.host_addr().add(5 * PAGE_SIZE as usize).write(1);
        }
        // SAFETY: the whole region is ours.
        let res = unsafe { crate::mapping::resident_pages(base, 8 * PAGE_SIZE) }.unwrap();
        assert_eq!(res, [false, false, true, false, false, true, false, false]);
        // SAFETY: page 2 is ours to discard.
        unsafe { crate::mapping::remove_range(base + 2 * PAGE_SIZE, PAGE_SIZE) }.unwrap();
        // SAFETY: as above.
        let res = unsafe { crate::mapping::resident_pages(base, 8 * PAGE_SIZE) }.unwrap();
        assert_eq!(res.iter().filter(|&&b| b).count(), 1);
        assert!(!r.holds_data(2 * PAGE_SIZE, PAGE_SIZE));
        assert!(r.holds_data(5 * PAGE_SIZE, PAGE_SIZE));
    }

    #[test]
    fn a_range_holds_data_only_when_every_page_does() {
        let r = MemfdRegion::new("holds-test", 0, 16 * PAGE_SIZE).unwrap();
        r.populate(0, 16 * PAGE_SIZE).unwrap();
        assert!(r.holds_data(0, 16 * PAGE_SIZE));
        assert!(r.holds_data(3 * PAGE_SIZE + 100, 2 * PAGE_SIZE));
        r.punch_hole(9 * PAGE_SIZE, PAGE_SIZE).unwrap();
        assert!(r.holds_data(0, 9 * PAGE_SIZE));
        // The hole in the middle, at the end, and reached by an unaligned start.
        assert!(!r.holds_data(8 * PAGE_SIZE, 3 * PAGE_SIZE));
        assert!(!r.holds_data(5 * PAGE_SIZE, 4 * PAGE_SIZE + 1));
        assert!(!r.holds_data(9 * PAGE_SIZE + 8, 8));
        assert!(r.holds_data(10 * PAGE_SIZE, 6 * PAGE_SIZE));
        r.punch_hole(12 * PAGE_SIZE, 4 * PAGE_SIZE).unwrap();
        // No data from the asked page to the end of the memfd (ENXIO).
        assert!(!r.holds_data(13 * PAGE_SIZE, PAGE_SIZE));
        assert!(!r.holds_data(16 * PAGE_SIZE, PAGE_SIZE));
    }

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
        assert!(matches!(
            MemfdRegion::new("x", !4095u64, 8192),
            Err(RegionError::AddressOverflow { .. })
        ));
        assert!(matches!(
            MemfdRegion::new("x", 0, !4095u64),
            Err(RegionError::Memfd { .. } | RegionError::Mmap { .. })
        ));
        assert!(matches!(
            MemfdRegion::new("nul\0name", 0, 4096),
            Err(RegionError::Memfd { .. })
        ));
    }

    #[test]
    fn from_fd_shares_the_memory() {
        let a = MemfdRegion::new("shared", 0x10_0000, 2 * PAGE_SIZE).unwrap();
        // SAFETY: byte 4097 of the two-page mapping.
        unsafe { *a.host_addr().add(4097) = 0x5a };
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = MemfdRegion::from_fd("shared-view", 0x10_0000, 2 * PAGE_SIZE, fd).unwrap();
        assert_ne!(a.host_addr(), b.host_addr());
        // SAFETY: as above, through the second mapping.
        assert_eq!(unsafe { *b.host_addr().add(4097) }, 0x5a);
        let fd = a.fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            MemfdRegion::from_fd("too-big", 0, 4 * PAGE_SIZE, fd),
            Err(RegionError::FileTooSmall {
                file_size: 8192,
                ..
            })
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
        // Within a window: clipped to it; nothing past it, nothing before.
        let p = PAGE_SIZE;
        assert_eq!(r.data_ranges_in(0, 16 * p), r.data_ranges());
        assert_eq!(r.data_ranges_in(4 * p, 5 * p), Vec::<(u64, u64)>::new());
        assert_eq!(r.data_ranges_in(4 * p, 6 * p), vec![(9 * p, p)]);
        assert_eq!(r.data_ranges_in(0, 4 * p), vec![(3 * p, p)]);
        assert_eq!(r.data_ranges_in(9 * p, 100 * p), vec![(9 * p, p)]);
        assert_eq!(r.data_ranges_in(20 * p, p), Vec::<(u64, u64)>::new());
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
