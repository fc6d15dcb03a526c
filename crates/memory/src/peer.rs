//! Another VM's guest RAM, mapped read-only: where a destination finds the
//! content of pages a source sends as references to what its host already
//! holds (cross-VM sharing, `ferry_migration::shared`). The other VMM keeps
//! running and writing its memory; a reader copies a page out and checks
//! what it copied, never trusting what it saw before.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use crate::region::{check_size, data_ranges_of, file_size, RegionError, PAGE_SIZE};

/// A read-only, shared mapping of another VMM's memfd region.
pub struct PeerRegion {
    name: String,
    size: u64,
    fd: OwnedFd,
    host: *const u8,
}

// SAFETY: the mapping lives exactly as long as the struct, is read-only, and
// is reached only through `copy_page`'s raw copies; the other process's
// concurrent writes are guest-memory semantics (a copy may be torn, which
// the reader detects by its own check).
unsafe impl Send for PeerRegion {}
// SAFETY: see Send.
unsafe impl Sync for PeerRegion {}

impl PeerRegion {
    /// Maps the first `size` bytes of `fd` (opened read-only) for reading;
    /// the file must hold that many bytes (checked: touching a mapping past
    /// its file's end raises SIGBUS).
    pub fn map(name: &str, size: u64, fd: OwnedFd) -> Result<Self, RegionError> {
        check_size(size)?;
        let file_size = file_size(&fd).map_err(|source| RegionError::Mmap { size, source })?;
        if file_size < size {
            return Err(RegionError::FileTooSmall { size, file_size });
        }
        // SAFETY: a read-only shared mapping of a file we hold, of a checked
        // size, at an address the kernel chooses; checked before use.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ,
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
        Ok(PeerRegion {
            name: name.into(),
            size,
            fd,
            host: host.cast_const().cast(),
        })
    }

    /// What the region is (the other VM and its region, for logs).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page-aligned (offset, length) ranges that hold data (holes are
    /// never read, so they are never populated).
    pub fn data_ranges(&self) -> Vec<(u64, u64)> {
        data_ranges_of(self.fd.as_fd(), self.size)
    }

    /// Copies the page at byte `offset` into `out`; false (nothing copied)
    /// if it is not a whole page inside the region.
    pub fn copy_page(&self, offset: u64, out: &mut [u8; PAGE_SIZE as usize]) -> bool {
        if !offset.is_multiple_of(PAGE_SIZE)
            || offset
                .checked_add(PAGE_SIZE)
                .is_none_or(|end| end > self.size)
        {
            return false;
        }
        // SAFETY: `offset .. offset + PAGE_SIZE` lies inside the live
        // mapping (checked); `out` is a page-sized buffer of ours. The other
        // VM may write the page meanwhile: the caller checks the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.host.add(offset as usize),
                out.as_mut_ptr(),
                PAGE_SIZE as usize,
            )
        };
        true
    }
}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping `map` made, once.
        unsafe { libc::munmap(self.host.cast_mut().cast(), self.size as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemfdRegion;

    #[test]
    fn a_peer_sees_what_the_owner_writes_and_only_whole_pages_inside() {
        let owner = MemfdRegion::new("owner", 0, 8 * PAGE_SIZE).unwrap();
        // SAFETY: page 3 of the owner's live mapping.
        unsafe { *owner.host_addr().add(3 * PAGE_SIZE as usize + 5) = 42 };
        let fd = owner.fd().try_clone_to_owned().unwrap();
        let peer = PeerRegion::map("peer", 8 * PAGE_SIZE, fd).unwrap();
        assert_eq!(peer.data_ranges(), vec![(3 * PAGE_SIZE, PAGE_SIZE)]);
        let mut page = [0u8; PAGE_SIZE as usize];
        assert!(peer.copy_page(3 * PAGE_SIZE, &mut page));
        assert_eq!(page[5], 42);
        // The owner writes on; the peer's next copy sees it.
        // SAFETY: as above.
        unsafe { *owner.host_addr().add(3 * PAGE_SIZE as usize + 5) = 7 };
        assert!(peer.copy_page(3 * PAGE_SIZE, &mut page));
        assert_eq!(page[5], 7);
        assert!(!peer.copy_page(8 * PAGE_SIZE, &mut page), "past the end");
        assert!(!peer.copy_page(5, &mut page), "unaligned");
        assert!(!peer.copy_page(!(PAGE_SIZE - 1), &mut page), "wraps around");
        // A file smaller than the size asked for is refused.
        let fd = owner.fd().try_clone_to_owned().unwrap();
        assert!(PeerRegion::map("big", 16 * PAGE_SIZE, fd).is_err());
    }
}
