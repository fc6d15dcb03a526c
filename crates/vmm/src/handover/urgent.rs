//! The threads that carry a handover's pause run at real-time priority for
//! as long as the VM is paused. The pause is a handful of messages between
//! two processes, each a wakeup; on a host whose cores are busy with other
//! guests' vCPUs, a woken thread of normal priority may wait a time slice
//! (milliseconds) before it runs, and every wait adds to the downtime. Only
//! these threads are raised, never vCPUs: they block between short bursts,
//! so they cannot starve anything (and the kernel's real-time throttling
//! bounds them regardless). A vCPU raised instead keeps the core it runs
//! guest code on, which made the pause longer when it was tried.
//!
//! `FERRY_HANDOVER_PRIORITY=normal` leaves them at normal priority (to
//! measure what the raise buys).

/// The calling thread at real-time priority until dropped; its policy is
/// then restored. Where the process may not raise itself, nothing changes.
pub(crate) struct Urgent {
    before: Option<(i32, libc::sched_param)>,
    /// Not Send: restored on the thread that was raised.
    _here: std::marker::PhantomData<*const ()>,
}

impl Urgent {
    /// Raises the calling thread (SCHED_FIFO, priority 1) if allowed.
    pub(crate) fn enter() -> Urgent {
        if std::env::var("FERRY_HANDOVER_PRIORITY").is_ok_and(|v| v == "normal") {
            return Urgent {
                before: None,
                _here: std::marker::PhantomData,
            };
        }
        // The kernel's own calls throughout: glibc's pthread_getschedparam
        // answers from a cache that sched_setscheduler does not update.
        let mut param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread.
        let policy = unsafe { libc::sched_getscheduler(0) };
        // SAFETY: pid 0 is the calling thread; `param` is a live local.
        if policy < 0 || unsafe { libc::sched_getparam(0, &mut param) } != 0 {
            return Urgent {
                before: None,
                _here: std::marker::PhantomData,
            };
        }
        Urgent {
            before: ferry_migration::priority::real_time().then_some((policy, param)),
            _here: std::marker::PhantomData,
        }
    }

    /// Back to the thread's own policy now (before long work, such as
    /// hashing all of memory for `--verify`, that must not hold a core).
    pub(crate) fn relax(&mut self) {
        if let Some((policy, param)) = self.before.take() {
            // SAFETY: pid 0 is the calling thread and `param` a live
            // sched_param; the guard is !Send, so this is the raised thread.
            unsafe { libc::sched_setscheduler(0, policy, &param) };
        }
    }

    /// True if the thread was raised.
    #[cfg(test)]
    pub(crate) fn raised(&self) -> bool {
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

    fn policy() -> i32 {
        // SAFETY: querying the calling thread's own policy.
        unsafe { libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK }
    }

    #[test]
    fn a_raised_thread_gets_its_policy_back() {
        std::thread::spawn(|| {
            let before = policy();
            {
                let u = Urgent::enter();
                if u.raised() {
                    assert_eq!(policy(), libc::SCHED_FIFO);
                } else {
                    eprintln!("NOTE: no CAP_SYS_NICE here: the handover thread stays as it was");
                    assert_eq!(policy(), before);
                }
            }
            assert_eq!(policy(), before);
            // A thread started while raised runs at the normal policy.
            let u = Urgent::enter();
            let child = std::thread::spawn(policy).join().unwrap();
            assert_eq!(
                child,
                libc::SCHED_OTHER,
                "a child of a raised thread is not real time"
            );
            drop(u);
            let mut u = Urgent::enter();
            u.relax();
            assert_eq!(policy(), before, "relaxed early");
            drop(u);
            assert_eq!(policy(), before);
        })
        .join()
        .unwrap();
    }
}
