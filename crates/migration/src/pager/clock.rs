//! Page-out's victim choice. The clock ranking works as a two-handed
//! clock: while the main host pages out, the front hand keeps a lead of
//! chunks armed (their page table entries dropped, so the next access
//! raises a MINOR fault that disarms them), and the back hand takes the
//! chunk armed longest ago that no access has touched since. A chunk in
//! use is touched within a few milliseconds, so it is never taken for cold
//! merely because no sampling period looked at it.
//!
//! Among the cold chunks the victim is the one used longest ago, unless
//! that choice keeps coming straight back (a loop over more than the
//! budget, where the chunk idle longest is the one needed next): quick
//! refaults then move the choice to the idle chunk used last, and quick
//! refaults of those move it back.
//!
//! Where the clock has no cold chunk (nothing armed long enough yet), or
//! the ranking is aging, [`fallback_victim`] takes the chunk ranked coldest.
//!
//! Pure state and arithmetic (dropping page table entries is the caller's
//! closure), so the policy is tested here without a VM.

use std::time::{Duration, Instant};

use crate::options::Rank;

use super::chunks::ON_MAIN;

/// Chunks the clock keeps armed ahead of page-out: this share of the
/// budget, within the bounds below.
const CLOCK_LEAD_SHARE: u64 = 8;
const CLOCK_LEAD_MIN: usize = 4;
const CLOCK_LEAD_MAX: usize = 256;
/// How long an armed chunk must go untouched before the clock takes it
/// for cold (a chunk in use is touched within a few milliseconds).
const CLOCK_MIN_EXPOSURE: Duration = Duration::from_millis(10);
/// How far one quick refault moves the clock's choice.
const LOOP_LEARN: f64 = 0.1;

/// The clock's per-chunk state and its learned choice.
pub(super) struct Clock {
    /// Per chunk held here: when it was armed and not touched since.
    armed_at: Vec<Option<Instant>>,
    /// The front hand.
    hand: usize,
    /// Per chunk paged out: the page-out count then, and whether the
    /// clock took it as the one used last.
    evicted: Vec<Option<(u64, bool)>>,
    /// How much quick refaults favour taking the idle chunk used last over
    /// the one used longest ago (above one half: the former).
    loop_weight: f64,
    /// Chunks kept armed ahead of page-out.
    lead: usize,
}

impl Clock {
    /// A clock over `chunks` chunks for a main host holding `budget`.
    pub(super) fn new(chunks: usize, budget: u64) -> Self {
        Clock {
            armed_at: vec![None; chunks],
            hand: 0,
            evicted: vec![None; chunks],
            loop_weight: 0.0,
            lead: ((budget / CLOCK_LEAD_SHARE) as usize).clamp(CLOCK_LEAD_MIN, CLOCK_LEAD_MAX),
        }
    }

    /// Chunk `c` was touched, or left the main host: not armed any more.
    pub(super) fn disarm(&mut self, c: usize) {
        self.armed_at[c] = None;
    }

    /// Sampling armed chunk `c` at `now` (an arming not yet touched keeps
    /// its older time).
    pub(super) fn armed(&mut self, c: usize, now: Instant) {
        self.armed_at[c].get_or_insert(now);
    }

    /// The back hand: among the chunks held here (but `keep`) that were
    /// armed and have gone untouched for long enough at `now`, the one used
    /// longest ago by `last_use`, or, while that choice keeps coming
    /// straight back (a loop over more than the budget, where the chunk
    /// idle longest is the one needed next), the one used last. Returns it
    /// and whether it was the latter.
    pub(super) fn victim(
        &self,
        places: &[u16],
        keep: usize,
        last_use: &[u64],
        now: Instant,
    ) -> Option<(usize, bool)> {
        let idle = (0..places.len())
            .filter(|&c| places[c] == ON_MAIN && c != keep)
            .filter(|&c| {
                self.armed_at[c].is_some_and(|t| now.duration_since(t) >= CLOCK_MIN_EXPOSURE)
            });
        let loop_mode = self.loop_weight > 0.5;
        if loop_mode {
            idle.max_by_key(|&c| last_use[c]).map(|c| (c, true))
        } else {
            idle.min_by_key(|&c| last_use[c]).map(|c| (c, false))
        }
    }

    /// Chunk `c` was paged out as the `outs`-th page-out; `by_last_use`
    /// says whether it was taken as the idle chunk used last.
    pub(super) fn paged_out(&mut self, c: usize, outs: u64, by_last_use: bool) {
        self.evicted[c] = Some((outs, by_last_use));
    }

    /// Chunk `c` came back after `outs` page-outs: if it was paged out only
    /// a lead of page-outs ago, the choice that took it was wrong, and the
    /// other one gains.
    pub(super) fn learn_refault(&mut self, c: usize, outs: u64) {
        let Some((at, by_last_use)) = self.evicted[c] else {
            return;
        };
        if outs.saturating_sub(at) > self.lead as u64 {
            return;
        }
        if by_last_use {
            self.loop_weight *= 1.0 - LOOP_LEARN;
        } else {
            self.loop_weight += (1.0 - self.loop_weight) * LOOP_LEARN;
        }
    }

    /// The front hand: arms chunks held here other than `keep` and `gone`
    /// (`drop_ptes` drops a chunk's page table entries and says whether it
    /// could: the next access raises a MINOR fault, which disarms) until
    /// the lead is armed again.
    pub(super) fn arm(
        &mut self,
        places: &[u16],
        keep: usize,
        gone: usize,
        now: Instant,
        mut drop_ptes: impl FnMut(usize) -> bool,
    ) {
        let lead = self.lead;
        let held = |c: usize| places[c] == ON_MAIN && c != keep && c != gone;
        let mut armed = (0..places.len())
            .filter(|&c| held(c) && self.armed_at[c].is_some())
            .count();
        let n = places.len();
        let mut seen = 0;
        while armed < lead && seen < n {
            let c = self.hand;
            self.hand = (self.hand + 1) % n;
            seen += 1;
            if !held(c) || self.armed_at[c].is_some() {
                continue;
            }
            if drop_ptes(c) {
                self.armed_at[c] = Some(now);
                armed += 1;
            }
        }
    }
}

/// The victim where the clock has no cold chunk, or the ranking is aging:
/// among the chunks held here but `keep`, the one used longest ago (clock),
/// or the one with the lowest aging history, then used longest ago (aging).
pub(super) fn fallback_victim(
    places: &[u16],
    keep: usize,
    rank: Rank,
    aging: &[u8],
    last_use: &[u64],
) -> Option<usize> {
    let held = |c: &usize| places[*c] == ON_MAIN && *c != keep;
    (0..places.len()).filter(held).min_by_key(|&c| match rank {
        Rank::Clock => (0u8, last_use[c]),
        Rank::Aging => (aging[c], last_use[c]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const REMOTE: u16 = 1;

    /// A clock over `n` chunks (lead 4) with every chunk armed at `t0`.
    fn all_armed(n: usize, t0: Instant) -> Clock {
        let mut clock = Clock::new(n, 32);
        for c in 0..n {
            clock.armed(c, t0);
        }
        clock
    }

    /// Pages out chunk 0 as the choice given and has it come straight back,
    /// `times` times.
    fn quick_refaults(clock: &mut Clock, by_last_use: bool, times: usize) {
        for i in 0..times as u64 {
            clock.paged_out(0, 10 * i, by_last_use);
            clock.learn_refault(0, 10 * i + 1);
        }
    }

    #[test]
    fn the_lead_is_a_share_of_the_budget_within_bounds() {
        assert_eq!(Clock::new(1, 0).lead, CLOCK_LEAD_MIN);
        assert_eq!(Clock::new(1, 800).lead, 100);
        assert_eq!(Clock::new(1, 1 << 20).lead, CLOCK_LEAD_MAX);
    }

    #[test]
    fn the_victim_is_the_cold_chunk_used_longest_ago() {
        let t0 = Instant::now();
        let clock = all_armed(5, t0);
        let later = t0 + Duration::from_millis(20);
        let places = [ON_MAIN, ON_MAIN, REMOTE, ON_MAIN, ON_MAIN];
        let last_use = [5, 2, 1, 9, 7];
        // Chunk 2 was used longest ago but is not here.
        assert_eq!(clock.victim(&places, 4, &last_use, later), Some((1, false)));
        // Never `keep`, the chunk just paged in.
        assert_eq!(clock.victim(&places, 1, &last_use, later), Some((0, false)));
    }

    #[test]
    fn a_chunk_touched_or_armed_too_recently_is_not_cold() {
        let t0 = Instant::now();
        let mut clock = all_armed(3, t0);
        let places = [ON_MAIN; 3];
        let last_use = [1, 2, 3];
        // Armed 5 ms ago: a chunk in use may not have been touched yet.
        let soon = t0 + Duration::from_millis(5);
        assert_eq!(clock.victim(&places, usize::MAX, &last_use, soon), None);
        // Touched since it was armed: in use.
        clock.disarm(0);
        let later = t0 + Duration::from_millis(20);
        assert_eq!(
            clock.victim(&places, usize::MAX, &last_use, later),
            Some((1, false))
        );
        // Sampling again keeps the older arming time.
        clock.armed(1, later);
        assert_eq!(
            clock.victim(&places, usize::MAX, &last_use, later),
            Some((1, false))
        );
    }

    #[test]
    fn quick_refaults_switch_to_the_idle_chunk_used_last_and_back() {
        let t0 = Instant::now();
        let mut clock = all_armed(4, t0);
        let places = [ON_MAIN; 4];
        let last_use = [4, 1, 3, 2];
        let later = t0 + Duration::from_millis(20);
        let pick = |clock: &Clock| clock.victim(&places, usize::MAX, &last_use, later);
        // Each quick refault of a chunk taken as used longest ago moves the
        // weight a tenth of the way to 1: above one half after 7.
        quick_refaults(&mut clock, false, 6);
        assert_eq!(pick(&clock), Some((1, false)));
        quick_refaults(&mut clock, false, 1);
        assert_eq!(pick(&clock), Some((0, true)), "a loop: the chunk used last");
        // A quick refault of one taken that way moves it back.
        quick_refaults(&mut clock, true, 1);
        assert_eq!(pick(&clock), Some((1, false)));
    }

    #[test]
    fn a_late_refault_or_a_chunk_never_paged_out_teaches_nothing() {
        let t0 = Instant::now();
        let mut clock = all_armed(2, t0);
        let places = [ON_MAIN; 2];
        let last_use = [2, 1];
        let later = t0 + Duration::from_millis(20);
        for i in 0..20 {
            // Back after more than the lead (4) of page-outs: a fair choice.
            clock.paged_out(0, 100 * i, false);
            clock.learn_refault(0, 100 * i + 5);
            clock.learn_refault(1, 100 * i + 1);
        }
        assert_eq!(
            clock.victim(&places, usize::MAX, &last_use, later),
            Some((1, false))
        );
    }

    #[test]
    fn the_fallback_ranks_by_last_use_or_by_aging_history() {
        let places = [ON_MAIN, ON_MAIN, REMOTE, ON_MAIN];
        let aging = [0x80, 0x40, 0x00, 0x40];
        let last_use = [1, 5, 0, 3];
        let pick = |rank, keep| fallback_victim(&places, keep, rank, &aging, &last_use);
        assert_eq!(pick(Rank::Clock, usize::MAX), Some(0));
        assert_eq!(pick(Rank::Clock, 0), Some(3));
        // Aging: the lowest history first (chunk 2 is not here), ties by
        // last use.
        assert_eq!(pick(Rank::Aging, usize::MAX), Some(3));
        assert_eq!(pick(Rank::Aging, 3), Some(1));
        assert_eq!(
            fallback_victim(&[REMOTE], usize::MAX, Rank::Clock, &[0], &[0]),
            None
        );
    }

    #[test]
    fn the_front_hand_arms_up_to_the_lead_and_goes_round() {
        let t0 = Instant::now();
        let mut clock = Clock::new(10, 32);
        let mut places = [ON_MAIN; 10];
        places[2] = REMOTE;
        let mut tried = Vec::new();
        // Chunk 0 is kept, 1 just went, 2 is elsewhere; 4 cannot be armed.
        clock.arm(&places, 0, 1, t0, |c| {
            tried.push(c);
            c != 4
        });
        assert_eq!(tried, [3, 4, 5, 6, 7]);
        let armed = |clock: &Clock| -> Vec<usize> {
            (0..10).filter(|&c| clock.armed_at[c].is_some()).collect()
        };
        assert_eq!(armed(&clock), [3, 5, 6, 7]);
        // Lead armed: nothing to do.
        tried.clear();
        clock.arm(&places, 0, 1, t0, |c| {
            tried.push(c);
            true
        });
        assert!(tried.is_empty());
        // One touched: the hand goes on from where it stopped, round the end.
        clock.disarm(5);
        clock.arm(&places, 0, 1, t0, |c| {
            tried.push(c);
            true
        });
        assert_eq!(tried, [8]);
        assert_eq!(armed(&clock), [3, 6, 7, 8]);
        clock.disarm(6);
        clock.disarm(7);
        clock.disarm(8);
        tried.clear();
        clock.arm(&places, 0, 1, t0, |c| {
            tried.push(c);
            true
        });
        assert_eq!(tried, [9, 4, 5]);
        assert_eq!(armed(&clock), [3, 4, 5, 9]);
    }
}
