//! The source's one data path, for every mode and codec, one per bulk stream:
//!
//! ```text
//! fetch ──(3 buffers)──▶ encode shard 0..k ──(3 buffers)──▶ send
//! ```
//!
//! Fetch copies a batch of up to 1024 pages out of guest RAM into a
//! [`PageBatch`] (zero pages become ranges), each encoder thread owns one
//! shard's codec state, and send writes the frames, paced by one [`Pacer`].
//! Buffers circulate through a free list, so a round allocates nothing and
//! a slow stage holds the others back by at most three batches. Without
//! the pipeline one thread does the three steps in turn.
//!
//! Raw is this path with the `none` codec: no encoder threads, the frame
//! checksum computed at fetch while each page is hot in cache, and batches
//! taken from one shared queue so a fast stream helps a slow one. With
//! codecs a page always belongs to the same stream and shard (by its
//! 1024-page block), because xbzrle's cache must see every version of a
//! page; per-shard order is kept from encoder to wire, so the destination's
//! mirror decodes in the same order.
//!
//! How a round's runs are cut into batches and dealt to the streams and
//! shards is in `sender/work.rs`; this file holds the sender, the stages
//! and the pipeline that joins them.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Mutex;
use std::time::Instant;

use ferry_codec::{EncodedBatch, Method};

use crate::batch::{Fill, PageBatch};
use crate::compress::{Backend, BatchEncoder, Policy};
use crate::governor::Governor;
use crate::memory::RegionView;
use crate::options::CompressOptions;
use crate::pacer::Pacer;
use crate::protocol::{self, PAGE};
use crate::ranges::{total_pages, GpaPages};
use crate::stats::{secs, thread_cpu_secs, CpuMeter, RoundStats};
use crate::transport::{Conn, ConnWriter};
use crate::{error::MigrationError, protocol::ProtocolError};
use work::{deal, group, pack_items, shard_of, Item, Work};

mod work;

/// Buffers between two stages.
const DEPTH: usize = 3;
/// A round of at most this many pages is sent from the calling thread.
const INLINE_PAGES: u64 = 256;

/// One batch on its way through the stages.
#[derive(Default)]
struct Batch {
    /// The pages read (their data checksummed at fetch on the raw path).
    pages: PageBatch,
    /// The pages' numbers, for the encoders.
    idx: Vec<u64>,
    method: Option<Method>,
    shard: u8,
    enc: EncodedBatch,
}

/// A bulk stream's encoder shards and buffers, kept across rounds (the
/// caches must be).
struct StreamState {
    shards: Vec<Box<dyn BatchEncoder>>,
    pool: Vec<Batch>,
}

/// What every stream of a round shares.
struct RoundCtx<'a> {
    regions: &'a [RegionView],
    round: u32,
    /// Set in the stop-and-copy: the bytes it has to move.
    final_bytes: Option<u64>,
    policy: &'a Policy,
    pipeline: bool,
    /// Checksum page data at fetch (raw path).
    crc_at_fetch: bool,
    /// Pages frames go sealed, without a checksum: every bulk link seals
    /// its bytes (TLS) and the peer reads sealed frames (v10).
    sealed: bool,
    pacer: Pacer,
    /// `--share-link`: steers each stream's packet pacing by its queue.
    governor: Option<&'a Governor>,
    /// Each stream's share of `--bandwidth` (bytes/s), if limited.
    fixed_share: Option<u64>,
    cpu: &'a CpuMeter,
    pages: AtomicU64,
    zero: AtomicU64,
    bytes: AtomicU64,
    /// Page bytes that went through an encoder, and what they became.
    encoded_in: AtomicU64,
    encoded_out: AtomicU64,
    /// Where pages sent are counted live.
    tel: Option<&'a crate::telemetry::Telemetry>,
    /// Where each page's hash goes as it is sent (a verified migration).
    hashes: Option<&'a crate::verify::PageHashes>,
    /// What the destination's host holds: such pages go by reference
    /// (never in the last round, which has no round after it to resend a
    /// miss in).
    shared: Option<&'a std::sync::Arc<crate::shared::Offer>>,
    /// Pages sent by reference.
    refs: AtomicU64,
    /// What each page last went as: a page dirtied without a change is
    /// left out (precopy's rounds).
    sent: Option<&'a std::sync::Arc<crate::unchanged::SentContent>>,
    /// Pages left out so.
    unchanged: AtomicU64,
}

/// The sending side of the bulk streams, kept for a whole migration.
pub(crate) struct PageSender {
    streams: Vec<StreamState>,
    policy: Policy,
    compressed: bool,
    pipeline: bool,
    bandwidth: Option<f64>,
    tel: Option<std::sync::Arc<crate::telemetry::Telemetry>>,
    /// The peer reads sealed Pages frames (protocol v10).
    may_seal: bool,
    /// Each page's hash as it was sent (a verified precopy, v12).
    hashes: Option<std::sync::Arc<crate::verify::PageHashes>>,
    /// The destination's offer of its host's pages (v14), if not empty.
    shared: Option<std::sync::Arc<crate::shared::Offer>>,
    /// Pages sent by reference, over the whole migration.
    refs_sent: u64,
    /// `--share-link`: the streams yield to the VM's own traffic.
    governor: Option<Governor>,
    /// What each page last went as (see [`crate::unchanged`]).
    sent: Option<std::sync::Arc<crate::unchanged::SentContent>>,
}

impl PageSender {
    /// A sender for `streams` bulk streams. With `compressed`, each stream
    /// gets the backend's encoders and `auto` calibrates on `sample`.
    pub(crate) fn new(
        copt: &CompressOptions,
        backend: &Backend,
        compressed: bool,
        streams: usize,
        bandwidth: Option<f64>,
        sample: &[u8],
    ) -> Self {
        let shards = if compressed {
            copt.workers.clamp(1, crate::encoded::MAX_SHARDS) as usize
        } else {
            0
        };
        let raw = CompressOptions::default();
        PageSender {
            streams: (0..streams)
                .map(|_| StreamState {
                    shards: (0..shards).map(|_| (backend.make)(copt.caches)).collect(),
                    pool: Vec::new(),
                })
                .collect(),
            policy: Policy::new(if compressed { copt } else { &raw }, bandwidth, sample),
            compressed,
            pipeline: compressed && copt.pipeline,
            bandwidth,
            tel: None,
            may_seal: false,
            hashes: None,
            shared: None,
            refs_sent: 0,
            governor: None,
            sent: None,
        }
    }

    /// Leaves out of every round the pages whose bytes are those last sent
    /// there, keeping what each page went as in `sent` (None: every dirty
    /// page goes).
    pub(crate) fn skipping_unchanged(
        mut self,
        sent: Option<std::sync::Arc<crate::unchanged::SentContent>>,
    ) -> Self {
        self.sent = sent;
        self
    }

    /// Paces the streams by the queue they find at the bottleneck
    /// (`--share-link`, see [`crate::governor`]), if `on`.
    pub(crate) fn sharing_link(mut self, on: bool) -> Self {
        self.governor = on.then(|| Governor::new(self.streams.len()));
        self
    }

    /// Sends the pages `offer` holds by reference, in every round but the
    /// last (an empty offer changes nothing).
    pub(crate) fn sharing(mut self, offer: Option<std::sync::Arc<crate::shared::Offer>>) -> Self {
        self.shared = offer.filter(|o| o.len() > 0);
        self
    }

    /// Pages sent by reference so far.
    pub(crate) fn refs_sent(&self) -> u64 {
        self.refs_sent
    }

    /// Records each page's hash in `hashes` as it is sent (and zero runs
    /// and holes as zero pages).
    pub(crate) fn hashing(
        mut self,
        hashes: Option<std::sync::Arc<crate::verify::PageHashes>>,
    ) -> Self {
        self.hashes = hashes;
        self
    }

    /// Sends Pages frames sealed (no checksum) on links that seal every
    /// byte, if `peer_reads_them` (the negotiated version has them).
    pub(crate) fn sealing(mut self, peer_reads_them: bool) -> Self {
        self.may_seal = peer_reads_them;
        self
    }

    /// Counts the pages it sends in `tel` as they go.
    pub(crate) fn watched_by(mut self, tel: std::sync::Arc<crate::telemetry::Telemetry>) -> Self {
        self.tel = Some(tel);
        self
    }

    /// The codec policy (its summary and link estimate go in the stats).
    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Sends `runs` (and the known-zero `holes`, unread, first on stream 0)
    /// over the bulk connections; returns the round's figures and the frames
    /// each stream carried.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_round(
        &mut self,
        regions: &[RegionView],
        conns: &mut [Conn],
        runs: &[GpaPages],
        holes: &[GpaPages],
        round: u32,
        final_bytes: Option<u64>,
        cpu: &CpuMeter,
    ) -> Result<(RoundStats, Vec<u64>), MigrationError> {
        let t0 = Instant::now();
        // Under a bandwidth limit the kernel also paces each stream's
        // packets at its share of it: the sender's own pacer keeps the
        // average, but it lets each batch go as one burst at the sender's
        // line rate, which sits in the bottleneck's queue ahead of the VM's
        // own traffic (kv clients saw their requests wait ~2 ms behind it).
        let fixed_share = crate::pacer::stream_share(self.bandwidth, conns.len());
        // The last round runs in the pause: no guest traffic to leave room
        // for, so the governor's cap comes off (a limit stays; the kernel
        // keeps pacing a socket once capped, at TCP's own rate). A governed
        // round starts from the caps its streams have.
        let governed = self.governor.as_ref().filter(|_| final_bytes.is_none());
        if governed.is_none() || fixed_share.is_some() {
            conns
                .iter_mut()
                .for_each(|c| c.writer().pace_packets(fixed_share));
        }
        let (hole_frames, hole_bytes) = protocol::write_holes(conns[0].writer(), holes)?;
        if let Some(h) = &self.hashes {
            holes.iter().for_each(|&run| h.set_zero(run));
        }
        // (A hole goes as zeros without being read: its key is unknown.)
        if let Some(sent) = &self.sent {
            sent.forget_runs(holes);
        }
        // A round this small (an idle VM's stop-and-copy) goes out from this
        // thread, stream after stream: starting threads would cost more than
        // sending it, and in the pause every microsecond counts. Its CPU is
        // then this thread's, which the session counts already.
        let inline = total_pages(runs) <= INLINE_PAGES;
        let counted_by_caller = CpuMeter::default();
        let ctx = RoundCtx {
            regions,
            round,
            final_bytes,
            policy: &self.policy,
            pipeline: self.pipeline,
            crc_at_fetch: !self.compressed,
            sealed: self.may_seal && conns.iter().all(|c| c.writer_seals()),
            pacer: Pacer::new(self.bandwidth),
            governor: governed,
            fixed_share,
            cpu: if inline { &counted_by_caller } else { cpu },
            pages: AtomicU64::new(0),
            zero: AtomicU64::new(0),
            bytes: AtomicU64::new(hole_bytes),
            encoded_in: AtomicU64::new(0),
            encoded_out: AtomicU64::new(0),
            tel: self.tel.as_deref(),
            hashes: self.hashes.as_deref(),
            shared: self.shared.as_ref().filter(|_| final_bytes.is_none()),
            refs: AtomicU64::new(0),
            sent: self.sent.as_ref(),
            unchanged: AtomicU64::new(0),
        };
        let n = conns.len();
        // The stop-and-copy's pages are often scattered (a page or two per
        // block): there each batch packs as many blocks as fit, since every
        // batch costs a record and a send of its own (15-60 µs here) and
        // the pause waits for them all.
        let shards = self.streams.first().map_or(1, |s| s.shards.len());
        let pack = |items: Vec<Item>| match final_bytes {
            Some(_) => pack_items(items, n, shards),
            None => items,
        };
        let work = if self.compressed {
            Work::Dealt(
                deal(runs, n)
                    .into_iter()
                    .map(|d| Mutex::new(pack(d).into_iter()))
                    .collect(),
            )
        } else {
            Work::Shared(Mutex::new(pack(group(runs)).into_iter()))
        };
        let results: Vec<Result<u64, MigrationError>> = if inline {
            conns
                .iter_mut()
                .zip(self.streams.iter_mut())
                .enumerate()
                .map(|(i, (conn, st))| run_stream(&ctx, conn.writer(), st, &work, i, n))
                .collect()
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = conns
                    .iter_mut()
                    .zip(self.streams.iter_mut())
                    .enumerate()
                    .map(|(i, (conn, st))| {
                        let (ctx, work) = (&ctx, &work);
                        s.spawn(move || run_stream(ctx, conn.writer(), st, work, i, n))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Ok(0)))
                    .collect()
            })
        };
        let mut frames = Vec::with_capacity(n);
        for (i, r) in results.into_iter().enumerate() {
            frames.push(r.map_err(|e| MigrationError::Stream {
                stream: i as u16,
                source: Box::new(e),
            })?);
        }
        frames[0] += hole_frames;
        let elapsed = secs(t0.elapsed()).max(1e-9);
        let bytes = ctx.bytes.load(Ordering::Relaxed);
        let encoded_in = ctx.encoded_in.load(Ordering::Relaxed);
        self.refs_sent += ctx.refs.load(Ordering::Relaxed);
        self.policy
            .observe_round(bytes as f64 / elapsed, elapsed, encoded_in == 0);
        Ok((
            RoundStats {
                round,
                pages: ctx.pages.load(Ordering::Relaxed),
                zero_pages: ctx.zero.load(Ordering::Relaxed) + total_pages(holes),
                bytes,
                secs: elapsed,
                throughput: bytes as f64 / elapsed,
                dirty_rate: 0.0,
                throttle_pct: 0,
                encoded_in,
                encoded_out: ctx.encoded_out.load(Ordering::Relaxed),
                unchanged_pages: ctx.unchanged.load(Ordering::Relaxed),
            },
            frames,
        ))
    }
}

/// Copies the batch's pages out of guest RAM; zero pages become ranges.
fn fetch(ctx: &RoundCtx, item: &Item, b: &mut Batch) {
    b.enc.clear();
    b.method = None;
    let how = match (ctx.crc_at_fetch, ctx.sealed) {
        (false, _) => Fill::ENCODE,
        (true, true) => Fill::SEALED,
        (true, false) => Fill::RAW,
    };
    b.pages.hash_pages(ctx.hashes.is_some());
    b.pages.share_with(ctx.shared);
    b.pages.skip_unchanged(ctx.sent);
    b.pages.fill_from(ctx.regions, item, how);
    if let Some(h) = ctx.hashes {
        for (&gpa, &hash) in b.pages.gpas().iter().zip(b.pages.hashes()) {
            h.set(gpa, hash);
        }
        let (refs, hashes) = b.pages.refs();
        for (r, &hash) in refs.iter().zip(hashes) {
            h.set(r.gpa, hash);
        }
        b.pages.zeros().iter().for_each(|&run| h.set_zero(run));
    }
    b.idx.clear();
    if !ctx.crc_at_fetch {
        // Only encoders read the page numbers (raw has none).
        b.idx
            .extend(b.pages.gpas().iter().map(|gpa| gpa / PAGE as u64));
    }
}

fn encode(
    ctx: &RoundCtx,
    enc: Option<&mut Box<dyn BatchEncoder>>,
    b: &mut Batch,
) -> Result<(), MigrationError> {
    let data = b.pages.data();
    if data.is_empty() {
        return Ok(()); // only zero pages: ranges, nothing to encode
    }
    let method = ctx
        .policy
        .choose(ctx.round, ctx.final_bytes, data.len() as u64);
    b.method = Some(method);
    if method == Method::None {
        return Ok(());
    }
    let enc = enc.ok_or_else(|| {
        MigrationError::Unsupported(format!("{method} chosen on a stream without encoders"))
    })?;
    let t = Instant::now();
    enc.encode(method, &b.idx, data, &mut b.enc)
        .map_err(MigrationError::Codec)?;
    let wire = b.enc.payload.len() + 13 * b.pages.gpas().len();
    ctx.policy
        .observe_encode(method, data.len() as u64, wire as u64, secs(t.elapsed()));
    Ok(())
}

/// Writes a batch's frames; returns how many. The writer also tells the
/// kernel's delivery rate while the policy probes (TCP only).
fn send(ctx: &RoundCtx, w: &mut ConnWriter, b: &mut Batch) -> Result<u64, MigrationError> {
    let mut frames = 0;
    let mut bytes = 0u64;
    let p = &mut b.pages;
    if p.zero_pages() > 0 {
        bytes += p.write_zeros(w)?;
        ctx.zero.fetch_add(p.zero_pages(), Ordering::Relaxed);
        frames += 1;
    }
    let refs = p.refs().0.len() as u64;
    if refs > 0 {
        bytes += p.write_refs(w)?;
        ctx.refs.fetch_add(refs, Ordering::Relaxed);
        frames += 1;
    }
    if p.pages() > 0 {
        match b.method.unwrap_or(Method::None) {
            Method::None => {
                // The pages are not read again: a link that seals may
                // seal them where they lie.
                let n = p
                    .write_pages_spending(w, ctx.sealed)
                    .map_err(ProtocolError::Io)?;
                bytes += n;
                // Only `auto` probes the link (a getsockopt per batch).
                if !ctx.crc_at_fetch {
                    ctx.policy.observe_raw_sent(n, w.delivery_rate());
                }
            }
            m => {
                let n = crate::encoded::write_encoded(w, m, b.shard, p.gpas(), &b.enc)
                    .map_err(ProtocolError::Io)?;
                bytes += n;
                ctx.encoded_in
                    .fetch_add(p.data().len() as u64, Ordering::Relaxed);
                ctx.encoded_out.fetch_add(n, Ordering::Relaxed);
            }
        }
        ctx.pages.fetch_add(p.pages(), Ordering::Relaxed);
        frames += 1;
    }
    let unchanged = p.unchanged_pages();
    ctx.unchanged.fetch_add(unchanged, Ordering::Relaxed);
    if let Some(t) = ctx.tel {
        t.add_pages(p.pages() + p.zero_pages() + refs + unchanged);
    }
    let sent = ctx.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
    ctx.pacer.pace(sent, w).map_err(ProtocolError::Io)?;
    if let Some(g) = ctx.governor {
        w.steer(g, bytes, ctx.fixed_share);
    }
    Ok(frames)
}

/// Sends one stream's share of a round; returns the frames it wrote.
fn run_stream(
    ctx: &RoundCtx,
    w: &mut ConnWriter,
    s: &mut StreamState,
    work: &Work,
    stream: usize,
    streams: usize,
) -> Result<u64, MigrationError> {
    let cpu0 = thread_cpu_secs();
    let shards = s.shards.len().max(1);
    while s.pool.len() < DEPTH * (shards + 2) {
        s.pool.push(Batch::default());
    }
    let result = if ctx.pipeline {
        run_pipelined(ctx, w, s, work, stream, streams)
    } else {
        let mut frames = 0;
        let mut b = s.pool.pop().unwrap_or_default();
        let mut out = Ok(());
        while let Some(item) = work.next(stream) {
            let shard = shard_of(&item, streams, shards);
            fetch(ctx, &item, &mut b);
            b.shard = shard as u8;
            out = encode(ctx, s.shards.get_mut(shard), &mut b)
                .and_then(|_| send(ctx, w, &mut b).map(|f| frames += f));
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

fn run_pipelined(
    ctx: &RoundCtx,
    writer: &mut ConnWriter,
    s: &mut StreamState,
    work: &Work,
    stream: usize,
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
                    let r = encode(ctx, Some(&mut *enc), &mut b).map(|_| b);
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
            while let Some(item) = work.next(stream) {
                let Ok(mut b) = free_rx.recv() else { break };
                let shard = shard_of(&item, streams, shards);
                fetch(ctx, &item, &mut b);
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
                let mut b = r?;
                frames += send(ctx, writer, &mut b)?;
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
mod tests;
