//! ferry's NBD client: a VM's disk on shared storage, served by a standard
//! NBD server (`qemu-nbd`, `nbdkit`: they serve raw, qcow2 and the other
//! image formats, so ferry has no image-format code of its own).
//!
//! The protocol is the fixed-newstyle handshake with `NBD_OPT_GO`, then
//! simple replies (structured replies are not asked for: a disk's reads
//! need nothing they add). The server is a peer like any other: every
//! length, size and cookie it sends is checked against a limit or against
//! what was asked before anything is kept, and whatever does not fit is a
//! typed error, never a panic.
//!
//! - [`uri`]: `nbd://HOST[:PORT]/EXPORT`, `nbds://…` (TLS, ferry's own
//!   certificates), `nbd+unix:///EXPORT?socket=PATH`;
//! - [`wire`]: the protocol's numbers and its frames, encoded and decoded
//!   without I/O (fuzzed on their own);
//! - [`handshake`]: the negotiation up to the export's size and flags;
//! - [`client`]: reads, writes, flush, trim and write-zeroes at offsets,
//!   split to the server's block limits, and reconnection.
//!
//! Why not a crate: the `nbd` crate on crates.io is an early, unmaintained
//! piece without TLS, flush or block-size negotiation, and libnbd (the
//! reference client) has no Rust binding on crates.io; a client is a few
//! hundred lines, and this one speaks TLS through the same rustls and
//! credentials as every other ferry link.

pub mod client;
pub mod error;
pub mod handshake;
pub mod uri;
pub mod wire;

pub use client::{Client, Export};
pub use error::NbdError;
pub use uri::{NbdUri, Transport};
