//! Fleet operations: what turns single migrations into running a fleet of
//! hosts that do not trust the network between them.
//!
//! - [`agent`]: `ferry agent`, the one long-lived process per host beside
//!   its VMMs. It registers the host under a lease (what it offers VMs),
//!   starts VMs and waiting destinations when asked, moves and hands over
//!   its VMs, and adopts the VMs already running after its own restart;
//!   VMMs outlive it.
//! - [`api`]: what an agent is asked, [`reply`] what it answers (typed,
//!   decoded once in the client); [`wire`] carries both (a JSON line each
//!   way over mutual TLS); [`client`] calls an agent.
//! - [`fleet`]: the hosts the registry knows, and their agents.
//! - [`drain`]: empties a host, as a session in rooms: plan, the moves'
//!   phases and failure rule, the scheduler, standbys, the report, and a
//!   [`drain::Drain`] that keeps its state in the registry ([`journal`]) so
//!   a drain restarted after a crash resumes (`claims`: the room its moves
//!   and standbys hold on each host); [`upgrade`]: hands every VM of a host
//!   to a fresh VMM process.
//!
//! docs/agent.md describes the API and the operations.

pub mod agent;
pub mod api;
mod claims;
pub mod client;
pub mod drain;
pub mod fleet;
pub mod journal;
pub mod reply;
#[cfg(test)]
mod testing;
pub mod upgrade;
mod wire;

pub use api::{HostInfo, Request, VmInfo, VmSpec};
pub use client::AgentClient;
pub use drain::{Drain, DrainOptions, DrainReport};
pub use fleet::Fleet;

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
