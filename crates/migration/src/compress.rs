//! Which codec each batch gets: a fixed one, none, or `auto`.
//!
//! `auto` follows what the GMigrate paper learned: compression pays only
//! where the link, not the CPU, limits the copy. It measures every codec's
//! ratio and speed on the VM's own pages before the first round, the link's
//! bandwidth while the first megabytes go out uncompressed (or takes
//! `--bandwidth`), and then per batch picks the codec whose effective rate
//!
//! ```text
//! min(link bytes/s / ratio, encode bytes/s x workers)
//! ```
//!
//! is highest, keeping the estimates current with every batch it encodes.
//! Compression must beat sending raw by 10% to be used, so incompressible
//! memory goes raw; xbzrle is tried only for re-sent pages (round 1 on); and
//! a stop-and-copy whose remainder goes raw in a couple of milliseconds
//! goes raw.

use std::sync::{Arc, Condvar, Mutex};

use std::time::Duration;
use std::time::Instant;

use ferry_codec::{CacheSizes, EncodedBatch, Method, StreamEncoder, PAGE};

use crate::options::{Compress, CompressOptions};

/// Encodes batches for one shard: ferry-codec's CPU encoder, or another
/// backend producing the same bytes (the CUDA one).
pub trait BatchEncoder: Send {
    /// As [`StreamEncoder::encode`].
    fn encode(
        &mut self,
        method: Method,
        pages: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), crate::vm_error::VmOpError>;
}

impl BatchEncoder for StreamEncoder {
    fn encode(
        &mut self,
        method: Method,
        pages: &[u64],
        data: &[u8],
        out: &mut EncodedBatch,
    ) -> Result<(), crate::vm_error::VmOpError> {
        Ok(StreamEncoder::encode(self, method, pages, data, out)?)
    }
}

/// Makes one encoder per shard.
pub type MakeEncoder = Arc<dyn Fn(CacheSizes) -> Box<dyn BatchEncoder> + Send + Sync>;

/// Where the codecs run.
#[derive(Clone)]
pub struct Backend {
    /// "cpu", "cuda", ...
    pub name: String,
    /// Why another backend was asked for but this one runs, if so.
    pub note: Option<String>,
    /// The encoder factory.
    pub make: MakeEncoder,
}

impl Backend {
    /// ferry-codec on the CPU.
    pub fn cpu() -> Backend {
        Backend {
            name: "cpu".into(),
            note: None,
            make: Arc::new(|c| Box::new(StreamEncoder::new(c))),
        }
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.name)
    }
}

/// Bytes on the wire per page besides its payload: address and metadata.
const PER_PAGE_META: f64 = 13.0;
/// Raw pages sent before the link bandwidth is known, and how many of the
/// first ones are ignored (they only fill socket buffers).
const PROBE_BYTES: u64 = 12 << 20;
const PROBE_SKIP: u64 = 4 << 20;
/// Longest wait for the probe's measurement before staying raw.
const PROBE_WAIT: Duration = Duration::from_secs(2);
/// A codec must beat raw by this factor to be used.
const MARGIN: f64 = 1.10;
/// One batch in this many tries another codec (auto).
const EXPLORE_EVERY: u64 = 16;
/// A stop-and-copy that goes raw within this long goes raw.
const SMALL_FINAL_SECS: f64 = 0.002;

#[derive(Clone, Copy, Debug)]
struct Estimate {
    /// Wire bytes per input byte.
    ratio: f64,
    /// Input bytes per second of one encoder thread.
    speed: f64,
}

struct State {
    link: Option<f64>,
    probe_sent: u64,
    probe_mark: Option<(Instant, u64)>,
    /// Raw bytes decided while probing (decisions run ahead of sends).
    probe_decided: u64,
    /// The kernel's delivery-rate samples while probing (TCP_INFO).
    probe_rates: Vec<f64>,
    /// The probe gave nothing usable: stay raw without waiting again.
    probe_failed: bool,
    est: Vec<(Method, Estimate)>,
    /// Batches per method name, for the report.
    used: Vec<(String, u64)>,
    /// Batches decided so far (auto).
    decisions: u64,
}

/// The per-migration policy, shared by all streams' threads.
pub struct Policy {
    compress: Compress,
    workers: f64,
    user_bandwidth: Option<f64>,
    state: Mutex<State>,
    /// Signalled when the probe has measured the link.
    measured: Condvar,
}

/// Codecs `auto` considers for first-time pages (xbzrle joins for re-sent ones).
const CANDIDATES: [Method; 4] = [Method::Rle, Method::Dedup, Method::Lz4, Method::Zstd(1)];

impl Policy {
    /// A policy; `sample` is a set of the VM's non-zero pages to calibrate
    /// `auto` on (ignored otherwise).
    pub fn new(opts: &CompressOptions, user_bandwidth: Option<f64>, sample: &[u8]) -> Policy {
        let est = if opts.compress == Compress::Auto {
            calibrate(sample)
        } else {
            Vec::new()
        };
        tracing::debug!(
            sample_pages = sample.len() / PAGE,
            estimates = ?est,
            "compression policy calibrated"
        );
        Policy {
            compress: opts.compress,
            workers: f64::from(opts.workers.max(1)),
            user_bandwidth,
            state: Mutex::new(State {
                link: user_bandwidth,
                probe_sent: 0,
                probe_mark: None,
                est,
                used: Vec::new(),
                decisions: 0,
                probe_decided: 0,
                probe_rates: Vec::new(),
                probe_failed: false,
            }),
            measured: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The method for the next batch (`bytes` of pages) of `round`;
    /// `final_bytes` is the whole stop-and-copy remainder when this is the
    /// stop-and-copy.
    pub fn choose(&self, round: u32, final_bytes: Option<u64>, bytes: u64) -> Method {
        let m = match self.compress {
            Compress::Fixed(m) => m,
            Compress::Auto => self.choose_auto(round, final_bytes, bytes),
        };
        let mut st = self.lock();
        let name = m.to_string();
        match st.used.iter_mut().find(|(n, _)| *n == name) {
            Some((_, k)) => *k += 1,
            None => st.used.push((name, 1)),
        }
        m
    }

    fn choose_auto(&self, round: u32, final_bytes: Option<u64>, bytes: u64) -> Method {
        let mut st = self.lock();
        if st.link.is_none() && !st.probe_failed {
            if st.probe_decided < PROBE_BYTES {
                st.probe_decided += bytes;
                return Method::None; // probing the link with raw batches
            }
            // Enough raw batches are on their way; rather than decide more
            // of them raw (a pipeline runs ahead of its sends), wait for the
            // measurement.
            st = self
                .measured
                .wait_timeout_while(st, PROBE_WAIT, |s| s.link.is_none())
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
            if st.link.is_none() {
                st.probe_failed = true;
            }
        }
        let Some(link) = st.link else {
            return Method::None;
        };
        if final_bytes.is_some_and(|b| b as f64 / link <= SMALL_FINAL_SECS) {
            return Method::None;
        }
        // Now and then a batch tries another codec, so the estimates follow
        // memory whose content changes from one region to the next.
        st.decisions += 1;
        if final_bytes.is_none() && st.decisions.is_multiple_of(EXPLORE_EVERY) {
            let tries: Vec<Method> = st
                .est
                .iter()
                .map(|e| e.0)
                .filter(|&m| m != Method::Xbzrle || round > 0)
                .collect();
            if !tries.is_empty() {
                let k = (st.decisions / EXPLORE_EVERY) as usize % tries.len();
                return tries[k];
            }
        }
        let raw = link * PAGE as f64 / (PAGE as f64 + PER_PAGE_META);
        let mut best = (Method::None, raw);
        for &(m, e) in &st.est {
            if m == Method::Xbzrle && round == 0 {
                continue;
            }
            let rate = (link / e.ratio.max(1e-3)).min(e.speed * self.workers);
            if rate > best.1 {
                best = (m, rate);
            }
        }
        if best.1 < raw * MARGIN {
            return Method::None;
        }
        best.0
    }

    /// Records an encoded batch: `input` page bytes became `wire` bytes in
    /// `secs` of one encoder thread.
    pub fn observe_encode(&self, method: Method, input: u64, wire: u64, secs: f64) {
        if self.compress != Compress::Auto || method == Method::None || input == 0 {
            return;
        }
        let ratio = wire as f64 / input as f64;
        let speed = input as f64 / secs.max(1e-7);
        let mut st = self.lock();
        match st.est.iter_mut().find(|(m, _)| *m == method) {
            Some((_, e)) => {
                e.ratio = 0.7 * e.ratio + 0.3 * ratio;
                e.speed = 0.7 * e.speed + 0.3 * speed;
            }
            None => st.est.push((method, Estimate { ratio, speed })),
        }
    }

    /// Records raw bytes written to the link while probing its bandwidth,
    /// with the kernel's delivery rate of the connection if it has one.
    pub fn observe_raw_sent(&self, bytes: u64, delivery_rate: Option<f64>) {
        if self.compress != Compress::Auto {
            return;
        }
        let mut st = self.lock();
        if st.link.is_some() {
            return;
        }
        st.probe_sent += bytes;
        let sent = st.probe_sent;
        if sent >= PROBE_SKIP {
            st.probe_rates.extend(delivery_rate.filter(|r| *r > 0.0));
        }
        match st.probe_mark {
            None if sent >= PROBE_SKIP => st.probe_mark = Some((Instant::now(), sent)),
            Some((t, at)) if sent >= PROBE_BYTES => {
                // TCP's own delivery-rate samples measure the path; time
                // over bytes is the fallback where there are none.
                let timed = (sent - at) as f64 / t.elapsed().as_secs_f64().max(1e-6);
                let rate = st
                    .probe_rates
                    .iter()
                    .copied()
                    .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))));
                st.link = Some(rate.unwrap_or(timed));
                self.measured.notify_all();
            }
            _ => {}
        }
    }

    /// Records a whole round's wire throughput: a round that went raw and
    /// took long enough to mean something also measures the link.
    pub fn observe_round(&self, throughput: f64, secs: f64, raw: bool) {
        if self.compress != Compress::Auto || !raw || secs < 0.05 {
            return;
        }
        let mut st = self.lock();
        let bw = match self.user_bandwidth {
            Some(u) => throughput.min(u),
            None => throughput,
        };
        st.link = Some(st.link.map_or(bw, |l| l.max(bw)));
    }

    /// The link bandwidth the policy believes in, if any yet.
    pub fn link(&self) -> Option<f64> {
        self.lock().link
    }

    /// Batches per method so far, e.g. "rle 812, none 6".
    pub fn summary(&self) -> String {
        let st = self.lock();
        let mut used = st.used.clone();
        used.sort_by_key(|u| std::cmp::Reverse(u.1));
        used.iter()
            .map(|(n, k)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Measures each candidate on the sample (two halves, so the second sees the
/// first in the dedup cache as later batches would).
fn calibrate(sample: &[u8]) -> Vec<(Method, Estimate)> {
    let pages = sample.len() / PAGE;
    if pages < 2 {
        return Vec::new();
    }
    let half = pages / 2 * PAGE;
    let idx: Vec<u64> = (0..pages as u64).collect();
    let mut out = Vec::new();
    let mut batch = EncodedBatch::default();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let warm: Vec<u8> = (0..PAGE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 56) as u8
        })
        .collect();
    for m in CANDIDATES {
        let mut enc = StreamEncoder::new(CacheSizes {
            xbzrle_bytes: 1 << 20,
            dedup_bytes: 4 << 20,
        });
        // Warm up (contexts, output buffers) so the timing is the codec's,
        // on pages of its own: sample pages would prime the dedup cache.
        if enc.encode(m, &[u64::MAX - 1], &warm, &mut batch).is_err() {
            continue;
        }
        // The thread's CPU time, not the clock's: on a busy host a wall
        // clock counts time this thread waited for a core as the codec's,
        // and a preemption over a small sample made a fast codec look
        // slower than a 1 Gbit link.
        let cpu0 = crate::stats::thread_cpu_secs();
        let mut wire = 0usize;
        let mut ok = true;
        for (i, part) in [&sample[..half], &sample[half..pages * PAGE]]
            .iter()
            .enumerate()
        {
            let ids = &idx[i * (half / PAGE)..i * (half / PAGE) + part.len() / PAGE];
            batch.clear();
            if enc.encode(m, ids, part, &mut batch).is_err() {
                ok = false;
                break;
            }
            wire += batch.payload.len() + batch.len() * PER_PAGE_META as usize;
        }
        if ok {
            let secs = (crate::stats::thread_cpu_secs() - cpu0).max(1e-7);
            let input = (pages * PAGE) as f64;
            out.push((
                m,
                Estimate {
                    ratio: wire as f64 / input,
                    speed: input / secs,
                },
            ));
        }
    }
    // Re-sent pages: xbzrle starts from rle's figures (its misses are rle).
    if let Some(&(_, e)) = out.iter().find(|(m, _)| *m == Method::Rle) {
        out.push((Method::Xbzrle, e));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(c: Compress) -> CompressOptions {
        CompressOptions {
            compress: c,
            ..Default::default()
        }
    }

    #[test]
    fn auto_compresses_constant_memory_on_a_slow_link_and_not_random_memory() {
        let best: Vec<u8> = (0..64 * PAGE).map(|i| (i / PAGE) as u8 | 1).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let worst: Vec<u8> = (0..64 * PAGE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let gbit = Some(117e6);
        let p = Policy::new(&opts(Compress::Auto), gbit, &best);
        let m = p.choose(0, None, 1 << 22);
        assert_ne!(
            m,
            Method::None,
            "constant pages on 1 Gbit must be compressed: {:?}",
            p.lock().est
        );
        assert_ne!(m, Method::Xbzrle, "xbzrle is for re-sent pages");
        // A tiny stop-and-copy goes raw.
        assert_eq!(p.choose(3, Some(64 << 10), 1 << 16), Method::None);
        let p = Policy::new(&opts(Compress::Auto), gbit, &worst);
        assert_eq!(p.choose(0, None, 1 << 22), Method::None);
        // Without a bandwidth, auto sends raw until the probe has measured the link.
        let p = Policy::new(&opts(Compress::Auto), None, &best);
        assert_eq!(p.choose(0, None, 1 << 22), Method::None);
        p.observe_raw_sent(PROBE_SKIP, None);
        std::thread::sleep(std::time::Duration::from_millis(20));
        p.observe_raw_sent(PROBE_BYTES, Some(117e6));
        assert_eq!(p.link(), Some(117e6), "the kernel's delivery rate wins");
        // Decisions that ran ahead of the probe wait for it, then compress.
        let p = std::sync::Arc::new(Policy::new(&opts(Compress::Auto), None, &best));
        assert_eq!(p.choose(0, None, PROBE_BYTES), Method::None);
        let q = p.clone();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            q.observe_raw_sent(PROBE_SKIP, None);
            q.observe_raw_sent(PROBE_BYTES, Some(117e6));
        });
        assert_ne!(p.choose(0, None, 1 << 22), Method::None);
        sender.join().unwrap();
        // Estimates follow what batches really do: a codec that stops paying is dropped.
        let p = Policy::new(&opts(Compress::Auto), gbit, &best);
        let m = p.choose(0, None, 1 << 22);
        for _ in 0..20 {
            p.observe_encode(m, 1 << 22, 1 << 22, 0.01);
        }
        let after = p.choose(0, None, 1 << 22);
        assert!(
            after == Method::None || after != m,
            "{m} kept after it stopped paying"
        );
        assert_eq!(
            Policy::new(&opts(Compress::Fixed(Method::Lz4)), None, &[]).choose(0, None, 1 << 22),
            Method::Lz4
        );
        assert!(p.summary().contains(&m.to_string()));
        assert_eq!(
            "zstd:5".parse::<Compress>(),
            Ok(Compress::Fixed(Method::Zstd(5)))
        );
        assert!("gzip".parse::<Compress>().is_err());
    }
}
