//! Split migration (the S-memV paper): a VM whose memory fits no single
//! host moves to a main host (vCPUs, devices, and the hot part of memory
//! up to its budget) and memory servers (the rest), in chunks of 2^k pages
//! ranked by the source's access history; afterwards the main host pages
//! chunks in from the servers when the guest touches them and pages the
//! coldest out to stay within budget.
//!
//! ```text
//! source                                   main host (ferry run --incoming)   memory servers
//!  ctl  SplitPlan{chunks, homes, servers}  ──▶  opens its store connections  ◀── StoreOpen
//!  store StoreOpen{vm, reserve}            ──────────────────────────────────▶  store made
//!  precopy rounds: pages of main chunks on the bulk streams to the main host,
//!  pages of the others straight to their server; a round ends with RoundDone
//!  on the main host and StoreSync on every server
//!  ctl  State, (Verify), Complete          ──▶  remote chunks are holes under
//!                                               userfaultfd; the pager starts;
//!                                          ◀──  Started                vCPUs run
//!  afterwards: fault on a remote chunk ── StoreFetch{page, rest of chunk, drop} ──▶
//!              page-out of a cold chunk ── Pages + StoreSync ──────────────────▶
//! ```
//! Files: [`source`] (the source's mode: rounds routed per chunk),
//! [`gather`] (the source's mode that brings a split VM back),
//! [`destination`] (the main host's mode, picked by a SplitPlan or
//! GatherPlan), [`pager`] (remote paging after the switch).

pub(crate) mod destination;
pub(crate) mod gather;
pub(crate) mod source;

use serde::{Deserialize, Serialize};

use crate::options::Rank;
use crate::ranges::GpaPages;
use crate::transport::Endpoint;
use crate::vm::AccessHistory;

pub use crate::pager::{ChunkMap, GatherSnapshot, PagerStats, RemotePager, SplitPlan, ON_MAIN};

/// What a gathering destination pulls from the memory servers (v8).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatherPlan {
    /// The VM's id on the servers.
    pub vm: String,
    /// The servers.
    pub servers: Vec<Endpoint>,
    /// Per server, the runs to pull from it.
    pub pulls: Vec<Vec<GpaPages>>,
    /// Per server, the secret of the VM's store there (v9).
    pub secrets: Vec<crate::memserver::StoreSecret>,
}

/// The most memory servers a split or gather plan may name: what a source
/// may be given (`--sub`), and a bound on the connections and threads a
/// peer's plan makes this host open.
pub const MAX_SERVERS: usize = 255;

/// Checks the memory servers a peer's plan names before any is reached: at
/// most [`MAX_SERVERS`], and a Unix-domain socket only in a plan that came
/// over one (a migration on this host): a remote source must not make this
/// host write a store's opening (its VM id and secret) to a local socket of
/// its choosing, outside TLS.
pub(crate) fn check_servers(
    kind: crate::protocol::Kind,
    servers: &[Endpoint],
    over_unix: bool,
) -> Result<(), crate::protocol::ProtocolError> {
    let bad = |reason: String| crate::protocol::ProtocolError::Malformed { kind, reason };
    if servers.len() > MAX_SERVERS {
        return Err(bad(format!(
            "{} memory servers (at most {MAX_SERVERS})",
            servers.len()
        )));
    }
    if !over_unix {
        if let Some(local) = servers.iter().find(|e| matches!(e, Endpoint::Unix(_))) {
            return Err(bad(format!(
                "memory server {local} is a local socket, and the plan came over the network"
            )));
        }
    }
    Ok(())
}

/// Opens a store on every server at once (a connection each, in
/// parallel), `open(i)` saying what to open on server `i`; the results in
/// the servers' order, each error naming its server.
pub(crate) fn open_stores(
    servers: &[Endpoint],
    timeout: std::time::Duration,
    open: impl Fn(usize) -> crate::memserver::StoreOpen + Sync,
) -> Vec<
    Result<
        (crate::memserver::StoreClient, crate::memserver::StoreAck),
        crate::error::MigrationError,
    >,
> {
    std::thread::scope(|sc| {
        let open = &open;
        let threads: Vec<_> = servers
            .iter()
            .enumerate()
            .map(|(i, to)| {
                sc.spawn(move || {
                    crate::memserver::StoreClient::open(to, timeout, &open(i)).map_err(|e| {
                        crate::error::MigrationError::Unsupported(format!(
                            "memory server {to}: {e}"
                        ))
                    })
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join().unwrap_or_else(|_| {
                    Err(crate::error::MigrationError::Unsupported(
                        "a memory server thread panicked".into(),
                    ))
                })
            })
            .collect()
    })
}

/// Replaces, in `hashes` (one per page of the VM, in order), the hashes
/// of every chunk `places` puts on a server by those of the server's
/// pages (fetched, left there); a page a server does not hold is zero.
pub(crate) fn hash_remote(
    map: &ChunkMap,
    places: &[u16],
    stores: &mut [crate::memserver::StoreClient],
    hashes: &mut [u64],
) -> Result<(), crate::error::MigrationError> {
    let zero = crate::protocol::page_hash(&[0u8; crate::protocol::PAGE]);
    let by_place = map.runs_by_place(places, stores.len() + 1);
    for (store, runs) in stores.iter_mut().zip(by_place.iter().skip(1)) {
        for run in runs {
            for g in run.page_addrs() {
                if let Some(h) = map.page_index(g).and_then(|i| hashes.get_mut(i as usize)) {
                    *h = zero;
                }
            }
        }
        store.fetch_runs(runs, false, |_, gpas, data| {
            for (j, &g) in gpas.iter().enumerate() {
                if let Some(h) = map.page_index(g).and_then(|i| hashes.get_mut(i as usize)) {
                    *h = crate::protocol::page_hash(
                        &data[j * crate::protocol::PAGE..][..crate::protocol::PAGE],
                    );
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Each chunk's heat: the pages accessed in the last period (clock), or
/// the sum of the pages' 8-bit aging histories (aging). No history: all 0.
pub fn chunk_scores(map: &ChunkMap, history: Option<&AccessHistory>, rank: Rank) -> Vec<u64> {
    let mut scores = vec![0u64; map.chunks()];
    let Some(h) = history else { return scores };
    let per_page = match rank {
        Rank::Clock => &h.clock,
        Rank::Aging => &h.aging,
    };
    for (ri, pages) in per_page.iter().enumerate() {
        let Some(&(_, n, first, _)) = map.regions.get(ri) else {
            break;
        };
        for (i, &v) in pages.iter().enumerate().take(n as usize) {
            scores[first + i / map.chunk_pages as usize] += u64::from(v);
        }
    }
    scores
}

/// Where each chunk goes: [`SplitPlan::places`], `homes` and `mirrors`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// [`ON_MAIN`] or the chunk's home.
    pub places: Vec<u16>,
    /// 1 + the server each chunk lives on when not on the main host.
    pub homes: Vec<u16>,
    /// 1 + the server of its second copy, or 0.
    pub mirrors: Vec<u16>,
}

/// Places chunks: the `budget` hottest on the main host (ties: lower
/// addresses first); every chunk gets a home server for page-out (and with
/// 2 `replicas` a mirror on another server), dealt so each server gets
/// about the same number of pages with data. `data[c]` counts chunk c's
/// pages with data.
pub fn place(scores: &[u64], data: &[u64], budget: u64, servers: usize, replicas: u8) -> Placed {
    let n = scores.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&c| (std::cmp::Reverse(scores[c]), c));
    let mut out = Placed {
        places: vec![ON_MAIN; n],
        homes: vec![1u16; n],
        mirrors: vec![0u16; n],
    };
    let mut load = vec![0u64; servers.max(1)];
    let least = |load: &[u64], not: usize| {
        (0..load.len())
            .filter(|&s| s != not)
            .min_by_key(|&s| (load[s], s))
    };
    for (rank, &c) in order.iter().enumerate() {
        let home = least(&load, usize::MAX).unwrap_or(0);
        out.homes[c] = home as u16 + 1;
        let mirror = (replicas > 1).then(|| least(&load, home)).flatten();
        if let Some(m) = mirror {
            out.mirrors[c] = m as u16 + 1;
        }
        if rank as u64 >= budget {
            out.places[c] = out.homes[c];
            load[home] += data[c].max(1);
            if let Some(m) = mirror {
                load[m] += data[c].max(1);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_plan_names_at_most_255_servers_and_no_local_socket_from_afar() {
        use crate::protocol::Kind;
        let tcp: Endpoint = "tcp:10.0.0.9:7400".parse().unwrap();
        let unix: Endpoint = "unix:/run/x.sock".parse().unwrap();
        check_servers(Kind::GatherPlan, &vec![tcp.clone(); MAX_SERVERS], false).unwrap();
        // Found by a hostile source: a gather plan of 2,000 servers opened
        // 2,000 threads and connections here.
        let e = check_servers(Kind::GatherPlan, &vec![tcp.clone(); 2000], false).unwrap_err();
        assert!(e.to_string().contains("2000 memory servers"), "{e}");
        // And one naming a local socket had this host write the store's
        // secret to it in cleartext.
        let e = check_servers(Kind::SplitPlan, &[tcp.clone(), unix.clone()], false).unwrap_err();
        assert!(e.to_string().contains("local socket"), "{e}");
        // A migration on this host (over a Unix socket) may use one.
        check_servers(Kind::SplitPlan, &[tcp, unix], true).unwrap();
    }
    use crate::memory::RegionView;
    use crate::ranges::PAGE;

    fn views(layout: &[(u64, u64)]) -> Vec<RegionView> {
        // SAFETY: these views are only used for their addresses here.
        layout
            .iter()
            .map(|&(gpa, size)| unsafe { RegionView::new(gpa, size, std::ptr::null_mut()) })
            .collect()
    }

    #[test]
    fn chunks_cover_every_region_and_routing_cuts_at_their_borders() {
        let map = ChunkMap::new(&views(&[(0, 10 * PAGE), (1 << 32, 4 * PAGE)]), 4);
        assert_eq!(map.chunks(), 3 + 1);
        assert_eq!(map.run(2), GpaPages::new(8 * PAGE, 2));
        assert_eq!(map.run(3), GpaPages::new(1 << 32, 4));
        assert_eq!(map.chunk_of(9 * PAGE), Some(2));
        assert_eq!(map.chunk_of((1 << 32) + 3 * PAGE), Some(3));
        assert_eq!(map.chunk_of(10 * PAGE), None);
        assert_eq!(map.page_index((1 << 32) + PAGE), Some(11));
        let places = [0, 1, 0, 2];
        let mut out = vec![Vec::new(); 3];
        map.route(
            &[GpaPages::new(PAGE, 9), GpaPages::new(1 << 32, 2)],
            &places,
            &mut out,
        );
        assert_eq!(
            out[0],
            vec![GpaPages::new(PAGE, 3), GpaPages::new(8 * PAGE, 2)]
        );
        assert_eq!(out[1], vec![GpaPages::new(4 * PAGE, 4)]);
        assert_eq!(out[2], vec![GpaPages::new(1 << 32, 2)]);
    }

    #[test]
    fn hot_chunks_fill_the_budget_and_the_rest_is_dealt_evenly() {
        let map = ChunkMap::new(&views(&[(0, 8 * PAGE)]), 2);
        let h = AccessHistory {
            clock: vec![vec![0, 0, 1, 1, 0, 0, 1, 0]],
            aging: vec![vec![0, 0, 0x80, 0x80, 0xff, 0, 0x40, 0]],
            periods: 8,
        };
        assert_eq!(chunk_scores(&map, Some(&h), Rank::Clock), vec![0, 2, 0, 1]);
        assert_eq!(
            chunk_scores(&map, Some(&h), Rank::Aging),
            vec![0, 0x100, 0xff, 0x40]
        );
        let Placed {
            places,
            homes,
            mirrors,
        } = place(&[0, 2, 0, 1], &[2, 2, 2, 2], 2, 2, 1);
        assert_eq!(places[1], ON_MAIN);
        assert_eq!(places[3], ON_MAIN);
        assert!(places[0] != ON_MAIN && places[2] != ON_MAIN && places[0] != places[2]);
        assert!(homes.iter().all(|&h| h == 1 || h == 2));
        assert!(mirrors.iter().all(|&m| m == 0));
        let two = place(&[0, 2, 0, 1], &[2, 2, 2, 2], 2, 3, 2);
        for c in 0..4 {
            assert!(two.mirrors[c] != 0 && two.mirrors[c] != two.homes[c]);
        }
        let plan = SplitPlan {
            vm: "x".into(),
            chunk_pages: 2,
            servers: vec!["tcp:127.0.0.1:1".parse().unwrap(); 2],
            places: places.clone(),
            homes: homes.clone(),
            mirrors: mirrors.clone(),
            budget_chunks: 2,
            rank: Rank::Clock,
            secrets: vec![crate::memserver::StoreSecret([1; 32]); 2],
        };
        assert!(plan.check(&map).is_ok());
        let over = SplitPlan {
            budget_chunks: 1,
            ..plan.clone()
        };
        assert!(over.check(&map).unwrap_err().contains("budget"));
        let secretless = SplitPlan {
            secrets: Vec::new(),
            ..plan.clone()
        };
        assert!(secretless.check(&map).unwrap_err().contains("secrets"));
        let short = SplitPlan {
            places: places[..3].to_vec(),
            ..plan
        };
        assert!(short.check(&map).is_err());
        let same = SplitPlan {
            mirrors: homes.clone(),
            places: places.clone(),
            ..short
        };
        assert!(same.check(&map).unwrap_err().contains("both its copies"));
    }
}
