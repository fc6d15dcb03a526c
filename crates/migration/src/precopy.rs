//! Precopy: copy all memory while the guest runs, then the pages it dirtied,
//! round after round, until the rest fits the downtime target at the
//! measured bandwidth (throttling a guest that outruns the link); then
//! pause, send the rest, and let the session finish (state, verify,
//! Complete). The destination side has no phases of its own beyond the
//! session's round barriers.
//!
//! The round loop serves every copy mode through its [`Rounds`] hooks
//! (hybrid, split and gather live in their own files); [`Precopy`] is the
//! mode with none.

use crate::compress::Backend;
use crate::dirty::{dirty_runs, first_round, sample_pages};
use crate::encoded::CodecSetup;
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::mode::SourceMode;
use crate::options::Mode;
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
/// precopy's.
pub(crate) trait Rounds {
    /// Once the session is open, before the bulk streams (split places
    /// its chunks; hybrid checks the destination can do postcopy).
    fn begin(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
    }

    /// Once the bulk streams are open, before round 0 (gather waits for
    /// the destination to pull the memory servers' part).
    fn streams_open(&mut self, _s: &mut SourceSession) -> Result<(), MigrationError> {
        Ok(())
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

    /// After a dirty round that did not converge: why to switch to
    /// postcopy now (hybrid), or None to go on copying.
    fn switch_due(&self, _s: &SourceSession, _rounds_done: u32) -> Option<String> {
        None
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
        run(s, backend, progress, self)
    }
}

/// Plain precopy: the round loop with no hooks.
pub(crate) struct Precopy;

impl Rounds for Precopy {}

/// Runs the copy rounds of `mode` over a session it opens.
pub(crate) fn run<M: Rounds + ?Sized>(
    s: &mut SourceSession,
    backend: &Backend,
    progress: &dyn Fn(&Progress),
    mode: &mut M,
) -> Result<Outcome, MigrationError> {
    let opts = s.opts;
    let copt = &opts.compression;
    s.open()?;
    mode.begin(s)?;
    let compressed = copt.enabled() && s.version >= 2;
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
            s.version
        ));
    }
    let setup = compressed.then(|| CodecSetup {
        xbzrle_bytes: copt.caches.xbzrle_bytes,
        dedup_bytes: copt.caches.dedup_bytes,
        shards: copt.workers.clamp(1, crate::encoded::MAX_SHARDS),
    });
    s.open_bulk(setup.as_ref())?;
    mode.streams_open(s)?;
    let vm = s.vm;
    let sample = if compressed {
        sample_pages(&s.regions, |i| vm.data_ranges(i), 256)
    } else {
        Vec::new()
    };
    let mut sender = PageSender::new(
        copt,
        backend,
        compressed,
        s.bulk.len(),
        opts.bandwidth,
        &sample,
    )
    .sharing_link(opts.share_link)
    .watched_by(s.tel.clone())
    .sealing(s.version >= crate::protocol::VERSION_SEALED_PAGES)
    .hashing(s.sent_hashes.clone())
    .sharing(s.shared.clone())
    // Split and gather send pages elsewhere than the destination's memory:
    // only a copy mode's rounds (hybrid's before it switches) know what
    // lies there.
    .skipping_unchanged(
        matches!(opts.mode, Mode::Precopy | Mode::Hybrid)
            .then(|| std::sync::Arc::new(crate::unchanged::SentContent::new(&s.regions))),
    );

    s.start_dirty_log()?;
    let (mut runs, holes) = first_round(&s.regions, |i| vm.data_ranges(i));
    let mut holes = mode.holes(holes);
    let mut round = 0u32;
    // The link's rate, from the latest round long enough to measure it: a
    // short round's pages fit the socket buffers and read as several times
    // the link (1.5 GB/s on a 1 Gbit link; 0.17 GB/s for 60 ms), which
    // made a remainder look as if it fit the downtime when it took twice
    // as long.
    let mut bandwidth = 0.0f64;
    let mut throttle = 0u32;
    let switch = loop {
        s.tel.round_began(round, total_pages(&runs));
        progress(&Progress {
            round,
            remaining_pages: total_pages(&runs),
            throughput: 0.0,
            bytes: stats.bytes,
            phase: Phase::Copy,
            ..Default::default()
        });
        let (mut rs, frames) = {
            let (regions, bulk, cpu) = (&s.regions, &mut s.bulk, &s.cpu);
            let mut send = |runs: &[GpaPages], holes: &[GpaPages]| {
                sender.send_round(regions, bulk, runs, holes, round, None, cpu)
            };
            mode.send_round(regions, &runs, &holes, &mut send)?
        };
        s.barrier(round, frames)?;
        let bitmaps = vm
            .take_dirty()
            .map_err(MigrationError::vm("read dirty log"))?;
        let (mut next, mut dirty) = dirty_runs(&s.regions, &bitmaps);
        let missed = s.take_missed();
        if !missed.is_empty() {
            // References the destination could not resolve go again, as data.
            if let Some(offer) = &s.shared {
                offer.withdraw(&missed);
            }
            stats.shared_missed += total_pages(&missed);
            next = union_runs(next.into_iter().chain(missed));
            dirty = total_pages(&next);
        }
        rs.dirty_rate = (dirty * PAGE) as f64 / rs.secs;
        rs.throttle_pct = throttle;
        if rs.secs >= RATE_ROUND_SECS || bandwidth == 0.0 {
            bandwidth = rs.throughput.max(1.0);
        }
        tracing::debug!(round, pages = rs.pages, dirty, secs = rs.secs, "round sent");
        // Auto-converge (after the full copy): when the guest dirtied more
        // than half of what the round could send and, at that ratio, the
        // rounds left would not bring it under the downtime, take away
        // more vCPU time, 20% at first, then 10% more each round, up to 99%.
        // Only what the guest changes costs the link: a dirty page whose
        // bytes are those last sent costs a hash (a kv store's reads dirty
        // ~90% of its pages so), and counting it would throttle a guest
        // the rounds keep up with.
        let changed = changed_share(&rs);
        let tuning = &opts.auto_converge_tuning;
        let fits_pause = (opts.downtime_ms / 1e3 * bandwidth / (PAGE + PAGE_META) as f64) as u64;
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
            throttle = tuning.next(throttle);
            vm.throttle(throttle)
                .map_err(MigrationError::vm("throttle"))?;
            tracing::info!(throttle, "auto-converge throttles the vCPUs");
        }
        s.tel.set_dirty(rs.dirty_rate, throttle);
        add_round(&mut stats, rs);
        runs = next;
        holes.clear();
        round += 1;
        let expected_ms = (dirty * (PAGE + PAGE_META)) as f64 / bandwidth * 1e3;
        if expected_ms <= opts.downtime_ms {
            stats.converged = format!("remainder of {dirty} pages fits {:.1} ms", opts.downtime_ms);
            break false;
        }
        if let Some(why) = mode.switch_due(s, round) {
            stats.converged =
                format!("not converged after {why} ({dirty} pages dirty): switched to postcopy");
            break true;
        }
        if round > opts.max_rounds {
            stats.converged = format!(
                "max rounds ({}) reached with {dirty} pages dirty",
                opts.max_rounds
            );
            break false;
        }
    };
    tracing::info!(rounds = round, converged = %stats.converged, "precopy converged");
    // A switch drops the pages dirtied since they were sent ahead of the
    // pause, where the destination can (v17).
    let dropped_ahead = if switch && s.version >= crate::protocol::VERSION_DROP_AHEAD {
        crate::postcopy::drop_ahead(s, &mut runs)?
    } else {
        0
    };

    // Stop and copy.
    s.pause()?;
    stats.downtime_parts.pause = s.lap_ms();
    let bitmaps = vm
        .take_dirty()
        .map_err(MigrationError::vm("read dirty log"))?;
    let (mut last, _) = dirty_runs(&s.regions, &bitmaps);
    last.extend(runs);
    // What the VMM wrote itself (the service ring) goes too, except, in a
    // copy mode, its holes: reading a hole allocates it (about 10 µs a page
    // on these machines, 5 ms for a mostly empty 2 MiB ring), and a hole
    // at the source is zero at the destination already. Split, gather and
    // a switch to postcopy keep every written page.
    let written = vm.host_written_ranges();
    let (written, written_holes) = if matches!(opts.mode, Mode::Precopy | Mode::Hybrid) && !switch {
        split_holes(&s.regions, vm, &written)
    } else {
        (written.iter().map(GpaBytes::pages).collect(), Vec::new())
    };
    last.extend(written);
    let last: Vec<GpaPages> = union_runs(last);
    // Pages dirtied by the guest hold data: a hole left is one nobody wrote.
    let written_holes = subtract_runs(&written_holes, &last);
    if switch {
        // (The dirty log goes off once the VM runs there: postcopy::switch.)
        let _ = vm.throttle(0);
        stats.downtime_parts.last_round = s.lap_ms();
        add_encoding(&mut stats, &sender, compressed);
        let paused = crate::postcopy::switch(s, &mut stats, last, round, progress)?;
        if let Some(p) = stats.postcopy.as_mut() {
            p.dropped_ahead_pages = dropped_ahead;
        }
        return Ok(crate::postcopy::outcome(stats, paused));
    }
    // From v15 the state goes first, so the destination restores it
    // while the last round arrives; a copy mode that commits elsewhere at
    // Complete (split, gather) keeps the old order.
    let state_first = s.version >= crate::protocol::VERSION_EARLY_STATE
        && matches!(opts.mode, Mode::Precopy | Mode::Hybrid);
    if state_first {
        send_state(s, &mut stats)?;
        if s.send_clients_early()? {
            stats.downtime_parts.clients = s.lap_ms();
        }
        s.ctl()?.flush()?;
    }
    let remaining = total_pages(&last);
    s.tel.round_began(round, remaining);
    progress(&Progress {
        round,
        remaining_pages: remaining,
        throughput: bandwidth,
        bytes: stats.bytes,
        phase: Phase::StopAndCopy,
        ..Default::default()
    });
    let (rs, frames) = {
        let (regions, bulk, cpu) = (&s.regions, &mut s.bulk, &s.cpu);
        let mut send = |runs: &[GpaPages], holes: &[GpaPages]| {
            let bytes = Some(total_pages(runs) * PAGE);
            sender.send_round(regions, bulk, runs, holes, round, bytes, cpu)
        };
        mode.send_round(regions, &last, &written_holes, &mut send)?
    };
    // The last round's ack is read after Complete went out (a round trip
    // less in the pause), except by a copy mode that commits state
    // elsewhere at Complete (split's stores, gather's pager): its last round
    // must be known applied before it commits.
    if matches!(opts.mode, Mode::Precopy | Mode::Hybrid) {
        s.last_round_done(round, frames)?;
    } else {
        s.barrier(round, frames)?;
    }
    add_round(&mut stats, rs);
    stats.downtime_parts.last_round = s.lap_ms();

    // (Saving the state on a thread of its own while the last round went
    // out was tried: on 2 cores it made the pause longer, 1.55 ms against
    // 1.29 for an idle 1 GiB VM.)
    if !state_first {
        send_state(s, &mut stats)?;
    }
    if opts.verify {
        if s.sent_hashes.is_none() {
            s.relax(); // hashes all of memory (here or in the mode)
        }
        progress(&Progress {
            round,
            remaining_pages: 0,
            throughput: bandwidth,
            bytes: stats.bytes,
            phase: Phase::Verify,
            ..Default::default()
        });
        let (pages, bytes) = match (&s.sent_hashes, mode.hashes(s)) {
            // What was sent against what landed, by digest; memory itself
            // is checked once the VM runs there (below).
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
        stats.verified_pages = pages;
        stats.bytes += bytes;
    }
    stats.downtime_parts.verify = s.lap_ms();
    mode.commit(&mut stats);
    let report = s.complete(SourcePhase::Done)?;
    let ms = s.lap_ms();
    s.note_started(&mut stats, &report, ms);
    // Outside the downtime: the log was read for the last time in the
    // pause, and a VM that never runs here again needs it off only to free
    // its bitmaps (switching it off rewrites the memory slots). The move
    // has succeeded: a failure here is only logged.
    if let Err(e) = s.stop_dirty_log() {
        tracing::warn!(error = %e, "the VM moved; stopping its dirty log here failed");
    }
    stats.destination_cpu_s = report.cpu_s;
    add_encoding(&mut stats, &sender, compressed);
    stats.source_cpu_s = s.cpu_secs();
    stats.downtime_ms = s.downtime_ms();
    if let Some(sent) = s.sent_hashes.clone() {
        // This side's memory has not changed since the pause: each page
        // must still be what it last sent. The VM already runs there, so
        // this costs no downtime.
        let t = std::time::Instant::now();
        let checked = sent.check_memory(&s.regions, |i| vm.data_ranges(i));
        stats.verify_after_ms = t.elapsed().as_secs_f64() * 1e3;
        stats.verified_pages = checked.map_err(|m| MigrationError::VerifyAfterSwitch {
            bad: m.bad,
            total: m.total,
            first: m.first,
        })?;
    }
    stats.total_secs = secs(s.t_start.elapsed());
    // With the destination's service: clients that stay are forwarded
    // from now on, not after the destination's timeline came back.
    progress(&Progress {
        round,
        remaining_pages: 0,
        throughput: bandwidth,
        bytes: stats.bytes,
        phase: Phase::Done,
        destination_service: stats.destination_service.clone(),
    });
    Ok(Outcome::Done(stats))
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
