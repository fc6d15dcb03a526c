//! A small safe wrapper over Linux userfaultfd, for guest RAM on memfds.
//!
//! ferry uses it for postcopy and remote paging (MISSING faults resolved with
//! [`Userfaultfd::copy`]), access sampling (MINOR faults after
//! [`crate::region::MemfdRegion::discard`], resolved with [`Userfaultfd::continue_range`])
//! and page-out (write protection).
//!
//! Cost: every fault is two thread wake-ups (faulting thread -> handler ->
//! faulting thread). On the 2-core development VM (Linux 6.18) a host thread
//! fault resolved by a handler measured ~8-10 µs back to back and ~20-25 µs
//! when the handler was asleep in poll; budget ~30-90 µs per fault for vCPUs
//! (KVM adds its own exit and retry). So handlers should
//! [`Userfaultfd::poll`], drain every pending event per wake-up with
//! [`Userfaultfd::read_events`], and resolve in batches (copy with
//! `wake: false`, then one [`Userfaultfd::wake`]), ideally ahead of faults.
//!
//! Register only guest memory (mappings that no Rust reference points into):
//! the resolving calls fill pages behind the compiler's back, and a thread
//! touching a registered range blocks until its fault is resolved.
//!
//! Files: this one (the error and the descriptor type), `open.rs` (the
//! descriptor and its API handshake), `mode.rs` (the features, fault kinds
//! and ioctls asked for and granted), `resolve.rs` (registering ranges and
//! the ioctls that resolve faults), `event.rs` (polling for and reading
//! fault events), `abi.rs` (the kernel's structs and numbers, written out
//! by hand), `tests.rs` (against the real kernel).

mod abi;
mod event;
mod mode;
mod open;
mod resolve;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

pub use event::Event;
pub use mode::{Features, Ioctls, RegisterMode};

/// Why a userfaultfd call failed.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// Neither /dev/userfaultfd nor the syscall gave a descriptor.
    #[error(
        "cannot open userfaultfd: /dev/userfaultfd: {dev}; userfaultfd(2): {syscall} \
         (needs access to /dev/userfaultfd, CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd=1)"
    )]
    Open {
        /// Why /dev/userfaultfd (open or USERFAULTFD_IOC_NEW) failed.
        dev: std::io::Error,
        /// Why the userfaultfd(2) syscall failed.
        syscall: std::io::Error,
    },
    /// The kernel does not offer some requested features.
    #[error("this kernel's userfaultfd lacks {missing:?} (it offers {available:?})")]
    MissingFeatures {
        /// Requested features the kernel lacks (UFFD_FEATURE_* names).
        missing: Vec<String>,
        /// What the kernel offers.
        available: Vec<String>,
    },
    /// The API handshake failed for another reason.
    #[error("userfaultfd API handshake (features {requested:?}) failed: {source}")]
    Api {
        /// Requested features.
        requested: Vec<String>,
        /// OS error.
        source: std::io::Error,
    },
    /// Registering a range failed.
    #[error("cannot register {len:#x} bytes at {addr:#x} with userfaultfd ({mode:?}): {source}")]
    Register {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Requested fault kinds.
        mode: RegisterMode,
        /// OS error (EINVAL: unaligned, or a mode the mapping or fd does not
        /// support; EBUSY: registered with another userfaultfd).
        source: std::io::Error,
    },
    /// The page is already mapped (e.g. another thread resolved it first);
    /// callers resolving faults may ignore this.
    #[error("page at {addr:#x} is already mapped")]
    AlreadyMapped {
        /// Address.
        addr: u64,
    },
    /// Any other ioctl failure.
    #[error("userfaultfd {op} at {addr:#x}+{len:#x} failed: {source}")]
    Ioctl {
        /// Which ioctl.
        op: &'static str,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// Reading or polling for events failed.
    #[error("reading userfaultfd events failed: {0}")]
    Read(std::io::Error),
}

/// An open userfaultfd (non-blocking, close-on-exec).
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
    available: u64,
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests;
