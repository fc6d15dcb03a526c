//! From the registry's hosts to where a split VM goes: one main host (a
//! waiting VMM) that takes the VM and as much of its memory as its budget
//! allows, and memory servers for the rest, each chunk on `replicas`
//! distinct servers, spread so the fullest server fills last.

use crate::{HostEntry, HostKind};

/// A memory server's part of a placement.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SubShare {
    /// The server's name in the registry.
    pub name: String,
    /// Where to reach it.
    pub addr: String,
    /// Chunks it will hold (replicas count on each server holding one).
    pub chunks: u64,
}

/// Where a VM goes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// The main host's name and address.
    pub main_name: String,
    /// Its address.
    pub main_addr: String,
    /// Chunks that stay on the main host.
    pub main_chunks: u64,
    /// The memory servers, in the order chunks were dealt.
    pub subs: Vec<SubShare>,
}

/// Why no placement fits.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No waiting VMM (or not the one asked for).
    #[error("no main host: {0}")]
    NoMain(String),
    /// The memory servers lack room.
    #[error("the memory servers lack room: {missing} of {chunks} chunks ({chunk_bytes} bytes each, {replicas} copies) found no place")]
    NoRoom {
        /// Chunks without enough servers.
        missing: u64,
        /// Chunks to place on servers.
        chunks: u64,
        /// Bytes per chunk.
        chunk_bytes: u64,
        /// Copies asked for.
        replicas: u32,
    },
}

/// What a split migration asks of the registry.
#[derive(Clone, Debug)]
pub struct Request<'a> {
    /// The VM's memory in chunks.
    pub chunks: u64,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// The main host by address, or `None` for the VMM with most room.
    pub main: Option<&'a str>,
    /// At most this much memory on the main host (else its advertised free).
    pub main_budget: Option<u64>,
    /// Copies of every chunk on the servers.
    pub replicas: u32,
}

/// How the chunks that do not fit the main host are dealt to the servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Each chunk to the servers with the most room still free, so the
    /// fullest fills last (a registry's standing servers share the load).
    Evenly,
    /// Each chunk to the servers that had the most room to begin with,
    /// while they have room: as few servers as can hold the rest (a drain
    /// starts one for the VM on each host used, and each is one more
    /// process that can fail).
    Fewest,
}

/// Picks the main host and deals the chunks that do not fit it to the
/// memory servers, evenly.
pub fn place(hosts: &[HostEntry], req: &Request<'_>) -> Result<Placement, PlacementError> {
    place_with(hosts, req, Fill::Evenly)
}

/// Picks the main host and deals the chunks that do not fit it to the
/// memory servers as `fill` says.
pub fn place_with(
    hosts: &[HostEntry],
    req: &Request<'_>,
    fill: Fill,
) -> Result<Placement, PlacementError> {
    let vmms: Vec<&HostEntry> = hosts.iter().filter(|h| h.kind == HostKind::Vmm).collect();
    let main =
        match req.main {
            Some(addr) => vmms
                .iter()
                .find(|h| h.addr == addr || h.name == addr)
                .copied()
                .ok_or_else(|| {
                    PlacementError::NoMain(format!("{addr} is not a waiting VMM in the registry"))
                })?,
            None => vmms.iter().max_by_key(|h| h.free).copied().ok_or_else(|| {
                PlacementError::NoMain("the registry lists no waiting VMM".into())
            })?,
        };
    let budget = req.main_budget.unwrap_or(main.free).min(main.free);
    let main_chunks = (budget / req.chunk_bytes.max(1)).min(req.chunks);
    let rest = req.chunks - main_chunks;
    let mut subs: Vec<(SubShare, u64)> = hosts
        .iter()
        .filter(|h| h.kind == HostKind::Memserver)
        .map(|h| {
            (
                SubShare {
                    name: h.name.clone(),
                    addr: h.addr.clone(),
                    chunks: 0,
                },
                h.free / req.chunk_bytes.max(1),
            )
        })
        .collect();
    let room: Vec<u64> = subs.iter().map(|s| s.1).collect();
    let replicas = req.replicas.max(1) as usize;
    let mut missing = 0;
    for _ in 0..rest {
        // The `replicas` servers with the most chunks still free.
        let mut order: Vec<usize> = (0..subs.len()).filter(|&i| subs[i].1 > 0).collect();
        match fill {
            Fill::Evenly => order.sort_by_key(|&i| std::cmp::Reverse(subs[i].1)),
            Fill::Fewest => order.sort_by_key(|&i| std::cmp::Reverse(room[i])),
        }
        if order.len() < replicas {
            missing += 1;
            continue;
        }
        for &i in &order[..replicas] {
            subs[i].0.chunks += 1;
            subs[i].1 -= 1;
        }
    }
    if missing > 0 {
        return Err(PlacementError::NoRoom {
            missing,
            chunks: rest,
            chunk_bytes: req.chunk_bytes,
            replicas: replicas as u32,
        });
    }
    Ok(Placement {
        main_name: main.name.clone(),
        main_addr: main.addr.clone(),
        main_chunks,
        subs: subs
            .into_iter()
            .map(|(s, _)| s)
            .filter(|s| s.chunks > 0)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn host(name: &str, kind: HostKind, free_mib: u64) -> HostEntry {
        HostEntry {
            name: name.into(),
            kind,
            addr: format!("{name}:1"),
            capacity: free_mib * MIB,
            free: free_mib * MIB,
            agent: None,
        }
    }

    fn req(chunks: u64, replicas: u32) -> Request<'static> {
        Request {
            chunks,
            chunk_bytes: MIB,
            main: None,
            main_budget: None,
            replicas,
        }
    }

    #[test]
    fn the_roomiest_vmm_is_main_and_the_rest_is_spread() {
        let hosts = [
            host("v1", HostKind::Vmm, 100),
            host("v2", HostKind::Vmm, 300),
            host("m1", HostKind::Memserver, 400),
            host("m2", HostKind::Memserver, 400),
        ];
        let p = place(&hosts, &req(1000, 1)).unwrap();
        assert_eq!(p.main_name, "v2");
        assert_eq!(p.main_chunks, 300);
        // 700 dealt one by one to the server with most room: about even.
        let total: u64 = p.subs.iter().map(|s| s.chunks).sum();
        assert_eq!(total, 700);
        let m1 = p.subs.iter().find(|s| s.name == "m1").unwrap().chunks;
        assert!((350..=400).contains(&m1), "{m1}");
    }

    #[test]
    fn a_budget_and_a_named_main_are_kept() {
        let hosts = [
            host("v1", HostKind::Vmm, 100),
            host("v2", HostKind::Vmm, 300),
            host("m1", HostKind::Memserver, 400),
        ];
        let mut r = req(200, 1);
        r.main = Some("v1:1");
        r.main_budget = Some(50 * MIB);
        let p = place(&hosts, &r).unwrap();
        assert_eq!((p.main_name.as_str(), p.main_chunks), ("v1", 50));
        assert_eq!(p.subs[0].chunks, 150);
        r.main = Some("v9:1");
        assert!(matches!(place(&hosts, &r), Err(PlacementError::NoMain(_))));
    }

    #[test]
    fn fewest_fills_the_roomiest_servers_first_and_evenly_spreads() {
        let hosts = vec![
            host("m", HostKind::Vmm, 0),
            host("s1", HostKind::Memserver, 100),
            host("s2", HostKind::Memserver, 60),
            host("s3", HostKind::Memserver, 80),
        ];
        let chunks = |p: &Placement| -> Vec<(String, u64)> {
            p.subs.iter().map(|s| (s.name.clone(), s.chunks)).collect()
        };
        let r = req(130, 1);
        let few = place_with(&hosts, &r, Fill::Fewest).unwrap();
        assert_eq!(chunks(&few), [("s1".into(), 100), ("s3".into(), 30)]);
        let even = place(&hosts, &r).unwrap();
        assert_eq!(even.subs.len(), 3, "{even:?}");
        // Two copies: the two roomiest for as long as both have room.
        let few = place_with(&hosts, &req(90, 2), Fill::Fewest).unwrap();
        assert_eq!(
            chunks(&few),
            [("s1".into(), 90), ("s2".into(), 10), ("s3".into(), 80)]
        );
    }

    #[test]
    fn replicas_need_distinct_servers_with_room() {
        let hosts = [
            host("v", HostKind::Vmm, 10),
            host("m1", HostKind::Memserver, 100),
            host("m2", HostKind::Memserver, 100),
        ];
        let p = place(&hosts, &req(110, 2)).unwrap();
        assert_eq!(p.subs.len(), 2);
        assert!(p.subs.iter().all(|s| s.chunks == 100));
        // One more chunk has no second server.
        let e = place(&hosts, &req(111, 2)).unwrap_err();
        assert!(
            matches!(e, PlacementError::NoRoom { missing: 1, .. }),
            "{e}"
        );
        // Three copies cannot be kept on two servers at all.
        assert!(place(&hosts, &req(20, 3)).is_err());
        assert!(place(&[host("m", HostKind::Memserver, 9)], &req(1, 1)).is_err());
    }
}
