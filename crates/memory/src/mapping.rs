//! Calls on a shared guest-memory mapping by address alone, for code that
//! holds a view of the mapping but not the memfd (the split pager).

use std::io;

/// The unit of guest memory accounting (`region` and the rest use it from
/// here: this module stands below them).
pub const PAGE_SIZE: u64 = 4096;

/// Which pages of `len` bytes from `addr` are in memory (the memfd's page
/// cache, for a shared memfd mapping), asked with mincore(2) so nothing is
/// touched: a page-out must not fault on a hole it would read.
///
/// # Safety
/// `addr .. addr + len` must be a page-aligned range of a mapping the
/// caller owns.
pub unsafe fn resident_pages(addr: u64, len: u64) -> io::Result<Vec<bool>> {
    let pages = len.div_ceil(PAGE_SIZE) as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: the caller promises the range is its own mapping; `vec` has
    // one byte per page as mincore writes.
    let r = unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, vec.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(vec.into_iter().map(|b| b & 1 == 1).collect())
}

/// Frees the memfd pages behind `len` bytes from `addr` (MADV_REMOVE: a
/// hole punched through the mapping); the next access reads zeros, or
/// raises a userfaultfd MISSING fault where registered.
///
/// # Safety
/// `addr .. addr + len` must be a page-aligned range of a shared mapping
/// the caller owns whose contents it means to discard.
pub unsafe fn remove_range(addr: u64, len: u64) -> io::Result<()> {
    // SAFETY: the caller promises the range is its own shared mapping and
    // that its contents may go.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_REMOVE) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops the page table entries of `len` bytes from `addr` (MADV_DONTNEED;
/// a shared memfd keeps the data): the next access maps the page again,
/// raising a MINOR fault where the range is registered for them.
///
/// # Safety
/// `addr .. addr + len` must be a page-aligned range of a shared mapping
/// the caller owns.
pub unsafe fn drop_ptes(addr: u64, len: u64) -> io::Result<()> {
    // SAFETY: the caller promises the range is its own shared mapping, so
    // only page table entries go; the memfd keeps every page.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Allocates and maps every page of `len` bytes from `addr` now
/// (MADV_POPULATE_WRITE, Linux 5.14): the first touch then costs nothing.
/// Contents are unchanged: missing pages become zero pages, present ones
/// stay.
///
/// # Safety
/// `addr .. addr + len` must be a page-aligned range of a mapping the
/// caller owns and may write, not registered with a userfaultfd that
/// nobody serves (populating it would wait on that fault).
pub unsafe fn populate_write(addr: u64, len: u64) -> io::Result<()> {
    // Not in every libc crate version.
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: the caller promises the range is its own writable mapping;
    // the advice only faults pages in.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, MADV_POPULATE_WRITE) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
