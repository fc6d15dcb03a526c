//! The control socket: one unix socket per VM speaking JSON lines, like QMP.
//!
//! ```text
//! client                                   VMM
//!   {"cmd":"status"}\n          ──────▶
//!                               ◀──────   {"ok":true,"state":"running",...}\n
//!   {"cmd":"pause"}\n           ──────▶
//!                               ◀──────   {"ok":true}\n
//!   {"cmd":"bogus"}\n           ──────▶
//!                               ◀──────   {"ok":false,"error":"..."}\n
//! ```
//! Commands (the `"cmd"` of a [`Request`]):
//! - `status`: run state, size, workloads, uptime, service, split and
//!   access-tracking figures
//! - `metrics`: the guest's counters
//! - `pause`: stop the vCPUs
//! - `resume`: run them again
//! - `quit`: stop the VM and end its VMM process
//! - `migrate`: live-migrate the VM ([`MigrateRequest`]: where to, the
//!   engine's options, a timeline file)
//! - `migrate-resume`: continue a postcopy migration that paused on a
//!   broken link
//! - `handover`: move the VM to a new VMM process on this host without
//!   copying its memory
//! - `dump`: write the guest's non-zero pages to a file
//! - `dirty-rate`: how fast the guest writes memory (pages logged dirty
//!   over a short window)
//!
//! Only the VMM's own user and root may connect: the socket is created
//! 0600 whatever the umask, and each peer's uid is checked (SO_PEERCRED);
//! anyone else gets one `{"ok":false,"error":"refused: ..."}` line and is
//! closed ([`access`]).
//!
//! A reply is one line, `{"ok":true,...}` with the command's fields or
//! `{"ok":false,"error":"..."}`; `migrate`, `migrate-resume` and `handover`
//! send `{"progress":...}` lines before it. A line longer than [`MAX_LINE`]
//! bytes is refused and the connection closed.
//!
//! Parts: [`protocol`] (the commands, replies and errors: the contract),
//! [`server`] (the socket, its accept loop and the line limit), [`access`]
//! (who may connect), [`client`]
//! (what `ferry` calls a VMM with) and [`vm_control`] (what each command
//! does to the VM).

pub mod access;
pub mod client;
pub mod protocol;
pub mod server;
pub mod vm_control;

pub use client::ControlClient;
pub use protocol::{ControlError, MigrateRequest, Request, MAX_LINE};
pub use server::{ControlHandler, ControlServer, ControlSocket};
pub use vm_control::{metrics_json, HandoverSetup, VmControl};
