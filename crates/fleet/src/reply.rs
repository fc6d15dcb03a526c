//! What an agent answers, as types: each reply line is decoded once, in
//! the client ([`crate::AgentClient`]), into the type of its request, so no
//! caller reads an answer by key. The agent writes the same types.

use std::collections::BTreeMap;

use ferry_migration::{MigrationStats, Progress};
use ferry_vmm::handover::HandoverStats;

use crate::api::{HostInfo, StoreInfo, VmInfo};

/// The answer to `info`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct InfoReply {
    /// The host and its VMs.
    pub host: HostInfo,
}

/// The answer to `dirty-rates`.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RatesReply {
    /// VM name → bytes/s it dirties (VMs that could not be measured are
    /// left out).
    pub rates: BTreeMap<String, f64>,
}

/// The answer to `start`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StartReply {
    /// The VM as it runs now.
    pub vm: VmInfo,
}

/// The answer to `stop`.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct StopReply {
    /// A VMM of that name was stopped.
    pub vm: bool,
    /// A memory server or standby for it was stopped.
    pub store: bool,
}

/// The answer to `store` and `standby`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StoreReply {
    /// Where it listens (`tcp:HOST:PORT`).
    pub addr: String,
    /// The process.
    pub store: StoreInfo,
}

/// The answer to `receive`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ReadyReply {
    /// Where to send the VM (`tcp:HOST:PORT`).
    pub to: String,
    /// The waiting VMM.
    pub vm: VmInfo,
}

/// The answer to `send`: the migration's own figures.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SendReply {
    /// What the source's engine measured.
    pub stats: MigrationStats,
}

/// The progress lines of a `send`: the migration's own.
pub type SendProgress = Progress;

/// The answer to `upgrade`: the handover's own figures.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct UpgradeReply {
    /// What the handover measured.
    pub stats: HandoverStats,
}
