//! What a userfaultfd is asked for and what the kernel grants: the
//! optional features of the API handshake, the fault kinds a range is
//! registered for, and the ioctls then allowed on it. Plain flag types,
//! kept apart from the calls that use them.

use super::abi::{self, feature};

/// Optional kernel features to request in the API handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// MISSING faults on shmem/memfd (UFFD_FEATURE_MISSING_SHMEM).
    pub missing_shmem: bool,
    /// MINOR faults on shmem/memfd (UFFD_FEATURE_MINOR_SHMEM).
    pub minor_shmem: bool,
    /// Write protection on shmem/memfd (UFFD_FEATURE_WP_HUGETLBFS_SHMEM and
    /// UFFD_FEATURE_PAGEFAULT_FLAG_WP).
    pub wp_shmem: bool,
    /// Write protection also of never-populated anonymous pages
    /// (UFFD_FEATURE_WP_UNPOPULATED, Linux 6.4+). shmem gets this without it.
    pub wp_unpopulated: bool,
    /// The faulting thread's id in each fault event (UFFD_FEATURE_THREAD_ID).
    pub thread_id: bool,
}

impl Features {
    pub(super) fn bits(self) -> u64 {
        let mut bits = 0;
        if self.missing_shmem {
            bits |= feature::MISSING_SHMEM;
        }
        if self.minor_shmem {
            bits |= feature::MINOR_SHMEM;
        }
        if self.wp_shmem {
            bits |= feature::WP_HUGETLBFS_SHMEM | feature::PAGEFAULT_FLAG_WP;
        }
        if self.wp_unpopulated {
            bits |= feature::WP_UNPOPULATED | feature::PAGEFAULT_FLAG_WP;
        }
        if self.thread_id {
            bits |= feature::THREAD_ID;
        }
        bits
    }
}

/// Which faults a registered range raises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisterMode {
    /// Access to a page with no backing page.
    pub missing: bool,
    /// Access to a page present in the page cache but not mapped here.
    pub minor: bool,
    /// Write to a write-protected page.
    pub wp: bool,
}

impl RegisterMode {
    pub(super) fn bits(self) -> u64 {
        let mut bits = 0;
        if self.missing {
            bits |= abi::REGISTER_MODE_MISSING;
        }
        if self.minor {
            bits |= abi::REGISTER_MODE_MINOR;
        }
        if self.wp {
            bits |= abi::REGISTER_MODE_WP;
        }
        bits
    }
}

/// The ioctls the kernel allows on a registered range (it depends on the
/// mapping type and the mode), so callers can check before relying on one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ioctls(pub(super) u64);

impl Ioctls {
    fn has(self, nr: u64) -> bool {
        self.0 & (1 << nr) != 0
    }

    /// The raw bitmask (bit n = ioctl number n).
    pub fn bits(self) -> u64 {
        self.0
    }

    /// [`Userfaultfd::copy`] works on the range.
    pub fn copy(self) -> bool {
        self.has(abi::nr::COPY)
    }

    /// [`Userfaultfd::zeropage`] works on the range.
    pub fn zeropage(self) -> bool {
        self.has(abi::nr::ZEROPAGE)
    }

    /// [`Userfaultfd::continue_range`] works on the range.
    pub fn continue_range(self) -> bool {
        self.has(abi::nr::CONTINUE)
    }

    /// [`Userfaultfd::write_protect`] works on the range.
    pub fn write_protect(self) -> bool {
        self.has(abi::nr::WRITEPROTECT)
    }

    /// [`Userfaultfd::wake`] works on the range.
    pub fn wake(self) -> bool {
        self.has(abi::nr::WAKE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_and_modes_map_to_the_kernel_bits() {
        assert_eq!(Features::default().bits(), 0);
        let all = Features {
            missing_shmem: true,
            minor_shmem: true,
            wp_shmem: true,
            wp_unpopulated: true,
            thread_id: true,
        };
        assert_eq!(
            all.bits(),
            feature::MISSING_SHMEM
                | feature::MINOR_SHMEM
                | feature::WP_HUGETLBFS_SHMEM
                | feature::WP_UNPOPULATED
                | feature::PAGEFAULT_FLAG_WP
                | feature::THREAD_ID
        );
        // Either kind of write protection brings the WP fault flag.
        for wp in [
            Features {
                wp_shmem: true,
                ..Default::default()
            },
            Features {
                wp_unpopulated: true,
                ..Default::default()
            },
        ] {
            assert_ne!(wp.bits() & feature::PAGEFAULT_FLAG_WP, 0, "{wp:?}");
        }
        let mode = RegisterMode {
            missing: true,
            minor: false,
            wp: true,
        };
        assert_eq!(
            mode.bits(),
            abi::REGISTER_MODE_MISSING | abi::REGISTER_MODE_WP
        );
        assert_eq!(RegisterMode::default().bits(), 0);
    }

    #[test]
    fn ioctls_read_the_kernel_mask_by_number() {
        let granted = Ioctls(1 << abi::nr::COPY | 1 << abi::nr::WAKE);
        assert!(granted.copy() && granted.wake());
        assert!(!granted.zeropage() && !granted.continue_range() && !granted.write_protect());
        assert_eq!(granted.bits(), 0b1100);
        let minor = Ioctls(1 << abi::nr::CONTINUE | 1 << abi::nr::WRITEPROTECT);
        assert!(minor.continue_range() && minor.write_protect() && !minor.copy());
    }
}
