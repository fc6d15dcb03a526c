//! Precopy: copy all memory while the guest runs, then the pages it dirtied,
//! round after round, until the rest fits the downtime target at the
//! measured bandwidth (throttling a guest that outruns the link); then
//! pause, send the rest, and let the session finish (state, verify,
//! Complete). The destination side has no phases of its own beyond the
//! session's round barriers.
//!
//! The round loop serves every copy mode through its [`Rounds`] hooks
//! (hybrid, split and gather live in their own files); [`Precopy`] is the
//! mode with none but its answers. The loop ends converged (this file
//! stops and copies) or handed over to the mode (hybrid's switch).

use crate::compress::Backend;
use crate::dirty::{dirty_runs, first_round, sample_pages};
use crate::encoded::CodecSetup;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::mode::SourceMode;
use crate::paused::Outcome;
use crate::protocol::Kind;
use crate::ranges::{
    subtract_runs, total_pages, union_runs, GpaBytes, GpaPages, OffsetBytes, PAGE,
};
use crate::sender::PageSender;
use crate::session::{SourcePhase, SourceSession};
use crate::stats::{secs, MigrationStats, Phase, Progress, RoundStats};

/// Bytes on the wire per page besides its payload (its address).
const PAGE_META: u64 = 8;
/// A round shorter than this (s) does not measure the link's rate.
const RATE_ROUND_SECS: f64 = 0.1;

/// Sends one round's pages to the destination over the bulk streams: runs,
/// then known-zero holes; returns the round's figures and each stream's
/// frame count (for the barrier).
pub(crate) type SendRound<'s> =
    dyn FnMut(&[GpaPages], &[GpaPages]) -> Result<(RoundStats, Vec<u64>), MigrationError> + 's;

/// What a copy mode adds to the round loop. The defaults are plain
/// precopy's but for the answers that save work: a mode opts in to those.
pub(crate) trait Rounds {
    /// Once the session is open, before the bulk streams (split places
    /// its chunks; hybrid checks the destination can take its switch).
    fn begin(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Once the bulk streams are open, before round 0 (gather waits for
    /// the destination to pull the memory servers' part).
    fn streams_open(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Whether every page sent lands in the destination's memory (not
    /// split's or gather's): then a page unchanged since it went need not
    /// go again, and a hole the VMM wrote here is zero there already.
    fn sends_in_place(&self) -> bool {
        false
    }

    /// Whether Complete commits nothing elsewhere (split's stores,
    /// gather's pager): then the state may go before the last round (v15)
    /// and the last round's ack be read after Complete.
    fn commits_nothing_at_complete(&self) -> bool {
        false
    }

    /// Round 0's known-zero ranges, as this mode sends them (gather: only
    /// the main host's own).
    fn holes(&self, holes: Vec<GpaPages>) -> Vec<GpaPages> {
        holes
    }

    /// Sends a round; `send` takes pages to the destination (split sends
    /// each memory server its chunks beside it).
    fn send_round(
        &mut self,
        _regions: &[RegionView],
        runs: &[GpaPages],
        holes: &[GpaPages],
        send: &mut SendRound<'_>,
    ) -> Result<(RoundStats, Vec<u64>), MigrationError> {
        send(runs, holes)
    }

    /// After a dirty round that left `dirty` pages, unconverged: why the
    /// mode takes over now (hybrid's switch), as the convergence note.
    fn hand_over_due(&self, _s: &SourceSession, _rounds_done: u32, _dirty: u64) -> Option<String> {
        None
    }

    /// The rounds ended because [`Rounds::hand_over_due`] said so: the
    /// mode takes the migration from here, the VM still running.
    fn hand_over(
        &mut self,
        _s: &mut SourceSession,
        _h: HandOver,
        _progress: &dyn Fn(&Progress),
    ) -> Result<Outcome, MigrationError> {
        Err(MigrationError::Internal("nothing takes over".into()))
    }

    /// The per-page hashes for Verify where this side's memory does not
    /// hold every page (gather); None: hash memory.
    fn hashes(&self, _s: &SourceSession) -> Option<Result<Vec<u64>, MigrationError>> {
        None
    }

    /// Complete is about to go out: keep what the destination will use
    /// and record the mode's figures.
    fn commit(&mut self, _stats: &mut MigrationStats) {}
}

/// Every copy mode runs the round loop.
impl<R: Rounds> SourceMode for R {
    fn run(
        &mut self,
        s: &mut SourceSession,
        backend: &Backend,
        progress: &dyn Fn(&Progress),
    ) -> Result<Outcome, MigrationError> {
        let c = open(s, backend, self)?;
        match rounds(s, c, progress, self)? {
            RoundsEnd::Converged(mut c) => {
                last_round(s, &mut c, progress, self)?;
                finish(s, c, progress, self)
            }
            RoundsEnd::HandOver(h) => self.hand_over(s, h, progress),
        }
    }
}

/// Plain precopy: the round loop with no hooks but its answers.
pub(crate) struct Precopy;

impl Rounds for Precopy {
    fn sends_in_place(&self) -> bool {
        true
    }

    fn commits_nothing_at_complete(&self) -> bool {
        true
    }
}

/// How the round loop ended (the convergence note says why).
enum RoundsEnd {
    /// What is left fits the downtime, or the rounds ran out: stop and copy.
    Converged(Copying),
    /// The mode ended the rounds unconverged and takes over.
    HandOver(HandOver),
}

/// What the rounds carry from piece to piece of the run.
struct Copying {
    stats: MigrationStats,
    sender: PageSender,
    compressed: bool,
    /// The pages dirtied since they last went.
    runs: Vec<GpaPages>,
    /// The next round's number.
    round: u32,
    /// The vCPU time auto-converge takes away (%).
    throttle: u32,
    /// The link's rate, from the latest round long enough to measure it: a
    /// short round's pages fit the socket buffers and read as several times
    /// the link (1.5 GB/s on a 1 Gbit link; 0.17 GB/s for 60 ms), which made
    /// a remainder seem to fit the downtime when it took twice as long.
    bandwidth: f64,
}

impl Copying {
    /// Where the migration stands, for the caller.
    fn progress(&self, phase: Phase, remaining_pages: u64, throughput: f64) -> Progress {
        Progress {
            round: self.round,
            remaining_pages,
            throughput,
            bytes: self.stats.bytes,
            phase,
            ..Default::default()
        }
    }
}

/// Where the rounds stopped unconverged, for the mode that takes over.
pub(crate) struct HandOver {
    /// The pages dirtied since they last went (the VM still runs).
    pub(crate) runs: Vec<GpaPages>,
    /// The round that would have come next.
    pub(crate) round: u32,
    c: Copying,
}

impl HandOver {
    /// Pauses the VM and returns every page not sent since (all the VMM
    /// wrote, holes too), with the figures so far: the pause's part
    /// counted, the throttle lifted, the encoding's figures added.
    pub(crate) fn pause(
        self,
        s: &mut SourceSession,
    ) -> Result<(Vec<GpaPages>, MigrationStats), MigrationError> {
        let mut c = self.c;
        let (last, _) = pause(s, &mut c.stats, self.runs, false)?;
        let _ = s.vm().throttle(0);
        c.stats.downtime_parts.last_round = s.lap_ms();
        add_encoding(&mut c.stats, &c.sender, c.compressed);
        Ok((last, c.stats))
    }
}

/// Opens the session and the bulk streams, and sets up the sender.
fn open<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    backend: &Backend,
    mode: &mut M,
) -> Result<Copying, MigrationError> {
    let opts = s.opts();
    let copt = &opts.compression;
    s.open()?;
    mode.begin(s)?;
    let compressed = copt.enabled() && s.caps().compressed_streams();
    let mut stats = MigrationStats {
        mode: opts.mode,
        ..Default::default()
    };
    stats.compression.asked = copt.compress.to_string();
    stats.compression.pipeline = compressed && copt.pipeline;
    stats.compression.backend = backend.name.clone();
    stats.compression.backend_note = backend.note.clone();
    if copt.enabled() && !compressed {
        stats.compression.note = Some(format!(
            "the destination speaks protocol v{}, compression needs v2: sent raw",
            s.caps().version()
        ));
    }
    let setup = compressed.then(|| CodecSetup {
        xbzrle_bytes: copt.caches.xbzrle_bytes,
        dedup_bytes: copt.caches.dedup_bytes,
        shards: copt.workers.clamp(1, crate::encoded::MAX_SHARDS),
    });
    s.open_bulk(setup.as_ref())?;
    mode.streams_open(s)?;
    let vm = s.vm();
    let sample = if compressed {
        sample_pages(s.regions(), |i| vm.data_ranges(i), 256)
    } else {
        Vec::new()
    };
    let sender = PageSender::new(
        copt,
        backend,
        compressed,
        s.streams(),
        opts.bandwidth,
        &sample,
    )
    .sharing_link(opts.share_link)
    .watched_by(s.tel().clone())
    .sealing(s.caps().sealed_pages())
    .hashing(s.sent_hashes().cloned())
    .sharing(s.shared().cloned())
    // Split and gather send pages elsewhere than the destination's memory:
    // only a copy mode's rounds (hybrid's before it switches) know what
    // lies there.
    .skipping_unchanged(
        mode.sends_in_place()
            .then(|| std::sync::Arc::new(crate::unchanged::SentContent::new(s.regions()))),
    );
    Ok(Copying {
        stats,
        sender,
        compressed,
        runs: Vec::new(),
        round: 0,
        throttle: 0,
        bandwidth: 0.0,
    })
}

/// Copies round after round, from the full copy on, until what is left
/// fits the downtime, the rounds run out, or the mode takes over.
fn rounds<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    mut c: Copying,
    progress: &dyn Fn(&Progress),
    mode: &mut M,
) -> Result<RoundsEnd, MigrationError> {
    let (opts, vm) = (s.opts(), s.vm());
    s.start_dirty_log()?;
    let (runs, holes) = first_round(s.regions(), |i| vm.data_ranges(i));
    c.runs = runs;
    let mut holes = mode.holes(holes);
    let hand_over = loop {
        let dirty = round(s, &mut c, &holes, progress, mode)?;
        holes.clear();
        let expected_ms = (dirty * (PAGE + PAGE_META)) as f64 / c.bandwidth * 1e3;
        if expected_ms <= opts.downtime_ms {
            c.stats.converged =
                format!("remainder of {dirty} pages fits {:.1} ms", opts.downtime_ms);
            break false;
        }
        if let Some(why) = mode.hand_over_due(s, c.round, dirty) {
            c.stats.converged = why;
            break true;
        }
        if c.round > opts.max_rounds {
            c.stats.converged = format!(
                "max rounds ({}) reached with {dirty} pages dirty",
                opts.max_rounds
            );
            break false;
        }
    };
    tracing::info!(rounds = c.round, converged = %c.stats.converged, "precopy converged");
    Ok(if hand_over {
        let (runs, round) = (std::mem::take(&mut c.runs), c.round);
        RoundsEnd::HandOver(HandOver { runs, round, c })
    } else {
        RoundsEnd::Converged(c)
    })
}

/// Sends a round (`c.runs`; `holes` as known zeros), reads what the guest
/// dirtied meanwhile into `c.runs`, and measures; returns the dirty pages.
fn round<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    c: &mut Copying,
    holes: &[GpaPages],
    progress: &dyn Fn(&Progress),
    mode: &mut M,
) -> Result<u64, MigrationError> {
    let round = c.round;
    s.tel().round_began(round, total_pages(&c.runs));
    progress(&c.progress(Phase::Copy, total_pages(&c.runs), 0.0));
    let (mut rs, frames) = {
        let (regions, bulk, cpu) = s.sending_parts();
        let mut send = |runs: &[GpaPages], holes: &[GpaPages]| {
            c.sender
                .send_round(regions, bulk, runs, holes, round, None, cpu)
        };
        mode.send_round(regions, &c.runs, holes, &mut send)?
    };
    s.barrier(round, frames)?;
    let bitmaps = s.take_dirty()?;
    let (mut next, mut dirty) = dirty_runs(s.regions(), &bitmaps);
    let missed = s.take_missed();
    if !missed.is_empty() {
        // References the destination could not resolve go again, as data.
        if let Some(offer) = s.shared() {
            offer.withdraw(&missed);
        }
        c.stats.shared_missed += total_pages(&missed);
        next = union_runs(next.into_iter().chain(missed));
        dirty = total_pages(&next);
    }
    rs.dirty_rate = (dirty * PAGE) as f64 / rs.secs;
    rs.throttle_pct = c.throttle;
    if rs.secs >= RATE_ROUND_SECS || c.bandwidth == 0.0 {
        c.bandwidth = rs.throughput.max(1.0);
    }
    tracing::debug!(round, pages = rs.pages, dirty, secs = rs.secs, "round sent");
    // Auto-converge (after the full copy): when the guest dirtied more than
    // half of what the round could send and, at that ratio, the rounds left
    // would not bring it under the downtime, take away more vCPU time, 20%
    // at first, then 10% more each round, up to 99%. Only what the guest
    // changes costs the link: a dirty page whose bytes are those last sent
    // costs a hash (a kv store's reads dirty ~90% of its pages so), and
    // counting it would throttle a guest the rounds keep up with.
    let changed = changed_share(&rs);
    let (opts, vm) = (s.opts(), s.vm());
    let tuning = &opts.auto_converge_tuning;
    let fits_pause = (opts.downtime_ms / 1e3 * c.bandwidth / (PAGE + PAGE_META) as f64) as u64;
    let rounds_left = opts.max_rounds.saturating_sub(round);
    if opts.auto_converge
        && round >= 1
        && tuning.triggered(
            rs.dirty_rate * changed,
            rs.throughput,
            (dirty as f64 * changed).ceil() as u64,
            fits_pause,
            rounds_left,
        )
    {
        c.throttle = tuning.next(c.throttle);
        vm.throttle(c.throttle)
            .map_err(MigrationError::vm("throttle"))?;
        tracing::info!(throttle = c.throttle, "auto-converge throttles the vCPUs");
    }
    s.tel().set_dirty(rs.dirty_rate, c.throttle);
    add_round(&mut c.stats, rs);
    c.runs = next;
    c.round += 1;
    Ok(dirty)
}

/// Pauses the VM and reads what is left to send: `runs`, the dirty log's
/// last read, and what the VMM wrote itself (the service ring); with
/// `written_holes`, the written pages that are holes here come apart.
fn pause(
    s: &mut SourceSession,
    stats: &mut MigrationStats,
    runs: Vec<GpaPages>,
    written_holes: bool,
) -> Result<(Vec<GpaPages>, Vec<GpaPages>), MigrationError> {
    s.pause()?;
    stats.downtime_parts.pause = s.lap_ms();
    let bitmaps = s.take_dirty()?;
    let (mut last, _) = dirty_runs(s.regions(), &bitmaps);
    last.extend(runs);
    // Reading a hole allocates it (about 10 µs a page on these machines,
    // 5 ms for a mostly empty 2 MiB ring), and a hole at the source is
    // zero at the destination already where the pages land in place.
    // Split, gather and a mode taking over keep every written page.
    let written = s.vm().host_written_ranges();
    let (written, holes) = if written_holes {
        split_holes(s.regions(), s.vm(), &written)
    } else {
        (written.iter().map(GpaBytes::pages).collect(), Vec::new())
    };
    last.extend(written);
    let last: Vec<GpaPages> = union_runs(last);
    // Pages dirtied by the guest hold data: a hole left is one nobody wrote.
    let holes = subtract_runs(&holes, &last);
    Ok((last, holes))
}

/// Stops and copies: pauses the VM, sends the state (first, from v15),
/// the last round, and the state (after it, before v15).
fn last_round<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    c: &mut Copying,
    progress: &dyn Fn(&Progress),
    mode: &mut M,
) -> Result<(), MigrationError> {
    let runs = std::mem::take(&mut c.runs);
    let (last, written_holes) = pause(s, &mut c.stats, runs, mode.sends_in_place())?;
    // From v15 the state goes first, so the destination restores it
    // while the last round arrives; a copy mode that commits elsewhere at
    // Complete (split, gather) keeps the old order.
    let state_first = s.caps().early_state() && mode.commits_nothing_at_complete();
    if state_first {
        send_state(s, &mut c.stats)?;
        if s.send_clients_early()? {
            c.stats.downtime_parts.clients = s.lap_ms();
        }
        s.ctl()?.flush()?;
    }
    let (round, remaining) = (c.round, total_pages(&last));
    s.tel().round_began(round, remaining);
    progress(&c.progress(Phase::StopAndCopy, remaining, c.bandwidth));
    let (rs, frames) = {
        let (regions, bulk, cpu) = s.sending_parts();
        let mut send = |runs: &[GpaPages], holes: &[GpaPages]| {
            let bytes = Some(total_pages(runs) * PAGE);
            c.sender
                .send_round(regions, bulk, runs, holes, round, bytes, cpu)
        };
        mode.send_round(regions, &last, &written_holes, &mut send)?
    };
    // The last round's ack is read after Complete went out (a round trip
    // less in the pause), except by a copy mode that commits state
    // elsewhere at Complete (split's stores, gather's pager): its last round
    // must be known applied before it commits.
    if mode.commits_nothing_at_complete() {
        s.last_round_done(round, frames)?;
    } else {
        s.barrier(round, frames)?;
    }
    add_round(&mut c.stats, rs);
    c.stats.downtime_parts.last_round = s.lap_ms();
    // (Saving the state on a thread of its own while the last round went
    // out was tried: on 2 cores it made the pause longer, 1.55 ms against
    // 1.29 for an idle 1 GiB VM.)
    if !state_first {
        send_state(s, &mut c.stats)?;
    }
    Ok(())
}

/// Verifies where asked (in the pause), commits, sends Complete (the VM
/// starts there) and counts the figures; then checks this side's memory
/// against what was sent, where hashed.
fn finish<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    mut c: Copying,
    progress: &dyn Fn(&Progress),
    mode: &mut M,
) -> Result<Outcome, MigrationError> {
    if s.opts().verify {
        if s.sent_hashes().is_none() {
            s.relax(); // hashes all of memory (here or in the mode)
        }
        progress(&c.progress(Phase::Verify, 0, c.bandwidth));
        let (pages, bytes) = match (s.sent_hashes(), mode.hashes(s)) {
            // What was sent against what landed, by digest; memory itself
            // is checked once the VM runs there (`finish`).
            (Some(sent), _) => {
                let body = postcard::to_stdvec(&sent.digests())
                    .map_err(|e| MigrationError::Internal(e.to_string()))?;
                s.ctl()?.send_frame(Kind::VerifyDigests, &body)?;
                (0, (crate::protocol::HEADER + body.len()) as u64)
            }
            (None, Some(hashes)) => {
                let hashes = hashes?;
                (hashes.len() as u64, s.send_hashes(&hashes)?)
            }
            (None, None) => s.send_verify()?,
        };
        c.stats.verified_pages = pages;
        c.stats.bytes += bytes;
    }
    c.stats.downtime_parts.verify = s.lap_ms();
    mode.commit(&mut c.stats);
    let report = s.complete(SourcePhase::Done)?;
    let ms = s.lap_ms();
    s.note_started(&mut c.stats, &report, ms);
    // Outside the downtime: the log was read for the last time in the
    // pause, and a VM that never runs here again needs it off only to free
    // its bitmaps (switching it off rewrites the memory slots). The move
    // has succeeded: a failure here is only logged.
    if let Err(e) = s.stop_dirty_log() {
        tracing::warn!(error = %e, "the VM moved; stopping its dirty log here failed");
    }
    c.stats.destination_cpu_s = report.cpu_s;
    add_encoding(&mut c.stats, &c.sender, c.compressed);
    c.stats.source_cpu_s = s.cpu_secs();
    c.stats.downtime_ms = s.downtime_ms();
    if let Some(sent) = s.sent_hashes().cloned() {
        // This side's memory has not changed since the pause: each page
        // must still be what it last sent. The VM already runs there, so
        // this costs no downtime.
        let t = std::time::Instant::now();
        let checked = sent.check_memory(s.regions(), |i| s.vm().data_ranges(i));
        c.stats.verify_after_ms = t.elapsed().as_secs_f64() * 1e3;
        c.stats.verified_pages = checked.map_err(|m| MigrationError::VerifyAfterSwitch {
            bad: m.bad,
            total: m.total,
            first: m.first,
        })?;
    }
    c.stats.total_secs = secs(s.started_at().elapsed());
    // With the destination's service: clients that stay are forwarded
    // from now on, not after the destination's timeline came back.
    progress(&Progress {
        destination_service: c.stats.destination_service.clone(),
        ..c.progress(Phase::Done, 0, c.bandwidth)
    });
    Ok(Outcome::Done(c.stats))
}

/// Sends the VM's state and counts it: its bytes, and its part of the
/// downtime (the lap since the previous part).
fn send_state(s: &mut SourceSession, stats: &mut MigrationStats) -> Result<(), MigrationError> {
    stats.state_bytes = s.send_state()?;
    stats.bytes += crate::protocol::HEADER as u64 + stats.state_bytes;
    stats.downtime_parts.save_state = s.lap_ms();
    Ok(())
}

/// Splits `ranges` (what the VMM wrote itself) into the pages that hold
/// data and the holes, asking the VM about those windows alone. A range
/// outside guest RAM is kept whole, as data (the sink refuses it, as before).
fn split_holes<V: crate::vm::MigratableVm + ?Sized>(
    regions: &[RegionView],
    vm: &V,
    ranges: &[GpaBytes],
) -> (Vec<GpaPages>, Vec<GpaPages>) {
    let (mut data, mut holes) = (Vec::new(), Vec::new());
    for r in ranges {
        let run = r.pages();
        let Some((i, reg)) = regions
            .iter()
            .enumerate()
            .find(|(_, g)| g.contains_range(run.gpa, run.bytes()))
        else {
            data.push(run);
            continue;
        };
        let window = OffsetBytes::new(run.gpa - reg.gpa(), run.bytes());
        let found = union_runs(
            vm.data_ranges_in(i, window)
                .iter()
                .map(|o| GpaBytes::new(reg.gpa() + o.offset, o.bytes).pages()),
        );
        holes.extend(subtract_runs(&[run], &found));
        data.extend(found);
    }
    (data, holes)
}

fn add_encoding(stats: &mut MigrationStats, sender: &PageSender, compressed: bool) {
    if compressed {
        stats.compression.batches = sender.policy().summary();
        stats.compression.link_bandwidth = sender.policy().link();
    }
    stats.shared_pages = sender.refs_sent();
    stats.compression.encoded_in = stats.rounds.iter().map(|r| r.encoded_in).sum();
    stats.compression.encoded_out = stats.rounds.iter().map(|r| r.encoded_out).sum();
}

/// The share of a round's dirty pages that went on the wire (as data or
/// zeros), the rest being unchanged since they last went: what the next
/// round's dirty pages are likely to cost the link (1 for a round that
/// handled no page).
fn changed_share(rs: &RoundStats) -> f64 {
    let went = rs.pages + rs.zero_pages;
    let handled = went + rs.unchanged_pages;
    if handled == 0 {
        1.0
    } else {
        went as f64 / handled as f64
    }
}

fn add_round(stats: &mut MigrationStats, rs: RoundStats) {
    stats.bytes += rs.bytes;
    stats.pages += rs.pages;
    stats.zero_pages += rs.zero_pages;
    stats.unchanged_pages += rs.unchanged_pages;
    stats.rounds.push(rs);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pages_that_went_on_the_wire_count_as_changed() {
        let rs = RoundStats {
            pages: 10,
            zero_pages: 10,
            unchanged_pages: 180,
            ..Default::default()
        };
        assert!((changed_share(&rs) - 0.1).abs() < 1e-12);
        let all_went = RoundStats {
            pages: 5,
            ..Default::default()
        };
        assert_eq!(changed_share(&all_went), 1.0);
        assert_eq!(changed_share(&RoundStats::default()), 1.0, "an empty round");
    }
}
