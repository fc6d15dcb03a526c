//! CPU priority of the postcopy threads. A vCPU that faults on a missing
//! page waits for three threads in turn: the destination's fault thread
//! (asks), the source's demand thread (answers) and the destination's
//! demand lander (copies the page in and wakes). On a host with few cores
//! they compete with the vCPUs themselves, the bulk receivers and the
//! pushers, and a fault whose thread waits for a time slice waits
//! milliseconds. So the fault path runs SCHED_FIFO at the lowest real-time
//! priority: it preempts ordinary threads the moment its read returns, and
//! since each of these threads blocks on a socket or the userfaultfd between
//! short bursts, it cannot starve them (the kernel's real-time throttling
//! bounds it regardless). The push runs at nice 10.
//!
//! [`real_time`] is also what the threads that carry a pause take
//! ([`Urgent`]): a handover's (ferry-vmm) for as long as it lasts, the
//! migration source's control thread from the pause to Started, and the destination's
//! from the start (it sleeps on its connection until the pause's first
//! frame, which must wake it at once). The pause is a handful of messages,
//! each a wake-up; on a host whose cores are busy (vCPUs, other guests, the
//! clients' readers a move wakes), a woken thread of normal priority may
//! wait a time slice (milliseconds) before it runs, and every wait adds to
//! the downtime. These threads block between short bursts, so they cannot
//! starve anything (and the kernel's real-time throttling bounds them
//! regardless).
//!
//! A pause also raises the VM's kicked vCPU threads, but only until each
//! parks ([`real_time_thread`], then [`normal`] by the thread itself): a
//! kicked thread behind busy threads of other VMs would otherwise wait a
//! time slice (5-85 ms measured with 16 busy vCPUs on 2 cores) before it
//! even saw the kick. A vCPU never runs guest code raised: one kept at real
//! time keeps its core, which made the pause longer when it was tried.
//!
//! `FERRY_FAULT_PRIORITY=normal` in a VMM's environment keeps its fault
//! path at normal priority (for a host that allows no real-time threads
//! to a VMM, and to measure what the priority buys).

/// `FERRY_PAUSE_PRIORITY=normal` in a VMM's environment keeps a
/// migration's control threads, and the vCPUs of any pause, at normal
/// priority.
pub const PAUSE_PRIORITY: &str = "FERRY_PAUSE_PRIORITY";

/// True when the environment variable `name` is `normal`: this VMM was
/// asked not to raise what it names.
pub fn opted_out(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "normal")
}

/// Which class a thread took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// SCHED_FIFO, priority 1.
    RealTime,
    /// SCHED_OTHER at a nice value below 0 (no CAP_SYS_NICE for real time).
    Raised,
    /// Unchanged: the process may not raise its priority at all.
    Unchanged,
}

/// Lifts the calling thread onto the fault path: real time if allowed,
/// else the highest nice value it may take, else as it was.
pub(crate) fn fault_path() -> Class {
    if opted_out("FERRY_FAULT_PRIORITY") {
        return Class::Unchanged;
    }
    if real_time() {
        return Class::RealTime;
    }
    if set_nice(-10) {
        Class::Raised
    } else {
        tracing::debug!("postcopy fault path keeps normal priority (no CAP_SYS_NICE)");
        Class::Unchanged
    }
}

/// Puts the calling thread at real-time priority (SCHED_FIFO 1); false
/// when not allowed. Reset on fork: a thread it starts never inherits real
/// time (a vCPU running guest code at real time would keep its core from
/// everything else).
pub fn real_time() -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: pid 0 is the calling thread, and `param` is a live
    // sched_param for the duration of the call.
    unsafe {
        libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param) == 0
    }
}

/// Puts thread `tid` of this process at real-time priority (SCHED_FIFO 1,
/// reset on fork); false when not allowed or when the thread has ended.
/// For a thread that must get a core at once and then lowers itself
/// ([`normal`]): a kicked vCPU on its way to park.
pub fn real_time_thread(tid: u32) -> bool {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: `param` is a live sched_param for the duration of the call;
    // the call changes only the named thread's policy, and fails harmlessly
    // if no such thread exists.
    unsafe {
        libc::sched_setscheduler(
            tid as libc::pid_t,
            libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK,
            &param,
        ) == 0
    }
}

/// Puts thread `tid` (0: the calling thread) back at the normal policy,
/// keeping its nice value.
pub fn normal(tid: u32) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `real_time_thread`.
    unsafe { libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_OTHER, &param) };
}

/// Whether the calling thread runs at a real-time policy (FIFO or RR).
/// Such a thread must not wait by polling: it would keep its core from the
/// normal threads it waits for.
pub fn is_real_time() -> bool {
    // SAFETY: pid 0 is the calling thread; the call only reads its policy.
    let policy = unsafe { libc::sched_getscheduler(0) } & !libc::SCHED_RESET_ON_FORK;
    policy == libc::SCHED_FIFO || policy == libc::SCHED_RR
}

/// Lowers the calling thread below the fault path and the vCPUs (bulk work
/// that may wait: the push).
pub(crate) fn background() {
    let _ = set_nice(10);
}

/// Lowers the calling thread below the push too (the postcopy safety
/// net's copy, a waiting VMM's background preallocation: on a host short of
/// CPU the move itself goes first).
pub fn lowest() {
    let _ = set_nice(19);
}

/// Puts thread `tid` back at nice 0: a thread lowered with [`lowest`] that
/// another now waits for, which on cores busy with normal threads could
/// take seconds to finish its step. False when not allowed (raising a
/// nice value takes CAP_SYS_NICE).
pub fn nice_normal(tid: u32) -> bool {
    set_thread_nice(tid, 0)
}

/// The calling thread's id, for [`nice_normal`] from another thread.
pub fn thread_id() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// Sets the calling thread's nice value; false when not allowed.
fn set_nice(nice: i32) -> bool {
    set_thread_nice(thread_id(), nice)
}

/// Sets thread `tid`'s nice value; false when not allowed.
fn set_thread_nice(tid: u32, nice: i32) -> bool {
    // SAFETY: setpriority on a thread id changes only that thread's nice value.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) == 0 }
}

/// The calling thread at real-time priority until dropped; its policy is
/// then restored. Where the process may not raise itself, nothing changes.
pub struct Urgent {
    /// The raised thread and its policy before, to restore (by thread id,
    /// so whoever drops the guard restores the thread that was raised).
    before: Option<(libc::pid_t, i32, libc::sched_param)>,
}

impl Urgent {
    /// Raises the calling thread (SCHED_FIFO, priority 1) if allowed and
    /// the environment variable `opt_out` is not `normal`.
    pub fn enter(opt_out: &str) -> Urgent {
        let unchanged = Urgent { before: None };
        if opted_out(opt_out) {
            return unchanged;
        }
        // The kernel's own calls throughout: glibc's pthread_getschedparam
        // answers from a cache that sched_setscheduler does not update.
        let mut param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread.
        let policy = unsafe { libc::sched_getscheduler(0) };
        // SAFETY: pid 0 is the calling thread; `param` is a live local.
        if policy < 0 || unsafe { libc::sched_getparam(0, &mut param) } != 0 {
            return unchanged;
        }
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        Urgent {
            before: real_time().then_some((tid, policy, param)),
        }
    }

    /// Back to the thread's own policy now (before long work, such as
    /// hashing all of memory for `--verify`, that must not hold a core).
    pub fn relax(&mut self) {
        if let Some((tid, policy, param)) = self.before.take() {
            // SAFETY: `tid` is the raised thread's id and `param` a live
            // sched_param; if that thread ended, the call fails harmlessly.
            unsafe { libc::sched_setscheduler(tid, policy, &param) };
        }
    }

    /// True if the thread was raised.
    pub fn raised(&self) -> bool {
        self.before.is_some()
    }
}

impl Drop for Urgent {
    fn drop(&mut self) {
        self.relax();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_path_thread_takes_the_highest_class_it_may() {
        let class = std::thread::spawn(|| {
            let c = fault_path();
            // SAFETY: querying the calling thread's own policy.
            let policy = unsafe { libc::sched_getscheduler(0) } & !libc::SCHED_RESET_ON_FORK;
            (c, policy)
        })
        .join()
        .unwrap();
        match class.0 {
            Class::RealTime => assert_eq!(class.1, libc::SCHED_FIFO),
            Class::Raised | Class::Unchanged => assert_eq!(class.1, libc::SCHED_OTHER),
        }
    }

    fn policy() -> i32 {
        // SAFETY: querying the calling thread's own policy.
        unsafe { libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK }
    }

    #[test]
    fn a_raised_thread_gets_its_policy_back() {
        std::thread::spawn(|| {
            let before = policy();
            {
                let u = Urgent::enter("FERRY_TEST_PRIORITY");
                if u.raised() {
                    assert_eq!(policy(), libc::SCHED_FIFO);
                    assert!(is_real_time());
                } else {
                    eprintln!("NOTE: no CAP_SYS_NICE here: the thread stays as it was");
                    assert_eq!(policy(), before);
                }
            }
            assert_eq!(policy(), before);
            assert!(!is_real_time(), "back to normal");
            // A thread started while raised runs at the normal policy.
            let u = Urgent::enter("FERRY_TEST_PRIORITY");
            let child = std::thread::spawn(policy).join().unwrap();
            assert_eq!(
                child,
                libc::SCHED_OTHER,
                "a child of a raised thread is not real time"
            );
            drop(u);
            let mut u = Urgent::enter("FERRY_TEST_PRIORITY");
            u.relax();
            assert_eq!(policy(), before, "relaxed early");
            drop(u);
            assert_eq!(policy(), before);
        })
        .join()
        .unwrap();
    }
}
