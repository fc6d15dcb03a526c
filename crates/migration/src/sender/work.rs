//! How a round's dirty runs become batches, and which stream and encoder
//! shard each batch goes to: a batch holds the runs of one 1024-page block
//! (a stop-and-copy packs several blocks into one), and with codecs a
//! block always goes to the same stream and shard, whose caches have seen
//! every version of its pages. [`Work`] is where a stream takes its next
//! batch from.

use std::sync::Mutex;

use crate::protocol::{MAX_BATCH, PAGE};
use crate::ranges::GpaPages;

/// One batch to fetch: runs of pages inside one 1024-page block.
pub(super) type Item = Vec<GpaPages>;

/// Where the streams take their batches from.
pub(super) enum Work {
    /// Any stream takes the next batch (raw: no per-stream state).
    Shared(Mutex<std::vec::IntoIter<Item>>),
    /// Each stream has its own (codecs: a block keeps its stream).
    Dealt(Vec<Mutex<std::vec::IntoIter<Item>>>),
}

impl Work {
    pub(super) fn next(&self, stream: usize) -> Option<Item> {
        let q = match self {
            Work::Shared(q) => q,
            Work::Dealt(qs) => &qs[stream],
        };
        q.lock().unwrap_or_else(|e| e.into_inner()).next()
    }
}

/// Groups sorted runs into batches: each holds the runs (or pieces of runs)
/// of one 1024-page block, so fragmented memory still travels in full
/// batches and a page's block decides its stream and shard.
pub(super) fn group(runs: &[GpaPages]) -> Vec<Item> {
    let mut out: Vec<Item> = Vec::new();
    let mut current: Option<u64> = None;
    for r in runs {
        let mut page = r.gpa / PAGE as u64;
        let end = page + r.pages;
        while page < end {
            let block = page / MAX_BATCH as u64;
            let stop = ((block + 1) * MAX_BATCH as u64).min(end);
            let piece = GpaPages::new(page * PAGE as u64, stop - page);
            match out.last_mut() {
                Some(item) if current == Some(block) => item.push(piece),
                _ => out.push(vec![piece]),
            }
            current = Some(block);
            page = stop;
        }
    }
    out
}

fn block_of(item: &Item) -> u64 {
    item.first()
        .map_or(0, |r| r.gpa / PAGE as u64 / MAX_BATCH as u64)
}

/// [`group`], then deals the batches to streams by block number.
pub(super) fn deal(runs: &[GpaPages], streams: usize) -> Vec<Vec<Item>> {
    let mut out = vec![Vec::new(); streams.max(1)];
    for item in group(runs) {
        out[(block_of(&item) % streams.max(1) as u64) as usize].push(item);
    }
    out
}

/// Joins consecutive items into batches of up to MAX_BATCH pages, never
/// across encoder shards (a block keeps its stream, and its shard's
/// caches, whichever batch carries it).
pub(super) fn pack_items(items: Vec<Item>, streams: usize, shards: usize) -> Vec<Item> {
    let mut out: Vec<Item> = Vec::new();
    let mut pages = 0u64;
    for item in items {
        let n: u64 = item.iter().map(|r| r.pages).sum();
        match out.last_mut() {
            Some(last)
                if pages + n <= MAX_BATCH as u64
                    && shard_of(last, streams, shards) == shard_of(&item, streams, shards) =>
            {
                last.extend(item);
                pages += n;
            }
            _ => {
                out.push(item);
                pages = n;
            }
        }
    }
    out
}

pub(super) fn shard_of(item: &Item, streams: usize, shards: usize) -> usize {
    ((block_of(item) / streams.max(1) as u64) % shards.max(1) as u64) as usize
}
