//! Run control shared by a VM's handle and its vCPU threads: the state the
//! vCPUs are asked to be in ([`RunState`]), parking them while paused
//! (their vCPU fds lent to the VM handle there, so it can read their state),
//! the auto-converge throttle, the first reason the VM stops, and the kick
//! that gets them out of KVM_RUN.
//!
//! It sits here, under the VM, because the vCPU run loop needs it and must
//! not import the VM module above it; the VM handle (`crate::vm`) builds
//! one and drives it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::exit::VmExit;
use super::kick::kick_signal;
use kvm_ioctls::VcpuFd;

use crate::devices::Devices;

/// What the vCPUs are asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    /// Run the guest.
    Running,
    /// Stay out of KVM_RUN until resumed.
    Paused,
    /// Leave the run loop.
    Stopped,
}

/// What a VM is doing, as its status, metrics and timelines report it.
/// Unlike [`RunState`] (what the vCPUs are asked to do), it is never
/// "running" before the vCPUs have started: a VMM waiting for its incoming
/// migration runs no guest yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportedState {
    /// The vCPUs have not started: the VM waits for its migration (or
    /// handover) to bring it.
    Waiting,
    /// The vCPUs run the guest (perhaps throttled).
    Running,
    /// The vCPUs are parked until resumed.
    Paused,
    /// The VM has stopped.
    Stopped,
}

/// What the VM handle and its vCPU threads wait on each other for (under
/// [`VmShared`]'s lock, signalled by its condition variable).
pub(crate) struct Control {
    /// vCPU threads parked (paused, out of KVM_RUN).
    pub(crate) parked: u32,
    /// vCPU threads still in their run loop.
    pub(crate) running_threads: u32,
    /// Why the VM stops, once decided (the first reason wins).
    pub(crate) exit: Option<VmExit>,
    /// Per vCPU: its fd while its thread is parked. The VM handle reads
    /// the vCPU's state through it under this lock, on its own thread: a
    /// save then costs no wake-up of the vCPU threads (each 50-200 µs on a
    /// nested host, inside the migration's pause). KVM takes any thread's
    /// state ioctls on a vCPU that is out of KVM_RUN.
    pub(crate) lent: Vec<Option<VcpuFd>>,
}

impl ReportedState {
    /// Its name, as status and metrics give it.
    pub fn name(self) -> &'static str {
        match self {
            ReportedState::Waiting => "waiting",
            ReportedState::Running => "running",
            ReportedState::Paused => "paused",
            ReportedState::Stopped => "stopped",
        }
    }
}

/// State shared between the VM handle and its vCPU threads.
pub struct VmShared {
    requested: AtomicU8,
    /// Auto-converge: percent of each THROTTLE_PERIOD the vCPUs sit out.
    pub(crate) throttle_pct: std::sync::atomic::AtomicU32,
    /// Per vCPU: a throttle period has started and it has not slept yet.
    pub(crate) throttle_pending: Vec<std::sync::atomic::AtomicBool>,
    control: Mutex<Control>,
    pub(crate) changed: Condvar,
    /// pthread ids of the running vCPU threads (the kick's targets).
    pub(crate) threads: Mutex<Vec<libc::pthread_t>>,
    /// Kernel thread ids of the vCPU threads, as each starts (index = vCPU).
    pub(crate) tids: Vec<std::sync::atomic::AtomicU32>,
    /// Per vCPU: its thread was raised to real time by a pause
    /// ([`VmShared::hurry_all`]) and must lower itself as it parks.
    hurried: Vec<std::sync::atomic::AtomicBool>,
    /// MSRs saved with each vCPU.
    pub msr_indices: Vec<u32>,
    /// The VM's devices.
    pub devices: Devices,
}

impl VmShared {
    /// Run control for a VM of `vcpus` vCPUs: asked to run, no thread
    /// started yet, no throttle.
    pub(crate) fn new(vcpus: u32, msr_indices: Vec<u32>, devices: Devices) -> Self {
        VmShared {
            requested: AtomicU8::new(RunState::Running as u8),
            throttle_pct: std::sync::atomic::AtomicU32::new(0),
            throttle_pending: (0..vcpus)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            control: Mutex::new(Control {
                parked: 0,
                running_threads: 0,
                exit: None,
                lent: (0..vcpus).map(|_| None).collect(),
            }),
            msr_indices,
            changed: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            tids: (0..vcpus)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            hurried: (0..vcpus)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            devices,
        }
    }

    /// Records the calling thread as vCPU `id`'s.
    pub fn set_vcpu_tid(&self, id: u32) {
        let tid = ferry_migration::priority::thread_id();
        if let Some(t) = self.tids.get(id as usize) {
            t.store(tid, Ordering::Release);
        }
    }

    /// Forgets vCPU `id`'s thread as it ends: its id may be reused by
    /// another thread, which a pause must not raise.
    pub fn clear_vcpu_tid(&self, id: u32) {
        if let Some(t) = self.tids.get(id as usize) {
            t.store(0, Ordering::Release);
        }
    }

    /// What the vCPUs should do now.
    pub fn requested(&self) -> RunState {
        match self.requested.load(Ordering::Acquire) {
            0 => RunState::Running,
            1 => RunState::Paused,
            _ => RunState::Stopped,
        }
    }

    pub(crate) fn set_requested(&self, s: RunState) {
        self.requested.store(s as u8, Ordering::Release);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by a vCPU thread: true (once per period) if vCPU `id` should sleep for the throttle.
    pub fn throttle_due(&self, id: u32) -> bool {
        self.throttle_pending
            .get(id as usize)
            .is_some_and(|p| p.swap(false, Ordering::AcqRel))
    }

    /// How long a throttled vCPU sleeps each period.
    pub fn throttle_sleep(&self) -> Duration {
        THROTTLE_PERIOD * self.throttle_pct.load(Ordering::Relaxed) / 100
    }

    /// Called by a vCPU thread: sits out `d` of a throttle period, or less
    /// when the VM is asked to pause or stop meanwhile. A pause must not
    /// wait out a throttled vCPU's sleep (up to 9.9 ms at 99%): a hybrid
    /// switch's pause took 2-4 ms, not 0.1, when it came mid-period.
    pub fn sit_out(&self, d: Duration) {
        let c = self.lock();
        // The guard comes back either way; dropped here.
        drop(self.wait_until(c, d, |_| self.requested() != RunState::Running));
    }

    /// Waits up to `timeout` for `done` to hold; gives the guard back either
    /// way (Err on timeout).
    pub(crate) fn wait_until<'a>(
        &self,
        mut c: MutexGuard<'a, Control>,
        timeout: Duration,
        done: impl Fn(&Control) -> bool,
    ) -> Result<MutexGuard<'a, Control>, MutexGuard<'a, Control>> {
        let deadline = Instant::now() + timeout;
        while !done(&c) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(c);
            }
            c = self
                .changed
                .wait_timeout(c, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(c)
    }

    /// Called by a vCPU thread: waits while the VM is paused, its fd lent
    /// to the VM handle (see [`Control::lent`]); gives the fd back to the
    /// thread when the VM resumes or stops.
    pub fn park(&self, id: u32, vcpu: VcpuFd) -> VcpuFd {
        let id = id as usize;
        let mut c = self.lock();
        c.lent[id] = Some(vcpu);
        c.parked += 1;
        self.changed.notify_all();
        if self.hurried[id].load(Ordering::Acquire) {
            // Lowered only once counted as parked, and not under the lock:
            // a thread back at the normal policy on a busy host may wait a
            // time slice for its core, and the pause must not wait on it.
            drop(c);
            self.calm(id);
            c = self.lock();
        }
        while self.requested() == RunState::Paused {
            c = self.changed.wait(c).unwrap_or_else(|e| e.into_inner());
        }
        c.parked -= 1;
        // Raised after the look above (the pause raises, then flags), and
        // not lowered by the pause (a resume comes only after it ended):
        // never back into the guest at real time.
        self.calm(id);
        // Only this thread takes its slot, and only here: it is full.
        c.lent[id]
            .take()
            .unwrap_or_else(|| unreachable!("vCPU {id}'s lent fd is gone"))
    }

    /// Records why the VM stops (the first reason wins) and stops every vCPU.
    pub fn finish(&self, exit: VmExit) {
        {
            let mut c = self.lock();
            c.exit.get_or_insert(exit);
            self.set_requested(RunState::Stopped);
            self.changed.notify_all();
        }
        self.kick_all();
    }

    /// Called by a vCPU thread as it leaves its loop.
    pub fn vcpu_exited(&self) {
        let mut c = self.lock();
        c.running_threads -= 1;
        self.changed.notify_all();
    }

    /// Raises every vCPU thread to real time until it parks: on a host
    /// whose cores are busy, a kicked thread would otherwise wait a time
    /// slice behind other VMs' vCPUs before it leaves KVM_RUN, and the
    /// pause (a migration's or a handover's downtime) with it. Each is
    /// raised first and flagged after: a thread that finds no flag as it
    /// parks finds it when it wakes (and the pause lowers it, `calm_all`).
    /// True if every vCPU thread was raised.
    pub(crate) fn hurry_all(&self) -> bool {
        let mut all = true;
        for (tid, flag) in self.tids.iter().zip(&self.hurried) {
            let tid = tid.load(Ordering::Acquire);
            if tid != 0 && ferry_migration::priority::real_time_thread(tid) {
                flag.store(true, Ordering::Release);
            } else {
                all = false;
            }
        }
        all
    }

    /// Lowers every vCPU thread still raised: the pause's last step, once
    /// all parked or when it gave up.
    pub(crate) fn calm_all(&self) {
        for (tid, flag) in self.tids.iter().zip(&self.hurried) {
            let tid = tid.load(Ordering::Acquire);
            // (tid 0 would be the calling thread: a vCPU thread that ended.)
            if flag.swap(false, Ordering::AcqRel) && tid != 0 {
                ferry_migration::priority::normal(tid);
            }
        }
    }

    /// Called by vCPU thread `id`: back to the normal policy if raised.
    fn calm(&self, id: usize) {
        if self.hurried[id].swap(false, Ordering::AcqRel) {
            ferry_migration::priority::normal(0);
        }
    }

    /// Kicks every running vCPU thread out of KVM_RUN.
    pub(crate) fn kick_all(&self) {
        let threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        for &t in threads.iter() {
            // SAFETY: `t` is the pthread id of a vCPU thread we spawned and have
            // not joined yet (ids are removed before joining).
            unsafe { libc::pthread_kill(t, kick_signal()) };
        }
    }
}

/// Throttle period: a throttled vCPU sleeps pct% of every period.
pub(crate) const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn shared(vcpus: u32) -> Arc<VmShared> {
        Arc::new(VmShared::new(vcpus, Vec::new(), Devices::new(None, None)))
    }

    #[test]
    fn run_state_round_trips_through_the_atomic() {
        let s = shared(1);
        assert_eq!(s.requested(), RunState::Running);
        for want in [RunState::Paused, RunState::Stopped, RunState::Running] {
            s.set_requested(want);
            assert_eq!(s.requested(), want);
        }
        assert_eq!(
            serde_json::to_value(RunState::Paused).unwrap(),
            serde_json::json!("paused")
        );
    }

    #[test]
    fn a_reported_state_is_named_as_status_serialises_it() {
        for s in [
            ReportedState::Waiting,
            ReportedState::Running,
            ReportedState::Paused,
            ReportedState::Stopped,
        ] {
            assert_eq!(
                serde_json::to_value(s).unwrap(),
                serde_json::json!(s.name())
            );
        }
    }

    #[test]
    fn the_first_reason_to_stop_wins() {
        let s = shared(2);
        s.finish(VmExit::GuestExit { cpu: 1, code: 0 });
        s.finish(VmExit::Stopped);
        assert_eq!(s.requested(), RunState::Stopped);
        assert_eq!(s.lock().exit, Some(VmExit::GuestExit { cpu: 1, code: 0 }));
    }

    #[test]
    fn a_throttle_period_is_taken_once_per_vcpu() {
        let s = shared(2);
        assert!(!s.throttle_due(0), "no period started");
        s.throttle_pending[0].store(true, Ordering::Release);
        assert!(s.throttle_due(0));
        assert!(!s.throttle_due(0), "taken once");
        assert!(!s.throttle_due(1));
        assert!(!s.throttle_due(9), "no such vCPU");
        s.throttle_pct.store(30, Ordering::Release);
        assert_eq!(s.throttle_sleep(), Duration::from_millis(3));
    }

    #[test]
    fn a_pause_ends_a_throttled_vcpus_sleep() {
        let s = shared(1);
        s.throttle_pct.store(99, Ordering::Release);
        let sleeper = {
            let s = s.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                s.sit_out(s.throttle_sleep());
                t.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(1));
        {
            let _c = s.lock();
            s.set_requested(RunState::Paused);
            s.changed.notify_all();
        }
        let slept = sleeper.join().unwrap();
        assert!(
            slept < Duration::from_millis(8),
            "slept {slept:?} of 9.9 ms"
        );
        // Running, it sits out the whole share.
        s.set_requested(RunState::Running);
        let t = Instant::now();
        s.sit_out(Duration::from_millis(3));
        assert!(t.elapsed() >= Duration::from_millis(3));
    }

    #[test]
    fn thread_ids_are_kept_per_vcpu() {
        let s = shared(2);
        s.set_vcpu_tid(1);
        s.set_vcpu_tid(5); // no such vCPU: ignored
        assert_eq!(s.tids[0].load(Ordering::Acquire), 0);
        assert_ne!(s.tids[1].load(Ordering::Acquire), 0);
    }

    #[test]
    fn waiting_gives_the_guard_back_on_timeout() {
        let s = shared(1);
        let c = s.lock();
        let Err(c) = s.wait_until(c, Duration::from_millis(5), |c| c.parked > 0) else {
            panic!("nothing parked, yet the wait succeeded");
        };
        assert_eq!(c.parked, 0);
        drop(c);
        assert!(s
            .wait_until(s.lock(), Duration::ZERO, |c| c.parked == 0)
            .is_ok());
    }

    /// A KVM VM to make vCPU fds in; None (said loudly) without /dev/kvm.
    fn kvm_vm() -> Option<kvm_ioctls::VmFd> {
        let Ok(kvm) = kvm_ioctls::Kvm::new() else {
            eprintln!("SKIPPED: no /dev/kvm here: a vCPU fd is needed");
            return None;
        };
        Some(kvm.create_vm().expect("a KVM VM"))
    }

    /// The policy of thread `tid` (0: the calling thread).
    fn policy(tid: u32) -> i32 {
        // SAFETY: the call only reads the named thread's policy.
        unsafe { libc::sched_getscheduler(tid as libc::pid_t) & !libc::SCHED_RESET_ON_FORK }
    }

    /// A vCPU thread stand-in: records its tid, waits for `go`, parks
    /// (as its run loop does when paused) and returns its policy once
    /// resumed.
    fn parking_thread(
        s: &Arc<VmShared>,
        vcpu: VcpuFd,
    ) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<i32>) {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        s.lock().running_threads = 1;
        let thread_s = s.clone();
        let t = std::thread::spawn(move || {
            thread_s.set_vcpu_tid(0);
            let _ = wait.recv();
            let _vcpu = thread_s.park(0, vcpu);
            thread_s.vcpu_exited();
            policy(0)
        });
        while s.tids[0].load(Ordering::Acquire) == 0 {
            std::thread::yield_now();
        }
        (go, t)
    }

    #[test]
    fn a_hurried_vcpu_thread_parks_and_runs_again_at_the_normal_policy() {
        let Some(vm) = kvm_vm() else { return };
        let timeout = Duration::from_secs(10);
        // Raised on its way to park (the kick's case), and raised while
        // parked already (it parked before the pause raised it).
        for raised_while_parked in [false, true] {
            let s = shared(1);
            // (KVM keeps a vCPU id for the VM's life: one id per round.)
            let vcpu = vm.create_vcpu(u64::from(raised_while_parked));
            let (go, t) = parking_thread(&s, vcpu.expect("a vCPU"));
            let tid = s.tids[0].load(Ordering::Acquire);
            s.set_requested(RunState::Paused);
            if raised_while_parked {
                go.send(()).unwrap();
                drop(s.wait_until(s.lock(), timeout, |c| c.parked == 1));
            }
            s.hurry_all();
            if !s.hurried[0].load(Ordering::Acquire) {
                eprintln!("SKIPPED: no CAP_SYS_NICE here: a vCPU thread cannot be raised");
                s.set_requested(RunState::Running);
                let _ = go.send(());
                s.changed.notify_all();
                t.join().unwrap();
                return;
            }
            if !raised_while_parked {
                assert_eq!(policy(tid), libc::SCHED_FIFO, "raised until it parks");
                go.send(()).unwrap();
                let c = s.wait_until(s.lock(), timeout, |c| c.parked == 1);
                assert!(c.is_ok(), "the vCPU did not park");
                drop(c);
                // It lowers itself just after it counts as parked.
                let t0 = Instant::now();
                while policy(tid) != libc::SCHED_OTHER && t0.elapsed() < timeout {
                    std::thread::yield_now();
                }
                assert_eq!(
                    policy(tid),
                    libc::SCHED_OTHER,
                    "parked at the normal policy"
                );
            }
            {
                let _c = s.lock();
                s.set_requested(RunState::Running);
                s.changed.notify_all();
            }
            assert_eq!(
                t.join().unwrap(),
                libc::SCHED_OTHER,
                "back to the guest at the normal policy (raised while parked: \
                 {raised_while_parked})"
            );
            assert!(!s.hurried[0].load(Ordering::Acquire));
        }
    }

    #[test]
    fn a_pause_that_gives_up_lowers_the_threads_it_raised() {
        let Some(vm) = kvm_vm() else { return };
        let s = shared(1);
        let (go, t) = parking_thread(&s, vm.create_vcpu(0).expect("a vCPU"));
        let tid = s.tids[0].load(Ordering::Acquire);
        s.hurry_all();
        if s.hurried[0].load(Ordering::Acquire) {
            assert_eq!(policy(tid), libc::SCHED_FIFO);
        } else {
            eprintln!("NOTE: no CAP_SYS_NICE here: nothing was raised to lower");
        }
        // The thread never parked (it waits on `go`, as a vCPU stuck in a
        // device exit would): the pause gives up and lowers it.
        s.calm_all();
        assert_eq!(policy(tid), libc::SCHED_OTHER);
        assert!(!s.hurried[0].load(Ordering::Acquire));
        go.send(()).unwrap();
        assert_eq!(t.join().unwrap(), libc::SCHED_OTHER);
    }

    #[test]
    fn a_parked_vcpu_lends_its_fd_and_takes_it_back_on_resume() {
        let Some(vm) = kvm_vm() else { return };
        let vcpu = vm.create_vcpu(0).expect("a vCPU");
        let s = shared(1);
        s.set_requested(RunState::Paused);
        s.lock().running_threads = 1;
        let t = {
            let s = s.clone();
            std::thread::spawn(move || {
                let vcpu = s.park(0, vcpu);
                s.vcpu_exited();
                vcpu.get_regs().is_ok()
            })
        };
        let timeout = Duration::from_secs(10);
        let c = s.wait_until(s.lock(), timeout, |c| c.parked == 1);
        let c = c.unwrap_or_else(|_| panic!("the vCPU did not park"));
        // The VM handle reads the parked vCPU through the lent fd.
        let lent = c.lent[0].as_ref().expect("lent while parked");
        assert!(lent.get_regs().is_ok());
        // As the VM's resume does: under the lock, so the wake-up is not lost.
        s.set_requested(RunState::Running);
        s.changed.notify_all();
        drop(c);
        assert!(t.join().unwrap(), "the thread has its fd back");
        let c = s.lock();
        assert_eq!((c.parked, c.running_threads), (0, 0));
        assert!(c.lent[0].is_none());
    }
}
