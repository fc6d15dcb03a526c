//! The governor on made-up TCP_INFO samples: when a delay counts as a queue
//! and caps the streams, when the cap comes off, and how postcopy's push
//! starts and climbs.

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
fn run(g: &Governor, q: u32, rate: f64, periods: u32, mut now: Instant) -> (Option<u64>, Instant) {
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
