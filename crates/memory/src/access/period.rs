//! Closing a period: what was accessed in it (sampled reads, plus the
//! writes the caller logged) goes into each page's clock and aging
//! history, which split ranks chunks by ([`AccessSnapshot`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::AccessTracker;

/// The histories so far, per region (in the order given) and page.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessSnapshot {
    /// 1 if the page was accessed in the last period, else 0.
    pub clock: Vec<Vec<u8>>,
    /// Aging history: bit 7 = last period, bit 6 = the one before, ...
    pub aging: Vec<Vec<u8>>,
    /// Periods closed so far.
    pub periods: u64,
}

impl AccessTracker {
    /// Closes a period. A page was accessed in it if `dirty` says it was
    /// written (per region, bit i of word i/64 = page i) or it was read
    /// since it was last armed (pages armed in this period: whether they
    /// faulted; the others keep their latest sample's answer). Then
    /// clock = accessed, aging = aging >> 1 | accessed << 7. Returns the
    /// number of pages accessed.
    pub fn end_period(&self, dirty: Option<&[Vec<u64>]>) -> u64 {
        let t = Instant::now();
        let mut guard = self.lock();
        let p = &mut *guard;
        let mut accessed = 0u64;
        for (i, (range, seen)) in self.ranges.iter().zip(&self.seen).enumerate() {
            let written = dirty.and_then(|d| d.get(i));
            let (clock, aging) = (&mut p.clock[i], &mut p.aging[i]);
            for (w, seen) in seen.iter().enumerate() {
                let bits = seen.load(Ordering::Relaxed)
                    | written.and_then(|d| d.get(w)).copied().unwrap_or(0);
                let first = w * 64;
                let last = (first + 64).min(range.pages as usize);
                for page in first..last {
                    let a = ((bits >> (page - first)) & 1) as u8;
                    clock[page] = a;
                    aging[page] = (aging[page] >> 1) | (a << 7);
                }
                // Bits past the region's end are never set: count them all.
                accessed += u64::from(bits.count_ones());
            }
        }
        p.written = dirty.map(<[Vec<u64>]>::to_vec).unwrap_or_default();
        let now = Instant::now();
        p.tracked += now.saturating_duration_since(p.period_start);
        p.period_start = now;
        p.periods += 1;
        p.accessed_last = accessed;
        p.end_period_us_last = t.elapsed().as_secs_f64() * 1e6;
        accessed
    }

    /// The time since the last closed period is not tracked time (the
    /// caller paused tracking and goes on now).
    pub fn restart_period(&self) {
        self.lock().period_start = Instant::now();
    }

    /// The histories so far.
    pub fn snapshot(&self) -> AccessSnapshot {
        let p = self.lock();
        AccessSnapshot {
            clock: p.clock.clone(),
            aging: p.aging.clone(),
            periods: p.periods,
        }
    }
}
