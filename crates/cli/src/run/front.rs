//! The run's front-end settings: how it reports (JSON, quiet, timeline),
//! how long it runs, and what it set up on the host. A handover passes them
//! to the next process, so the run goes on there as it would have here.

use std::path::PathBuf;

/// What the front end of a run passes to the next process at a handover,
/// so the run goes on there as it would have here.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Carried {
    pub(super) json: bool,
    pub(super) quiet: bool,
    pub(super) timeline: Option<PathBuf>,
    pub(super) duration_ms: Option<u64>,
    /// When the run's clock started (ms since the epoch).
    pub(super) started_unix_ms: u64,
    /// The VM's own address (up on this host; the new process removes it
    /// when the VM leaves). Kept in the run's settings, not the handover
    /// protocol, so a ferry without the feature can still hand over.
    #[serde(default)]
    pub(super) vm_address: Option<std::net::Ipv4Addr>,
    /// Access tracking (period ms, share); absent or 0: off.
    #[serde(default)]
    pub(super) access_period_ms: u64,
    #[serde(default)]
    pub(super) access_share: u32,
    /// 0 (an older ferry's run): the default grain.
    #[serde(default)]
    pub(super) access_grain: u64,
    /// Writes from KVM's dirty log (--access-writes log).
    #[serde(default)]
    pub(super) access_log_writes: bool,
}
