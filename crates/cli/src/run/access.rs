//! `ferry run`'s access tracking: the flags' values made into the VMM's
//! access configuration, for a new run and for a handed-over one alike.

use std::time::Duration;

/// The access tracking a run asks for.
pub(super) fn access_config(
    period_ms: u64,
    share: u32,
    grain: u64,
    log_writes: bool,
) -> Option<ferry_vmm::access::AccessConfig> {
    (period_ms > 0).then(|| ferry_vmm::access::AccessConfig {
        period: Duration::from_millis(period_ms),
        share: share.max(1),
        grain: if grain == 0 {
            ferry_memory::DEFAULT_GRAIN_PAGES
        } else {
            grain
        },
        writes: if log_writes {
            ferry_vmm::access::WriteSource::Log
        } else {
            ferry_vmm::access::WriteSource::Sample
        },
    })
}

/// A power of two from 1 to 512 (pages).
pub(super) fn parse_grain(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if ferry_memory::valid_grain(n) => Ok(n),
        _ => Err(format!("{s:?} is not a power of two from 1 to 512")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_vmm::access::WriteSource;

    #[test]
    fn period_zero_is_off_and_zeros_from_older_runs_take_defaults() {
        assert!(access_config(0, 8, 64, false).is_none());
        let c = access_config(1000, 8, 16, true).unwrap();
        assert_eq!(c.period, Duration::from_secs(1));
        assert_eq!((c.share, c.grain), (8, 16));
        assert!(matches!(c.writes, WriteSource::Log));
        // A handed-over run from a ferry without share or grain.
        let c = access_config(500, 0, 0, false).unwrap();
        assert_eq!(c.share, 1);
        assert_eq!(c.grain, ferry_memory::DEFAULT_GRAIN_PAGES);
        assert!(matches!(c.writes, WriteSource::Sample));
    }

    #[test]
    fn grains_are_powers_of_two_up_to_512() {
        assert_eq!(parse_grain("1"), Ok(1));
        assert_eq!(parse_grain("512"), Ok(512));
        for bad in ["0", "3", "1024", "x", "-2"] {
            assert!(parse_grain(bad).is_err(), "{bad}");
        }
    }
}
