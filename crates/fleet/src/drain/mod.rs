//! `ferry drain HOST`: moves every VM off a host and never loses one.
//!
//! The drain is a session in the engine's image, in rooms:
//! - `plan`: where each VM goes and how (pure: hosts in, moves out;
//!   a VM no host can take whole is split by [`ferry_registry::placement`]).
//! - `moves`: one move's phases (Waiting → Preparing → Moving → Done |
//!   Failed | LeftAlone), checked, and the failure rule as data: what a
//!   failure at each phase leaves where, and what the drain may then do.
//! - `mover`: one try at a move, through the agents.
//! - `schedule`: runs the moves within the limits (`per_host`, `in_fleet`,
//!   the link's room), retrying a failed move on another host.
//! - `standby`: a postcopy move's standby on a third host.
//! - `report`: what each move did, and the drain.
//! - `session`: a [`Drain`] owns its record in the registry
//!   (`crate::journal`) from begin (settling a dead drain's moves) through
//!   heartbeat and cancel to end, so the CLI only parses and prints.
//!
//! A failed move leaves the VM running where it was (the engine's promise);
//! a move whose outcome is not known leaves every copy alone.

use std::time::Duration;

use ferry_migration::Mode;

use crate::api::HostInfo;

mod mover;
mod moves;
mod plan;
mod report;
mod schedule;
mod session;
mod standby;

pub use moves::MoveState;
pub use plan::{Plan, PlannedMove, PlannedSplit};
pub use report::{DrainReport, MoveReport};
pub use session::{cancel, plan_now, Drain, SETTLE_WITHIN};

/// Every default of a drain, in one place (the CLI's flags show these).
pub mod defaults {
    use std::time::Duration;

    /// Moves out of the host, and into any one host, at once.
    pub const PER_HOST: usize = 2;
    /// Moves in the whole fleet at once.
    pub const IN_FLEET: usize = 5;
    /// Other hosts a VM is tried on after a failed move.
    pub const RETRIES: usize = 2;
    /// Each move's completion deadline per GiB of its VM.
    pub const DEADLINE_PER_GIB: Duration = Duration::from_secs(20);
    /// Hybrid moves switch to postcopy after this many dirty rounds that
    /// did not converge: in a drain every page sent twice delays every
    /// other VM, so fewer than a lone migration's 3.
    pub const POSTCOPY_AFTER_ROUNDS: u32 = 1;
    /// Each postcopy or hybrid move gets a standby on a third host.
    pub const SAFETY_NET: bool = true;
    /// The standby finishes each move it stands by for.
    pub const NET_FINISHES: bool = true;
    /// Precopy rounds leave the link's queue to the VMs' own traffic.
    pub const SHARE_LINK: bool = ferry_migration::defaults::SHARE_LINK;
}

/// How a drain runs.
#[derive(Clone, Debug)]
pub struct DrainOptions {
    /// Moves out of the host, and into any one host, at once.
    pub per_host: usize,
    /// Moves in the whole fleet at once.
    pub in_fleet: usize,
    /// The mode for every VM (None: chosen per VM).
    pub mode: Option<Mode>,
    /// Compare every page's hash at the end of each move.
    pub verify: bool,
    /// Other hosts a VM is tried on after a failed move.
    pub retries: usize,
    /// Each move's completion deadline, per GiB of its VM: past it, a
    /// hybrid move switches to postcopy (which ends in about one pass over
    /// the memory left), so no VM keeps a drain waiting on rounds that do
    /// not converge.
    pub deadline_per_gib: Duration,
    /// The bandwidth the drain may use out of the host (bytes/s), shared
    /// by its moves; None: unlimited.
    pub bandwidth: Option<f64>,
    /// Each move's precopy rounds leave the bottleneck's queue to the VMs'
    /// own traffic (on by default; `ferry migrate --own-link` is off).
    pub share_link: bool,
    /// Hybrid moves switch to postcopy after this many dirty rounds that
    /// did not converge (or at their deadline).
    pub postcopy_after_rounds: u32,
    /// Give each postcopy or hybrid move a standby on a third host (the
    /// postcopy safety net).
    pub safety_net: bool,
    /// The standby finishes each move it stands by for: the source sends
    /// each pending page once, to it, hands the move over once it holds
    /// them all, and waits as its backup (false: the source pushes them to
    /// the destination as well, and the standby only stands by).
    pub net_finishes: bool,
}

impl Default for DrainOptions {
    fn default() -> Self {
        DrainOptions {
            per_host: defaults::PER_HOST,
            in_fleet: defaults::IN_FLEET,
            mode: None,
            verify: false,
            retries: defaults::RETRIES,
            deadline_per_gib: defaults::DEADLINE_PER_GIB,
            bandwidth: None,
            share_link: defaults::SHARE_LINK,
            postcopy_after_rounds: defaults::POSTCOPY_AFTER_ROUNDS,
            safety_net: defaults::SAFETY_NET,
            net_finishes: defaults::NET_FINISHES,
        }
    }
}

impl DrainOptions {
    /// What the moves out of `source` may use together (bytes/s): its
    /// link, or the drain's bandwidth budget if lower; None if neither is
    /// known.
    pub(crate) fn out_of(&self, source: &HostInfo) -> Option<f64> {
        [
            (source.link_bps > 0).then(|| source.link_bps as f64 / 8.0),
            self.bandwidth,
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min)
    }

    /// The deadline of a move of a `mem`-byte VM (at least 2 s).
    pub fn deadline(&self, mem: u64) -> Duration {
        self.deadline_per_gib
            .mul_f64(mem as f64 / (1u64 << 30) as f64)
            .max(Duration::from_secs(2))
    }

    /// Moves that may send out of the host at once.
    pub(crate) fn at_once(&self) -> usize {
        self.in_fleet.min(self.per_host).max(1)
    }
}
