//! An error from the VMM's side of the engine's boundary (whatever
//! implements the traits in `vm.rs`), kept whole so its own type and cause
//! chain reach the user. A leaf module: the sink, the traits and the
//! engine's own error all carry it, and it depends on none of them.

/// An error from the VMM (or whatever implements the engine's traits).
pub type VmOpError = Box<dyn std::error::Error + Send + Sync + 'static>;
