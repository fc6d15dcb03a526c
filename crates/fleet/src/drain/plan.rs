//! Where each VM of a drained host goes, and how: the host with the most
//! memory left after taking it, among those with room for its memory and
//! vCPUs, so VMs spread; hybrid unless asked otherwise (precopy rounds, then
//! postcopy if they do not converge, so a VM that dirties memory faster
//! than the link carries still finishes), postcopy for one that dirties
//! more than half its share of the link. Pure: hosts in, a plan out.

use ferry_migration::Mode;
use ferry_registry::{placement, HostEntry, HostKind};

use super::DrainOptions;
use crate::api::{HostInfo, VmInfo};

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

/// The memory a host's free `mem` lets a memory server hold (what
/// [`store_capacity`] of it fits).
fn server_room(mem: u64) -> u64 {
    mem.saturating_sub(16 << 20) / 9 * 8
}

/// A split of a `mem`-byte VM needing `vcpus` vCPUs over `room`, or None
/// if the hosts together lack the room: the main host is the one with the
/// most memory free, and the registry's placement deals the rest out to
/// memory servers on the others, filling the roomiest first (as few
/// servers as hold it).
fn plan_split(mem: u64, vcpus: u32, room: &[Room]) -> Option<(usize, PlannedSplit)> {
    let (main, m) = room
        .iter()
        .enumerate()
        .filter(|(_, r)| r.vcpus >= vcpus && r.mem >= MIN_MAIN)
        .max_by_key(|(_, r)| r.mem)?;
    let main_budget = (m.mem.min(mem - SPLIT_UNIT) / SPLIT_UNIT) * SPLIT_UNIT;
    let entry = |r: &Room, kind: HostKind, free: u64| HostEntry {
        name: r.name.clone(),
        kind,
        addr: r.name.clone(),
        capacity: free,
        free,
        agent: None,
    };
    let hosts: Vec<HostEntry> = std::iter::once(entry(m, HostKind::Vmm, m.mem))
        .chain(
            room.iter()
                .enumerate()
                .filter(|(i, _)| *i != main)
                .map(|(_, r)| entry(r, HostKind::Memserver, server_room(r.mem))),
        )
        .collect();
    let placed = placement::place_with(
        &hosts,
        &placement::Request {
            chunks: mem.div_ceil(SPLIT_UNIT),
            chunk_bytes: SPLIT_UNIT,
            main: Some(&m.name),
            main_budget: Some(main_budget),
            replicas: 1,
        },
        placement::Fill::Fewest,
    )
    .ok()?;
    let stores: Vec<(String, u64)> = placed
        .subs
        .iter()
        .map(|s| (s.name.clone(), store_capacity(s.chunks * SPLIT_UNIT)))
        .collect();
    (!stores.is_empty()).then_some((
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{host, vm};

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
    fn a_split_starts_as_few_memory_servers_as_hold_the_rest() {
        // The rest (512 MiB) fits h3's room alone: h4 gets no server, though
        // it has room too.
        let source = host("h1", 0, 0, vec![vm("big", 1536, 2)]);
        let others = [
            host("h2", 1024, 4, vec![]),
            host("h3", 768, 4, vec![]),
            host("h4", 700, 4, vec![]),
        ];
        let p = plan(&source, &others, &DrainOptions::default());
        let sp = p.moves[0].split.as_ref().unwrap();
        assert_eq!(sp.stores.len(), 1, "{sp:?}");
        assert_eq!(sp.stores[0].0, "h3");
        // Each server's capacity fits its host's free memory.
        let source = host("h1", 0, 0, vec![vm("big", 2048, 2)]);
        let p = plan(&source, &others, &DrainOptions::default());
        let sp = p.moves[0].split.as_ref().unwrap();
        let hosts: Vec<&str> = sp.stores.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(hosts, ["h3", "h4"], "{sp:?}");
        assert!(sp.stores[0].1 <= 768 << 20 && sp.stores[1].1 <= 700 << 20);
        let held: u64 = sp.stores.iter().map(|s| s.1).sum::<u64>();
        assert!(held + sp.main_budget >= 2048 << 20, "{sp:?}");
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
