//! `--bandwidth`: all bulk streams together stay under one byte rate.

use std::io::Write;
use std::time::{Duration, Instant};

/// Each of `streams` streams' share of a bandwidth limit (bytes/s, at least
/// 1), for the kernel to pace its packets at; None without a limit.
pub(crate) fn stream_share(limit: Option<f64>, streams: usize) -> Option<u64> {
    limit.map(|l| ((l / streams.max(1) as f64) as u64).max(1))
}

/// Paces writers that share one byte budget from a common start.
pub(crate) struct Pacer {
    limit: Option<f64>,
    t0: Instant,
}

impl Pacer {
    /// A pacer for `limit` bytes/s (None: no limit) starting now.
    pub(crate) fn new(limit: Option<f64>) -> Self {
        Pacer {
            limit,
            t0: Instant::now(),
        }
    }

    /// Called after a write that brought the shared total to `sent` bytes:
    /// when that is ahead of the limit, flushes `w` and sleeps it off.
    pub(crate) fn pace(&self, sent: u64, w: &mut impl Write) -> std::io::Result<()> {
        if let Some(rate) = self.limit {
            let ahead = sent as f64 / rate - self.t0.elapsed().as_secs_f64();
            if ahead > 0.0 {
                w.flush()?;
                std::thread::sleep(Duration::from_secs_f64(ahead));
            }
        }
        Ok(())
    }
}
