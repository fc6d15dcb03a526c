//! Guest memory for ferry: RAM regions backed by memfds and mapped shared
//! (so they can be handed to another process, punched, and put under
//! userfaultfd), and the guest-physical view over them.
//!
//! - [`region`]: one memfd-backed region ([`MemfdRegion`]).
//! - [`guest_memory`]: the VM's regions as one guest-physical address space
//!   ([`GuestMemory`]), with bounds-checked reads and writes.
//! - [`peer`]: another VM's RAM mapped read-only ([`PeerRegion`]), where
//!   pages shared across VMs are found.
//! - [`mapping`]: residency and hole punching by address (split's pager).
//! - [`uffd`]: userfaultfd for postcopy, access sampling and write protection
//!   ([`Userfaultfd`]).
//! - [`access`]: per-page clock and aging histories from sampled reads and
//!   logged writes ([`AccessTracker`]).

pub mod access;
pub mod guest_memory;
pub mod mapping;
pub mod peer;
pub mod region;
pub mod uffd;

pub use access::{
    valid_grain, AccessError, AccessSnapshot, AccessStats, AccessTracker, ArmReport,
    DEFAULT_GRAIN_PAGES,
};
pub use guest_memory::{GuestMemory, MemoryError, Plain};
pub use peer::PeerRegion;
pub use region::{MemfdRegion, RegionError};
pub use uffd::{Event, Features, Ioctls, RegisterMode, UffdError, Userfaultfd};

pub use region::PAGE_SIZE;
