//! What each move of a drain did, and the drain as a whole: what the CLI
//! prints, `--json` gives, and the journal records.

use ferry_migration::{MigrationStats, Mode};

use super::moves::{IllegalStep, MoveState};
use super::plan::{PlannedMove, PlannedSplit};

/// One VM's move as it went.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoveReport {
    /// The VM.
    pub vm: String,
    /// Its guest RAM.
    pub mem_bytes: u64,
    /// Where it is going (or went, or last tried).
    pub to: String,
    /// How.
    pub mode: Mode,
    /// Where it stands.
    pub state: MoveState,
    /// Seconds the move took (so far).
    pub secs: f64,
    /// Bytes sent so far.
    pub bytes: u64,
    /// Bytes its first round sent (its memory as the move began: what had
    /// to cross the link at least; a postcopy move's all), once done.
    pub first_round_bytes: Option<u64>,
    /// Pages left in the current round (while moving).
    pub remaining_pages: u64,
    /// The VM's downtime (ms), once done.
    pub downtime_ms: Option<f64>,
    /// True if it finished by postcopy.
    pub postcopy: bool,
    /// Why each try failed.
    pub errors: Vec<String>,
    /// A split move's shares.
    pub split: Option<PlannedSplit>,
    /// The host of its postcopy standby, if it had one.
    #[serde(default)]
    pub standby: Option<String>,
    /// Bytes its source sent that standby (beside `bytes`).
    #[serde(default)]
    pub standby_bytes: u64,
    /// The source handed the move over once its standby held every page
    /// the destination lacked, and the standby finished it.
    #[serde(default)]
    pub handed_over: bool,
    /// Seconds from the move's start until its destination's VMM (and its
    /// standby) waited for it: what the move cost before its first byte.
    #[serde(default)]
    pub ready_secs: f64,
    /// Pages whose hashes matched end to end (`--verify`), once done; None
    /// without verification or before the move's figures came back.
    #[serde(default)]
    pub verified_pages: Option<u64>,
}

impl MoveReport {
    /// A planned move not started yet.
    pub(crate) fn waiting(m: &PlannedMove) -> Self {
        MoveReport {
            vm: m.vm.clone(),
            mem_bytes: m.mem_bytes,
            to: m.to.clone(),
            mode: m.mode,
            state: MoveState::Waiting,
            secs: 0.0,
            bytes: 0,
            first_round_bytes: None,
            remaining_pages: 0,
            downtime_ms: None,
            postcopy: false,
            errors: Vec::new(),
            split: m.split.clone(),
            standby: None,
            standby_bytes: 0,
            handed_over: false,
            ready_secs: 0.0,
            verified_pages: None,
        }
    }

    /// Moves the report to phase `next`, if the move may go there.
    pub fn advance(&mut self, next: MoveState) -> Result<(), IllegalStep> {
        self.state = self.state.step(next)?;
        Ok(())
    }

    /// Takes the figures of a move that ended at its source: what it sent
    /// (to its standby too) and whether it finished by postcopy.
    pub(crate) fn take_stats(&mut self, stats: &MigrationStats, verify: bool) {
        self.bytes = stats.bytes;
        self.downtime_ms = Some(stats.downtime_ms);
        self.postcopy = stats.postcopy.is_some();
        let (net, handed) = stats
            .postcopy
            .as_ref()
            .map_or((0, false), |p| (p.safety_net_bytes, p.handed_over));
        self.standby_bytes = net;
        self.handed_over = handed;
        // A postcopy move has no rounds: it sends each page once, so all
        // it sent is what had to cross (to its standby, when that finished
        // the move: the destination got only its faults).
        self.first_round_bytes = Some(stats.rounds.first().map_or(
            if handed {
                stats.bytes.max(net)
            } else {
                stats.bytes
            },
            |r| r.bytes,
        ));
        self.verified_pages = verify.then_some(stats.verified_pages);
        self.remaining_pages = 0;
    }
}

/// What a drain did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DrainReport {
    /// The host drained.
    pub host: String,
    /// Every VM's move.
    pub moves: Vec<MoveReport>,
    /// VMs no host had room for.
    pub unplaced: Vec<(String, String)>,
    /// Seconds in all: until every VM runs whole at its destination
    /// (standbys that finish a move included).
    pub secs: f64,
    /// Seconds until the last move out of the host ended (the host was
    /// empty; a handed-over move ends when its standby has finished, and
    /// the drain then waits for the standby's process to end).
    pub emptied_secs: f64,
    /// True if it was cancelled before every move started.
    pub cancelled: bool,
    /// How the moves a dead drain of this host left in flight were settled
    /// before this one planned (a line per VM: where it runs, and what its
    /// move verified, as its source's agent recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<String>,
}

impl DrainReport {
    /// True if every VM left the host.
    pub fn emptied(&self) -> bool {
        self.unplaced.is_empty() && self.moves.iter().all(|m| m.state == MoveState::Done)
    }
}
