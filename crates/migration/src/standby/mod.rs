//! The postcopy safety net's third host (`ferry standby`). While a VM runs
//! at its destination by postcopy, the destination still lacks pages that
//! only the source holds: a source that dies then takes the VM with it.
//! With `--safety-net`, the source copies those pages here right after the
//! switch (postcopy/net.rs) and beats every second. Here they are held in
//! memory laid out as the guest's ([`image`]) until one of two things:
//!
//! - the source says Complete: the move is done, the copy is dropped;
//! - the source hands the move over (StandbyTakeOver, `--net-finishes`:
//!   it has closed its links to the destination and waits, holding every
//!   page, until this host says it finished) or falls
//!   silent (its connection ends or no beat for [`SILENCE`]): this host
//!   resumes the postcopy as the source's session,
//!   through the engine's own resume path. The destination, which paused
//!   when its link to the source broke, names the pages it still lacks,
//!   and they are served and pushed from here until it has them all.
//!
//! ```text
//! source                                         standby
//!  Hello{Standby, session}                 ──▶  HelloAck
//!  StandbyPlan{session, destination, layout} ─▶  memory laid out
//!  Pages / ZeroRanges (pending), Verify?   ──▶  held
//!  Complete                                ──▶  StandbyHeld
//!  StandbyBeat every second                ──▶  …
//!  Complete (the move is done)             ──▶  dropped
//!                      (silence)                 resume the destination as the session
//!  StandbyTakeOver (--net-finishes)        ──▶  resume the destination as the session
//!                                          ◀──  StandbyBeat every second, Complete at the end
//! ```
//!
//! Every connection comes through the listener's gate (mutual TLS with a
//! fleet certificate); the destination takes a resume only for a session
//! id it knows, which only the source and this host were told.

mod image;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::MigrationError;
use crate::options::{MigrateOptions, Mode};
use crate::paused::{Epoch, Outcome, PausedPostcopy, Resumable};
use crate::protocol::{self, Hello, Kind, ProtocolError, Role, StandbyPlan};
use crate::stats::{MigrationStats, PostcopyStats};
use crate::transport::{Conn, Endpoint, Listener};

use image::Image;

/// No beat for this long: the source is gone.
pub const SILENCE: Duration = Duration::from_secs(4);
/// While a source copies its pages here, it may stall this long (a link
/// slowed or cut for a while, its process stopped) before its copy is
/// given up. The connection came with the accept loop's 200 ms, which
/// dropped a copy at its first stall ("operation would block"). The
/// source gives the copy up sooner if its push waits for it
/// (postcopy/net.rs).
const INTAKE_SILENCE: Duration = Duration::from_millis(crate::options::defaults::TIMEOUT_MS);
/// VMs held at once; one more is refused.
pub const MAX_HELD: usize = 16;
/// How long a taken-over move keeps reconnecting to its destination.
const TAKEOVER_RECONNECT: Duration = Duration::from_secs(60);

/// What the standby has done, for its status line and tests.
#[derive(Default)]
pub struct StandbyStats {
    /// Sources taken in so far.
    pub accepted: AtomicU64,
    /// VMs held now.
    pub held: AtomicUsize,
    /// Moves released by their source (done without help).
    pub released: AtomicU64,
    /// Moves this host finished after its source went silent or handed
    /// the move over.
    pub finished: AtomicU64,
    /// Of the moves taken over, those their source handed over
    /// (`--net-finishes`), not lost.
    pub handed: AtomicU64,
    /// Pages of those moves the destination checked against the source's
    /// hashes (with verification).
    pub verified_pages: AtomicU64,
    /// Takeovers that failed.
    pub failed: AtomicU64,
}

/// A standby: accepts sources until stopped.
pub struct Standby {
    /// What it has done.
    pub stats: StandbyStats,
    stopping: AtomicBool,
    room: Arc<Room>,
}

/// Guest memory a standby may hold for all its sources together: a plan
/// takes its whole layout's size before any memory is made for it.
pub(crate) struct Room {
    capacity: u64,
    used: std::sync::Mutex<u64>,
}

/// A plan's share of the room, given back when its copy is dropped.
pub(crate) struct Taken {
    room: Arc<Room>,
    bytes: u64,
}

impl Room {
    pub(crate) fn new(capacity: u64) -> Arc<Room> {
        Arc::new(Room {
            capacity,
            used: std::sync::Mutex::new(0),
        })
    }

    fn take(self: &Arc<Self>, bytes: u64) -> Result<Taken, MigrationError> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if used.saturating_add(bytes) > self.capacity {
            return Err(MigrationError::Unsupported(format!(
                "this standby has room for {} MiB more; the VM has {} MiB",
                (self.capacity - *used) >> 20,
                bytes >> 20
            )));
        }
        *used += bytes;
        Ok(Taken {
            room: self.clone(),
            bytes,
        })
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut used = self.room.used.lock().unwrap_or_else(|e| e.into_inner());
        *used = used.saturating_sub(self.bytes);
    }
}

impl Standby {
    /// A standby holding nothing yet, with room for `capacity` bytes of
    /// guest memory in all.
    pub fn new(capacity: u64) -> Arc<Standby> {
        Arc::new(Standby {
            stats: StandbyStats::default(),
            stopping: AtomicBool::new(false),
            room: Room::new(capacity),
        })
    }

    /// Stops the accept loop (held VMs' threads run on to their end).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Accepts sources until stopped, each on a thread of its own.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> Result<(), MigrationError> {
        while !self.stopping.load(Ordering::Acquire) {
            // Also the taken connection's I/O timeout until the session
            // sets its own: not shorter (at 50 ms a source's first frames
            // over a busy lab link timed out).
            let (mut c, hello) = match listener.accept_hello(Duration::from_millis(200)) {
                Ok(admitted) => admitted,
                Err(MigrationError::Listen { source, .. })
                    if source.kind() == std::io::ErrorKind::TimedOut =>
                {
                    continue
                }
                Err(e) => {
                    tracing::warn!("standby: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if self.stats.held.fetch_add(1, Ordering::AcqRel) >= MAX_HELD {
                self.stats.held.fetch_sub(1, Ordering::AcqRel);
                c.abort(&format!("busy: this standby holds {MAX_HELD} VMs already"));
                continue;
            }
            self.stats.accepted.fetch_add(1, Ordering::Relaxed);
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("standby".into())
                .spawn(move || {
                    let session = hello.session;
                    match me.hold(&mut c, &hello) {
                        Ok(()) => {}
                        Err(e) => {
                            tracing::warn!(session, error = %e, "standby: a source's copy failed");
                            if !e.is_link_break() {
                                c.abort(&e.to_string());
                            }
                        }
                    }
                    me.stats.held.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(e) = spawned {
                tracing::warn!("standby: cannot start a thread: {e}");
                self.stats.held.fetch_sub(1, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    /// One source: take its plan and pages, stand by, and take over if it
    /// falls silent before saying the move is done.
    fn hold(&self, c: &mut Conn, hello: &Hello) -> Result<(), MigrationError> {
        c.set_timeouts(Some(INTAKE_SILENCE))
            .map_err(ProtocolError::Io)?;
        let Intake {
            plan,
            to,
            image,
            pages,
            _room,
        } = intake(c, hello, &self.room).map_err(|e| timed_out(e, INTAKE_SILENCE))?;
        tracing::info!(session = plan.session, %to, pages, "standby: holding what the destination lacks");
        // (Writes too: a beat to a source that stalls waits no longer.)
        let _ = c.set_timeouts(Some(SILENCE));
        // Why this host takes the move over, and whether it was asked to.
        let (lost, handed) = loop {
            match protocol::read_frame(c.reader()) {
                Ok(f) if f.kind == Kind::StandbyBeat => continue,
                Ok(f) if f.kind == Kind::StandbyTakeOver => {
                    self.stats.handed.fetch_add(1, Ordering::Relaxed);
                    break ("the source handed the move over".to_string(), true);
                }
                Ok(f) if f.kind == Kind::Complete => {
                    tracing::info!(
                        session = plan.session,
                        "standby: the move is done; copy dropped"
                    );
                    self.stats.released.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Ok(f) => {
                    break (
                        format!("the source sent {:?} while standing by", f.kind),
                        false,
                    )
                }
                Err(e) => break (e.to_string(), false),
            }
        };
        if handed {
            tracing::info!(session = plan.session, %to, "standby: the source handed the move over; resuming the move from here");
        } else {
            tracing::warn!(session = plan.session, %to, reason = %lost, "standby: the source is gone; resuming the move from here");
        }
        // A source that handed the move over waits, holding every page, for
        // this host to say it finished (beats meanwhile): if this host
        // fails, it takes the move back.
        let source = std::sync::Mutex::new((&mut *c, Instant::now()));
        let beat = || {
            if handed {
                let mut s = source.lock().unwrap_or_else(|p| p.into_inner());
                if s.1.elapsed() >= crate::postcopy::net::BEAT {
                    let _ = s.0.send_frame(Kind::StandbyBeat, &[]);
                    s.1 = Instant::now();
                }
            }
        };
        let result = take_over(&image, &plan, to, &lost, &beat);
        if let (true, Ok(verified)) = (handed, &result) {
            // The source reports the move: it learns what was verified
            // here (an older source ignores the body).
            let (c, _) = source.into_inner().unwrap_or_else(|p| p.into_inner());
            let _ = c.send_frame(Kind::Complete, &verified.to_le_bytes());
        }
        match result {
            Ok(verified) => {
                self.stats.finished.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .verified_pages
                    .fetch_add(verified, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}

/// A read or write that timed out (the socket's EAGAIN, shown as
/// "operation would block") said as what it is.
fn timed_out(e: MigrationError, within: Duration) -> MigrationError {
    match e {
        MigrationError::Protocol(ProtocolError::Io(io))
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            ProtocolError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the source's copy stalled: nothing moved for {:.0} s",
                    within.as_secs_f64()
                ),
            ))
            .into()
        }
        e => e,
    }
}

/// What a source handed over: its plan, the destination, the memory.
pub(crate) struct Intake {
    pub(crate) plan: StandbyPlan,
    pub(crate) to: Endpoint,
    image: Image,
    /// Pages with data held.
    pub(crate) pages: u64,
    _room: Taken,
}

/// Everything a source sends before the standby stands by, checked: its
/// Hello, the plan (destination, layout), the pages and hashes; answered
/// with StandbyHeld.
pub(crate) fn intake(
    c: &mut Conn,
    hello: &Hello,
    room: &Arc<Room>,
) -> Result<Intake, MigrationError> {
    let plan = admit(c, hello)?;
    let to: Endpoint = plan
        .destination
        .parse()
        .map_err(|e: String| bad(format!("destination: {e}")))?;
    let bytes = plan
        .layout
        .iter()
        .try_fold(0u64, |t, r| t.checked_add(r.1))
        .ok_or_else(|| bad("the layout's size wraps".into()))?;
    let taken = room.take(bytes)?;
    let mut image = Image::new(&plan.layout).map_err(bad)?;
    let pages = receive(c, &mut image)?;
    c.send(Kind::StandbyHeld, &pages)?;
    Ok(Intake {
        plan,
        to,
        image,
        pages,
        _room: taken,
    })
}

fn bad(reason: String) -> MigrationError {
    ProtocolError::Malformed {
        kind: Kind::StandbyPlan,
        reason,
    }
    .into()
}

/// The Hello, version and plan of a source; its session must be the
/// plan's.
fn admit(c: &mut Conn, hello: &Hello) -> Result<StandbyPlan, MigrationError> {
    if hello.role != Role::Standby {
        return Err(MigrationError::Unsupported(format!(
            "this is a postcopy standby; a {:?} connection has no place here",
            hello.role
        )));
    }
    let version = protocol::negotiate(hello)?;
    if !crate::protocol::Caps::of(version).standby() {
        return Err(MigrationError::Unsupported(format!(
            "a standby needs protocol v{}; the source speaks v{version}",
            protocol::VERSION_STANDBY
        )));
    }
    c.send(Kind::HelloAck, &version)?;
    let plan: StandbyPlan = c.recv(Kind::StandbyPlan)?;
    if plan.session != hello.session {
        return Err(bad("the plan names another session than its Hello".into()));
    }
    Ok(plan)
}

/// Lands the source's pages (and hashes) in `image` until Complete;
/// returns the pages with data.
fn receive(c: &mut Conn, image: &mut Image) -> Result<u64, MigrationError> {
    use crate::vm::MigratableVm;
    let regions = image.regions();
    let sink = image.sink();
    let (mut scratch, mut data, mut body) = (Vec::new(), Vec::new(), Vec::new());
    let mut pages = 0;
    loop {
        let h = protocol::read_header(c.reader())?;
        match h.kind {
            Kind::Pages => {
                pages += crate::pagein::read_pages(
                    c.reader(),
                    &h,
                    &regions,
                    &sink,
                    &mut scratch,
                    &mut data,
                )?;
            }
            // The image reads as zeros already.
            Kind::ZeroRanges => protocol::read_body_into(c.reader(), &h, &mut body)?,
            Kind::Verify => {
                protocol::read_body_into(c.reader(), &h, &mut body)?;
                let total: u64 = regions.iter().map(crate::memory::RegionView::pages).sum();
                if body.len() as u64 > total * 8 || body.len() % 8 != 0 {
                    return Err(ProtocolError::Malformed {
                        kind: Kind::Verify,
                        reason: format!("{} bytes of hashes for {total} pages", body.len()),
                    }
                    .into());
                }
                image.hashes = Some(
                    body.chunks_exact(8)
                        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
                        .collect(),
                );
            }
            Kind::Complete => {
                protocol::read_body_into(c.reader(), &h, &mut body)?;
                return Ok(pages);
            }
            k => {
                return Err(ProtocolError::Unexpected {
                    got: k,
                    want: "Pages, ZeroRanges, Verify or Complete from a source",
                }
                .into())
            }
        }
    }
}

/// Resumes the move as the source's session, serving from `image`;
/// returns the pages the destination verified.
fn take_over(
    image: &Image,
    plan: &StandbyPlan,
    to: Endpoint,
    why: &str,
    beat: &dyn Fn(),
) -> Result<u64, MigrationError> {
    let ago = (crate::telemetry::unix_now() - plan.started_unix_s).max(0.0);
    let now = Instant::now();
    let t_start = now
        .checked_sub(Duration::from_secs_f64(ago.min(1e6)))
        .unwrap_or(now);
    let opts = MigrateOptions {
        mode: Mode::Postcopy,
        streams: plan.streams.clamp(1, 16),
        prefetch: plan.prefetch.min(1024),
        verify: plan.verify && image.hashes.is_some(),
        timeline_tail_ms: 0,
        reconnect_timeout_ms: TAKEOVER_RECONNECT.as_millis() as u64,
        ..MigrateOptions::default()
    };
    let paused = PausedPostcopy {
        session: Resumable {
            id: plan.session,
            version: plan.version,
            t_start,
        },
        to: to.clone(),
        opts,
        stats: MigrationStats {
            mode: Mode::Postcopy,
            postcopy: Some(PostcopyStats {
                pending_pages: plan.pending_pages,
                ..Default::default()
            }),
            ..Default::default()
        },
        epoch: Epoch {
            round: plan.round,
            t_post: now,
            paused_since: Some(now),
            landed: false,
        },
        reason: format!("the source went silent ({why}); its standby resumes"),
    };
    match crate::source::resume(image, paused, Some(to.clone()), &|_| beat())? {
        Outcome::Done(stats) => {
            tracing::info!(
                session = plan.session,
                %to,
                pages = stats.pages,
                verified = stats.verified_pages,
                "standby: the move is finished from here; the VM runs at the destination with all its memory"
            );
            Ok(stats.verified_pages)
        }
        Outcome::Paused(p) => Err(MigrationError::Unsupported(format!(
            "the standby could not finish the move: {}",
            p.reason
        ))),
    }
}
