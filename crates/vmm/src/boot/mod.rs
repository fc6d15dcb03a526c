//! Booting the test guest: RAM layout, the kernel loader, and the state the
//! guest finds at entry.

pub mod layout;
pub mod loader;
pub mod setup;
