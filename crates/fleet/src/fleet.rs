//! The fleet as the registry shows it: its hosts' agents, and what each
//! says of itself.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_registry::{HostEntry, HostKind, Registry};
use ferry_tls::Credentials;

use crate::api::{HostInfo, VmInfo};
use crate::{AgentClient, FleetError};

/// A registry entry of an agent and what the agent said of its host.
pub type HostAnswer = (HostEntry, Result<HostInfo, FleetError>);

/// The registry and how to reach the agents it lists.
#[derive(Clone)]
pub struct Fleet {
    registry: Arc<dyn Registry>,
    tls: Option<Arc<Credentials>>,
}

impl Fleet {
    /// The fleet in `registry`, whose agents are reached with `tls` (None:
    /// plaintext, an `--insecure` fleet).
    pub fn new(registry: Arc<dyn Registry>, tls: Option<Arc<Credentials>>) -> Self {
        Fleet { registry, tls }
    }

    /// The registry itself (a drain keeps its state there).
    pub fn registry(&self) -> &Arc<dyn Registry> {
        &self.registry
    }

    /// Where the fleet is recorded, for messages.
    pub fn describe(&self) -> String {
        self.registry.describe()
    }

    /// Every live agent's registry entry, by name.
    pub fn agents(&self) -> Result<Vec<HostEntry>, FleetError> {
        let mut a: Vec<HostEntry> = self
            .registry
            .hosts()?
            .into_iter()
            .filter(|h| h.kind == HostKind::Agent)
            .collect();
        a.sort_by(|x, y| x.name.cmp(&y.name));
        a.dedup_by(|x, y| x.name == y.name);
        Ok(a)
    }

    /// The agent of host `name`: [`FleetError::HostDown`] if the registry
    /// lists the host dead (it registered once, its lease lapsed).
    pub fn agent(&self, name: &str) -> Result<AgentClient, FleetError> {
        let agents = self.agents()?;
        if !agents.iter().any(|h| h.name == name) {
            if let Some((_, addr)) = self.dead_hosts()?.into_iter().find(|(h, _)| h == name) {
                return Err(FleetError::HostDown {
                    host: name.into(),
                    reason: format!(
                        "the registry ({}) lists it dead: its agent{} holds no lease (killed, \
                         stopped, or cut off); its VMs may still run, but nothing can reach them \
                         until its agent is back",
                        self.describe(),
                        if addr.is_empty() {
                            String::new()
                        } else {
                            format!(" (last at {addr})")
                        }
                    ),
                });
            }
        }
        let e = agents.iter().find(|h| h.name == name).ok_or_else(|| {
            let known: Vec<&str> = agents.iter().map(|h| h.name.as_str()).collect();
            FleetError::Plan(format!(
                "no live agent for host {name} in {} (agents: {})",
                self.describe(),
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))
        })?;
        self.client(e)
    }

    /// A client for the agent of `entry`.
    pub fn client(&self, entry: &HostEntry) -> Result<AgentClient, FleetError> {
        let addr: SocketAddr = entry.addr.parse().map_err(|_| {
            FleetError::Refused(format!(
                "the registry gives agent {} the address {:?}, which is not HOST:PORT",
                entry.name, entry.addr
            ))
        })?;
        Ok(AgentClient::new(addr, self.tls.clone()))
    }

    /// What host `name`'s agent says of itself.
    pub fn host(&self, name: &str) -> Result<HostInfo, FleetError> {
        self.agent(name)?.info()
    }

    /// What every agent says of itself; an agent that does not answer is
    /// reported with its error.
    pub fn hosts(&self) -> Result<Vec<HostAnswer>, FleetError> {
        Ok(self
            .agents()?
            .into_iter()
            .map(|e| {
                let i = self.client(&e).and_then(|c| c.info());
                (e, i)
            })
            .collect())
    }

    /// The host that runs VM `name`, and the VM.
    pub fn find_vm(&self, name: &str) -> Result<(HostInfo, VmInfo), FleetError> {
        for (_, host) in self.hosts()? {
            let Ok(host) = host else { continue };
            // A forwarder's VM runs elsewhere.
            if let Some(vm) = host
                .vms
                .iter()
                .find(|v| v.spec.name == name && v.state != "forwarding")
                .cloned()
            {
                return Ok((host, vm));
            }
        }
        Err(FleetError::Plan(format!(
            "no agent in {} runs a VM named {name}",
            self.describe()
        )))
    }
}

/// The record that keeps a host known to the fleet beyond its lease.
pub fn known_key(host: &str) -> String {
    format!("agents/{host}")
}

impl Fleet {
    /// Hosts whose agent once registered but holds no lease now: dead, or
    /// their agent stopped (their VMs may run on). (name, last address).
    pub fn dead_hosts(&self) -> Result<Vec<(String, String)>, FleetError> {
        let live: Vec<String> = self.agents()?.into_iter().map(|h| h.name).collect();
        let mut out = Vec::new();
        for (k, v) in self.registry.records("agents/")? {
            let name = k.trim_start_matches("agents/").to_string();
            if live.contains(&name) {
                continue;
            }
            let addr = serde_json::from_slice::<serde_json::Value>(&v)
                .ok()
                .and_then(|v| v["addr"].as_str().map(String::from))
                .unwrap_or_default();
            out.push((name, addr));
        }
        Ok(out)
    }
}
