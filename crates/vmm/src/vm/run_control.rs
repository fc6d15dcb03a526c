//! Run control on the VM handle: pause (all vCPUs parked, or none),
//! resume, the auto-converge throttle, and the state the vCPUs are asked to
//! be in. The state itself, shared with the vCPU threads, is
//! [`VmShared`](crate::vstate::run_control::VmShared) in `vstate`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{ReportedState, RunState, Vm, VmError};
use crate::vstate::run_control::{Control, THROTTLE_PERIOD};

/// How long a pause waits awake for the vCPUs to park before it sleeps.
const SPIN_FOR_PARKING: Duration = Duration::from_millis(2);

impl Vm {
    /// Stops the vCPUs at their next exit and waits until all are parked.
    pub fn pause(&self) -> Result<(), VmError> {
        let timeout = Duration::from_secs(2);
        let n = self.config.vcpus;
        {
            // Under the lock, as a stop sets its state: a stop that came
            // first stays a stop (a pause over it would park the threads
            // the stop waits to see leave).
            let _c = self.shared.lock();
            if self.shared.requested() == RunState::Stopped {
                return Err(VmError::WrongState("stopped"));
            }
            self.shared.set_requested(RunState::Paused);
            // Wakes a vCPU sitting out a throttle period (VmShared::sit_out).
            self.shared.changed.notify_all();
        }
        self.shared.kick_all();
        // Each kicked thread takes a core at once to park on, unless this
        // VMM was asked to raise nothing for a pause. Raised after the kick:
        // with the signal pending, a raised thread cannot enter the guest
        // again. One that parks before it is flagged is lowered below.
        let hurried =
            !ferry_migration::priority::opted_out(ferry_migration::priority::PAUSE_PRIORITY)
                && self.shared.hurry_all();
        let all_parked = |c: &Control| c.parked >= c.running_threads.min(n) || c.exit.is_some();
        // The vCPUs park within a few hundred µs: waited for awake first
        // (yielding between looks), as a thread asleep on the condition
        // wakes 50-200 µs late on a virtualized host, and a migration's
        // pause counts that as downtime. Asleep after SPIN_FOR_PARKING, or
        // at once from a real-time caller whose vCPUs could not be raised
        // with it: its polling would keep its core from them (raised, they
        // take their turn as it yields).
        if hurried || !ferry_migration::priority::is_real_time() {
            let t = Instant::now();
            while !all_parked(&self.shared.lock()) && t.elapsed() < SPIN_FOR_PARKING {
                std::thread::yield_now();
            }
        }
        let c = self.shared.lock();
        let parked = self.shared.wait_until(c, timeout, all_parked).is_ok();
        // Any thread still raised (one that parked on an exit of its own
        // before it was flagged sleeps raised) is lowered here.
        self.shared.calm_all();
        if !parked {
            // Never leave a VM half-paused: let every vCPU run again (none
            // of them at real time).
            let _ = self.resume();
            return Err(VmError::PauseTimeout(timeout));
        }
        Ok(())
    }

    /// Lets paused vCPUs run again. Refused for a VM not started yet (an
    /// incoming VM's threads may wait parked for its state,
    /// [`Vm::prepare_incoming`]): only [`Vm::start`] lets them go.
    pub fn resume(&self) -> Result<(), VmError> {
        // Every start marks the VM started before it resumes; until then
        // vCPU threads made ahead (or being made) have no state to run.
        if !self.has_started() {
            return Err(VmError::WrongState(
                "not started: it waits for its state (an incoming migration)",
            ));
        }
        if let Some(why) = self.fence_forbids() {
            return Err(VmError::Fenced(why));
        }
        let _c = self.shared.lock();
        match self.shared.requested() {
            RunState::Stopped => Err(VmError::WrongState("stopped")),
            _ => {
                self.shared.set_requested(RunState::Running);
                self.shared.changed.notify_all();
                Ok(())
            }
        }
    }

    /// What the vCPUs are asked to do now.
    pub fn run_state(&self) -> RunState {
        self.shared.requested()
    }

    /// What the VM is doing, as reports show it: "waiting" until its
    /// vCPUs have started, then what they are asked to do.
    pub fn reported_state(&self) -> ReportedState {
        reported(self.has_started(), self.run_state())
    }

    /// Slows the guest for auto-converge: every vCPU sits out `pct`% (0-99)
    /// of each 10 ms. A helper thread kicks the vCPUs out of KVM_RUN once per
    /// period while the throttle is on; 0 stops it.
    pub fn set_throttle(&self, pct: u32) {
        let pct = pct.min(99);
        let was = self.shared.throttle_pct.swap(pct, Ordering::AcqRel);
        if pct > 0 && was == 0 {
            let shared = self.shared.clone();
            let _ = std::thread::Builder::new()
                .name("throttle".into())
                .spawn(move || {
                    while shared.throttle_pct.load(Ordering::Acquire) > 0
                        && shared.requested() != RunState::Stopped
                    {
                        for p in &shared.throttle_pending {
                            p.store(true, Ordering::Release);
                        }
                        shared.kick_all();
                        std::thread::sleep(THROTTLE_PERIOD);
                    }
                });
        }
    }

    /// The current auto-converge throttle (percent).
    pub fn throttle(&self) -> u32 {
        self.shared.throttle_pct.load(Ordering::Acquire)
    }

    /// The vCPU threads' kernel ids (0 for one not started yet).
    pub fn vcpu_tids(&self) -> Vec<u32> {
        self.shared
            .tids
            .iter()
            .map(|t| t.load(Ordering::Acquire))
            .collect()
    }
}

/// The state reported for a VM whose vCPUs have `started` (or not) and are
/// asked to be in `run`.
pub(crate) fn reported(started: bool, run: RunState) -> ReportedState {
    match (started, run) {
        (_, RunState::Stopped) => ReportedState::Stopped,
        (false, _) => ReportedState::Waiting,
        (true, RunState::Running) => ReportedState::Running,
        (true, RunState::Paused) => ReportedState::Paused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_whose_vcpus_never_started_is_waiting_whatever_they_are_asked() {
        assert_eq!(reported(false, RunState::Running), ReportedState::Waiting);
        assert_eq!(reported(false, RunState::Paused), ReportedState::Waiting);
        assert_eq!(reported(false, RunState::Stopped), ReportedState::Stopped);
        assert_eq!(reported(true, RunState::Running), ReportedState::Running);
        assert_eq!(reported(true, RunState::Paused), ReportedState::Paused);
        assert_eq!(
            serde_json::to_value(ReportedState::Waiting).unwrap(),
            serde_json::json!("waiting")
        );
    }
}
