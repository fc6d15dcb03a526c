//! A postcopy move's standby on a third host (the safety net): chosen from
//! the hosts as last seen, its room claimed before it starts and given back
//! when it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{HostInfo, VmInfo};
use crate::claims::{Claim, StandbyClaims};
use crate::fleet::Fleet;

/// Third hosts tried for a move's standby.
pub(crate) const STANDBY_TRIES: usize = 2;

/// Starts a postcopy standby for `vm` on the first of `third` whose room
/// can still be claimed and whose agent starts it; its agent, host name and
/// address. None when none can: the move then goes without one, as the
/// report says.
pub(crate) fn start_standby(
    fleet: &Fleet,
    claims: &Arc<StandbyClaims>,
    planned: &[Claim],
    hosts: &[HostInfo],
    third: &[String],
    vm: &VmInfo,
) -> Option<StandbyAt> {
    let (name, bytes) = (vm.spec.name.as_str(), vm.spec.mem_bytes);
    for h in third {
        if !claims.claim(hosts, planned, h, name, bytes) {
            tracing::warn!("drain: no standby on {h} for {name}: its room was claimed meanwhile");
            continue;
        }
        let started = fleet.agent(h).and_then(|a| {
            let r = a.standby(name, bytes)?;
            Ok((a, r.addr))
        });
        match started {
            Ok((agent, addr)) => {
                return Some(StandbyAt {
                    agent,
                    host: h.clone(),
                    addr,
                    claims: claims.clone(),
                })
            }
            Err(e) => {
                claims.release(h, name);
                tracing::warn!("drain: no standby on {h} for {name}: {e}");
            }
        }
    }
    tracing::warn!(
        "drain: no third host can hold {name}'s memory; its postcopy runs without a safety net"
    );
    None
}

/// The fleet's hosts as their agents last said, for choosing standbys:
/// asking every agent (and each of their VMMs) takes a quarter of a second
/// here, which every move paid before its first byte. A look older than
/// [`HOSTS_FRESH_FOR`] is still used while a new one is taken beside the
/// moves (the agent asked for a standby checks its room again).
pub(crate) struct HostsSeen {
    seen: std::sync::Mutex<Option<(Instant, Vec<HostInfo>)>>,
    looking: AtomicBool,
}

/// How long a look at the fleet's hosts is taken as current.
const HOSTS_FRESH_FOR: Duration = Duration::from_secs(2);

impl HostsSeen {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(HostsSeen {
            seen: std::sync::Mutex::new(None),
            looking: AtomicBool::new(false),
        })
    }

    fn look(&self, fleet: &Fleet) -> Vec<HostInfo> {
        let hosts: Vec<HostInfo> = fleet
            .hosts()
            .map(|h| h.into_iter().filter_map(|(_, h)| h.ok()).collect())
            .unwrap_or_default();
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), hosts.clone()));
        hosts
    }

    /// The hosts that answered the last look (waiting for the first).
    pub(crate) fn get(self: &Arc<Self>, fleet: &Fleet) -> Vec<HostInfo> {
        let last = self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some((at, hosts)) = last else {
            return self.look(fleet);
        };
        if at.elapsed() >= HOSTS_FRESH_FOR && !self.looking.swap(true, Ordering::AcqRel) {
            let (me, fleet) = (self.clone(), fleet.clone());
            let spawned = std::thread::Builder::new()
                .name("drain-hosts".into())
                .spawn(move || {
                    me.look(&fleet);
                    me.looking.store(false, Ordering::Release);
                });
            if spawned.is_err() {
                self.looking.store(false, Ordering::Release);
            }
        }
        hosts
    }
}

/// A move's postcopy standby: its host's agent, the host, its address, and
/// the drain's standby claims (its own given back when it is stopped).
pub(crate) struct StandbyAt {
    agent: crate::AgentClient,
    pub(crate) host: String,
    pub(crate) addr: String,
    claims: Arc<StandbyClaims>,
}

impl StandbyAt {
    /// Stops the standby for VM `vm` (one still finishing a move whose
    /// source died ends when that move does: it holds on SIGTERM).
    pub(crate) fn stop(&self, vm: &str) {
        let _ = self.agent.stop(vm);
        self.claims.release(&self.host, vm);
    }

    /// Waits (at most `within`) until the standby for VM `vm` has ended:
    /// one that finishes a move ends when the destination has every page.
    pub(crate) fn wait_ended(&self, vm: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let listed = self
                .agent
                .info()
                .is_ok_and(|h| h.stores.iter().any(|s| s.vm == vm));
            if !listed {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(
            "drain: the standby for {vm} on {} is still finishing its move",
            self.host
        );
    }
}
