//! Another VM's guest RAM, read through its memfd: where a destination
//! finds the content of pages a source sends as references to what its
//! host already holds (cross-VM sharing, `ferry_migration::shared`). The
//! other VMM keeps running and writing its memory; a reader copies a page
//! out and checks what it copied, never trusting what it saw before.
//!
//! Read with pread(2), never through a mapping: a read fault on a hole of a
//! shared memfd would put a zero page into the other VM's file, and that VM
//! may have punched the hole on purpose (a postcopy destination or a split
//! VM's pager waits for userfaultfd to report the page missing). pread of a
//! hole returns zeros and allocates nothing, and a file that shrank gives a
//! short read instead of SIGBUS.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;

use crate::region::{check_size, data_ranges_of, file_size, RegionError, PAGE_SIZE};

/// Another VMM's memfd region, read-only.
pub struct PeerRegion {
    name: String,
    size: u64,
    file: std::fs::File,
}

impl PeerRegion {
    /// Reads the first `size` bytes of `fd` (opened read-only); the file
    /// must hold that many bytes now (checked).
    pub fn open(name: &str, size: u64, fd: OwnedFd) -> Result<Self, RegionError> {
        check_size(size)?;
        let file_size = file_size(&fd).map_err(|source| RegionError::Mmap { size, source })?;
        if file_size < size {
            return Err(RegionError::FileTooSmall { size, file_size });
        }
        Ok(PeerRegion {
            name: name.into(),
            size,
            file: fd.into(),
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

    /// The page-aligned (offset, length) ranges that hold data.
    pub fn data_ranges(&self) -> Vec<(u64, u64)> {
        data_ranges_of(self.file.as_fd(), self.size)
    }

    /// Reads whole pages from byte `offset` into `out` (a multiple of a
    /// page long); false if they are not inside the region or the read
    /// came up short (the file shrank).
    pub fn read_pages(&self, offset: u64, out: &mut [u8]) -> bool {
        let len = out.len() as u64;
        if !offset.is_multiple_of(PAGE_SIZE)
            || !len.is_multiple_of(PAGE_SIZE)
            || offset.checked_add(len).is_none_or(|end| end > self.size)
        {
            return false;
        }
        self.file.read_exact_at(out, offset).is_ok()
    }

    /// Reads the page at byte `offset` into `out` ([`Self::read_pages`]).
    pub fn copy_page(&self, offset: u64, out: &mut [u8; PAGE_SIZE as usize]) -> bool {
        self.read_pages(offset, out)
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
        let peer = PeerRegion::open("peer", 8 * PAGE_SIZE, fd).unwrap();
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
        assert!(PeerRegion::open("big", 16 * PAGE_SIZE, fd).is_err());
    }

    #[test]
    fn reading_a_hole_leaves_it_a_hole() {
        // The owner punched page 2 (as a postcopy destination does): the
        // peer reads zeros, and the page stays missing for the owner.
        let owner = MemfdRegion::new("owner", 0, 4 * PAGE_SIZE).unwrap();
        for p in 0..4 {
            // SAFETY: page p of the owner's live mapping.
            unsafe { *owner.host_addr().add(p * PAGE_SIZE as usize) = 1 };
        }
        owner.punch_hole(2 * PAGE_SIZE, PAGE_SIZE).unwrap();
        let fd = owner.fd().try_clone_to_owned().unwrap();
        let peer = PeerRegion::open("peer", 4 * PAGE_SIZE, fd).unwrap();
        let mut all = vec![9u8; 4 * PAGE_SIZE as usize];
        assert!(peer.read_pages(0, &mut all));
        assert!(all[2 * PAGE_SIZE as usize..3 * PAGE_SIZE as usize]
            .iter()
            .all(|&b| b == 0));
        assert!(
            !owner.holds_data(2 * PAGE_SIZE, PAGE_SIZE),
            "the read filled the hole"
        );
    }
}
