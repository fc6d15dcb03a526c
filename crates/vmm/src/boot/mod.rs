//! Booting the test guest: RAM layout, the kernel loader, and the state the
//! guest finds at entry.

pub mod layout;
pub mod loader;
pub mod setup;

/// The test guest kernel, built from `guest/` by this crate's build script.
pub static GUEST_KERNEL: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/guest/ferry-guest.elf"));
