//! Memory servers: the page part of a destination and nothing else (split
//! migration's sub-hosts). A server holds pages of any number of VMs, each
//! in a sparse store of that VM's layout, within one capacity for all.
//!
//! Every connection opens with a `Hello{Store}` (v9 or newer) and a
//! `StoreOpen` naming the VM and carrying its owner's secret (the first
//! open creates the store and binds it to that secret; every later open
//! must carry the same one); then, in any order:
//!
//! ```text
//! client (source, main host, gatherer)          memory server
//!  Hello{Store}, StoreOpen{vm, layout, reserve, secret} ──▶  store found or made
//!                                               ◀──  StoreAck{held, free, idle}
//!                                                    (or Abort: not the owner, full, layout)
//!  Pages{gpa, data}...                          ──▶  held (page-out, migration)
//!  ZeroRanges{runs}                             ──▶  not held any more (zero)
//!  StoreDrop{runs}                              ──▶  not held any more (paged in elsewhere)
//!  StoreSync{token}                             ──▶  everything before it has landed
//!                                               ◀──  StoreAck{held, free}
//!  PageRequest{gpas}                            ──▶
//!                                               ◀──  Pages{those pages, in order}  (Abort if one is not held)
//!  StoreFetch{runs, drop} (v8)                  ──▶
//!                                               ◀──  Pages{held pages of run 1}, Pages{… run 2}, …
//!                                                    (each run in ⌈len/MAX_BATCH⌉ frames, absent = zero)
//!  StoreList                                    ──▶
//!                                               ◀──  StoreHeld{runs}  (what it holds, for gather)
//!  StoreClose                                   ──▶  the VM's store is freed
//!                                               ◀──  StoreAck{0, free}
//! ```
//! Every peer may be hostile: [`limits`] says what one may cost, and every
//! request is checked against those caps and the VM's layout before
//! anything is allocated or changed.
//!
//! Files: [`store`] (one VM's pages), [`server`] (the server: its stores
//! and capacity), `accept.rs` (the accept loop), [`conn`] (one
//! connection: handshake, requests, answers),
//! [`limits`], [`secret`] (the owner's secret), [`error`], [`client`]
//! (what the engine uses to talk to a server).

mod accept;
pub mod client;
pub mod conn;
pub mod error;
pub mod limits;
pub mod secret;
pub mod server;
pub mod store;

pub use client::StoreClient;
pub use error::StoreError;
pub use limits::Limits;
pub use secret::StoreSecret;
pub use server::{MemServer, ServerStats};
pub use store::VmStore;

use crate::ranges::GpaPages;

/// Opens a VM's store on a connection.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreOpen {
    /// The VM's id (the same on every connection and server of one split).
    pub vm: String,
    /// Its guest RAM regions (gpa, bytes): the store's shape.
    pub regions: Vec<(u64, u64)>,
    /// Pages the client means to put here (taken from the free room, and
    /// kept for this VM until held).
    pub reserve_pages: u64,
    /// The owner's secret (v9): binds a new store, must match an old one.
    pub secret: StoreSecret,
}

/// A server's answer: what it holds for the VM, and its room left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreAck {
    /// Pages it holds for this VM.
    pub held_pages: u64,
    /// Pages it could still take, for all VMs (neither held nor reserved).
    pub free_pages: u64,
    /// Seconds the server keeps a connection that sends nothing (v9): a
    /// client idle longer reopens before its next request.
    pub idle_secs: u32,
}

/// Asks for the held pages of `runs` (v8): the server answers run by run,
/// each run in `ceil(len / MAX_BATCH)` Pages frames holding only the pages
/// it holds (a page it does not hold is a zero page); with `drop` it
/// forgets them as they go out (they moved to the asker).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreFetch {
    /// Runs in the order to answer them.
    pub runs: Vec<GpaPages>,
    /// Forget the pages once sent.
    pub drop: bool,
}

/// What a server holds for a VM (answer to StoreList).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreHeld {
    /// Runs of held pages (this frame's share).
    pub runs: Vec<GpaPages>,
    /// True on the last frame.
    pub last: bool,
}
