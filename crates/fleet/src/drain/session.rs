//! A drain as one object: it takes the host's drain record in the
//! registry ([`crate::journal`]), settles the moves a drain that died left
//! in flight, plans from where the VMs are now, runs the moves while a
//! heartbeat renews the record and listens for `ferry drain HOST --cancel`,
//! records every move's phase (and verification) as it changes, and gives
//! the record back at the end, however the moves went. The CLI only parses
//! flags and prints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::plan::{plan, Plan};
use super::report::{DrainReport, MoveReport};
use super::schedule;
use super::DrainOptions;
use crate::fleet::Fleet;
use crate::journal::{self, DrainRecord, Journal};
use crate::FleetError;

/// How long a resumed drain waits for the moves its dead predecessor left
/// under way to end.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(600);

/// Asks the running drain of `host` to start no new move; its record.
pub fn cancel(fleet: &Fleet, host: &str) -> Result<DrainRecord, FleetError> {
    journal::cancel(&**fleet.registry(), host)
}

/// Where `host`'s VMs would go now: the host and the others as their agents
/// say, with each VM's dirty rate measured (half a second, all at once)
/// when the mode is chosen per VM.
pub fn plan_now(fleet: &Fleet, host: &str, opts: &DrainOptions) -> Result<Plan, FleetError> {
    let agent = fleet.agent(host)?;
    let mut source = agent.info()?;
    if opts.mode.is_none() {
        let rates = agent.dirty_rates()?;
        for vm in &mut source.vms {
            vm.dirty_bytes_per_s = rates.get(&vm.spec.name).copied();
        }
    }
    let others: Vec<_> = fleet
        .hosts()?
        .into_iter()
        .filter_map(|(_, h)| h.ok())
        .filter(|h| h.name != host)
        .collect();
    Ok(plan(&source, &others, opts))
}

/// A drain that holds its host's record in the registry.
pub struct Drain {
    fleet: Fleet,
    host: String,
    journal: Arc<Journal>,
    /// How a dead drain's moves were settled at begin (for the report).
    settled: Vec<String>,
}

/// A drain that died before this one, and how its moves were settled.
#[derive(Clone, Debug)]
pub struct Resumed {
    /// Its record as it left it.
    pub record: DrainRecord,
    /// A line per VM it had under way: where it runs now, what was stopped.
    pub notes: Vec<String>,
}

impl Drain {
    /// Takes `host`'s drain record (refused while another drain of it
    /// lives); a dead drain's moves are settled first, within `settle`.
    pub fn begin(
        fleet: &Fleet,
        host: &str,
        settle: Duration,
    ) -> Result<(Drain, Option<Resumed>), FleetError> {
        let (journal, before) = Journal::begin(fleet.registry().clone(), host)?;
        let resumed = match before {
            Some(record) => {
                let notes = journal::settle(fleet, &record, settle)?;
                Some(Resumed { record, notes })
            }
            None => None,
        };
        let drain = Drain {
            fleet: fleet.clone(),
            host: host.into(),
            journal: Arc::new(journal),
            settled: resumed
                .as_ref()
                .map(|r| r.notes.clone())
                .unwrap_or_default(),
        };
        Ok((drain, resumed))
    }

    /// Where the host's VMs go, from where they are now.
    pub fn plan(&self, opts: &DrainOptions) -> Result<Plan, FleetError> {
        plan_now(&self.fleet, &self.host, opts)
    }

    /// Runs `plan`; `update` sees every move after each change. Stops
    /// starting moves when `cancel` is set or the registry says so. The
    /// record is given back when the moves have ended, whatever they did.
    pub fn run(
        self,
        plan: Plan,
        opts: &DrainOptions,
        cancel: &Arc<AtomicBool>,
        update: &mut dyn FnMut(&[MoveReport]),
    ) -> Result<DrainReport, FleetError> {
        let ended = Arc::new(AtomicBool::new(false));
        // Renews the record every second and listens for `--cancel`.
        let beat = {
            let (journal, cancel, ended) = (self.journal.clone(), cancel.clone(), ended.clone());
            std::thread::spawn(move || {
                while !ended.load(Ordering::Relaxed) {
                    if journal.beat() {
                        cancel.store(true, Ordering::Relaxed);
                    }
                    std::thread::sleep(journal::HEARTBEAT);
                }
            })
        };
        let journal = self.journal.clone();
        let report = schedule::run(&self.fleet, plan, opts, cancel, &mut |moves| {
            journal.record(moves);
            update(moves);
        });
        ended.store(true, Ordering::Relaxed);
        let _ = beat.join();
        drop(journal);
        if let Ok(j) = Arc::try_unwrap(self.journal) {
            j.end();
        }
        report.map(|r| DrainReport {
            settled: self.settled,
            ..r
        })
    }
}
