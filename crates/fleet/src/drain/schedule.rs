//! Runs a drain's moves: at most `per_host` at once out of the host and
//! into any one host, `in_fleet` in all, and only while every move under
//! way still ends within its deadline on the link they share. A failed move
//! the rule lets be retried is tried on another host with room; cancelling
//! starts no new move and lets each running one end.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::mover::{run_try, Event, Shared};
use super::moves::MoveState;
use super::plan::Plan;
use super::report::{DrainReport, MoveReport};
use super::standby::HostsSeen;
use super::DrainOptions;
use crate::claims::{room_left, Claim, StandbyClaims};
use crate::fleet::Fleet;
use crate::FleetError;

/// May a move of `new_mem` bytes start beside `running` (each: bytes left
/// to send, time left to its deadline) on a link of `link` bytes/s? Only if
/// all of them, sharing the link, still end within the earliest deadline:
/// a second move must not push the first past its own. With no link speed
/// known the fixed limits alone decide.
pub fn room_on_link(running: &[(u64, Duration)], new_mem: u64, link: Option<f64>) -> bool {
    let Some(rate) = link.filter(|r| *r > 0.0) else {
        return true;
    };
    if running.is_empty() {
        return true;
    }
    let left: u64 = running.iter().map(|r| r.0).sum::<u64>() + new_mem;
    let soonest = running.iter().map(|r| r.1).min().unwrap_or_default();
    left as f64 / rate <= soonest.as_secs_f64()
}

/// Runs `plan` on `fleet`; `update` sees every move after each change.
pub fn run(
    fleet: &Fleet,
    plan: Plan,
    opts: &DrainOptions,
    cancel: &AtomicBool,
    update: &mut dyn FnMut(&[MoveReport]),
) -> Result<DrainReport, FleetError> {
    let t0 = Instant::now();
    let source = fleet.agent(&plan.from)?;
    let source_info = source.info()?;
    // What the moves out of the host may use together (bytes/s).
    let link = opts.out_of(&source_info);
    let mut reports: Vec<MoveReport> = plan.moves.iter().map(MoveReport::waiting).collect();
    // Hosts each move may still be tried on (its planned one first).
    let mut tried: Vec<Vec<String>> = plan.moves.iter().map(|_| Vec::new()).collect();
    let mut pending: Vec<usize> = (0..reports.len()).collect();
    let mut running: BTreeMap<usize, String> = BTreeMap::new();
    let (tx, rx) = mpsc::channel::<Event>();
    let mut cancelled = false;
    let mut emptied = Duration::ZERO;
    let hosts_seen = HostsSeen::new();
    let standby_claims = Arc::new(StandbyClaims::default());
    update(&reports);
    std::thread::scope(|sc| -> Result<(), FleetError> {
        loop {
            if cancel.load(Ordering::Relaxed) && !pending.is_empty() {
                cancelled = true;
                pending.clear();
            }
            // Start what the limits allow, in plan order. A move handed to
            // its standby no longer sends from the host: it holds no slot
            // (its standby's push crosses another host's link).
            let sending = |running: &BTreeMap<usize, String>| {
                running
                    .iter()
                    .filter(|(r, _)| !reports[**r].handed_over)
                    .map(|(r, h)| (*r, h.clone()))
                    .collect::<Vec<_>>()
            };
            let mut i = 0;
            while i < pending.len() && sending(&running).len() < opts.at_once() {
                let k = pending[i];
                let to = reports[k].to.clone();
                let into = sending(&running).iter().filter(|(_, h)| *h == to).count();
                let under_way: Vec<(u64, Duration)> = sending(&running)
                    .iter()
                    .map(|&(r, _)| {
                        let m = &reports[r];
                        let left = opts
                            .deadline(m.mem_bytes)
                            .saturating_sub(Duration::from_secs_f64(m.secs));
                        (m.mem_bytes.saturating_sub(m.bytes), left)
                    })
                    .collect();
                if into >= opts.per_host.max(1)
                    || !room_on_link(&under_way, reports[k].mem_bytes, link)
                {
                    i += 1;
                    continue;
                }
                pending.remove(i);
                running.insert(k, to.clone());
                tried[k].push(to.clone());
                let vm = source_info
                    .vms
                    .iter()
                    .find(|v| v.spec.name == reports[k].vm)
                    .cloned();
                let (tx, report) = (tx.clone(), reports[k].clone());
                let shared = Shared {
                    fleet: fleet.clone(),
                    hosts: hosts_seen.clone(),
                    planned: planned_claims(&reports, pending.iter().chain(running.keys())),
                    standbys: standby_claims.clone(),
                    source: source.clone(),
                    from: plan.from.clone(),
                    opts: opts.clone(),
                };
                sc.spawn(move || run_try(&shared, vm.as_ref(), report, tx, k));
            }
            if running.is_empty() && pending.is_empty() {
                emptied = t0.elapsed();
                return Ok(());
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(Event::Update(k, r)) => reports[k] = r,
                Ok(Event::Ended(k, mut r, failed)) => {
                    running.remove(&k);
                    if let Some(o) = failed {
                        r.errors.push(format!("to {}: {}", r.to, o.note));
                        // Another host, if one has room and tries are left.
                        let claims: Vec<Claim> =
                            planned_claims(&reports, pending.iter().chain(running.keys()))
                                .into_iter()
                                .chain(standby_claims.snapshot())
                                .collect();
                        let next = (o.retry
                            && !cancel.load(Ordering::Relaxed)
                            && tried[k].len() <= opts.retries)
                            .then(|| another_host(fleet, &plan.from, &r, &tried[k], &claims))
                            .flatten();
                        if let Some(h) = next {
                            if r.advance(MoveState::Waiting).is_ok() {
                                r.to = h;
                                pending.insert(0, k);
                            }
                        }
                    }
                    reports[k] = r;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
            update(&reports);
        }
    })?;
    update(&reports);
    Ok(DrainReport {
        host: plan.from,
        moves: reports,
        unplaced: plan.unplaced,
        secs: t0.elapsed().as_secs_f64(),
        emptied_secs: emptied.as_secs_f64(),
        cancelled,
        settled: Vec::new(),
    })
}

/// A host other than the source and those tried, with room for the VM now
/// (less what the drain's other moves and standbys have claimed there).
fn another_host(
    fleet: &Fleet,
    from: &str,
    r: &MoveReport,
    tried: &[String],
    claims: &[Claim],
) -> Option<String> {
    let hosts = fleet.hosts().ok()?;
    hosts
        .into_iter()
        .filter_map(|(_, h)| h.ok())
        .map(|h| (room_left(&h, claims), h))
        .filter(|(room, h)| h.name != from && !tried.contains(&h.name) && *room >= r.mem_bytes)
        .max_by_key(|(room, _)| *room)
        .map(|(_, h)| h.name)
}

/// The room the drain's moves not yet ended were planned to take: a claim
/// on the destination for each, a split's share on its main host and on
/// each memory server instead.
fn planned_claims<'a>(
    reports: &[MoveReport],
    moves: impl Iterator<Item = &'a usize>,
) -> Vec<Claim> {
    let claim = |host: &str, vm: &str, bytes: u64| Claim {
        host: host.into(),
        vm: vm.into(),
        bytes,
    };
    let mut claims = Vec::new();
    for r in moves.filter_map(|&k| reports.get(k)) {
        match &r.split {
            Some(sp) => {
                claims.push(claim(&r.to, &r.vm, sp.main_budget));
                for (host, bytes) in &sp.stores {
                    claims.push(claim(host, &r.vm, *bytes));
                }
            }
            None => claims.push(claim(&r.to, &r.vm, r.mem_bytes)),
        }
    }
    claims
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::plan::{PlannedMove, PlannedSplit};
    use crate::drain::standby::STANDBY_TRIES;
    use crate::testing::host;
    use ferry_migration::Mode;

    #[test]
    fn a_standby_never_takes_room_the_plan_gave_another_move() {
        // The CI failure this guards: a drain's standby for one VM took the
        // room on ferry-h3 that the plan had given the next VM, whose move
        // then found no room there.
        let report = |name: &str, to: &str, mib: u64, split: Option<PlannedSplit>| {
            MoveReport::waiting(&PlannedMove {
                vm: name.into(),
                mem_bytes: mib << 20,
                to: to.into(),
                mode: Mode::Hybrid,
                why: String::new(),
                split,
            })
        };
        let reports = [
            report("sort", "h2", 256, None),
            report("touch", "h3", 256, None),
            report(
                "big",
                "h4",
                1152,
                Some(PlannedSplit {
                    main_budget: 768 << 20,
                    stores: vec![("h3".into(), 384 << 20)],
                }),
            ),
            report("done", "h3", 512, None),
        ];
        // The last move has ended: only the first three are claimed.
        let planned = planned_claims(&reports, [0usize, 1, 2].iter());
        let on = |host: &str| -> u64 {
            planned
                .iter()
                .filter(|c| c.host == host)
                .map(|c| c.bytes)
                .sum()
        };
        assert_eq!(on("h2"), 256 << 20);
        assert_eq!(on("h3"), 640 << 20, "touch and big's server");
        assert_eq!(on("h4"), 768 << 20);
        let hosts = [
            host("h1", 4096, 8, vec![]),
            host("h2", 1024, 8, vec![]),
            host("h3", 896, 8, vec![]),
            host("h5", 200, 8, vec![]),
        ];
        let standbys = StandbyClaims::default();
        let third = |mib: u64| {
            standbys.candidates(&hosts, &planned, ("h1", "h2"), mib << 20, STANDBY_TRIES)
        };
        // sort's standby (h2 is its destination): h3 has 896 MiB free and
        // 640 of it claimed, so 256 MiB is left: just enough.
        assert_eq!(third(256), ["h3"]);
        // A 384 MiB VM fits h3's free memory but not what is left of it.
        assert!(third(384).is_empty());
        assert_eq!(
            standbys.candidates(&hosts, &[], ("h1", "h2"), 384 << 20, STANDBY_TRIES),
            ["h3"],
            "nothing claimed: free memory decides"
        );
        // Once sort's standby has claimed h3's last 256 MiB, no other
        // standby gets it, until it is given back.
        assert!(standbys.claim(&hosts, &planned, "h3", "sort", 256 << 20));
        assert!(third(256).is_empty());
        standbys.release("h3", "sort");
        assert_eq!(third(256), ["h3"]);
    }
    #[test]
    fn a_second_move_starts_only_if_both_still_end_within_the_first_ones_deadline() {
        let gib = 1u64 << 30;
        let link = Some(125e6); // 1 Gbit/s
                                // Nothing under way, or no link speed known: the fixed limits decide.
        assert!(room_on_link(&[], gib, link));
        assert!(room_on_link(&[(gib, Duration::from_secs(1))], gib, None));
        // 1 GiB left with 20 s to go: another 1 GiB fits (2 GiB in 17 s).
        assert!(room_on_link(&[(gib, Duration::from_secs(20))], gib, link));
        // With 10 s to go it would push the first past its deadline.
        assert!(!room_on_link(&[(gib, Duration::from_secs(10))], gib, link));
        let opts = DrainOptions::default();
        assert_eq!(opts.deadline(gib), Duration::from_secs(20));
        assert_eq!(
            opts.deadline(gib / 64),
            Duration::from_secs(2),
            "at least 2 s"
        );
    }
}
