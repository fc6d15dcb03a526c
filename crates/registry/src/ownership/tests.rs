//! The ownership rule, step by step and phase by phase: who may run the VM
//! and who must stop, in every mode (every mode moves a VM by the same two
//! steps: the destination's take-over at the switch, and the source's
//! take-back when the switch fails).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::fence::Hooks;
use super::*;
use crate::embedded::Embedded;

fn holder(host: &str, id: u64) -> Holder {
    Holder {
        host: host.into(),
        pid: 100,
        id,
    }
}

fn held(epoch: u64, h: &Holder) -> OwnerRecord {
    OwnerRecord {
        vm: "vm1".into(),
        epoch,
        holder: Some(h.clone()),
        since: 10.0,
    }
}

fn claim(epoch: u64, h: &Holder) -> Claim {
    Claim {
        vm: "vm1".into(),
        epoch,
        holder: h.clone(),
    }
}

fn epoch_written(d: &Decision) -> Option<(u64, Option<Holder>)> {
    match d {
        Decision::Write(r) => Some((r.epoch, r.holder.clone())),
        _ => None,
    }
}

#[test]
fn boot_takes_only_a_vm_nobody_holds() {
    let (a, b) = (holder("h1", 1), holder("h2", 2));
    assert_eq!(
        epoch_written(&decide("vm1", &Step::Boot, None, &a, 1.0)),
        Some((1, Some(a.clone())))
    );
    let released = OwnerRecord {
        holder: None,
        ..held(7, &b)
    };
    assert_eq!(
        epoch_written(&decide("vm1", &Step::Boot, Some(&released), &a, 1.0)),
        Some((8, Some(a.clone())))
    );
    // Held by a live holder, or by one that stopped renewing: refused
    // (nothing takes a VM from a silent holder).
    for since in [now(), 0.0] {
        let r = OwnerRecord {
            since,
            ..held(3, &b)
        };
        assert!(matches!(
            decide("vm1", &Step::Boot, Some(&r), &a, now()),
            Decision::Refuse(Refusal::HeldBy(_))
        ));
    }
}

#[test]
fn the_switch_is_won_by_exactly_one_side() {
    let (src, dst) = (holder("h1", 1), holder("h2", 2));
    let at_switch = held(4, &src);
    // The destination takes it from the source's exact claim...
    let d = decide(
        "vm1",
        &Step::TakeOver(claim(4, &src)),
        Some(&at_switch),
        &dst,
        1.0,
    );
    assert_eq!(epoch_written(&d), Some((5, Some(dst.clone()))));
    let after = held(5, &dst);
    // ...and then the source's take-back is refused: it must not run.
    assert!(matches!(
        decide("vm1", &Step::TakeBack(claim(4, &src)), Some(&after), &src, 1.0),
        Decision::Refuse(Refusal::Moved(r)) if r.holder == Some(dst.clone())
    ));
    // The other order: the source takes it back first...
    let d = decide(
        "vm1",
        &Step::TakeBack(claim(4, &src)),
        Some(&at_switch),
        &src,
        1.0,
    );
    assert_eq!(epoch_written(&d), Some((5, Some(src.clone()))));
    let back = held(5, &src);
    // ...and the destination may not start it.
    assert!(matches!(
        decide(
            "vm1",
            &Step::TakeOver(claim(4, &src)),
            Some(&back),
            &dst,
            1.0
        ),
        Decision::Refuse(Refusal::Moved(_))
    ));
    // A claim from a stale epoch takes nothing.
    assert!(matches!(
        decide(
            "vm1",
            &Step::TakeOver(claim(3, &src)),
            Some(&at_switch),
            &dst,
            1.0
        ),
        Decision::Refuse(_)
    ));
    // Nor does anyone but the claim's holder take it back.
    assert!(matches!(
        decide(
            "vm1",
            &Step::TakeBack(claim(4, &src)),
            Some(&at_switch),
            &dst,
            1.0
        ),
        Decision::Refuse(_)
    ));
}

#[test]
fn a_step_whose_answer_was_lost_is_found_done_when_retried() {
    let (src, dst) = (holder("h1", 1), holder("h2", 2));
    let taken = held(5, &dst);
    assert_eq!(
        decide(
            "vm1",
            &Step::TakeOver(claim(4, &src)),
            Some(&taken),
            &dst,
            1.0
        ),
        Decision::Already(claim(5, &dst))
    );
    let back = held(5, &src);
    assert_eq!(
        decide(
            "vm1",
            &Step::TakeBack(claim(4, &src)),
            Some(&back),
            &src,
            1.0
        ),
        Decision::Already(claim(5, &src))
    );
    let released = OwnerRecord {
        holder: None,
        ..held(5, &src)
    };
    assert!(matches!(
        decide(
            "vm1",
            &Step::Release(claim(4, &src)),
            Some(&released),
            &src,
            1.0
        ),
        Decision::Already(_)
    ));
}

#[test]
fn a_holder_whose_claim_moved_on_must_stop() {
    let (old, new) = (holder("h1", 1), holder("h1", 9));
    // Renewing its own claim is allowed, and writes nothing to the record
    // (a destination's read at the opening stays good for the switch).
    assert_eq!(
        decide(
            "vm1",
            &Step::Renew(claim(4, &old)),
            Some(&held(4, &old)),
            &old,
            2.0
        ),
        Decision::Already(claim(4, &old))
    );
    // A handover's new process took it: the old one's renewal is refused.
    for rec in [Some(held(5, &new)), None] {
        assert!(matches!(
            decide("vm1", &Step::Renew(claim(4, &old)), rec.as_ref(), &old, 2.0),
            Decision::Refuse(_)
        ));
    }
    // The same pid restarted is another holder.
    let reborn = Holder {
        id: 2,
        ..old.clone()
    };
    assert!(matches!(
        decide(
            "vm1",
            &Step::Renew(claim(4, &old)),
            Some(&held(4, &old)),
            &reborn,
            2.0
        ),
        Decision::Refuse(_)
    ));
}

fn registry() -> (Owners, std::path::PathBuf) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ferry-owners-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let r: Arc<dyn Registry> = Arc::new(Embedded::open(dir.clone()).unwrap());
    (Owners::new(r), dir)
}

/// Every mode's switch, raced: a destination taking over and a source
/// taking back at once, many times over a real (embedded) registry; each
/// time exactly one of them wins, and the loser knows it.
#[test]
fn racing_sides_never_both_hold_the_vm() {
    let (owners, dir) = registry();
    let src = holder("h1", 1);
    let mut c = owners.step("vm1", &Step::Boot, &src).unwrap();
    for round in 0..40u64 {
        let dst = holder("h2", 100 + round);
        let (o1, o2) = (owners.clone(), owners.clone());
        let (from1, from2) = (c.clone(), c.clone());
        let (s, d) = (c.holder.clone(), dst.clone());
        let t1 = std::thread::spawn(move || o1.step("vm1", &Step::TakeBack(from1), &s));
        let t2 = std::thread::spawn(move || o2.step("vm1", &Step::TakeOver(from2), &d));
        let (back, over) = (t1.join().unwrap(), t2.join().unwrap());
        assert!(
            back.is_ok() != over.is_ok(),
            "round {round}: {back:?} {over:?}"
        );
        let winner = back.or(over).unwrap();
        assert_eq!(winner.epoch, c.epoch + 1);
        let rec = owners.record("vm1").unwrap().unwrap();
        assert_eq!(rec.holder.as_ref(), Some(&winner.holder));
        c = winner;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_fence_stops_a_copy_whose_claim_was_taken_and_resolves_doubt() {
    let (owners, dir) = registry();
    let stopped = Arc::new(AtomicUsize::new(0));
    let resumed = Arc::new(AtomicUsize::new(0));
    let hooks = |stopped: &Arc<AtomicUsize>, resumed: &Arc<AtomicUsize>| {
        let (s, r) = (stopped.clone(), resumed.clone());
        Hooks {
            stop: Box::new(move |_| {
                s.fetch_add(1, Ordering::Relaxed);
            }),
            resume: Box::new(move || {
                r.fetch_add(1, Ordering::Relaxed);
            }),
        }
    };
    let a = Fence::new(
        owners.clone(),
        "vm1",
        holder("h1", 1),
        hooks(&stopped, &resumed),
    )
    .unwrap();
    let c = a.boot().unwrap();
    assert!(a.why_not_run().is_none());
    // A second fresh start of the same VM is refused while a holds it.
    let b = Fence::new(
        owners.clone(),
        "vm1",
        holder("h2", 2),
        hooks(&stopped, &resumed),
    )
    .unwrap();
    assert!(b.boot().is_err());
    assert!(b.why_not_run().is_some());
    // A migration: a goes in doubt, b takes over; a's take-back is refused.
    a.completing();
    assert!(a.why_not_run().is_some(), "in doubt, a may not run");
    b.take_over(&c, Duration::from_secs(1)).unwrap();
    assert!(matches!(a.take_back(Duration::from_secs(1)), TakeBack::Gone(Some(r)) if r.epoch == 2));
    assert_eq!(a.status().state, "handed");
    // A third process takes the VM from b behind its back (as a handover's
    // new VMM does): b's keeper finds out within a tick or two and stops it.
    let c3 = Fence::new(
        owners.clone(),
        "vm1",
        holder("h2", 3),
        hooks(&stopped, &resumed),
    )
    .unwrap();
    c3.take_over(&b.claim().unwrap(), Duration::from_secs(1))
        .unwrap();
    for _ in 0..40 {
        if stopped.load(Ordering::Relaxed) > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(stopped.load(Ordering::Relaxed), 1, "b was stopped");
    assert!(b.why_not_run().is_some());
    // In doubt, and the destination never took it: the take-back wins.
    c3.completing();
    assert!(matches!(c3.take_back(Duration::from_secs(1)), TakeBack::Back(c) if c.epoch == 4));
    assert!(c3.why_not_run().is_none());
    c3.release().unwrap();
    let rec = owners.record("vm1").unwrap().unwrap();
    assert_eq!((rec.epoch, rec.holder), (5, None));
    assert_eq!(resumed.load(Ordering::Relaxed), 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unreachable_registry_leaves_doubt_to_the_keeper() {
    let (owners, dir) = registry();
    let resumed = Arc::new(AtomicUsize::new(0));
    let r = resumed.clone();
    let a = Fence::new(
        owners.clone(),
        "vm1",
        holder("h1", 1),
        Hooks {
            stop: Box::new(|_| {}),
            resume: Box::new(move || {
                r.fetch_add(1, Ordering::Relaxed);
            }),
        },
    )
    .unwrap();
    a.boot().unwrap();
    a.completing();
    // The registry's directory made unusable: the take-back cannot say.
    let records = dir.join("records");
    std::fs::rename(&records, dir.join("away")).unwrap();
    std::fs::write(&records, b"not a directory").unwrap();
    assert!(matches!(
        a.take_back(Duration::from_millis(300)),
        TakeBack::Unknown(_)
    ));
    assert_eq!(a.status().state, "in-doubt");
    assert!(a.status().unreachable.is_some());
    // Back: the keeper resolves it and resumes the VM by itself.
    std::fs::remove_file(&records).unwrap();
    std::fs::rename(dir.join("away"), &records).unwrap();
    for _ in 0..40 {
        if resumed.load(Ordering::Relaxed) > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(resumed.load(Ordering::Relaxed), 1);
    assert_eq!(a.status().state, "holding");
    assert_eq!(a.status().epoch, Some(2));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn vm_names_are_checked() {
    for ok in ["vm1", "web-3.prod", "A_b"] {
        check_vm_name(ok).unwrap();
    }
    for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(101)] {
        assert!(check_vm_name(bad).is_err(), "{bad:?}");
    }
}
