//! Postcopy: pause, move the state, run on the destination at once, and let
//! memory follow (the yabusame paper's design): a vCPU touching a missing
//! page faults through userfaultfd, the destination asks for the page on
//! the demand connection, and the source answers with it and its ±N
//! neighbours not sent yet; a background pusher sends everything else on
//! the bulk streams. Hybrid runs precopy rounds first and switches here
//! when they do not converge in time (precopy.rs decides).
//!
//! ```text
//! source (paused for good)                       destination
//!  ctl  PostcopyPlan{pending runs, N, verify}  ──▶  pending pages discarded
//!  dmd  Hello{Demand}                          ──▶
//!  ctl  State, Complete                        ──▶  uffd MISSING on all RAM, vCPUs start
//!                                              ◀──  Started
//!  dmd  Pages{p, p±N unsent}                   ◀──  PageRequest{p}   (fault thread)
//!  bulk Pages / ZeroRanges (pusher)            ──▶  UFFDIO_COPY / ZEROPAGE, first copy wins
//!  ctl  RoundDone{frames per stream}           ──▶  waits until every page landed
//!                                              ◀──  RoundAck
//!  ctl  Verify (optional), Complete            ──▶  uffd released
//!                                              ◀──  Finished{fault report}
//! ```
//! Source files: [`source`] (push and demand), [`destination`] (the
//! destination's phases), [`fault_account`] (the destination's account of
//! faults and landed pages), [`pages`] (page sets).

pub(crate) mod destination;
mod drop_ahead;
pub(crate) mod fault_account;
pub(crate) mod net;
pub(crate) mod pages;
pub(crate) mod source;

pub(crate) use destination::PostcopyDestination;
pub(crate) use drop_ahead::drop_ahead;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::dirty::first_round;
use crate::paused::{Epoch, Outcome, PausedPostcopy};
use crate::protocol::{self, Kind, PostcopyPlan, ProtocolError, Role};
use crate::ranges::{total_pages, union_runs, GpaBytes, GpaPages};
use crate::session::{SourcePhase, SourceSession};
use crate::stats::{secs, MigrationStats, Phase, PostcopyStats, Progress};
use crate::transport::Conn;

use crate::error::MigrationError;

/// Refuses a destination too old for postcopy before anything changed.
pub(crate) fn require(s: &SourceSession) -> Result<(), MigrationError> {
    if !s.caps().postcopy() {
        return Err(MigrationError::Unsupported(format!(
            "the destination speaks protocol v{}; {} needs v{} (a newer ferry there)",
            s.caps().version(),
            s.opts().mode,
            protocol::VERSION_POSTCOPY
        )));
    }
    Ok(())
}

/// The postcopy mode on the source: no rounds, its own run.
pub(crate) struct Postcopy;

impl crate::mode::SourceMode for Postcopy {
    fn run(
        &mut self,
        s: &mut SourceSession,
        _backend: &crate::compress::Backend,
        progress: &dyn Fn(&Progress),
    ) -> Result<Outcome, MigrationError> {
        run(s, progress)
    }
}

/// The end of a postcopy: done with `stats`, or paused (the stats go with
/// the pause, for the resume to go on with).
pub(crate) fn outcome(stats: MigrationStats, paused: Option<Box<PausedPostcopy>>) -> Outcome {
    match paused {
        Some(p) => Outcome::Paused(p),
        None => Outcome::Done(stats),
    }
}

/// Pure postcopy: pause at once and switch.
pub(crate) fn run(
    s: &mut SourceSession,
    progress: &dyn Fn(&Progress),
) -> Result<Outcome, MigrationError> {
    s.open()?;
    require(s)?;
    s.open_bulk(None)?;
    let mut stats = MigrationStats {
        mode: s.opts().mode,
        converged: "postcopy: no precopy rounds".into(),
        ..Default::default()
    };
    stats.compression.asked = "none".into();
    s.pause()?;
    stats.downtime_parts.pause = s.lap_ms();
    let vm = s.vm();
    let (data, _holes) = first_round(s.regions(), |i| vm.data_ranges(i));
    let mut pending = data;
    pending.extend(vm.host_written_ranges().iter().map(GpaBytes::pages));
    let paused = switch(s, &mut stats, union_runs(pending), 0, progress)?;
    Ok(outcome(stats, paused))
}

/// From a paused VM whose memory the destination lacks `pending` of:
/// plan, state, start there, then serve and push every pending page until
/// the destination has them all (or the link broke for good: paused).
/// `round` numbers the push's barrier.
pub(crate) fn switch(
    s: &mut SourceSession,
    stats: &mut MigrationStats,
    pending: Vec<GpaPages>,
    round: u32,
    progress: &dyn Fn(&Progress),
) -> Result<Option<Box<PausedPostcopy>>, MigrationError> {
    let opts = s.opts();
    let pending_pages = total_pages(&pending);
    progress(&Progress {
        round,
        remaining_pages: pending_pages,
        throughput: 0.0,
        bytes: stats.bytes,
        phase: Phase::StopAndCopy,
        ..Default::default()
    });
    let guest_apf_base = s.vm().guest_apf_count();
    for (share, last) in protocol::run_frames(&pending) {
        let plan = PostcopyPlan {
            pending: share.to_vec(),
            last,
            prefetch: opts.prefetch,
            verify: opts.verify,
            guest_apf_base,
        };
        protocol::send(s.ctl()?.writer(), Kind::PostcopyPlan, &plan)?;
    }
    s.ctl()?.flush()?;
    let mut demand = s.open_role(Role::Demand)?;
    demand.flush()?;
    stats.downtime_parts.last_round += s.lap_ms();
    stats.state_bytes = s.send_state()?;
    stats.bytes += protocol::HEADER as u64 + stats.state_bytes;
    stats.downtime_parts.save_state = s.lap_ms();
    // Started moves the session to Switched: from there a failure never
    // resumes the VM here.
    let report = s.complete(SourcePhase::Switched)?;
    s.tel().set_remaining_pages(pending_pages);
    let ms = s.lap_ms();
    s.note_started(stats, &report, ms);
    // Outside the downtime, as precopy does: the log was read for the last
    // time in the pause, and switching it off rewrites the memory slots
    // (1.0 ms of a 4.6 ms hybrid pause here). The VM runs there now: a
    // failure is only logged.
    if let Err(e) = s.stop_dirty_log() {
        tracing::warn!(error = %e, "the VM runs at the destination; stopping its dirty log here failed");
    }
    stats.downtime_ms = s.downtime_ms();
    progress(&Progress {
        round,
        remaining_pages: pending_pages,
        bytes: stats.bytes,
        phase: Phase::Postcopy,
        destination_service: stats.destination_service.clone(),
        ..Default::default()
    });
    tracing::info!(
        pending = pending_pages,
        downtime_ms = stats.downtime_ms,
        "postcopy: the VM runs at the destination"
    );

    stats.postcopy = Some(PostcopyStats {
        switch_at_s: s
            .paused_at()
            .map_or(0.0, |t| secs(t.saturating_duration_since(s.started_at()))),
        pending_pages,
        ..Default::default()
    });
    let safety_net = opts
        .safety_net
        .clone()
        .map(|at| net::Net::start(net_feed(s, at, &pending, round)));
    let result = follow(
        s,
        stats,
        Epoch {
            round,
            t_post: Instant::now(),
            paused_since: None,
            landed: false,
        },
        Ok((pending, demand)),
        safety_net.as_ref().filter(|_| opts.net_finishes),
        progress,
    );
    let handed = stats.postcopy.as_ref().is_some_and(|p| p.handed_over);
    let sent = match (safety_net, &result) {
        (Some(n), Ok(None)) if handed => Some(n.ended()),
        (Some(n), Ok(None)) => Some(n.release()),
        (Some(n), _) => Some(n.abandon()),
        (None, _) => None,
    };
    if let (Some(sent), Some(post)) = (sent, stats.postcopy.as_mut()) {
        post.safety_net_bytes = sent.bytes.load(Ordering::Relaxed);
        post.safety_net_armed = sent.armed.load(Ordering::Acquire);
    }
    result
}

/// What the safety net's thread copies from this paused VM.
fn net_feed(
    s: &SourceSession,
    at: crate::transport::Endpoint,
    pending: &[GpaPages],
    round: u32,
) -> net::NetFeed {
    let vm = s.vm();
    net::NetFeed {
        net: at,
        plan: protocol::StandbyPlan {
            session: s.id(),
            version: s.caps().version(),
            started_unix_s: s.start_unix_s(),
            destination: s.to().to_string(),
            layout: s.regions().iter().map(|r| (r.gpa(), r.size())).collect(),
            round,
            prefetch: s.opts().prefetch,
            streams: s.opts().streams.max(1),
            pending_pages: total_pages(pending),
            verify: s.opts().verify,
        },
        regions: s.regions().to_vec(),
        pending: pending.to_vec(),
        verify: s
            .opts()
            .verify
            .then(|| (0..s.regions().len()).map(|i| vm.data_ranges(i)).collect()),
        timeout: s.opts().timeout(),
        tel: s.tel().clone(),
        finishes: s.opts().net_finishes,
        bandwidth: s.opts().bandwidth,
    }
}

/// Continues a paused postcopy: reconnects (within the reconnect timeout)
/// and serves until the destination has every page.
pub(crate) fn resume(
    s: &mut SourceSession,
    paused: PausedPostcopy,
    progress: &dyn Fn(&Progress),
) -> Result<Outcome, MigrationError> {
    let mut stats = paused.stats;
    let reason = format!("resuming after: {}", paused.reason);
    let again = follow(s, &mut stats, paused.epoch, Err(reason), None, progress)?;
    Ok(outcome(stats, again))
}

/// After the switch: serves and pushes the pending pages until the
/// destination has them all. A broken link pauses: every connection is
/// dropped, the source reconnects as the same session, and the destination
/// names the pages it still lacks, which go out again. `next` is the first
/// epoch's pages and demand connection, or why the link is down. `relay`:
/// a safety net that finishes the move (the push waits for it; once it is
/// armed this side hands over and waits, holding every page, until the
/// standby says it finished: `handed_over` in the stats; a standby that
/// fails is taken over from again). Returns the pause when the link did
/// not come back within the reconnect timeout.
fn follow(
    s: &mut SourceSession,
    stats: &mut MigrationStats,
    mut epoch: Epoch,
    mut next: Result<(Vec<GpaPages>, Conn), String>,
    mut relay: Option<&net::Net>,
    progress: &dyn Fn(&Progress),
) -> Result<Option<Box<PausedPostcopy>>, MigrationError> {
    let opts = s.opts();
    loop {
        let (pending, demand) = match next {
            Ok(connected) => connected,
            Err(reason) => {
                if epoch.paused_since.is_none() {
                    s.tel().event("link_broken", reason.clone());
                    s.link_broken(true);
                    tracing::warn!(
                        %reason,
                        retry_s = opts.reconnect_timeout().as_secs_f64(),
                        "postcopy paused: the link to the destination broke; every page stays here; reconnecting"
                    );
                }
                let since = *epoch.paused_since.get_or_insert_with(Instant::now);
                progress(&Progress {
                    round: epoch.round,
                    bytes: stats.bytes,
                    phase: Phase::PostcopyPaused,
                    ..Default::default()
                });
                s.drop_links();
                let again = s.reconnect(opts.reconnect_timeout());
                let post = stats.postcopy.get_or_insert_with(Default::default);
                match again {
                    Ok(connected) => {
                        post.pauses += 1;
                        post.paused_s += secs(since.elapsed());
                        epoch.paused_since = None;
                        s.tel().event(
                            "resumed",
                            format!("{} pages missing", total_pages(&connected.0)),
                        );
                        s.link_broken(false);
                        tracing::info!(missing = total_pages(&connected.0), "postcopy resumed");
                        connected
                    }
                    Err(e) if epoch.landed => {
                        // The link broke after the destination had every
                        // page (e.g. with its Finished on the wire) and
                        // it did not take the source back: it has ended.
                        // Nothing here is needed any more: release.
                        s.drop_links();
                        tracing::warn!(
                            %reason,
                            error = %e,
                            "postcopy: every page had landed at the destination (acknowledged) when the link broke; its final report is lost"
                        );
                        stats.verified_pages = 0;
                        let note = format!(
                            "every page landed at the destination (acknowledged); the link broke before its final report ({reason}), so its fault report{} missing",
                            if opts.verify { " and the verification result are" } else { " is" }
                        );
                        finished(s, stats, &epoch, &note, progress);
                        return Ok(None);
                    }
                    Err(e) => {
                        s.drop_links();
                        // What the registry knows of the destination is
                        // the truth the operator needs most.
                        let gone = match &e {
                            MigrationError::Fence(_) => None,
                            _ => s.vm().fence().and_then(|f| f.holder_gone()),
                        };
                        let reason = match gone {
                            Some(gone) => format!("{reason}; reconnecting failed: {e}; {gone}"),
                            None => format!("{reason}; reconnecting failed: {e}"),
                        };
                        tracing::error!(%reason, "postcopy stays paused");
                        return Ok(Some(Box::new(PausedPostcopy {
                            session: s.resumable(),
                            to: s.to().clone(),
                            opts: opts.clone(),
                            stats: stats.clone(),
                            epoch,
                            reason,
                        })));
                    }
                }
            }
        };
        // The hold runs from the switch: an epoch resumed after it pushes
        // at once, one resumed inside it holds for the rest.
        let push_from = epoch.t_post + std::time::Duration::from_millis(opts.push_delay_ms);
        let out = source::SourcePages::new(
            s.regions().to_vec(),
            &pending,
            opts.prefetch,
            opts.bandwidth,
            push_from,
        )
        .hot_first(s.vm().access_history().as_ref())
        .yielding(s.streams(), opts.bandwidth)
        .sealing(s.caps().sealed_pages());
        if relay.is_some_and(|n| n.state() == net::NetState::Copying) {
            out.net_copies.store(true, Ordering::Release);
        }
        let result = serve(s, &out, demand, &mut epoch, stats.bytes, relay, progress);
        let post = stats.postcopy.get_or_insert_with(Default::default);
        post.pushed_pages += out.pushed_pages.load(Ordering::Relaxed);
        post.pushed_zero_pages += out.pushed_zero_pages.load(Ordering::Relaxed);
        post.pushed_hot_pages += out.hot_pages.load(Ordering::Relaxed);
        post.requests += out.requests.load(Ordering::Relaxed);
        post.demand_pages += out.demand_pages.load(Ordering::Relaxed);
        post.prefetched_pages += out.prefetched_pages.load(Ordering::Relaxed);
        stats.bytes += out.bytes.load(Ordering::Relaxed);
        stats.pages +=
            out.pushed_pages.load(Ordering::Relaxed) + out.demand_pages.load(Ordering::Relaxed);
        stats.zero_pages += out.pushed_zero_pages.load(Ordering::Relaxed);
        stats.source_cpu_s += out.cpu.secs();
        match result {
            Ok(Served::HandedOver) => {
                // The destination sees its links end and waits for the
                // standby, told to take over after this.
                s.drop_links();
                let Some(n) = relay.take() else {
                    return Err(MigrationError::Unsupported(
                        "handed over without a net".into(),
                    ));
                };
                let waiting = || {
                    progress(&Progress {
                        round: epoch.round,
                        bytes: stats.bytes,
                        phase: Phase::HandedOver,
                        ..Default::default()
                    })
                };
                tracing::info!(
                    "postcopy: handed over to the standby; this side waits for it to finish"
                );
                match n.hand_over(&waiting) {
                    Ok(verified) => {
                        let post = stats.postcopy.get_or_insert_with(Default::default);
                        post.handed_over = true;
                        if opts.verify {
                            stats.verified_pages = verified.unwrap_or(0);
                        }
                        finished(
                            s,
                            stats,
                            &epoch,
                            "the standby finished the move it was handed",
                            progress,
                        );
                        return Ok(None);
                    }
                    // Every page is still here: this side resumes.
                    Err(why) => {
                        tracing::warn!(%why, "postcopy: the standby that was handed the move failed; resuming it from here");
                        next = Err(format!(
                            "the standby that was handed the move failed: {why}"
                        ));
                    }
                }
            }
            Ok(Served::Finished(faults, verified)) => {
                post.faults = *faults;
                stats.verified_pages = verified;
                finished(
                    s,
                    stats,
                    &epoch,
                    "every page arrived at the destination",
                    progress,
                );
                return Ok(None);
            }
            Err(e) if e.is_link_break() && s.caps().resume() => {
                next = Err(e.to_string());
            }
            Err(e) => {
                return Err(MigrationError::PostcopyBroken {
                    reason: e.to_string(),
                    unsent: out.unsent(),
                    pending: post.pending_pages,
                })
            }
        }
    }
}

/// The phase's end on this side: its times, the event, the last progress.
fn finished(
    s: &mut SourceSession,
    stats: &mut MigrationStats,
    epoch: &Epoch,
    note: &str,
    progress: &dyn Fn(&Progress),
) {
    let post = stats.postcopy.get_or_insert_with(Default::default);
    post.secs = secs(epoch.t_post.elapsed());
    stats.source_cpu_s += s.cpu_secs();
    stats.total_secs = secs(s.started_at().elapsed());
    s.tel().event("finished", note);
    progress(&Progress {
        round: epoch.round,
        bytes: stats.bytes,
        phase: Phase::Done,
        ..Default::default()
    });
}

/// How an epoch ended well.
enum Served {
    /// Every page landed: the destination's fault report and the pages it
    /// verified.
    Finished(Box<crate::stats::FaultReport>, u64),
    /// The net that finishes the move holds every page: this side stops.
    HandedOver,
}

/// One epoch of the phase (between the switch or a resume and the end or
/// a broken link): the demand thread, a pusher per bulk stream, and on
/// this thread the barrier (acknowledged: `epoch.landed`), the hashes and
/// Finished. With a `relay` net the push waits while it copies (at most
/// half the session timeout: the destination takes a long silence for a
/// broken link), goes on if it fails, and the epoch ends handed over once
/// it is armed.
fn serve(
    s: &mut SourceSession,
    out: &source::SourcePages,
    mut demand: Conn,
    epoch: &mut Epoch,
    base_bytes: u64,
    relay: Option<&net::Net>,
    progress: &dyn Fn(&Progress),
) -> Result<Served, MigrationError> {
    let opts = s.opts();
    let t0 = Instant::now();
    let hold_until = t0 + opts.timeout() / 2;
    // The demand connection idles for as long as no vCPU faults; it ends
    // when this side shuts it down after Finished.
    let _ = demand.set_read_timeout(None);
    let demand_sock = demand.closer().map_err(ProtocolError::Io)?;
    let bulk_socks = s
        .bulk()
        .iter()
        .map(Conn::closer)
        .collect::<Result<Vec<_>, _>>()
        .map_err(ProtocolError::Io)?;
    let vm = s.vm();
    let regions = s.regions().to_vec();
    let mut bulk = s.take_bulk();
    std::thread::scope(|sc| -> Result<_, MigrationError> {
        let demand_thread = sc.spawn(move || out.serve_demand(&mut demand));
        let hasher = opts.verify.then(|| {
            sc.spawn(|| {
                vm.page_hashes()
                    .unwrap_or_else(|| crate::session::hashes(&regions, |i| vm.data_ranges(i)))
            })
        });
        let pushers: Vec<_> = bulk
            .iter_mut()
            .map(|c| sc.spawn(move || out.push(c)))
            .collect();
        let result = (|| {
            let mut last_progress = t0 - Duration::from_secs(1);
            while pushers.iter().any(|p| !p.is_finished()) && !demand_thread.is_finished() {
                match relay.map(net::Net::state) {
                    Some(net::NetState::Armed) => {
                        out.halt.store(true, Ordering::Release);
                        for b in &bulk_socks {
                            b.shutdown();
                        }
                        for p in pushers {
                            let _ = p.join();
                        }
                        return Ok(Served::HandedOver);
                    }
                    // The push goes on from here: each page leaves once
                    // again, neighbours included.
                    Some(net::NetState::Lost) => {
                        out.net_copies.store(false, Ordering::Release);
                    }
                    Some(net::NetState::Copying) if Instant::now() >= hold_until => {
                        out.net_copies.store(false, Ordering::Release);
                    }
                    // A copy that stopped moving (its standby stopped, its
                    // link cut) is given up: the push holds for it no
                    // longer, and it competes with the push no more.
                    Some(net::NetState::Copying)
                        if out.net_copies.load(Ordering::Acquire)
                            && relay.is_some_and(|n| n.stalled(net::STALL)) =>
                    {
                        let why = format!(
                            "its copy did not move for {} s while the push waited for it",
                            net::STALL.as_secs()
                        );
                        relay.inspect(|n| n.drop_stalled(&why));
                        s.tel().event("safety_net_lost", why);
                        out.net_copies.store(false, Ordering::Release);
                    }
                    _ => {}
                }
                if last_progress.elapsed() >= Duration::from_millis(50) {
                    last_progress = Instant::now();
                    // A relay's pages go to its standby.
                    let sent =
                        out.bytes.load(Ordering::Relaxed) + relay.map_or(0, net::Net::sent_bytes);
                    progress(&Progress {
                        round: epoch.round,
                        remaining_pages: out.unsent(),
                        throughput: sent as f64 / secs(t0.elapsed()).max(1e-3),
                        bytes: base_bytes + sent,
                        phase: Phase::Postcopy,
                        ..Default::default()
                    });
                }
                // A relay's hand-over waits for this loop to see it armed.
                std::thread::sleep(if relay.is_some() {
                    Duration::from_millis(2)
                } else {
                    Duration::from_millis(50)
                });
            }
            if demand_thread.is_finished() {
                // The demand connection ended before the push did: the
                // link broke. Pushers blocked on a silent peer end too.
                out.halt.store(true, Ordering::Release);
                for b in &bulk_socks {
                    b.shutdown();
                }
            }
            let mut frames = Vec::new();
            for p in pushers {
                frames.push(p.join().map_err(|_| panicked("pusher"))??);
            }
            // Acknowledged once every pending page landed there.
            s.barrier(epoch.round, frames)?;
            epoch.landed = true;
            let mut verified = 0;
            if let Some(h) = hasher {
                let hashes = h.join().map_err(|_| panicked("hashing"))?;
                let wire = s.send_hashes(&hashes)?;
                out.bytes.fetch_add(wire, Ordering::Relaxed);
                verified = hashes.len() as u64;
            }
            Ok(Served::Finished(Box::new(s.finish()?), verified))
        })();
        out.done.store(true, Ordering::Release);
        demand_sock.shutdown();
        let demand_result = demand_thread.join().map_err(|_| panicked("demand"))?;
        match (result, demand_result) {
            (Err(_), Err(e)) => Err(e),
            (r, _) => r,
        }
    })
}

fn panicked(what: &str) -> MigrationError {
    MigrationError::Unsupported(format!("the postcopy {what} thread panicked"))
}
