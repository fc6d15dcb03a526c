//! The source's side of the postcopy safety net (`--safety-net`): once the
//! VM runs at the destination, a thread copies every page the destination
//! still lacks to a third host's `ferry standby` (the VM is paused here for
//! good, so the copy is final), with the page hashes when verifying, and
//! then tells the standby every second that this source lives. When the
//! move ends it releases the standby; if this process dies the beats stop,
//! and the standby resumes the postcopy as this session (standby/).
//!
//! The copy crosses a link while the destination already runs: until the
//! standby says it holds every page, a source that dies still takes the
//! pages only it has (docs/agent.md explains why no design closes that
//! window for free).
//!
//! With `--net-finishes` the net also finishes the move: the source holds
//! its push (only faults are answered) while this copy runs at the push's
//! priority, and once the standby holds every page the source closes its
//! links to the destination and hands over ([`Net::hand_over`]: a
//! StandbyTakeOver frame); the standby resumes the move at once and
//! pushes the rest from its own host. Each page leaves the source's host
//! once instead of once to each peer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::{Fill, PageBatch};
use crate::error::MigrationError;
use crate::memory::RegionView;
use crate::protocol::{self, Hello, Kind, ProtocolError, Role, StandbyPlan, MAX_BATCH};
use crate::ranges::{GpaPages, OffsetBytes};
use crate::telemetry::Telemetry;
use crate::transport::{Closer, Conn, Endpoint};

/// How often the source tells its standby it lives (and a standby that
/// was handed a move tells its source).
pub(crate) const BEAT: Duration = Duration::from_secs(1);
/// A standby finishing a move it was handed says nothing for this long: it
/// is gone (it may wait up to a minute for the destination to take it).
pub(crate) const HANDED_SILENCE: Duration = Duration::from_secs(90);
/// A push that waits for the net (`--net-finishes`) waits no longer than
/// this for a copy that stopped moving (a standby stopped, its link cut
/// or blackholed): the net is dropped and the source pushes itself.
pub(crate) const STALL: Duration = Duration::from_secs(3);
/// Reaching the standby takes at most this long (at most the session
/// timeout): a standby's host that is gone costs the feed no more.
const CONNECT_WITHIN: Duration = Duration::from_secs(5);
/// The move is over: the feed has this long to say so to its standby
/// (Complete) and end; past it, its link is cut (a standby that stalls
/// would otherwise keep the feed, and the move's end, waiting for a
/// write or read timeout: up to a minute).
const END_GRACE: Duration = Duration::from_secs(2);

/// What the feeding thread needs, taken from the session at the switch.
pub(crate) struct NetFeed {
    pub(crate) net: Endpoint,
    pub(crate) plan: StandbyPlan,
    pub(crate) regions: Vec<RegionView>,
    pub(crate) pending: Vec<GpaPages>,
    /// Per region, what may hold data (the hashes cover it), when verifying.
    pub(crate) verify: Option<Vec<Vec<OffsetBytes>>>,
    pub(crate) timeout: Duration,
    pub(crate) tel: Arc<Telemetry>,
    /// The net finishes the move (`--net-finishes`): copy at the push's
    /// priority, not below it, and within the move's bandwidth limit.
    pub(crate) finishes: bool,
    /// `--bandwidth` (bytes/s), for a net that finishes the move: its copy
    /// is then the source's bulk traffic (a drain's budget per host).
    pub(crate) bandwidth: Option<f64>,
}

/// Where the copy stands, for a source that hands over once it is armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NetState {
    /// Still sending, or waiting for StandbyHeld.
    Copying,
    /// The standby holds every pending page.
    Armed,
    /// The net failed: the move goes on without it.
    Lost,
}

/// The running net: ends with [`release`](Self::release) (the move is
/// done: the standby drops its copy) or [`abandon`](Self::abandon) (this
/// side stops; the standby takes over).
pub(crate) struct Net {
    stop: Arc<AtomicBool>,
    release: Arc<AtomicBool>,
    hand_over: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    sent: Arc<Sent>,
    /// Cuts the link to the standby once the feed has opened it.
    link: Arc<std::sync::Mutex<Option<Closer>>>,
    /// When the feed started ([`Sent::moved_ms`] counts from it).
    t0: Instant,
}

/// What the feed did, for the move's figures.
pub(crate) struct Sent {
    /// Bytes written to the standby.
    pub(crate) bytes: AtomicU64,
    /// The standby said it holds every page.
    pub(crate) armed: AtomicBool,
    /// The feed failed (the move goes on without a net).
    pub(crate) lost: AtomicBool,
    /// The standby said it finished the move it was handed.
    pub(crate) finished: AtomicBool,
    /// The pages the destination verified, as the standby that finished
    /// the move said in its Complete ([`NOT_SAID`] if it did not).
    pub(crate) verified: AtomicU64,
    /// When the copy last moved (ms after the feed started): connected,
    /// a batch written, Complete sent, StandbyHeld read.
    moved_ms: AtomicU64,
    /// Why the feed failed.
    why_lost: std::sync::Mutex<Option<String>>,
}

/// `Sent::verified` before (or without) a standby's word on it.
const NOT_SAID: u64 = u64::MAX;

impl Default for Sent {
    fn default() -> Sent {
        Sent {
            bytes: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            verified: AtomicU64::new(NOT_SAID),
            moved_ms: AtomicU64::new(0),
            why_lost: std::sync::Mutex::new(None),
        }
    }
}

impl Sent {
    /// What the standby that finished the move said the destination
    /// verified (None: it did not say, e.g. an older standby).
    pub(crate) fn verified(&self) -> Option<u64> {
        Some(self.verified.load(Ordering::Acquire)).filter(|&v| v != NOT_SAID)
    }

    /// The feed failed for `why` (the first reason stays).
    fn lose(&self, why: String) {
        let mut w = self.why_lost.lock().unwrap_or_else(|p| p.into_inner());
        w.get_or_insert(why);
        self.lost.store(true, Ordering::Release);
    }
}

impl Net {
    /// Starts feeding the standby on a thread of its own.
    pub(crate) fn start(feed: NetFeed) -> Net {
        let stop = Arc::new(AtomicBool::new(false));
        let release = Arc::new(AtomicBool::new(false));
        let hand_over = Arc::new(AtomicBool::new(false));
        let (st, rel, hand) = (stop.clone(), release.clone(), hand_over.clone());
        let sent = Arc::new(Sent::default());
        let sent2 = sent.clone();
        let link: Arc<std::sync::Mutex<Option<Closer>>> = Arc::default();
        let link2 = link.clone();
        let t0 = Instant::now();
        let thread = std::thread::Builder::new()
            .name("safety-net".into())
            .spawn(move || {
                let tel = feed.tel.clone();
                let net = feed.net.to_string();
                let feeding = Feeding {
                    stop: &st,
                    release: &rel,
                    hand_over: &hand,
                    sent: &sent2,
                    link: &link2,
                    t0,
                };
                if let Err(e) = run(feed, &feeding) {
                    // A net dropped as stalled said so already.
                    let dropped = sent2.lost.load(Ordering::Acquire);
                    sent2.lose(e.to_string());
                    if !dropped {
                        tracing::warn!(%net, error = %e, "the postcopy safety net failed: the move goes on without it");
                        tel.event("safety_net_lost", format!("{net}: {e}"));
                    }
                }
            })
            .ok();
        Net {
            stop,
            release,
            hand_over,
            thread,
            sent,
            link,
            t0,
        }
    }

    /// True while the copy is under way but has not moved for `within`
    /// (its standby or the link to it stalls).
    pub(crate) fn stalled(&self, within: Duration) -> bool {
        let moved = Duration::from_millis(self.sent.moved_ms.load(Ordering::Acquire));
        self.state() == NetState::Copying && self.t0.elapsed().saturating_sub(moved) >= within
    }

    /// Gives the net up now (`why`: its copy stalled): its link is cut,
    /// the feed ends, and the move goes on without it ([`NetState::Lost`]).
    pub(crate) fn drop_stalled(&self, why: &str) {
        self.sent.lose(why.to_string());
        tracing::warn!(
            why,
            "the postcopy safety net stalls: dropped; the source finishes the move itself"
        );
        if let Some(c) = self.link.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            c.shutdown();
        }
    }

    /// The move is done: the standby may drop its copy. What the feed did.
    pub(crate) fn release(mut self) -> Arc<Sent> {
        self.release.store(true, Ordering::Release);
        self.end();
        self.sent.clone()
    }

    /// Bytes sent to the standby so far.
    pub(crate) fn sent_bytes(&self) -> u64 {
        self.sent.bytes.load(Ordering::Relaxed)
    }

    /// Where the copy stands (a net that failed is lost, armed before or
    /// not).
    pub(crate) fn state(&self) -> NetState {
        if self.sent.lost.load(Ordering::Acquire) || self.thread.is_none() {
            NetState::Lost
        } else if self.sent.armed.load(Ordering::Acquire) {
            NetState::Armed
        } else {
            NetState::Copying
        }
    }

    /// This side has closed its links to the destination: the armed
    /// standby is told to resume the move at once, and this waits until it
    /// says it finished (Ok: the pages the destination verified, as the
    /// standby said) or fails or falls silent for
    /// [`HANDED_SILENCE`] (Err: why; this side, which still holds every
    /// page, then resumes the move itself). `waiting` is called every
    /// 50 ms meanwhile.
    pub(crate) fn hand_over(&self, waiting: &dyn Fn()) -> Result<Option<u64>, String> {
        self.hand_over.store(true, Ordering::Release);
        loop {
            if self.sent.finished.load(Ordering::Acquire) {
                return Ok(self.sent.verified());
            }
            let ended = self.thread.as_ref().is_none_or(JoinHandle::is_finished);
            if self.sent.lost.load(Ordering::Acquire) || ended {
                // The thread sets `finished` before it ends.
                if self.sent.finished.load(Ordering::Acquire) {
                    return Ok(self.sent.verified());
                }
                let why = self.sent.why_lost.lock().unwrap_or_else(|p| p.into_inner());
                return Err(why
                    .clone()
                    .unwrap_or_else(|| "the standby's feed ended".into()));
            }
            waiting();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The feed has ended (or is to end now): what it did.
    pub(crate) fn ended(mut self) -> Arc<Sent> {
        self.end();
        self.sent.clone()
    }

    /// This side stops serving with pages still missing there: the
    /// standby is left to resume the move. What the feed did.
    pub(crate) fn abandon(mut self) -> Arc<Sent> {
        self.end();
        self.sent.clone()
    }

    /// Stops the feed: it has [`END_GRACE`] to end by itself (releasing
    /// its standby), then its link is cut, so a standby that stalls never
    /// holds up the move's end.
    fn end(&mut self) {
        self.stop.store(true, Ordering::Release);
        let Some(t) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + END_GRACE;
        while !t.is_finished() {
            if Instant::now() >= deadline {
                // (Again each time: the feed may open its link meanwhile.)
                if let Some(c) = self.link.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    c.shutdown();
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = t.join();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.end();
    }
}

/// What the feeding thread shares with its [`Net`].
struct Feeding<'a> {
    stop: &'a AtomicBool,
    release: &'a AtomicBool,
    hand_over: &'a AtomicBool,
    sent: &'a Sent,
    link: &'a std::sync::Mutex<Option<Closer>>,
    t0: Instant,
}

impl Feeding<'_> {
    /// The copy moved just now.
    fn moved(&self) {
        let ms = u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.sent.moved_ms.store(ms, Ordering::Release);
    }
}

fn run(feed: NetFeed, f: &Feeding<'_>) -> Result<(), MigrationError> {
    let (stop, release, hand_over, sent) = (f.stop, f.release, f.hand_over, f.sent);
    // A net that finishes the move is the source's only bulk sender.
    if feed.finishes {
        crate::priority::background();
    } else {
        crate::priority::lowest();
    }
    let t0 = Instant::now();
    let hello = Hello {
        version_min: protocol::VERSION_STANDBY,
        version_max: protocol::VERSION_MAX,
        role: Role::Standby,
        session: feed.plan.session,
        streams: 1,
    };
    let mut c = Conn::open(&feed.net, feed.timeout.min(CONNECT_WITHIN), &hello)?;
    c.set_timeouts(Some(feed.timeout))
        .map_err(ProtocolError::Io)?;
    *f.link.lock().unwrap_or_else(|p| p.into_inner()) = c.closer().ok();
    if stop.load(Ordering::Acquire) || sent.lost.load(Ordering::Acquire) {
        // The move ended (or gave the net up) while this connected.
        return Ok(());
    }
    f.moved();
    c.flush()?;
    let version: u16 = c.recv(Kind::HelloAck)?;
    if !crate::protocol::Caps::of(version).standby() {
        return Err(ProtocolError::Version {
            min: protocol::VERSION_STANDBY,
            max: version,
        }
        .into());
    }
    c.send(Kind::StandbyPlan, &feed.plan)?;
    let sealed = c.writer_seals();
    let fill = if sealed { Fill::SEALED } else { Fill::RAW };
    let mut b = PageBatch::default();
    let mut bytes = 0u64;
    let pacer = crate::pacer::Pacer::new(feed.bandwidth.filter(|_| feed.finishes));
    let pages = feed.pending.iter().flat_map(|r| r.page_addrs());
    let mut pages = pages.peekable();
    while pages.peek().is_some() {
        if stop.load(Ordering::Acquire) {
            // The move ended before the copy did: nothing to stand by for.
            return Ok(());
        }
        b.fill_upto(&feed.regions, &mut pages, fill, MAX_BATCH);
        let n = b
            .write_pages_spending(c.writer(), sealed)
            .map_err(ProtocolError::Io)?
            + b.write_zeros(c.writer())?;
        bytes += n;
        sent.bytes.fetch_add(n, Ordering::Relaxed);
        f.moved();
        // (Sleeping within `--bandwidth` is no stall.)
        pacer.pace(bytes, c.writer()).map_err(ProtocolError::Io)?;
        f.moved();
    }
    if let Some(ranges) = &feed.verify {
        let hashes = crate::session::hashes(&feed.regions, |i| ranges[i].clone());
        let body: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        protocol::write_frame(c.writer(), Kind::Verify, &body).map_err(ProtocolError::Io)?;
    }
    c.send_frame(Kind::Complete, &[])?;
    f.moved();
    // The standby answers once it holds every page.
    let _ = c.set_read_timeout(Some(feed.timeout.max(Duration::from_secs(60))));
    c.recv::<u64>(Kind::StandbyHeld)?;
    if sent.lost.load(Ordering::Acquire) {
        // Dropped as stalled meanwhile: the push has gone on without it.
        return Ok(());
    }
    sent.armed.store(true, Ordering::Release);
    let secs = t0.elapsed().as_secs_f64();
    tracing::info!(net = %feed.net, pages = feed.plan.pending_pages, bytes, secs, "postcopy safety net armed: a third host holds every page the destination lacks");
    feed.tel.event(
        "safety_net_armed",
        format!(
            "{} holds {} pages ({bytes} bytes) after {secs:.2} s",
            feed.net, feed.plan.pending_pages
        ),
    );
    let mut beat = Instant::now();
    while !stop.load(Ordering::Acquire) && !hand_over.load(Ordering::Acquire) {
        // Short: a source handing over waits for this loop to see it.
        std::thread::sleep(Duration::from_millis(5));
        if beat.elapsed() >= BEAT {
            c.send_frame(Kind::StandbyBeat, &[])?;
            beat = Instant::now();
        }
    }
    if hand_over.load(Ordering::Acquire) {
        c.send_frame(Kind::StandbyTakeOver, &[])?;
        feed.tel
            .event("handed_over", format!("{} finishes the move", feed.net));
        // It beats while it finishes, and says Complete at the end.
        let _ = c.set_read_timeout(Some(HANDED_SILENCE));
        loop {
            let f = protocol::read_frame(c.reader())?;
            match f.kind {
                Kind::StandbyBeat => continue,
                Kind::Complete => {
                    // Its body: the pages the destination verified (u64),
                    // hostile like any count: at most the guest's pages.
                    let pages: u64 = feed.regions.iter().map(|r| r.size() / 4096).sum();
                    match <[u8; 8]>::try_from(f.body.as_slice()).map(u64::from_le_bytes) {
                        Ok(v) if v <= pages => sent.verified.store(v, Ordering::Release),
                        Ok(v) => tracing::warn!(
                            net = %feed.net,
                            "the standby says {v} pages were verified, more than the guest's {pages}: ignored"
                        ),
                        Err(_) => {} // an older standby says nothing
                    }
                    break;
                }
                k => {
                    return Err(ProtocolError::Unexpected {
                        got: k,
                        want: "StandbyBeat or Complete from a standby finishing a move",
                    }
                    .into())
                }
            }
        }
        sent.finished.store(true, Ordering::Release);
        tracing::info!(net = %feed.net, "the standby finished the move it was handed");
        feed.tel.event("standby_finished", feed.net.to_string());
    } else if release.load(Ordering::Acquire) {
        c.send_frame(Kind::Complete, &[])?;
    }
    c.shutdown();
    Ok(())
}
