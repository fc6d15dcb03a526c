//! The bulk streams leave a shared bottleneck's queue to the VM's own
//! traffic: precopy's rounds with `--share-link`, postcopy's push always
//! (so its demand answers do not wait behind it).
//!
//! A bulk TCP stream at the path's full rate keeps the bottleneck's queue
//! full, and the VM's answers to its clients wait in it: on the lab's
//! 1 Gbit link a kv VM's requests waited ~2 ms longer and it answered half
//! as many. Without a bandwidth limit the sender does not know the
//! bottleneck's rate, but each stream's TCP_INFO says how long its packets
//! now take (smoothed RTT) against the shortest they ever took (min RTT):
//! the difference is the queue. Like LEDBAT, the governor caps the streams
//! (the kernel paces their packets, SO_MAX_PACING_RATE) and steers the cap
//! by that delay: down to 85% of what they sent (at most once per rate
//! window, so one episode of queueing does not compound) while the queue is
//! over its target, up by a step of their best rate while it is well under.
//!
//! Where the host, not the network, is what is slow (a CPU-bound receiver,
//! a busy host's scheduling), the RTT grows too: on this machine's
//! loopback to ~2.5 ms against a min of ~5 µs, as much as the lab's
//! 1 Gbit queue. Slowing down buys nothing there, so to be on by default
//! the governor counts a delay as a queue only when it looks like one:
//! - the stream is not held back by its receiver's window
//!   ([`WindowWatch`]: TCP_INFO's rwnd_limited, 40-60% of the busy time
//!   on loopback, 0% behind the lab's queue);
//! - the RTT is steady ([`STEADY_SHARE`]: a standing queue's mean
//!   deviation is small, a busy host's is not);
//! - it stands in every sample of a period (the shortest one steers);
//! - cuts drain it: after [`FUTILE_CUTS`] cuts that did not halve it, the
//!   cap comes off and the target rises above it;
//! - and the peer is not on loopback.
//!
//! Postcopy's push counts any delay ([`Governor::for_push`]): its demand
//! answers wait behind it, whatever made the queue. It also starts slow
//! (capped at [`START_RATE`], the cap growing by [`START_GROWTH`] a period
//! until the first queue): uncapped, its first 100 ms filled the lab's
//! shaped link to its 50 ms queue, and the guest's first faults after the
//! switch, and its clients' requests, waited in it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The queueing delay (µs) over which the streams back off.
pub(crate) const TARGET_US: u32 = 250;
/// At most one change of the cap per period.
const PERIOD: Duration = Duration::from_millis(10);
/// The cap after a period over the target, as a share of what the streams
/// sent over the last rate window (or of the cap, if lower).
const DECREASE: f64 = 0.85;
/// What a period well under the target adds to the cap, as a share of the
/// path's best rate: precopy's rounds. Each climb ends in a queue that
/// the next cut drains, and the VM's clients wait in it: at 2% a period
/// (the push's step) the cap climbed 15% in ~70 ms, overshot the
/// bottleneck by that much, and the queue stood at 1-2 ms for ~20-40% of
/// round 0 (pings through the lab's shaped link); at 0.2% it came back
/// in ~0.8 s and stood over 200 µs for 7-11%.
const INCREASE: f64 = 0.002;
/// The push's step: it yields to demand answers that come and go with the
/// guest's faults, and must take the link back as soon as they are gone.
const PUSH_INCREASE: f64 = 0.02;
/// A slow start's first cap, all streams together (bytes/s): 200 Mbit/s.
const START_RATE: f64 = 25e6;
/// A slow start's cap grows by this factor a period until the first
/// period over the target: 25 MB/s reaches a 1 Gbit link in ~8 periods,
/// and overshoots it by at most this share for the period it takes the
/// RTT to tell.
const START_GROWTH: f64 = 1.25;
/// A slow start grows by this factor at most between two samples.
const START_MAX_STEP: f64 = 1.5;
/// A slow start that never met a queue ends here, uncapped (bytes/s).
const START_MAX: f64 = 10e9;
/// The cap never goes below this share of the path's best rate (the move
/// must end).
const FLOOR: f64 = 0.1;
/// After this many cuts in a row that did not halve the queue, the delay
/// is taken for the hosts' own and the target rises above it.
const FUTILE_CUTS: u32 = 2;
/// The highest the target rises (µs).
const MAX_TARGET_US: u32 = 20_000;

/// One stream's view of its path, from TCP_INFO.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PathSample {
    /// Smoothed round-trip time (µs).
    pub srtt_us: u32,
    /// Its mean deviation (µs).
    pub rttvar_us: u32,
    /// The shortest round trip seen (µs).
    pub min_rtt_us: u32,
    /// The stream waited on its receiver's window for much of its recent
    /// busy time ([`WindowWatch`]): the receiver is the slow part, and a
    /// long RTT is not a network queue.
    pub receiver_limited: bool,
    /// The peer is on a loopback address: no link is shared.
    pub to_loopback: bool,
}

impl PathSample {
    /// How long packets wait in network queues now (µs): none while the
    /// receiver is what holds the stream back, or while the RTT jumps
    /// about (a standing queue holds it steady).
    pub(crate) fn queue_us(&self) -> u32 {
        let unsteady = self.rttvar_us as f64 > STEADY_SHARE * self.srtt_us as f64;
        if self.receiver_limited || unsteady || self.to_loopback {
            return 0;
        }
        self.raw_queue_us()
    }

    /// The RTT over its shortest, whatever its cause (µs).
    pub(crate) fn raw_queue_us(&self) -> u32 {
        self.srtt_us.saturating_sub(self.min_rtt_us)
    }
}

/// A standing queue holds the RTT steady: its mean deviation stayed under
/// 0.15 of it behind the lab's 1 Gbit queue, while a busy host's
/// scheduling delays put it at 0.44-1.8 (10th to 90th percentile, the lab
/// unshaped with 128 kv clients and 8 kv workers on its two cores).
const STEADY_SHARE: f64 = 0.2;

/// Over this share of its busy time waiting on the receiver's window, a
/// stream is held back by its receiver (the lab's 1 Gbit queue: 0%; this
/// machine's loopback: 40-60%).
const RECEIVER_LIMITED_SHARE: f64 = 0.1;
/// The kernel counts busy and window-limited time in jiffies (4 ms here):
/// shares are taken over at least this much busy time.
const WATCH_SPAN_US: u64 = 40_000;

/// One stream's verdict on whether its receiver holds it back, from
/// TCP_INFO's cumulative busy time and time limited by the receiver's
/// window, over spans of [`WATCH_SPAN_US`] of busy time.
#[derive(Debug, Default)]
pub(crate) struct WindowWatch {
    /// Busy and receiver-limited time (µs) where the current span began.
    base: Option<(u64, u64)>,
    /// The verdict of the last full span.
    limited: bool,
}

impl WindowWatch {
    /// Takes the stream's counters now and returns the latest verdict.
    pub(crate) fn update(&mut self, busy_us: u64, rwnd_limited_us: u64) -> bool {
        match self.base {
            None => self.base = Some((busy_us, rwnd_limited_us)),
            Some((busy0, rwnd0)) => {
                let busy = busy_us.saturating_sub(busy0);
                if busy >= WATCH_SPAN_US {
                    let waited = rwnd_limited_us.saturating_sub(rwnd0);
                    self.limited = waited as f64 > RECEIVER_LIMITED_SHARE * busy as f64;
                    self.base = Some((busy_us, rwnd_limited_us));
                }
            }
        }
        self.limited
    }
}

#[derive(Debug, Default)]
struct State {
    /// The cap on all streams together (bytes/s); None until the first
    /// period over the target.
    cap: Option<f64>,
    /// The highest rate the streams sent at over a [`RATE_WINDOW`], all
    /// together (what the path carried, as far as known).
    best: f64,
    /// The latest such rate.
    recent: f64,
    /// Bytes the streams sent, all rounds together.
    total: u64,
    /// Where the current rate window began: when, and `total` then.
    window: Option<(Instant, u64)>,
    /// When a sample last counted (one a period).
    last: Option<Instant>,
    /// The shortest queue any sample saw since then: a network queue
    /// stands in every sample, while a busy host's scheduling delays
    /// make the RTT jump about (50-450 µs on this machine's loopback with
    /// no queue at all), so one long sample alone is not a queue.
    least_queue: Option<u32>,
    /// When the cap last went down (one decrease a rate window: the RTT
    /// and the measured rate trail a cut by that long).
    last_decrease: Option<Instant>,
    /// The last cut, until judged: the queue that caused it and the
    /// shortest queue seen since.
    judging: Option<(u32, u32)>,
    /// Cuts in a row after which the queue did not even halve.
    futile: u32,
    /// The queueing delay over which the streams back off (µs): [`TARGET_US`],
    /// raised above a delay that cuts proved not to be a queue.
    target: u32,
    /// Starting slow: the cap grows by [`START_GROWTH`] a period until the
    /// first period over the target. Decided at the first sample.
    starting: Option<bool>,
}

impl State {
    /// One period's decision on the shortest queue its samples saw.
    /// `judge` says whether cuts that drain nothing lift the cap.
    fn steer(&mut self, queue: u32, now: Instant, judge: bool, increase: f64, since: Duration) {
        let target = self.target.max(TARGET_US);
        if self.starting == Some(true) {
            let cap = self.cap.unwrap_or(START_RATE);
            if queue > target {
                // The path is full: from here the usual steering.
                self.starting = Some(false);
                let sent = cap.min(if self.recent > 0.0 { self.recent } else { cap });
                // What the path carried when it filled, if no rate window
                // has told yet: the climb back is steps of it.
                self.best = self.best.max(sent);
                self.cap = Some(sent * DECREASE);
                self.last_decrease = Some(now);
                self.judging = Some((queue, u32::MAX));
            } else if queue < target / 2 {
                // By the time since the last sample: a stream sends a batch
                // between samples, which takes long at a low cap.
                let periods = since.as_secs_f64() / PERIOD.as_secs_f64();
                let up = cap * START_GROWTH.powf(periods.max(1.0)).min(START_MAX_STEP);
                // Far past any link it could have met: no cap.
                self.cap = (up < START_MAX).then_some(up);
                self.starting = Some(up < START_MAX);
            }
            return;
        }
        if let Some((_, least)) = self.judging.as_mut() {
            *least = (*least).min(queue);
        }
        let may_cut = self
            .last_decrease
            .is_none_or(|t| now.duration_since(t) >= RATE_WINDOW);
        if may_cut && judge {
            if let Some((caused, least)) = self.judging.take() {
                // A bottleneck's queue drains once the streams send below
                // its rate; a delay that a cut does not even halve is the
                // hosts' (CPU, scheduling), and slowing down buys nothing.
                self.futile = if least.saturating_mul(2) > caused {
                    self.futile + 1
                } else {
                    0
                };
                if self.futile >= FUTILE_CUTS {
                    self.futile = 0;
                    self.cap = None;
                    self.target = least.saturating_mul(2).clamp(target, MAX_TARGET_US);
                    return;
                }
            }
        }
        if queue > target && may_cut && self.recent > 0.0 {
            let from = self.cap.unwrap_or(self.recent).min(self.recent);
            self.cap = Some((from * DECREASE).max(self.best * FLOOR));
            self.last_decrease = Some(now);
            self.judging = Some((queue, u32::MAX));
        } else if queue < target / 2 {
            if let Some(cap) = self.cap {
                let up = cap + self.best * increase;
                // Past the best the streams ever did a cap holds nothing
                // back: lift it until the queue says otherwise.
                self.cap = (up < self.best).then_some(up);
            }
        }
    }
}

/// The window over which the streams' rate is measured: long enough that
/// the socket buffers' filling does not count as the path's rate.
const RATE_WINDOW: Duration = Duration::from_millis(100);

/// Shared by the bulk streams of one migration; see the module.
#[derive(Debug)]
pub(crate) struct Governor {
    streams: usize,
    /// Only a delay that looks like a network queue counts (precopy's
    /// rounds); off: any delay does (postcopy's push, which must leave
    /// every bit of room to the demand answers queued behind it: with the
    /// checks on, kv lost 86-90% during a postcopy against 76%).
    host_aware: bool,
    /// What a period well under the target adds to the cap (a share of
    /// the best rate).
    increase: f64,
    /// Start capped at [`START_RATE`] and grow (not on loopback, where no
    /// link is shared).
    slow_start: bool,
    state: Mutex<State>,
}

impl Governor {
    /// A governor for `streams` bulk streams, none capped yet, that
    /// counts only a delay that looks like a network queue.
    pub(crate) fn new(streams: usize) -> Self {
        Governor {
            streams: streams.max(1),
            host_aware: true,
            increase: INCREASE,
            slow_start: false,
            state: Mutex::new(State::default()),
        }
    }

    /// A governor for postcopy's push: it starts slow, any delay counts,
    /// one sample a period, and a cut is never judged futile.
    pub(crate) fn for_push(streams: usize) -> Self {
        Governor {
            host_aware: false,
            increase: PUSH_INCREASE,
            slow_start: true,
            ..Governor::new(streams)
        }
    }

    /// The best rate the streams sent at over a rate window (bytes/s).
    #[cfg(test)]
    pub(crate) fn best_rate(&self) -> f64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).best
    }

    /// True while the streams are held below their rate (a queue was seen
    /// and has not gone, or the slow start has not met the path's rate).
    pub(crate) fn capped(&self) -> bool {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.cap.is_some()
    }

    /// Takes one stream's sample after it sent `bytes` more (once a period
    /// the shortest queue sampled in it steers the cap), and returns the
    /// cap each stream should keep to now (bytes/s; None: none).
    pub(crate) fn observe(&self, s: PathSample, bytes: u64, now: Instant) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.starting.is_none() {
            let slow = self.slow_start && !s.to_loopback;
            st.starting = Some(slow);
            if slow {
                st.cap = Some(START_RATE);
            }
        }
        st.total = st.total.saturating_add(bytes);
        let sent = st.total;
        match st.window {
            None => st.window = Some((now, sent)),
            Some((t, b)) if now.duration_since(t) >= RATE_WINDOW => {
                st.recent = sent.saturating_sub(b) as f64 / now.duration_since(t).as_secs_f64();
                st.best = st.best.max(st.recent);
                st.window = Some((now, sent));
            }
            Some(_) => {}
        }
        if s.min_rtt_us > 0 {
            if self.host_aware {
                let q = s.queue_us();
                st.least_queue = Some(st.least_queue.map_or(q, |l| l.min(q)));
            } else {
                st.least_queue = Some(s.raw_queue_us());
            }
        }
        let since = st.last.map_or(PERIOD, |t| now.duration_since(t));
        let due = since >= PERIOD;
        if due && st.best == 0.0 && st.starting != Some(true) {
            // No rate to cut from yet: these samples steer nothing.
            st.last = Some(now);
            st.least_queue = None;
        } else if due {
            if let Some(queue) = st.least_queue.take() {
                st.last = Some(now);
                st.steer(queue, now, self.host_aware, self.increase, since);
            }
        }
        st.cap.map(|c| (c / self.streams as f64).max(1.0) as u64)
    }
}

#[cfg(test)]
mod tests;
