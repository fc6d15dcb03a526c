//! Auto-converge's steps as options: when a precopy round throttles the
//! guest's vCPUs and by how much. Apart from the rest of the options
//! because it carries its own arithmetic (the next throttle) and checks.

use serde::{Deserialize, Serialize};

use super::defaults;

/// Auto-converge's steps: when a precopy round throttles the vCPUs and by
/// how much. Read only while [`super::MigrateOptions::auto_converge`] is on (that
/// switch stays where it was, so options written before these existed
/// mean what they meant).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AutoConverge {
    /// Throttle when the guest dirtied more than this share of what the
    /// round could send (dirty rate > ratio x throughput).
    pub trigger_ratio: f64,
    /// The first throttle, % of vCPU time taken away.
    pub initial_pct: u32,
    /// Added at each further round that still triggers, %.
    pub step_pct: u32,
    /// The most it takes away, %.
    pub max_pct: u32,
}

impl Default for AutoConverge {
    fn default() -> Self {
        AutoConverge {
            trigger_ratio: defaults::AUTO_CONVERGE_TRIGGER_RATIO,
            initial_pct: defaults::AUTO_CONVERGE_INITIAL_PCT,
            step_pct: defaults::AUTO_CONVERGE_STEP_PCT,
            max_pct: defaults::AUTO_CONVERGE_MAX_PCT,
        }
    }
}

/// The share of the rounds left a guest's projected convergence may take
/// before auto-converge throttles it (a guest's ratio tends to grow as the
/// rounds shrink, so the projection is optimistic).
const CONVERGE_MARGIN: f64 = 0.75;

/// Rounds until `dirty` pages shrink under `target` if each round leaves
/// `ratio` of the last one dirty (infinite when they do not shrink).
fn rounds_to_converge(ratio: f64, dirty: u64, target: u64) -> f64 {
    if dirty <= target {
        return 0.0;
    }
    // (A ratio that is not a number shrinks nothing either.)
    if ratio.is_nan() || ratio >= 1.0 || target == 0 {
        return f64::INFINITY;
    }
    (dirty as f64 / target as f64).ln() / (1.0 / ratio).ln()
}

impl AutoConverge {
    /// True when a round calls for (more) throttle: the guest dirtied more
    /// than the trigger's share of what the round could send (both
    /// bytes/s), and at that ratio the rounds left cannot bring its
    /// `dirty_pages` under `target_pages` (what fits the downtime). A
    /// guest that dirties fast but whose rounds still shrink fast enough
    /// keeps all of its vCPU time: a throttle costs its service at once,
    /// a longer precopy only time.
    pub fn triggered(
        &self,
        dirty_rate: f64,
        throughput: f64,
        dirty_pages: u64,
        target_pages: u64,
        rounds_left: u32,
    ) -> bool {
        let outran = dirty_rate > self.trigger_ratio * throughput;
        if !outran {
            return false;
        }
        rounds_to_converge(dirty_rate / throughput, dirty_pages, target_pages)
            > CONVERGE_MARGIN * rounds_left as f64
    }

    /// The throttle after one more triggered round, from `current` (0: not
    /// throttled yet).
    pub fn next(&self, current: u32) -> u32 {
        if current == 0 {
            self.initial_pct.min(self.max_pct)
        } else {
            current.saturating_add(self.step_pct).min(self.max_pct)
        }
    }

    /// Refuses steps no throttle can take.
    pub fn check(&self) -> Result<(), String> {
        if !(self.trigger_ratio > 0.0 && self.trigger_ratio.is_finite()) {
            return Err(format!(
                "the auto-converge trigger ratio {} must be above 0",
                self.trigger_ratio
            ));
        }
        for (pct, name) in [
            (self.initial_pct, "initial"),
            (self.step_pct, "step"),
            (self.max_pct, "max"),
        ] {
            if !(1..=99).contains(&pct) {
                return Err(format!(
                    "the auto-converge {name} throttle must be 1 to 99%, not {pct}"
                ));
            }
        }
        if self.initial_pct > self.max_pct {
            return Err(format!(
                "the auto-converge initial throttle ({}%) is above its max ({}%)",
                self.initial_pct, self.max_pct
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::MigrateOptions;

    #[test]
    fn auto_converge_steps_as_precopy_took_them() {
        let a = AutoConverge::default();
        // Half of what the round could send dirtied: not yet, whatever is
        // left to do.
        assert!(!a.triggered(50.0, 100.0, 1 << 20, 0, 0));
        assert!(a.triggered(50.1, 100.0, 1 << 20, 0, 0));
        let mut seen = vec![];
        let mut t = 0;
        for _ in 0..10 {
            t = a.next(t);
            seen.push(t);
        }
        assert_eq!(seen, [20, 30, 40, 50, 60, 70, 80, 90, 99, 99]);
        let steep = AutoConverge {
            initial_pct: 50,
            step_pct: 30,
            max_pct: 90,
            ..a
        };
        assert_eq!(steep.next(0), 50);
        assert_eq!(steep.next(50), 80);
        assert_eq!(steep.next(80), 90);
    }

    #[test]
    fn bad_auto_converge_steps_are_refused() {
        let with = |t: AutoConverge| MigrateOptions {
            auto_converge_tuning: t,
            ..Default::default()
        };
        let a = AutoConverge::default();
        assert!(with(a).check().is_ok());
        for (bad, needle) in [
            (
                AutoConverge {
                    initial_pct: 0,
                    ..a
                },
                "initial",
            ),
            (AutoConverge { step_pct: 100, ..a }, "step"),
            (AutoConverge { max_pct: 0, ..a }, "max"),
            (
                AutoConverge {
                    initial_pct: 60,
                    max_pct: 50,
                    ..a
                },
                "above its max",
            ),
            (
                AutoConverge {
                    trigger_ratio: 0.0,
                    ..a
                },
                "ratio",
            ),
            (
                AutoConverge {
                    trigger_ratio: f64::NAN,
                    ..a
                },
                "ratio",
            ),
        ] {
            let err = with(bad).check().unwrap_err();
            assert!(err.contains(needle), "{bad:?}: {err}");
        }
    }

    #[test]
    fn auto_converge_throttles_only_a_guest_the_rounds_left_cannot_catch() {
        let a = AutoConverge::default();
        // A kv guest on a shared 1 Gbit link: each round leaves 0.74 of the
        // last dirty; 32,000 pages to bring under 220 (10 ms): about 16.6
        // rounds at that ratio.
        assert!((rounds_to_converge(0.74, 32_000, 220) - 16.6).abs() < 0.1);
        // With 29 rounds left it converges unthrottled; with 14 it does not
        // (the projection may take 3/4 of them).
        assert!(!a.triggered(74.0, 100.0, 32_000, 220, 29));
        assert!(a.triggered(74.0, 100.0, 32_000, 220, 14));
        // Rounds that do not shrink, or nothing fits the pause: throttle.
        assert!(a.triggered(100.0, 100.0, 1000, 999, 1000));
        assert!(a.triggered(60.0, 100.0, 1000, 0, 1000));
        // What is left fits the pause already: no need.
        assert!(!a.triggered(99.0, 100.0, 200, 220, 0));
        // Not a number (a round of no time): never a throttle.
        assert!(!a.triggered(f64::NAN, 100.0, 32_000, 220, 0));
    }
}
