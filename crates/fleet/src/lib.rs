//! Fleet operations: what turns single migrations into running a fleet of
//! hosts that do not trust the network between them.
//!
//! - `agent/`: `ferry agent`, the one long-lived process per host beside
//!   its VMMs. It registers the host under a lease (what it offers VMs),
//!   starts VMs and waiting destinations when asked, moves and hands over
//!   its VMs, and adopts the VMs already running after its own restart;
//!   VMMs outlive it.
//! - `api.rs`: what an agent is asked, `reply.rs` what it answers (typed,
//!   decoded once in the client); `wire.rs` carries both (a JSON line each
//!   way over mutual TLS); `client.rs` calls an agent.
//! - `fleet.rs`: the hosts the registry knows, and their agents.
//! - [`drain`]: empties a host, as a session in rooms: plan, the moves'
//!   phases and failure rule, the scheduler, standbys, the report, and a
//!   [`Drain`] that keeps its state in the registry (`journal.rs`) so a
//!   drain restarted after a crash resumes (`claims.rs`: the room its moves
//!   and standbys hold on each host); `upgrade.rs`: hands every VM of a
//!   host to a fresh VMM process.
//!
//! The front door is small: the root re-exports what the CLI and the fuzz
//! targets use, and [`drain`] is public for its face alone (its defaults,
//! `plan_now`, `cancel`, the plan and the reports); every room is private.
//!
//! docs/agent.md describes the API and the operations.

mod agent;
mod api;
mod claims;
mod client;
pub mod drain;
mod fleet;
mod journal;
mod reply;
#[cfg(test)]
mod testing;
mod upgrade;
mod wire;

pub use agent::{run_until, Agent, AgentOptions};
pub use api::{
    check_name, parse_request, HostInfo, Request, VmInfo, VmSpec, MAX_FIELD, MAX_STORES,
};
pub use client::AgentClient;
pub use drain::{Drain, DrainOptions, DrainReport};
pub use fleet::Fleet;
pub use journal::{all as drains, DrainRecord};
pub use upgrade::{run as upgrade, UpgradeReport};

/// Why a fleet operation failed.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The agent link failed (connect, handshake, a read or write).
    #[error("agent {agent}: {reason}")]
    Link {
        /// The agent's address.
        agent: String,
        /// What failed.
        reason: String,
    },
    /// A peer sent something this side will not take.
    #[error("{0}")]
    Refused(String),
    /// The agent answered with an error.
    #[error("agent {agent} ({op}): {error}")]
    Agent {
        /// The agent's address.
        agent: String,
        /// What it was asked.
        op: &'static str,
        /// Its answer.
        error: String,
    },
    /// The registry could not be read or written.
    #[error(transparent)]
    Registry(#[from] ferry_registry::RegistryError),
    /// A VM's VMM did not do what was asked of it.
    #[error("VM {vm}: {reason}")]
    Vm {
        /// The VM.
        vm: String,
        /// What went wrong.
        reason: String,
    },
    /// A local file or process.
    #[error("{what}: {error}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        error: std::io::Error,
    },
    /// No host of that name, or no room anywhere.
    #[error("{0}")]
    Plan(String),
    /// A host the operation needs is down: the registry lists it dead
    /// (its agent holds no lease), or its agent does not answer.
    #[error("host {host}: {reason}")]
    HostDown {
        /// The host.
        host: String,
        /// How it is known to be down.
        reason: String,
    },
}

impl FleetError {
    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FleetError {
        let what = what.into();
        move |error| FleetError::Io { what, error }
    }
}
