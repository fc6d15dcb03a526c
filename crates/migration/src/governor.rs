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
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn queue(queue_us: u32) -> PathSample {
        PathSample {
            srtt_us: 30 + queue_us,
            rttvar_us: 5,
            min_rtt_us: 30,
            receiver_limited: false,
            to_loopback: false,
        }
    }

    /// Feeds `g` a sample every period for `periods`, the streams sending
    /// at `rate` (or at the cap, if lower); returns the last cap and the
    /// time reached.
    fn run(
        g: &Governor,
        q: u32,
        rate: f64,
        periods: u32,
        mut now: Instant,
    ) -> (Option<u64>, Instant) {
        let mut cap = g.observe(queue(q), 0, now);
        for _ in 0..periods {
            let total = cap.map_or(rate, |c| (c as f64 * g.streams as f64).min(rate));
            now += PERIOD;
            cap = g.observe(queue(q), (total * PERIOD.as_secs_f64()) as u64, now);
        }
        (cap, now)
    }

    #[test]
    fn no_queue_no_cap() {
        let g = Governor::new(2);
        let (cap, _) = run(&g, 20, 120.0 * MB, 50, Instant::now());
        assert_eq!(cap, None);
    }

    #[test]
    fn a_growing_queue_caps_the_streams_below_their_rate_then_it_comes_off() {
        // Two streams sending 120 MB/s together, no queue for 200 ms: the
        // governor learns the rate and caps nothing.
        let g = Governor::new(2);
        let (cap, at) = run(&g, 0, 120.0 * MB, 20, Instant::now());
        assert_eq!(cap, None);
        // A queue builds: the first period over the target caps them at
        // 85% of their rate...
        let (cap, at) = run(&g, 2000, 120.0 * MB, 1, at);
        let first = cap.unwrap() as f64 * 2.0;
        assert!(
            (first - 120.0 * MB * DECREASE).abs() < 0.02 * 120.0 * MB,
            "{first}"
        );
        // ...and holds it for a rate window, whatever the queue says (the
        // RTT trails the cut)...
        let (held, at) = run(&g, 2000, 120.0 * MB, 8, at);
        assert_eq!(held, cap);
        // ...then cuts again, once a window...
        let (cap2, at) = run(&g, 2000, 120.0 * MB, 3, at);
        assert!(
            (cap2.unwrap() as f64) < cap.unwrap() as f64 * 0.9,
            "{cap2:?}"
        );
        // ...never below a tenth of the best rate, while the cuts do drain
        // the queue (it falls under the target once a window, and comes
        // back).
        let mut at = at;
        for _ in 0..80 {
            (_, at) = run(&g, 2000, 120.0 * MB, 4, at);
            (_, at) = run(&g, TARGET_US - 10, 120.0 * MB, 1, at);
        }
        let (cap, at) = run(&g, 2000, 120.0 * MB, 1, at);
        let floor = cap.unwrap() as f64 * 2.0;
        assert!(
            (floor - 120.0 * MB * FLOOR).abs() < 0.05 * 120.0 * MB,
            "{floor}"
        );
        // Between half the target and the target the cap holds.
        let (held, at) = run(&g, TARGET_US - 10, 120.0 * MB, 10, at);
        assert_eq!(held, cap);
        // The queue gone, it grows by 0.2% of the best a period (the
        // push's 2%: the_push_climbs_back_ten_times_faster), and comes off
        // once it would pass the best: not within 400 periods from a
        // tenth of it, within 460.
        let (up, at) = run(&g, 0, 120.0 * MB, 1, at);
        let step = (up.unwrap() as f64 - cap.unwrap() as f64) * 2.0;
        assert!(
            (step - 120.0 * MB * INCREASE).abs() < 0.001 * 120.0 * MB,
            "{step}"
        );
        let (still, at) = run(&g, 0, 120.0 * MB, 400, at);
        assert!(still.is_some());
        let (off, _) = run(&g, 0, 120.0 * MB, 60, at);
        assert_eq!(off, None);
    }

    #[test]
    fn a_new_round_does_not_read_as_a_stalled_path() {
        // The byte count runs across rounds: a queue seen as a round starts
        // (nothing sent in it yet) cuts from the rate the streams had, not
        // from nothing down to the floor.
        let g = Governor::new(1);
        let (_, at) = run(&g, 0, 120.0 * MB, 100, Instant::now());
        let (cap, _) = run(&g, 2000, 120.0 * MB, 0, at + PERIOD);
        let cap = cap.unwrap() as f64;
        assert!(cap > 0.5 * 120.0 * MB, "{cap}");
    }

    #[test]
    fn samples_before_a_rate_is_known_or_without_an_rtt_change_nothing() {
        let g = Governor::new(1);
        let t = Instant::now();
        // No rate window has closed yet.
        assert_eq!(g.observe(queue(5000), 0, t), None);
        assert_eq!(g.observe(queue(5000), 1 << 20, t + PERIOD), None);
        // A window closed, but the kernel gave no min RTT.
        let no_rtt = PathSample {
            srtt_us: 5000,
            rttvar_us: 5,
            min_rtt_us: 0,
            receiver_limited: false,
            to_loopback: false,
        };
        assert_eq!(g.observe(no_rtt, 100 << 20, t + RATE_WINDOW * 2), None);
        // With one, the same queue caps.
        assert!(g
            .observe(queue(5000), 1 << 20, t + RATE_WINDOW * 2 + PERIOD)
            .is_some());
    }

    #[test]
    fn a_long_rtt_behind_a_slow_receiver_caps_nothing() {
        // The same 2 ms RTT as a queue, but the stream waits on its
        // receiver's window: the receiver is the bottleneck, no cap.
        let g = Governor::new(1);
        let behind_receiver = PathSample {
            receiver_limited: true,
            ..queue(2000)
        };
        let mut now = Instant::now();
        let mut cap = None;
        for _ in 0..100 {
            now += PERIOD;
            cap = g.observe(behind_receiver, 1 << 20, now);
        }
        assert_eq!(cap, None);
        // The receiver keeps up again and the queue is the network's: capped.
        for _ in 0..2 {
            now += PERIOD;
            cap = g.observe(queue(2000), 1 << 20, now);
        }
        assert!(cap.is_some());
    }

    #[test]
    fn the_window_watch_judges_spans_of_busy_time() {
        let mut w = WindowWatch::default();
        assert!(!w.update(0, 0), "no span yet");
        // The lab's queue: busy, never limited by the receiver.
        assert!(
            !w.update(20_000, 0),
            "a span not full yet keeps the verdict"
        );
        assert!(!w.update(44_000, 0));
        // Loopback on a busy host: half of 40 ms waiting on the window.
        assert!(!w.update(64_000, 12_000), "the span is still open");
        assert!(w.update(84_000, 20_000));
        // Less than a tenth of the next span: not limited any more.
        assert!(w.update(100_000, 21_000), "the verdict holds within a span");
        assert!(!w.update(124_000, 23_000));
    }

    #[test]
    fn a_queue_must_stand_in_every_sample_of_a_period() {
        // A busy host's RTT jumps about with no queue: long samples with a
        // short one among them each period cap nothing...
        let g = Governor::new(1);
        let (_, mut now) = run(&g, 0, 120.0 * MB, 20, Instant::now());
        let mut cap = None;
        for _ in 0..50 {
            for q in [2000, 400, 60, 3000] {
                now += PERIOD / 4;
                cap = g.observe(queue(q), 300_000, now);
            }
        }
        assert_eq!(cap, None);
        // ...while a queue in every sample does.
        for _ in 0..8 {
            now += PERIOD / 4;
            cap = g.observe(queue(2000), 300_000, now);
        }
        assert!(cap.is_some());
    }

    #[test]
    fn cuts_that_do_not_drain_the_delay_lift_the_cap_and_the_target() {
        // A busy host's RTT (loopback: ~2.5 ms) stays whatever the streams
        // send: two cuts that did not halve it, and the cap comes off...
        let g = Governor::new(1);
        let (_, at) = run(&g, 0, 120.0 * MB, 20, Instant::now());
        let (cap, at) = run(&g, 2500, 120.0 * MB, 1, at);
        assert!(cap.is_some());
        let (cap, at) = run(&g, 2500, 120.0 * MB, 10, at);
        assert!(cap.is_some(), "one futile cut: cut again");
        let (cap, at) = run(&g, 2500, 120.0 * MB, 10, at);
        assert_eq!(cap, None, "two futile cuts: the delay is not a queue");
        // ...and such a delay no longer counts as a queue...
        let (cap, at) = run(&g, 2500, 120.0 * MB, 100, at);
        assert_eq!(cap, None);
        // ...though a queue standing well over it does.
        let (cap, _) = run(&g, 12_000, 120.0 * MB, 2, at);
        assert!(cap.is_some());
    }

    #[test]
    fn an_rtt_that_jumps_about_is_not_a_queue() {
        let steady = queue(2000);
        assert_eq!(steady.queue_us(), 2000);
        // A busy host: the same RTT, its deviation half of it.
        let jumpy = PathSample {
            rttvar_us: 1015,
            ..steady
        };
        assert_eq!(jumpy.queue_us(), 0);
    }

    #[test]
    fn the_push_climbs_back_ten_times_faster() {
        // Both capped by a queue, then none: the push takes the path back
        // within 50 periods; precopy's rounds are still at ~0.85 + 0.1 of
        // the rate they were cut from.
        let (precopy, push) = (Governor::new(1), Governor::for_push(1));
        let mut caps = Vec::new();
        for g in [&precopy, &push] {
            let (_, at) = run(g, 0, 120.0 * MB, 20, Instant::now());
            let (cut, at) = run(g, 2000, 120.0 * MB, 1, at);
            assert!(cut.is_some());
            caps.push(run(g, 0, 120.0 * MB, 50, at).0);
        }
        let precopy_cap = caps[0].expect("precopy still capped") as f64;
        assert!(
            (precopy_cap - 0.95 * 120.0 * MB).abs() < 0.02 * 120.0 * MB,
            "{precopy_cap}"
        );
        assert_eq!(caps[1], None, "the push is back to its full rate");
    }

    #[test]
    fn the_push_starts_slow_and_grows_until_the_first_queue() {
        let g = Governor::for_push(2);
        // No queue for 8 periods (9 samples): 25 MB/s x 1.25^9, in two
        // streams' shares.
        let (cap, at) = run(&g, 0, 1000.0 * MB, 8, Instant::now());
        let total = 2.0 * cap.expect("capped from the start") as f64;
        let want = START_RATE * START_GROWTH.powi(9);
        assert!((total - want).abs() < 0.01 * want, "{total} against {want}");
        // The first queue: a cut, and the end of the start.
        let (cut, at) = run(&g, 2000, 1000.0 * MB, 1, at);
        let cut = 2.0 * cut.expect("still capped") as f64;
        assert!(cut <= DECREASE * total * 1.01, "{cut} after {total}");
        // Quiet again: the push's linear climb, not the start's growth.
        let (after, _) = run(&g, 0, 1000.0 * MB, 4, at);
        let after = 2.0 * after.expect("still capped") as f64;
        assert!(after > cut && after < cut * 1.5, "{after} from {cut}");
        // A start that never meets a queue ends uncapped (25 MB/s x 1.25^28
        // is past 10 GB/s); a sample after a long batch grows it by 1.5 at
        // most.
        let free = Governor::for_push(1);
        let (cap, at) = run(&free, 0, 1e12, 8, Instant::now());
        let before = cap.expect("starting") as f64;
        let late = free
            .observe(queue(0), 0, at + 20 * PERIOD)
            .expect("starting") as f64;
        assert!(
            (late - 1.5 * before).abs() < 0.01 * late,
            "{late} after {before}"
        );
        assert_eq!(run(&free, 0, 1e12, 30, at + 20 * PERIOD).0, None);
        // On loopback no link is shared: no start cap.
        let lo = Governor::for_push(2);
        let sample = PathSample {
            to_loopback: true,
            ..queue(0)
        };
        assert_eq!(lo.observe(sample, 0, Instant::now()), None);
    }

    #[test]
    fn the_push_counts_any_delay() {
        // A busy host's RTT, jumping about: precopy's governor lets it be,
        // postcopy's push backs off (its demand answers wait behind it).
        let jumpy = PathSample {
            rttvar_us: 1015,
            to_loopback: true,
            ..queue(2000)
        };
        let (precopy, push) = (Governor::new(1), Governor::for_push(1));
        let mut now = Instant::now();
        let (mut a, mut b) = (None, None);
        for _ in 0..30 {
            now += PERIOD;
            a = precopy.observe(jumpy, 1 << 20, now);
            b = push.observe(jumpy, 1 << 20, now);
        }
        assert_eq!(a, None);
        assert!(b.is_some());
    }
}
