//! What remote paging did so far: the counters the pager thread bumps, the
//! page-in latencies it keeps, and [`PagerStats`], the snapshot the VMM's
//! status shows. Separate so the numbers and how they are summed up can be
//! read (and tested) without the fault handling around them.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Page-in latencies kept for the percentiles.
const LATENCY_SAMPLES: usize = 1 << 16;

/// What remote paging did so far (the VMM's status shows it).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PagerStats {
    /// Pages per chunk.
    pub chunk_pages: u64,
    /// Chunks in all.
    pub chunks: u64,
    /// Chunks the main host may hold.
    pub budget_chunks: u64,
    /// Chunks held here now.
    pub resident_chunks: u64,
    /// Chunks paged in (faults on a remote chunk).
    pub page_ins: u64,
    /// Pages those brought (held ones; the rest of a chunk is zero).
    pub pages_in: u64,
    /// Chunks paged out.
    pub page_outs: u64,
    /// Pages those sent.
    pub pages_out: u64,
    /// Page-outs that sent nothing: the chunk was unchanged since its
    /// page-in, and its servers still held it.
    #[serde(default)]
    pub clean_drops: u64,
    /// Page-outs of a chunk the clock had armed and seen untouched since
    /// (the others fell back to the least recently seen chunk).
    pub cold_victims: u64,
    /// Of those, the ones taken as the idle chunk used last, because the
    /// chunk idle longest kept coming straight back (a loop).
    pub loop_victims: u64,
    /// Zero pages mapped into chunks held here (never-written pages of a
    /// chunk filled at its first fault, or the pages a page-in did not bring).
    pub zero_fills: u64,
    /// MINOR faults taken by access sampling.
    pub sampled_faults: u64,
    /// False when the kernel refused MINOR with MISSING+WP: page-out then
    /// ranks chunks by their faults only.
    pub sampling: bool,
    /// Fault to wake of a page-in, µs: median, 99th percentile, most.
    pub page_in_p50_us: f64,
    /// As above, 99th percentile.
    pub page_in_p99_us: f64,
    /// As above, the most.
    pub page_in_max_us: f64,
    /// Memory servers lost while paging (their chunks are served from
    /// their second copies, where there are any).
    pub lost_servers: Vec<String>,
    /// Memory server connections opened again after one broke (a link down
    /// for a while, a server stopped and continued): nothing was lost.
    #[serde(default)]
    pub reconnects: u64,
    /// Why paging stopped (a chunk with no copy left), if it did.
    pub failure: Option<String>,
}

/// Counters the pager thread updates and anyone may read.
#[derive(Default)]
pub(super) struct Counters {
    pub(super) resident: AtomicU64,
    pub(super) page_ins: AtomicU64,
    pub(super) pages_in: AtomicU64,
    pub(super) page_outs: AtomicU64,
    pub(super) pages_out: AtomicU64,
    pub(super) cold_victims: AtomicU64,
    pub(super) loop_victims: AtomicU64,
    pub(super) zero_fills: AtomicU64,
    pub(super) sampled: AtomicU64,
    pub(super) clean_drops: AtomicU64,
    pub(super) reconnects: AtomicU64,
}

/// Keeps one page-in latency, in µs (the first [`LATENCY_SAMPLES`] only).
pub(super) fn record_latency(kept: &Mutex<Vec<f64>>, us: f64) {
    let mut lat = kept.lock().unwrap_or_else(|e| e.into_inner());
    if lat.len() < LATENCY_SAMPLES {
        lat.push(us);
    }
}

/// The median, 99th percentile and most of `lat` (zeros when it is empty).
pub(super) fn percentiles(mut lat: Vec<f64>) -> (f64, f64, f64) {
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (pct(0.5), pct(0.99), lat.last().copied().unwrap_or(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_page_in_yet_reads_as_zeros() {
        assert_eq!(percentiles(Vec::new()), (0.0, 0.0, 0.0));
    }

    #[test]
    fn percentiles_come_from_the_sorted_samples() {
        // 1..=100 shuffled: the median rounds to the 51st (index 49.5 -> 50),
        // the 99th percentile to the 99th, the most is 100.
        let lat: Vec<f64> = (1..=100).map(|i| ((i * 37) % 100 + 1) as f64).collect();
        assert_eq!(percentiles(lat), (51.0, 99.0, 100.0));
        assert_eq!(percentiles(vec![7.0]), (7.0, 7.0, 7.0));
    }

    #[test]
    fn only_the_first_samples_are_kept() {
        let kept = Mutex::new(Vec::new());
        for i in 0..LATENCY_SAMPLES + 10 {
            record_latency(&kept, i as f64);
        }
        let kept = kept.into_inner().unwrap();
        assert_eq!(kept.len(), LATENCY_SAMPLES);
        assert_eq!(kept.last().copied(), Some((LATENCY_SAMPLES - 1) as f64));
    }
}
