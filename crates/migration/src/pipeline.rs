//! The compressed data path of the source, one per bulk stream:
//!
//! ```text
//! fetch ──(3 buffers)──▶ encode shard 0..k ──(3 buffers)──▶ send
//! ```
//!
//! Fetch copies a batch of up to 1024 pages out of guest RAM (zero pages
//! become ranges), each encoder thread owns one shard's codec state, and send
//! writes the frames. Buffers circulate through a free list, so a round
//! allocates nothing and a slow stage holds the others back by at most three
//! batches. Without the pipeline one thread does the three steps in turn.
//!
//! A page always belongs to the same stream and shard (by its 1024-page
//! block), because xbzrle's cache must see every version of a page; per-shard
//! order is kept from encoder to wire, so the destination's mirror decodes
//! in the same order.

use std::io::Write;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::time::{Duration, Instant};

use ferry_codec::{EncodedBatch, Method};

use crate::compress::{BatchEncoder, Policy};
use crate::protocol::{self, Kind, MAX_BATCH, PAGE};
use crate::stats::{secs, thread_cpu_secs, CpuMeter};
use crate::vm::RegionView;
use crate::{MigrationError, ProtocolError};

/// Buffers between two stages.
const DEPTH: usize = 3;

/// One batch on its way through the stages.
#[derive(Default)]
pub(crate) struct Batch {
    gpas: Vec<u64>,
    idx: Vec<u64>,
    data: Vec<u8>,
    zeros: Vec<(u64, u64)>,
    method: Option<Method>,
    shard: u8,
    enc: EncodedBatch,
}

/// A compressed bulk stream's encoder shards and buffers, kept across
/// rounds (the caches must be).
pub(crate) struct EncState {
    pub(crate) shards: Vec<Box<dyn BatchEncoder>>,
    pool: Vec<Batch>,
}

impl EncState {
    pub(crate) fn new(shards: Vec<Box<dyn BatchEncoder>>) -> Self {
        EncState {
            shards,
            pool: Vec::new(),
        }
    }
}

/// What every stream of a round shares.
pub(crate) struct RoundCtx<'a> {
    pub(crate) regions: &'a [RegionView],
    pub(crate) round: u32,
    /// Set in the stop-and-copy: the bytes it has to move.
    pub(crate) final_bytes: Option<u64>,
    pub(crate) policy: &'a Policy,
    pub(crate) pipeline: bool,
    pub(crate) limit: Option<f64>,
    pub(crate) t0: Instant,
    pub(crate) cpu: &'a CpuMeter,
    pub(crate) pages: AtomicU64,
    pub(crate) zero: AtomicU64,
    pub(crate) bytes: AtomicU64,
    /// Page bytes that went through an encoder, and what they became.
    pub(crate) encoded_in: AtomicU64,
    pub(crate) encoded_out: AtomicU64,
    /// Page bytes that went raw.
    pub(crate) raw_in: AtomicU64,
}

/// One batch to fetch: runs of pages inside one 1024-page block.
pub(crate) type Item = Vec<(u64, u64)>;

/// Groups sorted runs into batches: each holds the runs (or pieces of runs)
/// of one 1024-page block, so fragmented memory still travels in full
/// batches and a page's block decides its stream and shard.
pub(crate) fn group(runs: &[(u64, u64)]) -> Vec<Item> {
    let mut out: Vec<Item> = Vec::new();
    let mut current: Option<u64> = None;
    for &(gpa, n) in runs {
        let mut page = gpa / PAGE as u64;
        let end = page + n;
        while page < end {
            let block = page / MAX_BATCH as u64;
            let stop = ((block + 1) * MAX_BATCH as u64).min(end);
            let piece = (page * PAGE as u64, stop - page);
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
        .map_or(0, |r| r.0 / PAGE as u64 / MAX_BATCH as u64)
}

/// [`group`], then deals the batches to streams by block number.
pub(crate) fn deal(runs: &[(u64, u64)], streams: usize) -> Vec<Vec<Item>> {
    let mut out = vec![Vec::new(); streams.max(1)];
    for item in group(runs) {
        out[(block_of(&item) % streams.max(1) as u64) as usize].push(item);
    }
    out
}

fn fetch(regions: &[RegionView], item: &Item, b: &mut Batch) {
    b.gpas.clear();
    b.idx.clear();
    b.data.clear();
    b.zeros.clear();
    b.enc.clear();
    b.method = None;
    for i in item
        .iter()
        .flat_map(|&(base, n)| (0..n).map(move |i| base + i * PAGE as u64))
    {
        let gpa = i;
        let Some(r) = regions.iter().find(|r| r.contains(gpa)) else {
            continue;
        };
        let page = r.page((gpa - r.gpa) / PAGE as u64);
        if crate::precopy::is_zero(page) {
            match b.zeros.last_mut() {
                Some((g, k)) if *g + *k * PAGE as u64 == gpa => *k += 1,
                _ => b.zeros.push((gpa, 1)),
            }
        } else {
            b.gpas.push(gpa);
            b.idx.push(gpa / PAGE as u64);
            b.data.extend_from_slice(page);
        }
    }
}

fn encode(ctx: &RoundCtx, enc: &mut dyn BatchEncoder, b: &mut Batch) -> Result<(), MigrationError> {
    if b.gpas.is_empty() {
        return Ok(()); // only zero pages: ranges, nothing to encode
    }
    let method = ctx
        .policy
        .choose(ctx.round, ctx.final_bytes, b.data.len() as u64);
    b.method = Some(method);
    if method == Method::None {
        return Ok(());
    }
    let t = Instant::now();
    enc.encode(method, &b.idx, &b.data, &mut b.enc)
        .map_err(MigrationError::Codec)?;
    let wire = b.enc.payload.len() + 13 * b.gpas.len();
    ctx.policy
        .observe_encode(method, b.data.len() as u64, wire as u64, secs(t.elapsed()));
    Ok(())
}

/// Writes a batch's frames; returns how many. `sock` is the connection's
/// socket, for the kernel's delivery rate while the policy probes the link.
fn send<W: Write>(
    ctx: &RoundCtx,
    w: &mut W,
    sock: Option<RawFd>,
    b: &Batch,
) -> Result<u64, MigrationError> {
    let mut frames = 0;
    let mut bytes = 0u64;
    if !b.zeros.is_empty() {
        bytes += protocol::write_zero_ranges(w, &b.zeros)?;
        ctx.zero
            .fetch_add(b.zeros.iter().map(|z| z.1).sum(), Ordering::Relaxed);
        frames += 1;
    }
    if !b.gpas.is_empty() {
        match b.method.unwrap_or(Method::None) {
            Method::None => {
                let count = (b.gpas.len() as u32).to_le_bytes();
                let addrs: Vec<u8> = b.gpas.iter().flat_map(|g| g.to_le_bytes()).collect();
                protocol::write_frame_parts(w, Kind::Pages, &[&count, &addrs, &b.data])
                    .map_err(ProtocolError::Io)?;
                let n = (protocol::HEADER + 4 + addrs.len() + b.data.len()) as u64;
                bytes += n;
                ctx.raw_in.fetch_add(b.data.len() as u64, Ordering::Relaxed);
                ctx.policy
                    .observe_raw_sent(n, sock.and_then(crate::stats::delivery_rate));
            }
            m => {
                let n = crate::encoded::write_encoded(w, m, b.shard, &b.gpas, &b.enc)
                    .map_err(ProtocolError::Io)?;
                bytes += n;
                ctx.encoded_in
                    .fetch_add(b.data.len() as u64, Ordering::Relaxed);
                ctx.encoded_out.fetch_add(n, Ordering::Relaxed);
            }
        }
        ctx.pages.fetch_add(b.gpas.len() as u64, Ordering::Relaxed);
        frames += 1;
    }
    let sent = ctx.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
    // --bandwidth: all streams together stay under the limit.
    if let Some(rate) = ctx.limit {
        let ahead = sent as f64 / rate - secs(ctx.t0.elapsed());
        if ahead > 0.0 {
            w.flush().map_err(ProtocolError::Io)?;
            std::thread::sleep(Duration::from_secs_f64(ahead));
        }
    }
    Ok(frames)
}

fn shard_of(item: &Item, streams: usize, shards: usize) -> usize {
    ((block_of(item) / streams.max(1) as u64) % shards.max(1) as u64) as usize
}

/// Sends one stream's share of a round; returns the frames it wrote.
pub(crate) fn run_stream<W: Write + Send>(
    ctx: &RoundCtx,
    w: &mut W,
    sock: Option<RawFd>,
    s: &mut EncState,
    items: Vec<Item>,
    streams: usize,
) -> Result<u64, MigrationError> {
    let cpu0 = thread_cpu_secs();
    let shards = s.shards.len().max(1);
    while s.pool.len() < DEPTH * (shards + 2) {
        s.pool.push(Batch::default());
    }
    let result = if ctx.pipeline {
        run_pipelined(ctx, w, sock, s, items, streams)
    } else {
        let mut frames = 0;
        let mut b = s.pool.pop().unwrap_or_default();
        let mut out = Ok(());
        for item in items {
            let shard = shard_of(&item, streams, shards);
            fetch(ctx.regions, &item, &mut b);
            b.shard = shard as u8;
            out = encode(ctx, s.shards[shard].as_mut(), &mut b)
                .and_then(|_| send(ctx, w, sock, &b).map(|f| frames += f));
            if out.is_err() {
                break;
            }
        }
        s.pool.push(b);
        out.map(|_| frames)
    };
    let flushed = w.flush().map_err(ProtocolError::Io);
    ctx.cpu.add(thread_cpu_secs() - cpu0);
    let frames = result?;
    flushed?;
    Ok(frames)
}

fn run_pipelined<W: Write + Send>(
    ctx: &RoundCtx,
    writer: &mut W,
    sock: Option<RawFd>,
    s: &mut EncState,
    items: Vec<Item>,
    streams: usize,
) -> Result<u64, MigrationError> {
    let shards = s.shards.len().max(1);
    let (free_tx, free_rx): (Sender<Batch>, Receiver<Batch>) = channel();
    for b in s.pool.drain(..) {
        let _ = free_tx.send(b);
    }
    let (out_tx, out_rx) = sync_channel::<Result<Batch, MigrationError>>(DEPTH);
    let encoders = &mut s.shards;
    let (result, free_rx) = std::thread::scope(|sc| {
        let mut to_shard: Vec<SyncSender<Batch>> = Vec::new();
        for enc in encoders.iter_mut() {
            let (tx, rx) = sync_channel::<Batch>(DEPTH);
            to_shard.push(tx);
            let out = out_tx.clone();
            sc.spawn(move || {
                let cpu0 = thread_cpu_secs();
                for mut b in rx {
                    let r = encode(ctx, enc.as_mut(), &mut b).map(|_| b);
                    let failed = r.is_err();
                    if out.send(r).is_err() || failed {
                        break;
                    }
                }
                ctx.cpu.add(thread_cpu_secs() - cpu0);
            });
        }
        drop(out_tx);
        let fetcher = sc.spawn(move || {
            let cpu0 = thread_cpu_secs();
            for item in items {
                let Ok(mut b) = free_rx.recv() else { break };
                let shard = shard_of(&item, streams, shards);
                fetch(ctx.regions, &item, &mut b);
                b.shard = shard as u8;
                if to_shard[shard].send(b).is_err() {
                    break;
                }
            }
            ctx.cpu.add(thread_cpu_secs() - cpu0);
            // Dropping the shard senders ends the encoders, then the sender.
            free_rx
        });
        let mut sent = || -> Result<u64, MigrationError> {
            let mut frames = 0;
            for r in out_rx.iter() {
                let b = r?;
                frames += send(ctx, writer, sock, &b)?;
                let _ = free_tx.send(b);
            }
            Ok(frames)
        };
        let result = sent();
        // On an error, stopping here unblocks every stage: encoders find
        // the output gone, the fetcher its encoders or its free list.
        drop(out_rx);
        drop(free_tx);
        (result, fetcher.join().ok())
    });
    // What is left on the free list comes home for the next round.
    if let Some(rx) = free_rx {
        s.pool.extend(rx.try_iter());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_stay_inside_blocks_and_blocks_keep_their_stream() {
        let p = PAGE as u64;
        // Fragmented runs of one block travel as one batch.
        let runs = [(0, 3), (4 * p, 3), (8 * p, 1500), (3000 * p, 10)];
        let dealt = deal(&runs, 2);
        assert_eq!(
            dealt[0],
            vec![
                vec![(0, 3), (4 * p, 3), (8 * p, 1016)],
                vec![(3000 * p, 10)]
            ]
        );
        assert_eq!(dealt[1], vec![vec![(1024 * p, 484)]]);
        // Same page, same stream and shard, whatever run it arrives in.
        let again = deal(&[(1100 * p, 1)], 2);
        assert_eq!(again[1], vec![vec![(1100 * p, 1)]]);
        assert_eq!(
            shard_of(&vec![(1024 * p, 1)], 2, 3),
            shard_of(&vec![(2047 * p, 1)], 2, 3)
        );
        assert_ne!(
            shard_of(&vec![(0, 1)], 1, 2),
            shard_of(&vec![(1024 * p, 1)], 1, 2)
        );
    }
}
