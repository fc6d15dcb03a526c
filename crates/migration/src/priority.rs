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
//! [`real_time`] is also what a handover's pause threads take (ferry-vmm).
//!
//! `FERRY_FAULT_PRIORITY=normal` in a VMM's environment keeps its fault
//! path at normal priority (for a host that allows no real-time threads
//! to a VMM, and to measure what the priority buys).

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
    if std::env::var("FERRY_FAULT_PRIORITY").is_ok_and(|v| v == "normal") {
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

/// Sets the calling thread's nice value; false when not allowed.
fn set_nice(nice: i32) -> bool {
    // SAFETY: gettid has no preconditions; setpriority on our own thread id
    // changes only this thread's nice value.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) == 0
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
}
