//! `ferry drain HOST`: moves every VM off a host and never loses one.
//!
//! - [`plan`]: where each VM goes (the host with the most memory left
//!   after taking it, among those with room for its memory and vCPUs, so
//!   VMs spread) and how (hybrid unless asked otherwise: precopy rounds,
//!   then postcopy if they do not converge, so a VM that dirties memory
//!   faster than the link carries still finishes).
//! - [`run`]: runs the moves, at most `per_host` at once out of the host
//!   and into any one host, and `in_fleet` in all. Each move: the
//!   destination's agent starts a waiting VMM that admits only this host
//!   with a one-time token; the source's agent migrates the VM there. A
//!   failed move leaves the VM running where it was (the engine's promise),
//!   the waiting VMM is stopped, and the VM is tried on another host.
//!   Cancelling starts no new move and lets each running one end.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ferry_migration::{MigrationToken, Mode};
use serde_json::Value;

use crate::api::{HostInfo, Request, VmInfo};
use crate::claims::{room_left, Claim, StandbyClaims};
use crate::fleet::Fleet;
use crate::FleetError;

/// How a drain runs.
#[derive(Clone, Debug)]
pub struct DrainOptions {
    /// Moves out of the host, and into any one host, at once.
    pub per_host: usize,
    /// Moves in the whole fleet at once.
    pub in_fleet: usize,
    /// The mode for every VM (None: chosen per VM).
    pub mode: Option<Mode>,
    /// Compare every page's hash at the end of each move.
    pub verify: bool,
    /// Other hosts a VM is tried on after a failed move.
    pub retries: usize,
    /// Each move's completion deadline, per GiB of its VM: past it, a
    /// hybrid move switches to postcopy (which ends in about one pass over
    /// the memory left), so no VM keeps a drain waiting on rounds that do
    /// not converge.
    pub deadline_per_gib: Duration,
    /// The bandwidth the drain may use out of the host (bytes/s), shared
    /// by its moves; None: unlimited.
    pub bandwidth: Option<f64>,
    /// Each move's precopy rounds leave the bottleneck's queue to the VMs'
    /// own traffic (on by default; `ferry migrate --own-link` is off).
    pub share_link: bool,
    /// Hybrid moves switch to postcopy after this many dirty rounds that
    /// did not converge (or at their deadline): in a drain every page sent
    /// twice delays every other VM, so fewer than a lone migration's 3.
    pub postcopy_after_rounds: u32,
    /// Give each postcopy or hybrid move a standby on a third host (the
    /// postcopy safety net).
    pub safety_net: bool,
    /// The standby finishes each move it stands by for: the source sends
    /// each pending page once, to it, hands the move over once it holds
    /// them all, and waits as its backup (false: the source pushes them to
    /// the destination as well, and the standby only stands by).
    pub net_finishes: bool,
}

impl Default for DrainOptions {
    fn default() -> Self {
        DrainOptions {
            per_host: 2,
            in_fleet: 5,
            mode: None,
            verify: false,
            retries: 2,
            deadline_per_gib: Duration::from_secs(20),
            bandwidth: None,
            share_link: ferry_migration::options::defaults::SHARE_LINK,
            postcopy_after_rounds: 1,
            safety_net: true,
            net_finishes: true,
        }
    }
}

impl DrainOptions {
    /// What the moves out of `source` may use together (bytes/s): its
    /// link, or the drain's bandwidth budget if lower; None if neither is
    /// known.
    fn out_of(&self, source: &HostInfo) -> Option<f64> {
        [
            (source.link_bps > 0).then(|| source.link_bps as f64 / 8.0),
            self.bandwidth,
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min)
    }

    /// The deadline of a move of a `mem`-byte VM (at least 2 s).
    pub fn deadline(&self, mem: u64) -> Duration {
        self.deadline_per_gib
            .mul_f64(mem as f64 / (1u64 << 30) as f64)
            .max(Duration::from_secs(2))
    }
}

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

/// One VM's planned move.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlannedMove {
    /// The VM.
    pub vm: String,
    /// Its guest RAM.
    pub mem_bytes: u64,
    /// Where to.
    pub to: String,
    /// How.
    pub mode: Mode,
    /// Why that mode.
    pub why: String,
    /// For a VM no host can take whole: the main host's share and where
    /// the rest goes.
    pub split: Option<PlannedSplit>,
}

/// A split move: `to` (the main host) holds `main_budget` bytes of the VM,
/// memory servers started on `stores` (host, capacity) hold the rest.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PlannedSplit {
    /// What the main host holds (bytes).
    pub main_budget: u64,
    /// The memory servers: host and capacity (bytes).
    pub stores: Vec<(String, u64)>,
}

/// The least a main host must hold of a split VM.
const MIN_MAIN: u64 = 64 << 20;

/// The unit a split's shares are counted in (its chunks are 1 MiB).
const SPLIT_UNIT: u64 = 1 << 20;

/// Room a memory server needs beyond the pages it holds (its bitmaps and
/// buffers), and a margin for uneven dealing.
fn store_capacity(share: u64) -> u64 {
    share + share / 8 + (16 << 20)
}

/// A destination host as the plan sees it while it deals VMs out.
#[derive(Clone, Debug)]
struct Room {
    /// Its name.
    name: String,
    /// Memory still free after what the plan gave it.
    mem: u64,
    /// vCPUs still free.
    vcpus: u32,
    /// Moves planned into it.
    moves: usize,
}

/// A split of a `mem`-byte VM needing `vcpus` vCPUs over `room`, or None
/// if the hosts together
/// lack the room: the main host is the one with the most memory free, the
/// rest goes to the others' memory servers, most room first.
fn plan_split(mem: u64, vcpus: u32, room: &[Room]) -> Option<(usize, PlannedSplit)> {
    let (main, m) = room
        .iter()
        .enumerate()
        .filter(|(_, r)| r.vcpus >= vcpus && r.mem >= MIN_MAIN)
        .max_by_key(|(_, r)| r.mem)?;
    let main_budget = (m.mem.min(mem - SPLIT_UNIT) / SPLIT_UNIT) * SPLIT_UNIT;
    let mut rest = mem - main_budget;
    let mut others: Vec<&Room> = room
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != main)
        .map(|(_, r)| r)
        .collect();
    others.sort_by_key(|r| std::cmp::Reverse(r.mem));
    let mut stores = Vec::new();
    for r in others {
        if rest == 0 {
            break;
        }
        // The largest share whose server fits the host's free memory.
        let mut share = rest;
        while share > 0 && store_capacity(share) > r.mem {
            share = share.saturating_sub(SPLIT_UNIT.max(share / 4));
        }
        if share == 0 {
            continue;
        }
        stores.push((r.name.clone(), store_capacity(share)));
        rest -= share;
    }
    (rest == 0 && !stores.is_empty()).then_some((
        main,
        PlannedSplit {
            main_budget,
            stores,
        },
    ))
}

/// Where every VM of a host goes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Plan {
    /// The host drained.
    pub from: String,
    /// The moves, largest VM first.
    pub moves: Vec<PlannedMove>,
    /// VMs no host has room for, and why.
    pub unplaced: Vec<(String, String)>,
}

/// The mode for a VM that dirties `dirty` bytes/s (if measured) when its
/// move gets `share` bytes/s of the link (if known), and why: postcopy for
/// one that dirties more than half its share (precopy would send its pages
/// again and again; postcopy sends each once), hybrid for the rest.
fn choose_mode(asked: Option<Mode>, dirty: Option<f64>, share: Option<f64>) -> (Mode, String) {
    if let Some(m) = asked {
        return (m, "asked for".into());
    }
    match (dirty, share) {
        (Some(d), Some(s)) if d > s / 2.0 => (
            Mode::Postcopy,
            format!(
                "postcopy: it dirties {:.0} MiB/s, over half the {:.0} MiB/s its move gets of the link",
                d / (1u64 << 20) as f64,
                s / (1u64 << 20) as f64
            ),
        ),
        (Some(d), Some(s)) => (
            Mode::Hybrid,
            format!(
                "hybrid: it dirties {:.0} MiB/s, at most half the {:.0} MiB/s its move gets of \
                 the link; precopy rounds, then postcopy if they do not converge",
                d / (1u64 << 20) as f64,
                s / (1u64 << 20) as f64
            ),
        ),
        _ => (
            Mode::Hybrid,
            "hybrid: precopy rounds, then postcopy if they do not converge".into(),
        ),
    }
}

/// Places `source`'s VMs on `others` (hosts that are not the source;
/// what they have free is what their agents said), largest VM first.
pub fn plan(source: &HostInfo, others: &[HostInfo], opts: &DrainOptions) -> Plan {
    // What one move gets of the host's link (or budget) when the most run
    // at once.
    let link = opts.out_of(source);
    let share = link.map(|l| l / opts.per_host.min(opts.in_fleet).max(1) as f64);
    let mut room: Vec<Room> = others
        .iter()
        .filter(|h| h.name != source.name)
        .map(|h| Room {
            name: h.name.clone(),
            mem: h.free_mem,
            vcpus: h.free_vcpus,
            moves: 0,
        })
        .collect();
    // A waiting VMM has no VM yet, and a forwarder's VM runs elsewhere.
    let mut vms: Vec<&VmInfo> = source.vms.iter().filter(|v| v.runs_here()).collect();
    vms.sort_by(|a, b| {
        b.spec
            .mem_bytes
            .cmp(&a.spec.mem_bytes)
            .then(a.spec.name.cmp(&b.spec.name))
    });
    let mut moves = Vec::new();
    let mut unplaced = Vec::new();
    for vm in vms {
        let (mem, vcpus) = (vm.spec.mem_bytes, vm.spec.vcpus);
        let best = room
            .iter_mut()
            .filter(|r| r.mem >= mem && r.vcpus >= vcpus)
            // Most memory left after it, then fewest moves in: VMs spread.
            .max_by(|a, b| {
                (a.mem - mem)
                    .cmp(&(b.mem - mem))
                    .then(b.moves.cmp(&a.moves))
            });
        match best {
            Some(r) => {
                r.mem -= mem;
                r.vcpus -= vcpus;
                r.moves += 1;
                let (mode, why) = choose_mode(opts.mode, vm.dirty_bytes_per_s, share);
                moves.push(PlannedMove {
                    vm: vm.spec.name.clone(),
                    mem_bytes: mem,
                    to: r.name.clone(),
                    mode,
                    why,
                    split: None,
                });
            }
            None => match plan_split(mem, vcpus, &room) {
                Some((main, sp)) => {
                    for (host, bytes) in &sp.stores {
                        if let Some(r) = room.iter_mut().find(|r| &r.name == host) {
                            r.mem = r.mem.saturating_sub(*bytes);
                        }
                    }
                    let r = &mut room[main];
                    r.mem -= sp.main_budget;
                    r.vcpus -= vcpus;
                    r.moves += 1;
                    moves.push(PlannedMove {
                        vm: vm.spec.name.clone(),
                        mem_bytes: mem,
                        to: r.name.clone(),
                        mode: Mode::Split,
                        why: format!(
                            "split: no host has room for all of it; {} MiB on {}, the rest on \
                             memory servers on {}",
                            sp.main_budget >> 20,
                            r.name,
                            sp.stores
                                .iter()
                                .map(|s| s.0.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                        split: Some(sp),
                    });
                }
                None => {
                    let most = room.iter().map(|r| r.mem).max().unwrap_or(0);
                    let all: u64 = room.iter().map(|r| r.mem).sum();
                    unplaced.push((
                        vm.spec.name.clone(),
                        format!(
                            "needs {} MiB and {vcpus} vCPUs; the most memory free on another host \
                             is {} MiB, {} MiB on all of them together",
                            mem >> 20,
                            most >> 20,
                            all >> 20
                        ),
                    ));
                }
            },
        }
    }
    Plan {
        from: source.name.clone(),
        moves,
        unplaced,
    }
}

/// Where a move stands.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoveState {
    /// Not started.
    Waiting,
    /// The destination is being made ready.
    Preparing,
    /// Pages are moving.
    Moving,
    /// The VM runs at the destination.
    Done,
    /// It stays where it was.
    Failed,
}

/// One VM's move as it went.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoveReport {
    /// The VM.
    pub vm: String,
    /// Its guest RAM.
    pub mem_bytes: u64,
    /// Where it is going (or went, or last tried).
    pub to: String,
    /// How.
    pub mode: Mode,
    /// Where it stands.
    pub state: MoveState,
    /// Seconds the move took (so far).
    pub secs: f64,
    /// Bytes sent so far.
    pub bytes: u64,
    /// Bytes its first round sent (its memory as the move began: what had
    /// to cross the link at least; a postcopy move's all), once done.
    pub first_round_bytes: Option<u64>,
    /// Pages left in the current round (while moving).
    pub remaining_pages: u64,
    /// The VM's downtime (ms), once done.
    pub downtime_ms: Option<f64>,
    /// True if it finished by postcopy.
    pub postcopy: bool,
    /// Why each try failed.
    pub errors: Vec<String>,
    /// A split move's shares.
    pub split: Option<PlannedSplit>,
    /// The host of its postcopy standby, if it had one.
    #[serde(default)]
    pub standby: Option<String>,
    /// Bytes its source sent that standby (beside `bytes`).
    #[serde(default)]
    pub standby_bytes: u64,
    /// The source handed the move over once its standby held every page
    /// the destination lacked, and the standby finished it.
    #[serde(default)]
    pub handed_over: bool,
    /// Seconds from the move's start until its destination's VMM (and its
    /// standby) waited for it: what the move cost before its first byte.
    #[serde(default)]
    pub ready_secs: f64,
}

impl MoveReport {
    /// A planned move not started yet.
    fn waiting(m: &PlannedMove) -> Self {
        MoveReport {
            vm: m.vm.clone(),
            mem_bytes: m.mem_bytes,
            to: m.to.clone(),
            mode: m.mode,
            state: MoveState::Waiting,
            secs: 0.0,
            bytes: 0,
            first_round_bytes: None,
            remaining_pages: 0,
            downtime_ms: None,
            postcopy: false,
            errors: Vec::new(),
            split: m.split.clone(),
            standby: None,
            standby_bytes: 0,
            handed_over: false,
            ready_secs: 0.0,
        }
    }
}

/// What a drain did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DrainReport {
    /// The host drained.
    pub host: String,
    /// Every VM's move.
    pub moves: Vec<MoveReport>,
    /// VMs no host had room for.
    pub unplaced: Vec<(String, String)>,
    /// Seconds in all: until every VM runs whole at its destination
    /// (standbys that finish a move included).
    pub secs: f64,
    /// Seconds until the last move out of the host ended (the host was
    /// empty; a handed-over move ends when its standby has finished, and
    /// the drain then waits for the standby's process to end).
    pub emptied_secs: f64,
    /// True if it was cancelled before every move started.
    pub cancelled: bool,
}

impl DrainReport {
    /// True if every VM left the host.
    pub fn emptied(&self) -> bool {
        self.unplaced.is_empty() && self.moves.iter().all(|m| m.state == MoveState::Done)
    }
}

/// What a move's thread tells the scheduler.
enum Event {
    Update(usize, MoveReport),
    Ended(usize, MoveReport, Option<String>),
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
    let source_info = crate::fleet::info(&source)?;
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
            while i < pending.len()
                && sending(&running).len() < opts.in_fleet.min(opts.per_host).max(1)
            {
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
                let (tx, mut report) = (tx.clone(), reports[k].clone());
                let shared = Shared {
                    fleet: fleet.clone(),
                    hosts: hosts_seen.clone(),
                    planned: planned_claims(&reports, pending.iter().chain(running.keys())),
                    standbys: standby_claims.clone(),
                    source: source.clone(),
                    from: plan.from.clone(),
                    opts: opts.clone(),
                };
                sc.spawn(move || {
                    let t = Instant::now();
                    report.state = MoveState::Preparing;
                    let _ = tx.send(Event::Update(k, report.clone()));
                    let mut standby = None;
                    let r = match &vm {
                        Some(vm) => one_move(&shared, vm, &mut report, &tx, k, t, &mut standby),
                        None => Err(format!("VM {} is no longer on {}", report.vm, shared.from)),
                    };
                    report.secs = t.elapsed().as_secs_f64();
                    let err = r.err();
                    report.state = if err.is_none() {
                        MoveState::Done
                    } else {
                        MoveState::Failed
                    };
                    // The standby of a move that succeeded is stopped after
                    // the move is reported: its end (a few hundred ms) then
                    // holds no slot (the scope waits for it before the drain
                    // ends). A failed move's goes first: its retry may pick
                    // that host, for the VM or for a new standby.
                    let stop = |s: Option<StandbyAt>| {
                        if let (Some(s), Some(vm)) = (s, &vm) {
                            s.stop(&vm.spec.name);
                        }
                    };
                    if err.is_some() {
                        stop(standby.take());
                    }
                    let (handed, deadline) =
                        (report.handed_over, shared.opts.deadline(report.mem_bytes));
                    let _ = tx.send(Event::Ended(k, report, err));
                    // A standby finishing the move ends with it (`--once`):
                    // the drain is done when it is, not before.
                    if let (true, Some(s), Some(vm)) = (handed, &standby, &vm) {
                        s.wait_ended(&vm.spec.name, deadline);
                    }
                    stop(standby);
                });
            }
            if running.is_empty() && pending.is_empty() {
                emptied = t0.elapsed();
                return Ok(());
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(Event::Update(k, r)) => reports[k] = r,
                Ok(Event::Ended(k, mut r, err)) => {
                    running.remove(&k);
                    if let Some(e) = err {
                        r.errors.push(format!("to {}: {e}", r.to));
                        // Another host, if one has room and tries are left.
                        let claims: Vec<Claim> =
                            planned_claims(&reports, pending.iter().chain(running.keys()))
                                .into_iter()
                                .chain(standby_claims.snapshot())
                                .collect();
                        let next = (!cancel.load(Ordering::Relaxed)
                            && tried[k].len() <= opts.retries)
                            .then(|| another_host(fleet, &plan.from, &r, &tried[k], &claims))
                            .flatten();
                        if let Some(h) = next {
                            r.to = h;
                            r.state = MoveState::Waiting;
                            pending.insert(0, k);
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

/// Third hosts tried for a move's standby.
const STANDBY_TRIES: usize = 2;

/// Starts a postcopy standby for `vm` on the first of `third` whose room
/// can still be claimed and whose agent starts it; its agent, host name and
/// address. None when none can: the move then goes without one, as the
/// report says.
fn start_standby(
    sh: &Shared,
    hosts: &[HostInfo],
    third: &[String],
    vm: &VmInfo,
) -> Option<StandbyAt> {
    let (name, bytes) = (vm.spec.name.as_str(), vm.spec.mem_bytes);
    for h in third {
        if !sh.standbys.claim(hosts, &sh.planned, h, name, bytes) {
            tracing::warn!("drain: no standby on {h} for {name}: its room was claimed meanwhile");
            continue;
        }
        let started = sh.fleet.agent(h).and_then(|a| {
            let v = a.call(&Request::Standby {
                vm: name.into(),
                bytes,
            })?;
            Ok((a, v["addr"].as_str().unwrap_or_default().to_string()))
        });
        match started {
            Ok((agent, addr)) => {
                return Some(StandbyAt {
                    agent,
                    host: h.clone(),
                    addr,
                    claims: sh.standbys.clone(),
                })
            }
            Err(e) => {
                sh.standbys.release(h, name);
                tracing::warn!("drain: no standby on {h} for {name}: {e}");
            }
        }
    }
    tracing::warn!(
        "drain: no third host can hold {name}'s memory; its postcopy runs without a safety net"
    );
    None
}

/// The fleet's hosts as their agents last said, for choosing standbys:
/// asking every agent (and each of their VMMs) takes a quarter of a second
/// here, which every move paid before its first byte. A look older than
/// [`HOSTS_FRESH_FOR`] is still used while a new one is taken beside the
/// moves (the agent asked for a standby checks its room again).
struct HostsSeen {
    seen: std::sync::Mutex<Option<(Instant, Vec<HostInfo>)>>,
    looking: AtomicBool,
}

/// How long a look at the fleet's hosts is taken as current.
const HOSTS_FRESH_FOR: Duration = Duration::from_secs(2);

impl HostsSeen {
    fn new() -> Arc<Self> {
        Arc::new(HostsSeen {
            seen: std::sync::Mutex::new(None),
            looking: AtomicBool::new(false),
        })
    }

    fn look(&self, fleet: &Fleet) -> Vec<HostInfo> {
        let hosts: Vec<HostInfo> = fleet
            .hosts()
            .map(|h| h.into_iter().filter_map(|(_, h)| h.ok()).collect())
            .unwrap_or_default();
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((Instant::now(), hosts.clone()));
        hosts
    }

    /// The hosts that answered the last look (waiting for the first).
    fn get(self: &Arc<Self>, fleet: &Fleet) -> Vec<HostInfo> {
        let last = self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some((at, hosts)) = last else {
            return self.look(fleet);
        };
        if at.elapsed() >= HOSTS_FRESH_FOR && !self.looking.swap(true, Ordering::AcqRel) {
            let (me, fleet) = (self.clone(), fleet.clone());
            let spawned = std::thread::Builder::new()
                .name("drain-hosts".into())
                .spawn(move || {
                    me.look(&fleet);
                    me.looking.store(false, Ordering::Release);
                });
            if spawned.is_err() {
                self.looking.store(false, Ordering::Release);
            }
        }
        hosts
    }
}

/// A move's postcopy standby: its host's agent, the host, its address, and
/// the drain's standby claims (its own given back when it is stopped).
struct StandbyAt {
    agent: crate::AgentClient,
    host: String,
    addr: String,
    claims: Arc<StandbyClaims>,
}

impl StandbyAt {
    /// Stops the standby for VM `vm` (one still finishing a move whose
    /// source died ends when that move does: it holds on SIGTERM).
    fn stop(&self, vm: &str) {
        let _ = self.agent.call(&Request::Stop { name: vm.into() });
        self.claims.release(&self.host, vm);
    }

    /// Waits (at most `within`) until the standby for VM `vm` has ended:
    /// one that finishes a move ends when the destination has every page.
    fn wait_ended(&self, vm: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let listed = self.agent.call(&Request::Info).ok().is_some_and(|v| {
                v["host"]["stores"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|x| x["vm"] == vm))
            });
            if !listed {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::warn!(
            "drain: the standby for {vm} on {} is still finishing its move",
            self.host
        );
    }
}

/// What every move of a drain shares.
struct Shared {
    fleet: Fleet,
    /// The hosts, as last seen (for choosing standbys).
    hosts: Arc<HostsSeen>,
    /// Room the drain's moves not yet ended were planned to take (as this
    /// move started): no standby takes it.
    planned: Vec<Claim>,
    /// The room the drain's standbys hold.
    standbys: Arc<StandbyClaims>,
    /// The drained host's agent, and its name.
    source: crate::AgentClient,
    from: String,
    opts: DrainOptions,
}

/// One try at moving `vm` from the source to `report.to`. The standby it
/// started, if any, is left in `standby` for the caller to stop.
#[allow(clippy::too_many_arguments)]
fn one_move(
    sh: &Shared,
    vm: &VmInfo,
    report: &mut MoveReport,
    tx: &mpsc::Sender<Event>,
    k: usize,
    t0: Instant,
    standby_out: &mut Option<StandbyAt>,
) -> Result<(), String> {
    let (fleet, source, from) = (&sh.fleet, &sh.source, sh.from.as_str());
    let verify = sh.opts.verify;
    let deadline = sh.opts.deadline(vm.spec.mem_bytes);
    // The host's budget, shared by the moves out of it at once.
    let bandwidth = sh
        .opts
        .bandwidth
        .map(|b| b / sh.opts.per_host.max(1) as f64);
    let dest = fleet.agent(&report.to).map_err(|e| e.to_string())?;
    let token = MigrationToken::generate().map_err(|e| format!("no token: {e}"))?;
    // A split move's memory servers first, then its main host.
    let mut stores: Vec<(crate::AgentClient, String)> = Vec::new();
    let undo = |stores: &[(crate::AgentClient, String)]| {
        for (agent, _) in stores {
            let _ = agent.call(&Request::Stop {
                name: vm.spec.name.clone(),
            });
        }
    };
    if let Some(sp) = &report.split {
        for (host, bytes) in &sp.stores {
            let started = fleet.agent(host).and_then(|a| {
                let v = a.call(&Request::Store {
                    vm: vm.spec.name.clone(),
                    bytes: *bytes,
                })?;
                Ok((a, v["addr"].as_str().unwrap_or_default().to_string()))
            });
            match started {
                Ok(s) => stores.push(s),
                Err(e) => {
                    undo(&stores);
                    return Err(format!("a memory server on {host}: {e}"));
                }
            }
        }
    }
    // A postcopy or hybrid move gets a standby on a third host, which
    // keeps what the destination lacks after the switch until the move
    // ends: a source that dies mid-postcopy then loses no VM. It starts
    // while the destination's VMM does, which admits every host it may be
    // on.
    let want_net = sh.opts.safety_net && matches!(report.mode, Mode::Postcopy | Mode::Hybrid);
    let hosts = if want_net {
        sh.hosts.get(fleet)
    } else {
        Vec::new()
    };
    let third = sh.standbys.candidates(
        &hosts,
        &sh.planned,
        (from, &report.to),
        vm.spec.mem_bytes,
        STANDBY_TRIES,
    );
    let admitted = std::iter::once(from)
        .chain(third.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(",");
    let receive = Request::Receive {
        vm: vm.spec.clone(),
        from: admitted,
        token: token.0.clone(),
        budget: report.split.as_ref().map(|s| s.main_budget),
        mode: Some(report.mode),
    };
    let (standby, ready) = std::thread::scope(|sc| {
        let starting = want_net.then(|| sc.spawn(|| start_standby(sh, &hosts, &third, vm)));
        let ready = dest.call(&receive);
        let standby = starting.and_then(|t| t.join().ok()).flatten();
        (standby, ready)
    });
    report.standby = standby.as_ref().map(|s| s.host.clone());
    let ready = match ready {
        Ok(r) => r,
        Err(e) => {
            undo(&stores);
            if let Some(s) = &standby {
                s.stop(&vm.spec.name);
            }
            return Err(e.to_string());
        }
    };
    let to = ready["to"].as_str().unwrap_or_default().to_string();
    report.ready_secs = t0.elapsed().as_secs_f64();
    report.state = MoveState::Moving;
    let _ = tx.send(Event::Update(k, report.clone()));
    let sent = source.call_with_progress(
        &Request::Send {
            name: vm.spec.name.clone(),
            to,
            token: token.0,
            mode: report.mode,
            verify,
            postcopy_after: matches!(report.mode, Mode::Hybrid).then_some(
                ferry_migration::PostcopyAfter::Either(
                    sh.opts.postcopy_after_rounds,
                    deadline.as_secs_f64(),
                ),
            ),
            bandwidth,
            share_link: sh.opts.share_link,
            split: report.split.as_ref().map(|sp| crate::api::SplitSpec {
                subs: stores.iter().map(|s| s.1.clone()).collect(),
                main_budget: sp.main_budget,
            }),
            safety_net: standby.as_ref().map(|s| s.addr.clone()),
            net_finishes: standby.is_some() && sh.opts.net_finishes,
        },
        &mut |p: &Value| {
            report.bytes = p["bytes"].as_u64().unwrap_or(report.bytes);
            report.remaining_pages = p["remaining_pages"].as_u64().unwrap_or(0);
            report.secs = t0.elapsed().as_secs_f64();
            // Its standby finishes it: the source's link is free.
            report.handed_over |= p["phase"] == "handed-over";
            let _ = tx.send(Event::Update(k, report.clone()));
        },
    );
    // Released by its source at the move's end; the caller stops it.
    *standby_out = standby;
    match sent {
        Ok(v) => {
            let stats = &v["stats"];
            report.bytes = stats["bytes"].as_u64().unwrap_or(report.bytes);
            report.downtime_ms = stats["downtime_ms"].as_f64();
            report.postcopy = !stats["postcopy"].is_null();
            report.standby_bytes = stats["postcopy"]["safety_net_bytes"].as_u64().unwrap_or(0);
            report.handed_over = stats["postcopy"]["handed_over"].as_bool().unwrap_or(false);
            // A postcopy move has no rounds: it sends each page once, so
            // all it sent is what had to cross (to its standby, when that
            // finished the move: the destination got only its faults).
            report.first_round_bytes = stats["rounds"][0]["bytes"].as_u64().or_else(|| {
                stats["bytes"].as_u64().map(|b| {
                    if report.handed_over {
                        b.max(report.standby_bytes)
                    } else {
                        b
                    }
                })
            });
            report.remaining_pages = 0;
            Ok(())
        }
        // The source says the move failed, or its answer was lost (its VMM
        // may end as the migration does): the destination says which.
        Err(e) => match state_at(&dest, &vm.spec.name).as_deref() {
            there if arrived(there) => {
                // The destination runs the VM: the move is done, and
                // stopping that VMM would lose the VM.
                tracing::warn!(
                    "drain: {} runs at {} although its source said: {e}",
                    vm.spec.name,
                    report.to
                );
                report.errors.push(format!(
                    "the source's answer was lost ({e}); the VM runs at {}",
                    report.to
                ));
                report.remaining_pages = 0;
                Ok(())
            }
            // Where the VM runs is not known: its VMM there is left alone
            // (it may hold the only copy), and the move counts as failed.
            Some("unresponsive") => Err(format!(
                "{e}; the VMM at {} does not answer, so it is left running",
                report.to
            )),
            None => Err(format!(
                "{e}; {}'s agent does not say where the VM is, so its VMM there is left as it is",
                report.to
            )),
            _ => {
                // The VM runs on at the source; the waiting VMM goes.
                if let Err(stop) = dest.call(&Request::Stop {
                    name: vm.spec.name.clone(),
                }) {
                    tracing::warn!(
                        "drain: cannot stop the waiting VMM for {}: {stop}",
                        vm.spec.name
                    );
                }
                Err(e.to_string())
            }
        },
    }
}

/// The state `agent` lists VM `name` in, if it lists it.
fn state_at(agent: &crate::AgentClient, name: &str) -> Option<String> {
    let v = agent.call(&Request::Info).ok()?;
    v["host"]["vms"]
        .as_array()?
        .iter()
        .find(|x| x["spec"]["name"] == name)
        .and_then(|x| x["state"].as_str().map(String::from))
}

/// True if a destination's VMM in `state` runs the VM (it no longer waits
/// for it; by postcopy it may still be fetching pages).
fn arrived(state: Option<&str>) -> bool {
    !matches!(state, None | Some("waiting" | "starting" | "unresponsive"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{host, vm};

    #[test]
    fn only_a_destination_that_runs_the_vm_counts_as_arrived() {
        for s in ["running", "paused", "forwarding"] {
            assert!(arrived(Some(s)), "{s}");
        }
        for s in [
            None,
            Some("waiting"),
            Some("starting"),
            Some("unresponsive"),
        ] {
            assert!(!arrived(s), "{s:?}");
        }
    }

    #[test]
    fn vms_go_largest_first_where_most_room_is_left_and_what_fits_nowhere_is_named() {
        let source = host(
            "h1",
            0,
            0,
            vec![
                vm("a", 512, 1),
                vm("b", 1024, 2),
                vm("c", 256, 1),
                vm("huge", 8192, 1),
            ],
        );
        let mut waiting = vm("w", 128, 1);
        waiting.state = "waiting".into();
        let others = [
            host("h1", 4096, 8, vec![]),
            host("h2", 1536, 4, vec![]),
            host("h3", 1024, 4, vec![waiting]),
        ];
        let p = plan(&source, &others, &DrainOptions::default());
        let got: Vec<(&str, &str)> = p
            .moves
            .iter()
            .map(|m| (m.vm.as_str(), m.to.as_str()))
            .collect();
        // b (1 GiB) to h2 (0.5 GiB left beats h3's 0), a to h3 (0.5 GiB
        // left beats h2's 0), c to either: h2 and h3 both have 512 MiB; h2
        // has had one move in, h3 one: the first found wins.
        assert_eq!(got[0], ("b", "h2"));
        assert_eq!(got[1], ("a", "h3"));
        assert_eq!(got[2].0, "c");
        assert!(
            p.moves.iter().all(|m| m.to != "h1"),
            "never back to the source"
        );
        assert!(p.moves.iter().all(|m| m.mode == Mode::Hybrid));
        assert_eq!(p.unplaced.len(), 1);
        assert_eq!(p.unplaced[0].0, "huge");
        assert!(p.unplaced[0].1.contains("8192 MiB"), "{:?}", p.unplaced);
    }

    #[test]
    fn vcpus_count_as_room_too_and_an_asked_mode_is_kept() {
        let source = host("h1", 0, 0, vec![vm("a", 128, 4), vm("b", 128, 4)]);
        let others = [host("h2", 4096, 4, vec![]), host("h3", 256, 4, vec![])];
        let opts = DrainOptions {
            mode: Some(Mode::Precopy),
            ..Default::default()
        };
        let p = plan(&source, &others, &opts);
        let mut to: Vec<&str> = p.moves.iter().map(|m| m.to.as_str()).collect();
        to.sort_unstable();
        assert_eq!(to, ["h2", "h3"], "four vCPUs each: one VM per host");
        assert!(p
            .moves
            .iter()
            .all(|m| m.mode == Mode::Precopy && m.why == "asked for"));
    }

    #[test]
    fn a_vm_no_host_can_take_whole_is_split_over_a_main_host_and_memory_servers() {
        let source = host("h1", 0, 0, vec![vm("big", 1536, 2), vm("small", 128, 1)]);
        let others = [host("h2", 1024, 4, vec![]), host("h3", 768, 4, vec![])];
        let p = plan(&source, &others, &DrainOptions::default());
        assert!(p.unplaced.is_empty(), "{:?}", p.unplaced);
        let big = p.moves.iter().find(|m| m.vm == "big").unwrap();
        assert_eq!((big.to.as_str(), big.mode), ("h2", Mode::Split));
        let sp = big.split.as_ref().unwrap();
        assert_eq!(sp.main_budget, 1024 << 20);
        assert_eq!(sp.stores.len(), 1);
        assert_eq!(sp.stores[0].0, "h3");
        assert!(
            sp.stores[0].1 >= 512 << 20 && sp.stores[0].1 <= 768 << 20,
            "{sp:?}"
        );
        // What the split took is gone from the plan's room: the small VM
        // fits what h3 has left.
        let small = p.moves.iter().find(|m| m.vm == "small").unwrap();
        assert_eq!((small.to.as_str(), small.split.is_none()), ("h3", true));
        // Too little anywhere together: unplaced, and why.
        let source = host("h1", 0, 0, vec![vm("huge", 4096, 1)]);
        let p = plan(&source, &others, &DrainOptions::default());
        assert_eq!(p.unplaced[0].0, "huge");
        assert!(
            p.unplaced[0].1.contains("1792 MiB on all"),
            "{:?}",
            p.unplaced
        );
    }

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

    #[test]
    fn a_vm_that_dirties_more_than_half_its_share_of_the_link_goes_by_postcopy() {
        let mut fast = vm("fast", 256, 1);
        fast.dirty_bytes_per_s = Some(100e6);
        let mut slow = vm("slow", 256, 1);
        slow.dirty_bytes_per_s = Some(10e6);
        let unmeasured = vm("quiet", 256, 1);
        let mut source = host("h1", 0, 0, vec![fast, slow, unmeasured]);
        source.link_bps = 1_000_000_000; // 125 MB/s, 62.5 MB/s a move at 2
        let others = [host("h2", 4096, 8, vec![])];
        let p = plan(&source, &others, &DrainOptions::default());
        let mode = |n: &str| p.moves.iter().find(|m| m.vm == n).unwrap().mode;
        assert_eq!(mode("fast"), Mode::Postcopy);
        assert_eq!(mode("slow"), Mode::Hybrid);
        assert_eq!(mode("quiet"), Mode::Hybrid);
        // One move at a time gets the whole link: 100 MB/s is still over
        // half of 125; on a 2 Gbit link it is not.
        let one = DrainOptions {
            per_host: 1,
            ..Default::default()
        };
        let p = plan(&source, &others, &one);
        assert_eq!(
            p.moves.iter().find(|m| m.vm == "fast").unwrap().mode,
            Mode::Postcopy
        );
        source.link_bps = 2_000_000_000;
        let p = plan(&source, &others, &one);
        assert_eq!(
            p.moves.iter().find(|m| m.vm == "fast").unwrap().mode,
            Mode::Hybrid
        );
    }
}
