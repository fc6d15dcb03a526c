//! One try at moving a VM, through the agents: the destination's agent
//! starts a waiting VMM that admits only the drained host (and the move's
//! standby) with a one-time token, a split move's memory servers and a
//! postcopy move's standby start beside it, then the source's agent
//! migrates the VM there. What a failure leaves where is not decided here
//! but by [`Failure::outcome`]; this file only carries it out.

use std::sync::{mpsc, Arc};
use std::time::Instant;

use ferry_migration::{MigrationToken, Mode, Phase};

use super::moves::{Cleanup, Failure, Holds, MoveState, Outcome, Seen};
use super::report::MoveReport;
use super::standby::{start_standby, HostsSeen, StandbyAt, STANDBY_TRIES};
use super::DrainOptions;
use crate::api::{Request, SplitSpec, VmInfo};
use crate::claims::{Claim, StandbyClaims};
use crate::fleet::Fleet;
use crate::AgentClient;
use crate::FleetError;

/// What every move of a drain shares.
pub(crate) struct Shared {
    pub(crate) fleet: Fleet,
    /// The hosts, as last seen (for choosing standbys).
    pub(crate) hosts: Arc<HostsSeen>,
    /// Room the drain's moves not yet ended were planned to take (as this
    /// move started): no standby takes it.
    pub(crate) planned: Vec<Claim>,
    /// The room the drain's standbys hold.
    pub(crate) standbys: Arc<StandbyClaims>,
    /// The drained host's agent, and its name.
    pub(crate) source: AgentClient,
    pub(crate) from: String,
    pub(crate) opts: DrainOptions,
}

/// What a move's thread tells the scheduler.
pub(crate) enum Event {
    /// The move's report changed.
    Update(usize, MoveReport),
    /// The try ended: done (None), or failed with what it left where.
    Ended(usize, MoveReport, Option<Outcome>),
}

/// One try at a move, and what it started so far.
struct Try<'a> {
    sh: &'a Shared,
    vm: &'a VmInfo,
    report: MoveReport,
    tx: mpsc::Sender<Event>,
    k: usize,
    t0: Instant,
    dest: Option<AgentClient>,
    stores: Vec<(AgentClient, String)>,
    standby: Option<StandbyAt>,
}

/// Runs one try at move `k` (its thread's whole life): tells the scheduler
/// as the report changes and when it ends, and stops what the try started
/// as the failure rule says.
pub(crate) fn run_try(
    sh: &Shared,
    vm: Option<&VmInfo>,
    mut report: MoveReport,
    tx: mpsc::Sender<Event>,
    k: usize,
) {
    let t0 = Instant::now();
    if let Err(e) = report.advance(MoveState::Preparing) {
        // The scheduler starts only waiting moves (as `end` does for its
        // last step: said, not hidden).
        tracing::error!("drain: {}: {e}", report.vm);
        report.state = MoveState::Preparing;
    }
    let _ = tx.send(Event::Update(k, report.clone()));
    let Some(vm) = vm else {
        let e = format!("VM {} is no longer on {}", report.vm, sh.from);
        let outcome = Failure::Gone(e).outcome(&report.to);
        report.state = outcome.state;
        let _ = tx.send(Event::Ended(k, report, Some(outcome)));
        return;
    };
    let mut t = Try {
        sh,
        vm,
        report,
        tx,
        k,
        t0,
        dest: None,
        stores: Vec::new(),
        standby: None,
    };
    let outcome = t.go().err().map(|f| f.outcome(&t.report.to));
    t.end(outcome);
}

impl Try<'_> {
    fn update(&self) {
        let _ = self.tx.send(Event::Update(self.k, self.report.clone()));
    }

    /// Prepares the destination and sends the VM.
    fn go(&mut self) -> Result<(), Failure> {
        let token =
            MigrationToken::generate().map_err(|e| Failure::Preparing(format!("no token: {e}")))?;
        let to = self.prepare(&token).map_err(Failure::Preparing)?;
        self.report.ready_secs = self.t0.elapsed().as_secs_f64();
        self.report
            .advance(MoveState::Moving)
            .map_err(|e| Failure::Preparing(e.to_string()))?;
        self.update();
        self.send(to, token)
    }

    /// A split move's memory servers first, then the destination's waiting
    /// VMM beside the standby; where to send the VM.
    fn prepare(&mut self, token: &MigrationToken) -> Result<String, String> {
        let (sh, vm) = (self.sh, self.vm);
        let dest = sh.fleet.agent(&self.report.to).map_err(|e| e.to_string())?;
        self.dest = Some(dest.clone());
        for (host, bytes) in self.report.split.iter().flat_map(|sp| sp.stores.clone()) {
            let started = sh.fleet.agent(&host).and_then(|a| {
                let r = a.store(&vm.spec.name, bytes)?;
                Ok((a, r.addr))
            });
            let s = started.map_err(|e| format!("a memory server on {host}: {e}"))?;
            self.stores.push(s);
        }
        // A postcopy or hybrid move gets a standby on a third host, which
        // keeps what the destination lacks after the switch until the move
        // ends: a source that dies mid-postcopy then loses no VM. It starts
        // while the destination's VMM does, which admits every host it may
        // be on.
        let want_net =
            sh.opts.safety_net && matches!(self.report.mode, Mode::Postcopy | Mode::Hybrid);
        let hosts = if want_net {
            sh.hosts.get(&sh.fleet)
        } else {
            Vec::new()
        };
        let third = sh.standbys.candidates(
            &hosts,
            &sh.planned,
            (&sh.from, &self.report.to),
            vm.spec.mem_bytes,
            STANDBY_TRIES,
        );
        let admitted = std::iter::once(sh.from.as_str())
            .chain(third.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(",");
        let receive = Request::Receive {
            vm: vm.spec.clone(),
            from: admitted,
            token: token.0.clone(),
            budget: self.report.split.as_ref().map(|s| s.main_budget),
            mode: Some(self.report.mode),
        };
        let (standby, ready) = std::thread::scope(|sc| {
            let starting = want_net.then(|| {
                sc.spawn(|| start_standby(&sh.fleet, &sh.standbys, &sh.planned, &hosts, &third, vm))
            });
            let ready = dest.receive(&receive);
            let standby = starting.and_then(|t| t.join().ok()).flatten();
            (standby, ready)
        });
        self.report.standby = standby.as_ref().map(|s| s.host.clone());
        self.standby = standby;
        Ok(ready.map_err(|e| e.to_string())?.to)
    }

    /// Asks the source to send the VM to `to`, following its progress.
    fn send(&mut self, to: String, token: MigrationToken) -> Result<(), Failure> {
        let (sh, vm) = (self.sh, self.vm);
        let mode = self.report.mode;
        let deadline = sh.opts.deadline(vm.spec.mem_bytes);
        let req = Request::Send {
            name: vm.spec.name.clone(),
            to,
            token: token.0,
            mode,
            verify: sh.opts.verify,
            postcopy_after: matches!(mode, Mode::Hybrid).then_some(
                ferry_migration::PostcopyAfter::Either(
                    sh.opts.postcopy_after_rounds,
                    deadline.as_secs_f64(),
                ),
            ),
            // The host's budget, shared by the moves out of it at once.
            bandwidth: sh
                .opts
                .bandwidth
                .map(|b| b / sh.opts.per_host.max(1) as f64),
            share_link: sh.opts.share_link,
            split: self.report.split.as_ref().map(|sp| SplitSpec {
                subs: self.stores.iter().map(|s| s.1.clone()).collect(),
                main_budget: sp.main_budget,
            }),
            safety_net: self.standby.as_ref().map(|s| s.addr.clone()),
            net_finishes: self.standby.is_some() && sh.opts.net_finishes,
        };
        let (report, tx, k, t0) = (&mut self.report, &self.tx, self.k, self.t0);
        let sent = sh.source.send(&req, &mut |p| {
            report.bytes = p.bytes;
            report.remaining_pages = p.remaining_pages;
            report.secs = t0.elapsed().as_secs_f64();
            // Its standby finishes it: the source's link is free.
            report.handed_over |= p.phase == Phase::HandedOver;
            let _ = tx.send(Event::Update(k, report.clone()));
        });
        match sent {
            Ok(r) => {
                self.report.take_stats(&r.stats, sh.opts.verify);
                Ok(())
            }
            // The source says the move failed, or its answer was lost (its
            // VMM may end as the migration does): the destination says
            // which.
            Err(e) => Err(Failure::Moving {
                error: e.to_string(),
                answered: !matches!(e, FleetError::Link { .. } | FleetError::Io { .. }),
                seen: self.seen_at_destination(),
                holds: self.held_by(),
            }),
        }
    }

    /// Who the registry says holds the VM: its owner record's holder is a
    /// process on the source's host or the destination's (agents name their
    /// VMMs' holders after their host). Asked after the source's answer,
    /// which comes once its own take-back (if the switch failed after
    /// Complete) has settled.
    fn held_by(&self) -> Holds {
        let owners = ferry_registry::ownership::Owners::new(self.sh.fleet.registry().clone());
        let to = self.report.to.as_str();
        match owners.record(&self.vm.spec.name) {
            Ok(Some(r)) => match r.holder.as_ref().map(|h| h.host.as_str()) {
                Some(h) if h == to => Holds::Destination,
                Some(h) if h == self.sh.from => Holds::Source,
                _ => Holds::Unknown,
            },
            _ => Holds::Unknown,
        }
    }

    /// What the destination's agent lists for the VM.
    fn seen_at_destination(&self) -> Seen {
        let Some(dest) = &self.dest else {
            return Seen::NoAnswer("no agent was reached".into());
        };
        match dest.info() {
            Ok(h) => h
                .vms
                .iter()
                .find(|v| v.spec.name == self.vm.spec.name)
                .map_or(Seen::NotListed, |v| Seen::from_state(&v.state)),
            Err(e) => Seen::NoAnswer(e.to_string()),
        }
    }

    /// Stops what `c` names, of what this try started.
    fn clean_up(&mut self, c: Cleanup) {
        let name = &self.vm.spec.name;
        if let (true, Some(dest)) = (c.waiting_vmm, &self.dest) {
            // The VM runs on at the source; the waiting VMM goes.
            if let Err(e) = dest.stop(name) {
                tracing::warn!("drain: cannot stop the waiting VMM for {name}: {e}");
            }
        }
        if c.stores {
            for (agent, _) in self.stores.drain(..) {
                let _ = agent.stop(name);
            }
        }
        if c.standby {
            if let Some(s) = self.standby.take() {
                s.stop(name);
            }
        }
    }

    /// Ends the try: the report's last phase, then what the rule stops. A
    /// failed move's standby goes before the scheduler hears (its retry may
    /// pick that host); a done move's after (its end, a few hundred ms,
    /// then holds no slot), once a standby that finishes the move has.
    fn end(mut self, outcome: Option<Outcome>) {
        self.report.secs = self.t0.elapsed().as_secs_f64();
        let name = self.vm.spec.name.clone();
        let failed = match outcome {
            Some(o) if o.state != MoveState::Done => Some(o),
            done => {
                if let Some(o) = done {
                    tracing::warn!("drain: {name} runs at {}: {}", self.report.to, o.note);
                    self.report.errors.push(o.note);
                    self.report.remaining_pages = 0;
                }
                None
            }
        };
        let next = failed.as_ref().map_or(MoveState::Done, |o| o.state);
        if let Err(e) = self.report.advance(next) {
            tracing::error!("drain: {name}: {e}");
            self.report.state = next;
        }
        if let Some(o) = &failed {
            self.clean_up(o.cleanup);
        }
        let (handed, deadline) = (
            self.report.handed_over,
            self.sh.opts.deadline(self.report.mem_bytes),
        );
        let _ = self
            .tx
            .send(Event::Ended(self.k, self.report.clone(), failed));
        if let (true, Some(s)) = (handed, &self.standby) {
            // A standby finishing the move ends with it (`--once`): the
            // drain is done when it is, not before.
            s.wait_ended(&name, deadline);
        }
        if let Some(s) = self.standby.take() {
            // Left alone: it may hold the only copy of pages the
            // destination lacks.
            if !matches!(next, MoveState::LeftAlone) {
                s.stop(&name);
            }
        }
    }
}
