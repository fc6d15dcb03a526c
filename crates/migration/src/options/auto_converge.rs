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

impl AutoConverge {
    /// True when a round's dirty rate outran its share of the throughput
    /// (both bytes/s).
    pub fn triggered(&self, dirty_rate: f64, throughput: f64) -> bool {
        dirty_rate > self.trigger_ratio * throughput
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
        // Half of what the round could send dirtied: not yet.
        assert!(!a.triggered(50.0, 100.0));
        assert!(a.triggered(50.1, 100.0));
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
}
