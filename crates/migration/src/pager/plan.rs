//! A split VM's plan: where each chunk lives (the main host or a memory
//! server, and its second copy), sent by the source to the main host
//! before any page (v8), checked there and handed to the pager.

use serde::{Deserialize, Serialize};

use super::chunks::{ChunkMap, ON_MAIN};
use crate::memserver::StoreSecret;
use crate::options::Rank;
use crate::transport::Endpoint;

/// The source's plan, sent to the main host before any page (v8).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitPlan {
    /// The VM's id on the memory servers (the same on every connection).
    pub vm: String,
    /// Pages per chunk.
    pub chunk_pages: u32,
    /// The memory servers, as the main host reaches them.
    pub servers: Vec<Endpoint>,
    /// Per chunk (in guest address order over all regions): [`ON_MAIN`],
    /// or 1 + the index of the server holding it.
    pub places: Vec<u16>,
    /// Per chunk: 1 + the server it goes to when paged out (a chunk not
    /// on the main host lives there).
    pub homes: Vec<u16>,
    /// Per chunk: 1 + the server holding its second copy, or 0 (no
    /// replicas).
    pub mirrors: Vec<u16>,
    /// Chunks the main host may hold.
    pub budget_chunks: u64,
    /// The ranking page-out uses.
    pub rank: Rank,
    /// Per server, the secret of the VM's store there (v9): the main host
    /// opens the stores with them, and hands them on in a GatherPlan.
    pub secrets: Vec<StoreSecret>,
}

impl SplitPlan {
    /// Checks the plan against the main host's memory.
    pub fn check(&self, map: &ChunkMap) -> Result<(), String> {
        let n = map.chunks();
        if self.places.len() != n || self.homes.len() != n || self.mirrors.len() != n {
            return Err(format!(
                "the plan places {} chunks, this VM's memory has {n} of {} pages",
                self.places.len(),
                self.chunk_pages
            ));
        }
        let servers = self.servers.len();
        if self.secrets.len() != servers {
            return Err(format!(
                "the plan gives {} store secrets for {servers} servers",
                self.secrets.len()
            ));
        }
        if self.places.iter().any(|&p| usize::from(p) > servers)
            || self
                .homes
                .iter()
                .any(|&h| h == ON_MAIN || usize::from(h) > servers)
            || self.mirrors.iter().any(|&m| usize::from(m) > servers)
        {
            return Err(format!("the plan names a server beyond its {servers}"));
        }
        let misplaced = (0..n).any(|c| {
            (self.places[c] != ON_MAIN && self.places[c] != self.homes[c])
                || self.mirrors[c] == self.homes[c]
        });
        if misplaced {
            return Err(
                "the plan puts a chunk away from its home, or both its copies on one server".into(),
            );
        }
        let on_main = self.places.iter().filter(|&&p| p == ON_MAIN).count() as u64;
        if on_main > self.budget_chunks {
            return Err(format!(
                "the plan puts {on_main} chunks on the main host, over its budget of {}",
                self.budget_chunks
            ));
        }
        Ok(())
    }
}
