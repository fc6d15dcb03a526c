//! One process's side of the ownership rule: what it holds now, a keeper
//! thread that renews the claim every [`RENEW_EVERY`] and stops the VM the
//! moment the claim is found gone, and the migration's steps (take over,
//! take back) with their retries.
//!
//! ```text
//!  Unheld ──take_over──▶ Holding ◀──boot
//!                          │  ▲
//!               completing │  │ take_back: the destination never took it
//!                          ▼  │
//!                        InDoubt ──take_back refused, or Started──▶ Handed
//!  Holding ──renewal refused──▶ Handed (the VM is stopped here, and why is said)
//!  Holding ──release──▶ Released
//! ```
//!
//! The registry unreachable: a holder keeps running (nobody can take its
//! claim without it), a take-over or take-back waits and retries, and an
//! in-doubt source whose take-back ran out of patience keeps trying in the
//! keeper, resuming the VM only once the registry says it never left.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::{
    decide, Claim, Decision, Holder, OwnerRecord, Owners, OwnershipError, Read, Refusal, Step,
    RENEW_EVERY,
};

/// What the fence does to the VM of its process.
pub struct Hooks {
    /// Stop the vCPUs at once (the claim is gone): the reason.
    pub stop: Box<dyn Fn(&str) + Send + Sync>,
    /// Resume the vCPUs (an in-doubt source learned the VM never left).
    pub resume: Box<dyn Fn() + Send + Sync>,
}

#[derive(Clone, Debug)]
enum State {
    /// Holds nothing yet (a destination waiting for its VM).
    Unheld,
    /// Holds the VM: may run it.
    Holding(Claim),
    /// Complete went out: the destination may have taken the VM. Never
    /// runs; `background`: the keeper resolves it.
    InDoubt { claim: Claim, background: bool },
    /// Another process holds the VM (its record when last read).
    Handed(Option<OwnerRecord>),
    /// Given up for good.
    Released,
}

/// The outcome of a take-back.
#[derive(Clone, Debug)]
pub enum TakeBack {
    /// The destination never took the VM: it is held here again (at a new
    /// epoch) and may run.
    Back(Claim),
    /// Another process holds it: nothing here may run it again.
    Gone(Option<OwnerRecord>),
    /// The registry did not answer in time: the VM stays paused, and the
    /// fence keeps asking (resuming it if the answer is "never left").
    Unknown(String),
}

/// What `ferry status` shows of the fence.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FenceStatus {
    /// The VM's name in the registry.
    pub vm: String,
    /// The registry.
    pub registry: String,
    /// `holding`, `unheld`, `in-doubt`, `handed`, `released`.
    pub state: &'static str,
    /// The epoch held, or the holder's (handed).
    pub epoch: Option<u64>,
    /// Who holds it, when another process does.
    pub holder: Option<String>,
    /// The other holder stopped renewing: it seems dead, and with it the
    /// VM's newest state.
    pub holder_lapsed: bool,
    /// The last failure to reach the registry, if the last try failed.
    pub unreachable: Option<String>,
}

/// One process's fence for one VM.
pub struct Fence {
    owners: Owners,
    vm: String,
    me: Holder,
    state: Mutex<State>,
    hooks: Hooks,
    unreachable: Mutex<Option<String>>,
    /// The record as a destination read it at the opening (the switch
    /// starts its take-over from it).
    expected: Mutex<Option<Read>>,
    /// Another process holds the VM and has been silent past the TTL.
    holder_lapsed: AtomicBool,
}

/// How long a retried step waits between tries.
const RETRY: Duration = Duration::from_millis(200);

impl Fence {
    /// A fence for `vm`, held by nothing yet, with its keeper thread (which
    /// ends when the fence is dropped).
    pub fn new(
        owners: Owners,
        vm: &str,
        me: Holder,
        hooks: Hooks,
    ) -> Result<Arc<Fence>, OwnershipError> {
        super::check_vm_name(vm)?;
        let fence = Arc::new(Fence {
            owners,
            vm: vm.into(),
            me,
            state: Mutex::new(State::Unheld),
            hooks,
            unreachable: Mutex::new(None),
            expected: Mutex::new(None),
            holder_lapsed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&fence);
        std::thread::Builder::new()
            .name("ownership".into())
            .spawn(move || keep(weak))
            .map_err(|e| OwnershipError::Busy(format!("{vm}: no keeper thread: {e}")))?;
        Ok(fence)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The VM's name.
    pub fn vm(&self) -> &str {
        &self.vm
    }

    /// This process.
    pub fn me(&self) -> &Holder {
        &self.me
    }

    /// The claim held, if this process may run the VM.
    pub fn claim(&self) -> Option<Claim> {
        match &*self.state() {
            State::Holding(c) => Some(c.clone()),
            _ => None,
        }
    }

    /// Why this process may not run the VM now (None: it may).
    pub fn why_not_run(&self) -> Option<String> {
        match &*self.state() {
            State::Holding(_) => None,
            State::Unheld => Some(format!("this process does not hold VM {}", self.vm)),
            State::InDoubt { .. } => Some(format!(
                "VM {} was handed to a destination and the registry has not said whether it \
                 took it",
                self.vm
            )),
            State::Handed(r) => Some(match r {
                Some(r) => r.describe(),
                None => format!("another process holds VM {}", self.vm),
            }),
            State::Released => Some(format!("VM {} was released here", self.vm)),
        }
    }

    /// A fresh VM starts here: takes it if nobody holds it.
    pub fn boot(&self) -> Result<Claim, OwnershipError> {
        let c = self.owners.step(&self.vm, &Step::Boot, &self.me)?;
        *self.state() = State::Holding(c.clone());
        Ok(c)
    }

    /// A destination, at a migration's opening: checks that the registry
    /// gives the VM to `from` now (so a source whose claim is stale is
    /// refused before anything moves) and keeps what it read, so the
    /// take-over at the switch is one compare-and-swap.
    pub fn expect(&self, from: &Claim) -> Result<(), OwnershipError> {
        let read = self.owners.read(&self.vm)?;
        let now = read.as_ref().map(|(r, _)| r);
        if let Decision::Refuse(r) = decide(
            &self.vm,
            &Step::TakeOver(from.clone()),
            now,
            &self.me,
            super::now(),
        ) {
            return Err(OwnershipError::Refused(r));
        }
        *self.expected.lock().unwrap_or_else(|p| p.into_inner()) = read;
        Ok(())
    }

    /// A destination takes the VM from the source's claim `from`, before
    /// the guest's first instruction here. While the registry does not
    /// answer it retries, for as long as `patience` (the outcome of a try
    /// may be unknown, and every try is safe to repeat); a refusal means
    /// the source took the VM back or another process holds it.
    pub fn take_over(&self, from: &Claim, patience: Duration) -> Result<Claim, OwnershipError> {
        if from.vm != self.vm {
            return Err(OwnershipError::Refused(Refusal::Missing));
        }
        let read = self
            .expected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let c = self.retrying(&Step::TakeOver(from.clone()), patience, read)?;
        *self.state() = State::Holding(c.clone());
        Ok(c)
    }

    /// Complete went out: from now on the VM is not run here unless a
    /// take-back says it never left.
    pub fn completing(&self) {
        let mut s = self.state();
        if let State::Holding(c) = &*s {
            *s = State::InDoubt {
                claim: c.clone(),
                background: false,
            };
        }
    }

    /// The destination said it started the VM: it holds it now.
    pub fn handed(&self) {
        *self.state() = State::Handed(None);
    }

    /// A source whose migration failed after Complete takes its VM back:
    /// retried while the registry does not answer, up to `patience`; then
    /// the keeper goes on asking and resumes the VM itself if the answer is
    /// "it never left".
    pub fn take_back(&self, patience: Duration) -> TakeBack {
        let claim = match &*self.state() {
            State::Holding(c) | State::InDoubt { claim: c, .. } => c.clone(),
            State::Handed(r) => return TakeBack::Gone(r.clone()),
            State::Unheld | State::Released => return TakeBack::Gone(None),
        };
        match self.retrying(&Step::TakeBack(claim.clone()), patience, None) {
            Ok(c) => {
                *self.state() = State::Holding(c.clone());
                TakeBack::Back(c)
            }
            Err(OwnershipError::Refused(r)) => {
                let rec = match r {
                    Refusal::HeldBy(r) | Refusal::Moved(r) => Some(r),
                    Refusal::Missing => None,
                };
                *self.state() = State::Handed(rec.clone());
                TakeBack::Gone(rec)
            }
            Err(e) => {
                *self.state() = State::InDoubt {
                    claim,
                    background: true,
                };
                TakeBack::Unknown(e.to_string())
            }
        }
    }

    /// The VM stopped here for good: gives it up.
    pub fn release(&self) -> Result<(), OwnershipError> {
        let claim = match &*self.state() {
            State::Holding(c) => c.clone(),
            _ => return Ok(()),
        };
        self.owners
            .step(&self.vm, &Step::Release(claim), &self.me)?;
        *self.state() = State::Released;
        Ok(())
    }

    /// A source that handed the VM: the holder's record when that holder
    /// has stopped renewing past the TTL (it seems dead, and the VM's
    /// newest state with it); None while it renews, or before the keeper
    /// has looked.
    pub fn lapsed_holder(&self) -> Option<OwnerRecord> {
        match &*self.state() {
            State::Handed(Some(r)) if self.holder_lapsed.load(Ordering::Relaxed) => Some(r.clone()),
            _ => None,
        }
    }

    /// What `ferry status` shows.
    pub fn status(&self) -> FenceStatus {
        let unreachable = self
            .unreachable
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (state, epoch, holder, holder_lapsed) = match &*self.state() {
            State::Unheld => ("unheld", None, None, false),
            State::Holding(c) => ("holding", Some(c.epoch), None, false),
            State::InDoubt { claim, .. } => ("in-doubt", Some(claim.epoch), None, false),
            State::Handed(r) => (
                "handed",
                r.as_ref().map(|r| r.epoch),
                r.as_ref()
                    .and_then(|r| r.holder.as_ref().map(|h| h.to_string())),
                self.holder_lapsed.load(Ordering::Relaxed),
            ),
            State::Released => ("released", None, None, false),
        };
        FenceStatus {
            vm: self.vm.clone(),
            registry: self.owners.describe(),
            state,
            epoch,
            holder,
            holder_lapsed,
            unreachable,
        }
    }

    /// Takes `step`, retrying while the registry does not answer.
    fn retrying(
        &self,
        step: &Step,
        patience: Duration,
        mut read: Option<Read>,
    ) -> Result<Claim, OwnershipError> {
        let deadline = Instant::now() + patience;
        let mut said = Instant::now();
        loop {
            match self.owners.step_from(&self.vm, step, &self.me, read.take()) {
                Err(e @ (OwnershipError::Unreachable(_) | OwnershipError::Busy(_))) => {
                    self.note_unreachable(Some(e.to_string()));
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    if said.elapsed() > Duration::from_secs(5) {
                        tracing::warn!(vm = %self.vm, "ownership step waits for the registry: {e}");
                        said = Instant::now();
                    }
                    std::thread::sleep(RETRY);
                }
                r => {
                    self.note_unreachable(None);
                    return r;
                }
            }
        }
    }

    fn note_unreachable(&self, e: Option<String>) {
        let mut u = self.unreachable.lock().unwrap_or_else(|p| p.into_inner());
        match (&*u, &e) {
            (None, Some(e)) => tracing::warn!(vm = %self.vm, "registry unreachable: {e}"),
            (Some(_), None) => tracing::info!(vm = %self.vm, "registry reachable again"),
            _ => {}
        }
        *u = e;
    }

    /// One keeper tick.
    fn tick(&self) {
        let state = self.state().clone();
        match state {
            State::Holding(c) => match self.owners.renew(&c, &self.me) {
                Ok(_) => self.note_unreachable(None),
                Err(OwnershipError::Refused(r)) => {
                    let rec = match &r {
                        Refusal::HeldBy(r) | Refusal::Moved(r) => Some(r.clone()),
                        Refusal::Missing => None,
                    };
                    {
                        let mut s = self.state();
                        // Only if nothing changed meanwhile (a migration's
                        // step may have moved the state on).
                        if matches!(&*s, State::Holding(_)) {
                            *s = State::Handed(rec);
                        } else {
                            return;
                        }
                    }
                    let why = format!("this process no longer holds VM {}: {r}", self.vm);
                    tracing::error!("{why}; its vCPUs are stopped here");
                    (self.hooks.stop)(&why);
                }
                Err(e) => self.note_unreachable(Some(e.to_string())),
            },
            State::InDoubt {
                background: true, ..
            } => {
                if let TakeBack::Back(c) = self.take_back(Duration::ZERO) {
                    tracing::warn!(vm = %self.vm, epoch = c.epoch,
                        "the registry says the destination never took the VM: it runs here again");
                    (self.hooks.resume)();
                }
            }
            State::Handed(_) => {
                if let Ok(Some(r)) = self.owners.record(&self.vm) {
                    let lapsed = r.holder.as_ref() != Some(&self.me) && self.owners.lapsed(&r);
                    let was_lapsed = self.holder_lapsed.swap(lapsed, Ordering::Relaxed);
                    if lapsed && !was_lapsed {
                        // Said once, as it happens: the VM's newest state
                        // may have died with its holder.
                        tracing::error!(
                            vm = %self.vm,
                            "{}: its holder stopped renewing; if it is dead, the VM's newest \
                             state died with it (docs/safety.md)",
                            r.describe()
                        );
                    }
                    let mut s = self.state();
                    if matches!(&*s, State::Handed(_)) {
                        *s = State::Handed(Some(r));
                    }
                }
            }
            State::Unheld | State::InDoubt { .. } | State::Released => {}
        }
    }
}

/// The keeper: a tick every [`RENEW_EVERY`] while the fence lives (once
/// it is dropped, the weak reference no longer upgrades).
fn keep(fence: Weak<Fence>) {
    loop {
        std::thread::sleep(RENEW_EVERY);
        let Some(f) = fence.upgrade() else { return };
        f.tick();
    }
}
