//! The room a drain has claimed on its hosts: what each move not yet ended
//! was planned to take (its destination, a split's memory servers), and the
//! standbys its moves have started. A host's agent counts a VM's room only
//! once that VM or memory server exists there, and the drain's look at the
//! hosts may be older than that; so the room a drain may still give away on
//! a host is its free memory as last seen, less the claims on it the host
//! did not show yet. A standby (which lasts only its own move) or a retry
//! then never takes room the plan gave another move.

use std::sync::Mutex;

use crate::api::HostInfo;

/// Room claimed on a host for one VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    /// The host.
    pub host: String,
    /// The VM (a move's, or the one a standby or memory server is for).
    pub vm: String,
    /// Bytes of memory.
    pub bytes: u64,
}

/// `h`'s free memory as its agent said, less the claims on it that it did
/// not show: a claim whose VM the host already lists (as a VM, or as a
/// memory server or standby) is in that free memory already.
pub(crate) fn room_left(h: &HostInfo, claims: &[Claim]) -> u64 {
    let shown =
        |vm: &str| h.vms.iter().any(|v| v.spec.name == vm) || h.stores.iter().any(|s| s.vm == vm);
    let unseen: u64 = claims
        .iter()
        .filter(|c| c.host == h.name && !shown(&c.vm))
        .map(|c| c.bytes)
        .sum();
    h.free_mem.saturating_sub(unseen)
}

/// The standbys a drain's moves have claimed room for, shared by the moves:
/// a host is chosen and claimed in one step, so two moves starting together
/// never both count the same room.
#[derive(Debug, Default)]
pub(crate) struct StandbyClaims(Mutex<Vec<Claim>>);

impl StandbyClaims {
    fn all(&self) -> std::sync::MutexGuard<'_, Vec<Claim>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hosts a standby for `vm` (`bytes`) may run on, the most room left
    /// first: neither `from` nor `to`, with room after `planned` and every
    /// standby claimed; at most `most`.
    pub(crate) fn candidates(
        &self,
        hosts: &[HostInfo],
        planned: &[Claim],
        (from, to): (&str, &str),
        bytes: u64,
        most: usize,
    ) -> Vec<String> {
        let claims: Vec<Claim> = planned.iter().chain(self.all().iter()).cloned().collect();
        let mut third: Vec<(u64, &HostInfo)> = hosts
            .iter()
            .filter(|h| h.name != from && h.name != to)
            .map(|h| (room_left(h, &claims), h))
            .filter(|(room, _)| *room >= bytes)
            .collect();
        third.sort_by_key(|(room, _)| std::cmp::Reverse(*room));
        third
            .into_iter()
            .take(most)
            .map(|(_, h)| h.name.clone())
            .collect()
    }

    /// Claims `bytes` on `host` for `vm`'s standby if the room is still
    /// there (false if not, or if `host` is not among `hosts`).
    pub(crate) fn claim(
        &self,
        hosts: &[HostInfo],
        planned: &[Claim],
        host: &str,
        vm: &str,
        bytes: u64,
    ) -> bool {
        let mut standbys = self.all();
        let Some(h) = hosts.iter().find(|h| h.name == host) else {
            return false;
        };
        let claims: Vec<Claim> = planned.iter().chain(standbys.iter()).cloned().collect();
        if room_left(h, &claims) < bytes {
            return false;
        }
        standbys.push(Claim {
            host: host.into(),
            vm: vm.into(),
            bytes,
        });
        true
    }

    /// Gives back the claim of `vm`'s standby on `host` (none: nothing).
    pub(crate) fn release(&self, host: &str, vm: &str) {
        let mut standbys = self.all();
        if let Some(i) = standbys.iter().position(|c| c.host == host && c.vm == vm) {
            standbys.remove(i);
        }
    }

    /// The standbys' claims now.
    pub(crate) fn snapshot(&self) -> Vec<Claim> {
        self.all().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::StoreInfo;
    use crate::testing::vm;

    /// `free_mib` free, running `vms`, serving memory for `stores`.
    fn host(name: &str, free_mib: u64, vms: &[&str], stores: &[&str]) -> HostInfo {
        let mut h = crate::testing::host(
            name,
            free_mib,
            8,
            vms.iter().map(|n| vm(n, 512, 1)).collect(),
        );
        h.stores = stores
            .iter()
            .map(|n| StoreInfo {
                vm: (*n).into(),
                addr: "tcp:10.0.0.1:7600".into(),
                bytes: 512 << 20,
                pid: 2,
                standby: true,
            })
            .collect();
        h
    }

    fn claim(host: &str, vm: &str, mib: u64) -> Claim {
        Claim {
            host: host.into(),
            vm: vm.into(),
            bytes: mib << 20,
        }
    }

    #[test]
    fn a_claim_the_host_already_shows_is_not_counted_twice() {
        let claims = [
            claim("h3", "b", 512),
            claim("h3", "c", 256),
            claim("h4", "d", 1024),
        ];
        // b's destination is not on h3 yet: both claims count.
        assert_eq!(room_left(&host("h3", 2048, &[], &[]), &claims), 1280 << 20);
        // Now h3 lists b (its free memory counts it): only c's counts.
        assert_eq!(
            room_left(&host("h3", 1536, &["b"], &[]), &claims),
            1280 << 20
        );
        // A standby or memory server for c shows as a store.
        assert_eq!(
            room_left(&host("h3", 1280, &["b"], &["c"]), &claims),
            1280 << 20
        );
        // Claims past free memory leave nothing, not an underflow.
        assert_eq!(room_left(&host("h4", 512, &[], &[]), &claims), 0);
    }

    #[test]
    fn two_standbys_chosen_from_the_same_look_cannot_both_take_one_rooms_worth() {
        // The look at the hosts both moves start from: h4 1024 MiB free,
        // 256 of it planned for a move still to come.
        let hosts = [
            host("h1", 0, &[], &[]),
            host("h2", 0, &[], &[]),
            host("h4", 1024, &[], &[]),
        ];
        let planned = [claim("h4", "c", 256)];
        let standbys = StandbyClaims::default();
        let for_512 =
            |s: &StandbyClaims| s.candidates(&hosts, &planned, ("h1", "h2"), 512 << 20, 2);
        assert_eq!(for_512(&standbys), ["h4"]);
        assert!(standbys.claim(&hosts, &planned, "h4", "a", 512 << 20));
        // 1024 - 256 - 512 = 256 MiB left: the second 512 MiB standby is
        // refused (it was offered h4 by the same look before the claim).
        assert!(!standbys.claim(&hosts, &planned, "h4", "b", 512 << 20));
        assert!(for_512(&standbys).is_empty());
        assert!(
            !standbys.claim(&hosts, &planned, "h9", "b", 1),
            "an unknown host"
        );
        standbys.release("h4", "a");
        assert!(standbys.claim(&hosts, &planned, "h4", "b", 512 << 20));
        assert_eq!(standbys.snapshot(), [claim("h4", "b", 512)]);
    }
}
