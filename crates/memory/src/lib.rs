//! Guest memory for ferry: RAM regions backed by memfds and mapped shared
//! (so they can be handed to another process, punched, and put under
//! userfaultfd), and the guest-physical view over them.

pub mod guest_memory;
pub mod region;
pub mod uffd;

pub use guest_memory::{GuestMemory, MemoryError};
pub use region::{MemfdRegion, RegionError};
pub use uffd::{Event, Features, RegisterMode, UffdError, Userfaultfd};

/// The unit of guest memory accounting.
pub const PAGE_SIZE: u64 = 4096;
