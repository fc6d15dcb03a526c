//! Live figures of a migration in progress, for whoever watches it while it
//! runs: the timeline sampler (every 10 ms) and the Prometheus endpoint.
//!
//! The engine only stores here (relaxed atomics, a short lock per event);
//! it never waits on a reader. One [`Telemetry`] per migration, on each
//! side; the VMM hands it to the engine through
//! [`crate::vm::MigratableVm::telemetry`] / [`crate::vm::DestinationVm::telemetry`].

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Bytes through one connection, both ways.
#[derive(Debug, Default)]
pub struct LinkMeter {
    /// Written to the socket.
    pub sent: AtomicU64,
    /// Read from the socket.
    pub received: AtomicU64,
}

/// Where a migration is, as the watchers see it (KubeVirt's phases, the
/// ones a single VMM can know).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum LivePhase {
    /// Nothing started yet.
    Pending = 0,
    /// Connected, copying while the VM runs here (precopy rounds).
    Running = 1,
    /// The VM is paused for the switch.
    Switching = 2,
    /// The VM runs at the destination; memory still follows (postcopy).
    Postcopy = 3,
    /// The link broke in postcopy; waiting for it to come back.
    Paused = 4,
    /// Done: the VM runs at the destination.
    Succeeded = 5,
    /// Failed (the VM runs on at the source, or stays paused in doubt).
    Failed = 6,
}

impl LivePhase {
    /// Every phase, in order.
    pub const ALL: [LivePhase; 7] = [
        LivePhase::Pending,
        LivePhase::Running,
        LivePhase::Switching,
        LivePhase::Postcopy,
        LivePhase::Paused,
        LivePhase::Succeeded,
        LivePhase::Failed,
    ];

    /// Its name in the timeline and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            LivePhase::Pending => "pending",
            LivePhase::Running => "running",
            LivePhase::Switching => "switching",
            LivePhase::Postcopy => "postcopy",
            LivePhase::Paused => "paused",
            LivePhase::Succeeded => "succeeded",
            LivePhase::Failed => "failed",
        }
    }

    fn from_u8(v: u8) -> LivePhase {
        LivePhase::ALL
            .get(v as usize)
            .copied()
            .unwrap_or(LivePhase::Pending)
    }
}

/// Something that happened at one moment (a round began, the VM paused...).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    /// Seconds since the Unix epoch (this host's clock).
    pub t: f64,
    /// What: "open", "round", "pause", "state_sent", "complete", "started",
    /// "postcopy", "link_broken", "resumed", "finished", "failed".
    pub what: String,
    /// Details (round number, pages, the error...).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// The live figures of one migration, on one side.
#[derive(Debug)]
pub struct Telemetry {
    phase: AtomicU8,
    round: AtomicU32,
    /// Guest RAM the migration covers (bytes).
    total_bytes: AtomicU64,
    /// Pages still to send in this round (source) or still missing
    /// (destination, postcopy).
    remaining_pages: AtomicU64,
    /// Guest dirty rate of the last round (bytes/s).
    dirty_rate: AtomicU64,
    /// Auto-converge throttle in force (percent).
    throttle_pct: AtomicU32,
    /// Pages the source's rounds went through one by one so far, 4 KiB
    /// each, whether sent with data, found zero, sent as a reference or
    /// left out unchanged (round 0's holes known to be zero are not
    /// counted): not the bytes that crossed, which the links count.
    processed_bytes: AtomicU64,
    links: Mutex<Vec<(String, Arc<LinkMeter>)>>,
    events: Mutex<Vec<Event>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            phase: AtomicU8::new(LivePhase::Pending as u8),
            round: AtomicU32::new(0),
            total_bytes: AtomicU64::new(0),
            remaining_pages: AtomicU64::new(0),
            dirty_rate: AtomicU64::new(0),
            throttle_pct: AtomicU32::new(0),
            processed_bytes: AtomicU64::new(0),
            links: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One reading of every figure (what a sampler stores).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TelemetrySnapshot {
    /// Where the migration is.
    pub phase: String,
    /// Current precopy round.
    pub round: u32,
    /// Guest RAM covered (bytes).
    pub total_bytes: u64,
    /// Pages left in this round / still missing.
    pub remaining_pages: u64,
    /// Guest dirty rate (bytes/s) of the last round.
    pub dirty_rate: u64,
    /// Throttle in force (percent).
    pub throttle_pct: u32,
    /// Pages gone through so far at 4 KiB each (see [`Telemetry`]'s
    /// field): not bytes on the wire, which are the links' counts.
    pub processed_bytes: u64,
    /// Per connection: (name, bytes sent, bytes received).
    pub links: Vec<(String, u64, u64)>,
}

impl Telemetry {
    /// A fresh one, shared.
    pub fn new() -> Arc<Telemetry> {
        Arc::new(Telemetry::default())
    }

    /// The meter of connection `name` ("control", "bulk0", "demand"...):
    /// the same one again when a connection of that name reconnects, so
    /// its counts go on.
    pub fn link(&self, name: &str) -> Arc<LinkMeter> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, m)) = links.iter().find(|(n, _)| n == name) {
            return m.clone();
        }
        let m = Arc::new(LinkMeter::default());
        links.push((name.to_string(), m.clone()));
        m
    }

    /// Records that `what` happened now, and moves to `phase` if given.
    pub fn event(&self, what: &str, detail: impl Into<String>) {
        let e = Event {
            t: unix_now(),
            what: what.to_string(),
            detail: detail.into(),
        };
        tracing::debug!(what = %e.what, detail = %e.detail, "migration event");
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(e);
    }

    /// Sets the phase (and records it as an event when it changes).
    pub fn set_phase(&self, p: LivePhase) {
        let old = self.phase.swap(p as u8, Ordering::Relaxed);
        if old != p as u8 {
            self.event("phase", p.name());
        }
    }

    /// The phase now.
    pub fn phase(&self) -> LivePhase {
        LivePhase::from_u8(self.phase.load(Ordering::Relaxed))
    }

    /// A round began: its number and the pages it will send.
    pub fn round_began(&self, round: u32, pages: u64) {
        self.round.store(round, Ordering::Relaxed);
        self.remaining_pages.store(pages, Ordering::Relaxed);
        self.event("round", format!("{round}: {pages} pages"));
    }

    /// Guest RAM the migration covers.
    pub fn set_total_bytes(&self, b: u64) {
        self.total_bytes.store(b, Ordering::Relaxed);
    }

    /// Pages left to send (source) or missing (destination).
    pub fn set_remaining_pages(&self, n: u64) {
        self.remaining_pages.store(n, Ordering::Relaxed);
    }

    /// The dirty rate last measured and the throttle now in force.
    pub fn set_dirty(&self, rate: f64, throttle_pct: u32) {
        self.dirty_rate.store(rate as u64, Ordering::Relaxed);
        self.throttle_pct.store(throttle_pct, Ordering::Relaxed);
    }

    /// `pages` more pages were gone through (sent with data, as zero
    /// ranges or references, or left out unchanged).
    pub fn add_pages(&self, pages: u64) {
        self.processed_bytes
            .fetch_add(pages * crate::protocol::PAGE as u64, Ordering::Relaxed);
        let _ = self
            .remaining_pages
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                Some(r.saturating_sub(pages))
            });
    }

    /// Every figure now.
    pub fn snapshot(&self) -> TelemetrySnapshot {
        let links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        TelemetrySnapshot {
            phase: self.phase().name().to_string(),
            round: self.round.load(Ordering::Relaxed),
            total_bytes: self.total_bytes.load(Ordering::Relaxed),
            remaining_pages: self.remaining_pages.load(Ordering::Relaxed),
            dirty_rate: self.dirty_rate.load(Ordering::Relaxed),
            throttle_pct: self.throttle_pct.load(Ordering::Relaxed),
            processed_bytes: self.processed_bytes.load(Ordering::Relaxed),
            links: links
                .iter()
                .map(|(n, m)| {
                    (
                        n.clone(),
                        m.sent.load(Ordering::Relaxed),
                        m.received.load(Ordering::Relaxed),
                    )
                })
                .collect(),
        }
    }

    /// The events recorded since the last call (the sampler drains them).
    pub fn take_events(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Most bytes a timeline may unpack to (a hostile peer's zstd frame
/// cannot make this side allocate more).
pub const MAX_TIMELINE_BYTES: u64 = 256 << 20;

/// Packs timeline lines for the wire (zstd).
pub fn pack_lines(lines: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(lines, 3).unwrap_or_default()
}

/// Unpacks what [`pack_lines`] made, refusing more than
/// [`MAX_TIMELINE_BYTES`].
pub fn unpack_lines(body: &[u8]) -> Result<Vec<u8>, String> {
    use std::io::Read;
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let d = zstd::stream::read::Decoder::new(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    d.take(MAX_TIMELINE_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("not a zstd timeline: {e}"))?;
    if out.len() as u64 > MAX_TIMELINE_BYTES {
        return Err(format!(
            "timeline larger than {} MiB",
            MAX_TIMELINE_BYTES >> 20
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_pack_and_unpack_and_garbage_is_refused() {
        let lines = b"{\"t\":1}\n{\"t\":2}\n".repeat(100);
        assert_eq!(unpack_lines(&pack_lines(&lines)).unwrap(), lines);
        assert_eq!(unpack_lines(&[]).unwrap(), Vec::<u8>::new());
        assert!(unpack_lines(b"not zstd at all").is_err());
    }

    #[test]
    fn a_reconnected_link_keeps_counting() {
        let t = Telemetry::new();
        t.link("bulk0").sent.fetch_add(10, Ordering::Relaxed);
        t.link("bulk0").sent.fetch_add(5, Ordering::Relaxed);
        t.link("control").received.fetch_add(3, Ordering::Relaxed);
        let s = t.snapshot();
        assert_eq!(
            s.links,
            vec![("bulk0".into(), 15, 0), ("control".into(), 0, 3)]
        );
    }

    #[test]
    fn a_phase_change_is_an_event_and_events_drain() {
        let t = Telemetry::new();
        t.set_phase(LivePhase::Running);
        t.set_phase(LivePhase::Running);
        t.round_began(0, 100);
        t.add_pages(40);
        assert_eq!(t.snapshot().remaining_pages, 60);
        assert_eq!(t.snapshot().processed_bytes, 40 * 4096);
        let ev = t.take_events();
        assert_eq!(
            ev.iter().map(|e| e.what.as_str()).collect::<Vec<_>>(),
            ["phase", "round"]
        );
        assert!(t.take_events().is_empty());
    }
}
