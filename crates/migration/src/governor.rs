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
//! On a link where the receiver's CPU, not the network, is what is slow
//! (loopback on a busy host) the RTT grows too and the governor slows the
//! move: that is why it is asked for, not the default.

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
/// path's best rate.
const INCREASE: f64 = 0.02;
/// The cap never goes below this share of the path's best rate (the move
/// must end).
const FLOOR: f64 = 0.1;

/// One stream's view of its path, from TCP_INFO.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PathSample {
    /// Smoothed round-trip time (µs).
    pub srtt_us: u32,
    /// The shortest round trip seen (µs).
    pub min_rtt_us: u32,
}

impl PathSample {
    /// How long packets wait in queues now (µs).
    pub(crate) fn queue_us(&self) -> u32 {
        self.srtt_us.saturating_sub(self.min_rtt_us)
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
    /// When the cap last went down (one decrease a rate window: the RTT
    /// and the measured rate trail a cut by that long).
    last_decrease: Option<Instant>,
}

/// The window over which the streams' rate is measured: long enough that
/// the socket buffers' filling does not count as the path's rate.
const RATE_WINDOW: Duration = Duration::from_millis(100);

/// Shared by the bulk streams of one migration; see the module.
#[derive(Debug)]
pub(crate) struct Governor {
    streams: usize,
    state: Mutex<State>,
}

impl Governor {
    /// A governor for `streams` bulk streams, none capped yet.
    pub(crate) fn new(streams: usize) -> Self {
        Governor {
            streams: streams.max(1),
            state: Mutex::new(State::default()),
        }
    }

    /// Takes one stream's sample (at most one counts per period) after it
    /// sent `bytes` more, and returns the cap each stream should keep to now
    /// (bytes/s; None: none).
    pub(crate) fn observe(&self, s: PathSample, bytes: u64, now: Instant) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
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
        let due = st.last.is_none_or(|t| now.duration_since(t) >= PERIOD);
        if due && st.best > 0.0 && s.min_rtt_us > 0 {
            st.last = Some(now);
            let queue = s.queue_us();
            let may_cut = st
                .last_decrease
                .is_none_or(|t| now.duration_since(t) >= RATE_WINDOW);
            if queue > TARGET_US && may_cut && st.recent > 0.0 {
                let from = st.cap.unwrap_or(st.recent).min(st.recent);
                st.cap = Some((from * DECREASE).max(st.best * FLOOR));
                st.last_decrease = Some(now);
            } else if queue < TARGET_US / 2 {
                if let Some(cap) = st.cap {
                    let up = cap + st.best * INCREASE;
                    // Past the best the streams ever did a cap holds
                    // nothing back: lift it until the queue says otherwise.
                    st.cap = (up < st.best).then_some(up);
                }
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
            min_rtt_us: 30,
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
        // ...never below a tenth of the best rate.
        let (cap, at) = run(&g, 2000, 120.0 * MB, 400, at);
        let floor = cap.unwrap() as f64 * 2.0;
        assert!(
            (floor - 120.0 * MB * FLOOR).abs() < 0.05 * 120.0 * MB,
            "{floor}"
        );
        // Between half the target and the target the cap holds.
        let (held, at) = run(&g, TARGET_US - 10, 120.0 * MB, 10, at);
        assert_eq!(held, cap);
        // The queue gone, it grows by 2% of the best a period, and comes
        // off once it would pass the best.
        let (up, at) = run(&g, 0, 120.0 * MB, 1, at);
        let step = (up.unwrap() as f64 - cap.unwrap() as f64) * 2.0;
        assert!(
            (step - 120.0 * MB * INCREASE).abs() < 0.01 * 120.0 * MB,
            "{step}"
        );
        let (off, _) = run(&g, 0, 120.0 * MB, 100, at);
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
            min_rtt_us: 0,
        };
        assert_eq!(g.observe(no_rtt, 100 << 20, t + RATE_WINDOW * 2), None);
        // With one, the same queue caps.
        assert!(g
            .observe(queue(5000), 1 << 20, t + RATE_WINDOW * 2 + PERIOD)
            .is_some());
    }
}
