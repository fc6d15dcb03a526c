//! A migration's timeline file read back, and the series the report draws
//! from it (100 ms bins, seconds from the migration's start).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Width of a bin of the per-100 ms series (s).
pub const BIN: f64 = 0.1;

/// Farthest a line may lie from the migration's start (s). A timeline is
/// one migration and its tail; a time beyond this is corrupt (or hostile:
/// the destination's lines come from the peer), and a series stretched to
/// reach it would need more bins than memory holds.
pub const MAX_SPAN_S: f64 = 86_400.0;

/// Which VMM wrote a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

/// One 10 ms sample.
#[derive(Clone, Debug)]
pub struct Sample {
    pub side: Side,
    /// Seconds from the migration's start.
    pub t: f64,
    pub running: bool,
    pub throttle_pct: f64,
    /// The first workload's progress counter.
    pub progress: Option<u64>,
    /// Requests the VM's service answered (this side's device).
    pub answered: Option<u64>,
    pub service_mean_us: f64,
    /// Bytes sent per connection.
    pub sent: BTreeMap<String, u64>,
}

/// Something that happened.
#[derive(Clone, Debug)]
pub struct Event {
    pub side: Side,
    pub t: f64,
    pub what: String,
    pub detail: String,
}

/// One request of `ferry load`: when it was sent (s from the migration's
/// start) and how long it took (ms).
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub t: f64,
    pub ms: f64,
    pub ok: bool,
}

/// A migration, as its timeline (and optionally its load's log) says.
#[derive(Clone, Debug)]
pub struct Run {
    pub name: String,
    pub header: Value,
    /// The migration's start (Unix seconds); times are relative to it.
    pub t0: f64,
    pub samples: Vec<Sample>,
    pub events: Vec<Event>,
    /// The MigrationStats of a migration that succeeded.
    pub stats: Option<Value>,
    pub error: Option<String>,
    pub requests: Vec<Request>,
}

impl Run {
    /// Reads a timeline file.
    pub fn read(path: &Path) -> Result<Run> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read timeline {}", path.display()))?;
        let name = path
            .file_stem()
            .map_or("run".into(), |s| s.to_string_lossy().into_owned());
        Run::parse(&name, &text)
            .with_context(|| format!("{} is not a ferry timeline", path.display()))
    }

    /// Parses a timeline's lines.
    pub fn parse(name: &str, text: &str) -> Result<Run> {
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let header: Value = match lines.next() {
            Some(l) => serde_json::from_str(l).context("first line")?,
            None => bail!("it is empty"),
        };
        if header["type"] != "header" {
            bail!("its first line is not a timeline header");
        }
        let t0 = header["t"]
            .as_f64()
            .context("the header has no start time")?;
        let mut run = Run {
            name: name.to_string(),
            header,
            t0,
            samples: Vec::new(),
            events: Vec::new(),
            stats: None,
            error: None,
            requests: Vec::new(),
        };
        for (i, l) in lines.enumerate() {
            // A timeline cut short (a VMM killed mid-write) keeps what parsed.
            let Ok(v) = serde_json::from_str::<Value>(l) else {
                eprintln!(
                    "ferry: warning: {name}: line {} does not parse; skipped",
                    i + 2
                );
                continue;
            };
            let side = match v["side"].as_str() {
                Some("destination") => Side::Destination,
                _ => Side::Source,
            };
            let t = v["t"].as_f64().unwrap_or(t0) - t0;
            if !t.is_finite() || t.abs() > MAX_SPAN_S {
                eprintln!(
                    "ferry: warning: {name}: line {} is {t:.0} s from the start; skipped",
                    i + 2
                );
                continue;
            }
            match v["type"].as_str() {
                Some("sample") => run.samples.push(Sample {
                    side,
                    t,
                    running: v["running"].as_bool().unwrap_or(false),
                    throttle_pct: v["throttle_pct"].as_f64().unwrap_or(0.0),
                    // The first workload's counter (workloads count in
                    // units of their own: requests, bytes, adds).
                    progress: v["guest"]["progress"][0].as_u64(),
                    answered: v["service"]["answered"].as_u64(),
                    service_mean_us: v["service"]["mean_us"].as_f64().unwrap_or(0.0),
                    sent: v["links"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .filter_map(|(k, x)| Some((k.clone(), x[0].as_u64()?)))
                                .collect()
                        })
                        .unwrap_or_default(),
                }),
                Some("event") => run.events.push(Event {
                    side,
                    t,
                    what: v["what"].as_str().unwrap_or("").to_string(),
                    detail: v["detail"].as_str().unwrap_or("").to_string(),
                }),
                Some("summary") => {
                    if v["ok"] == true {
                        run.stats = Some(v["stats"].clone());
                    } else {
                        run.error = Some(v["error"].as_str().unwrap_or("failed").to_string());
                    }
                }
                _ => {}
            }
        }
        run.samples
            .sort_by(|a, b| a.t.partial_cmp(&b.t).unwrap_or(std::cmp::Ordering::Equal));
        run.events
            .sort_by(|a, b| a.t.partial_cmp(&b.t).unwrap_or(std::cmp::Ordering::Equal));
        Ok(run)
    }

    /// Adds the requests of a `ferry load --out` CSV.
    pub fn add_load(&mut self, path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read load log {}", path.display()))?;
        self.add_load_text(&text, &path.display().to_string())
    }

    /// Adds the requests of a `ferry load --out` CSV's text (`name` says
    /// which file in errors).
    pub fn add_load_text(&mut self, text: &str, name: &str) -> Result<()> {
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
        let col = |name: &str| head.iter().position(|h| *h == name);
        let (Some(t), Some(lat), Some(out)) =
            (col("send_unix_us"), col("latency_us"), col("outcome"))
        else {
            bail!(
                "{name} has no send_unix_us, latency_us and outcome columns (a `ferry load --out` log of this version)"
            );
        };
        for l in lines {
            let f: Vec<&str> = l.split(',').collect();
            let (Some(ts), Some(ms)) = (
                f.get(t).and_then(|x| x.parse::<f64>().ok()),
                f.get(lat).and_then(|x| x.parse::<f64>().ok()),
            ) else {
                continue;
            };
            self.requests.push(Request {
                t: ts / 1e6 - self.t0,
                ms: ms / 1e3,
                ok: f.get(out) == Some(&"ok"),
            });
        }
        Ok(())
    }

    /// The time span the report draws (s).
    pub fn span(&self) -> (f64, f64) {
        let lo = self
            .samples
            .iter()
            .find(|s| s.side == Side::Source)
            .map_or(0.0, |s| s.t)
            .min(0.0);
        let hi = self.samples.last().map_or(1.0, |s| s.t).max(lo + 0.5);
        (lo, hi)
    }

    /// The mode that ran.
    pub fn mode(&self) -> String {
        self.header["mode"].as_str().unwrap_or("?").to_string()
    }

    /// Seconds from the start at which the VM paused for the switch, if it did.
    pub fn switch_at(&self) -> Option<f64> {
        self.events
            .iter()
            .find(|e| e.side == Side::Source && e.what == "phase" && e.detail == "switching")
            .map(|e| e.t)
    }

    /// When the source's migration ended (the VM runs at the destination
    /// with all its memory), or the last sample.
    pub fn end_at(&self) -> f64 {
        self.events
            .iter()
            .find(|e| e.side == Side::Source && e.what == "phase" && e.detail == "succeeded")
            .map_or_else(|| self.span().1, |e| e.t)
    }

    fn bins(&self) -> Bins {
        let (lo, hi) = self.span();
        let lo = (lo / BIN).floor() * BIN;
        // Whole bins only: a last, partial one would read as a drop.
        Bins {
            lo,
            n: (((hi - lo) / BIN).floor() as usize).max(1),
        }
    }

    /// Per 100 ms bin, how fast a counter rose: (bin start, per second).
    /// Samples are taken in time order and only rises above the highest
    /// value seen count, so a sample that repeats an older value (a paused
    /// source while the destination runs on) counts nothing twice.
    fn increases(&self, mut seen: Vec<(f64, u64)>) -> Vec<(f64, f64)> {
        let bins = self.bins();
        let mut sums = vec![0.0; bins.n];
        seen.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut high: Option<u64> = None;
        for (t, v) in seen {
            if let (Some(h), Some(i)) = (high, bins.index(t)) {
                if v > h {
                    sums[i] += (v - h) as f64;
                }
            }
            high = Some(high.map_or(v, |h| h.max(v)));
        }
        sums.iter()
            .enumerate()
            .map(|(i, x)| (bins.start(i), x / BIN))
            .collect()
    }

    /// A counter each side keeps from its own zero (a service device's),
    /// per second: the sides' rises added up.
    fn rate(&self, value: impl Fn(&Sample) -> Option<u64>) -> Vec<(f64, f64)> {
        let per_side = [Side::Source, Side::Destination].map(|side| {
            self.increases(
                self.samples
                    .iter()
                    .filter(|s| s.side == side)
                    .filter_map(|s| Some((s.t, value(s)?)))
                    .collect(),
            )
        });
        let [a, b] = per_side;
        a.iter().zip(&b).map(|(x, y)| (x.0, x.1 + y.1)).collect()
    }

    /// The guest's workload progress per second.
    ///
    /// The counter lives in guest memory, so it runs on from one side to
    /// the other: both sides' samples count as one series (the destination
    /// may read it only some time after it started, during postcopy).
    pub fn progress_rate(&self) -> Vec<(f64, f64)> {
        self.increases(
            self.samples
                .iter()
                .filter_map(|s| Some((s.t, s.progress?)))
                .collect(),
        )
    }

    /// Requests the VM answered per second (its service devices).
    pub fn answered_rate(&self) -> Option<Vec<(f64, f64)>> {
        self.samples
            .iter()
            .any(|s| s.answered.is_some())
            .then(|| self.rate(|s| s.answered))
    }

    /// Bytes/s sent per connection, per side ("bulk0", "dst control"...),
    /// leaving out connections that carried under 1 MiB.
    pub fn bandwidth(&self) -> Vec<(String, Vec<(f64, f64)>)> {
        let mut names: Vec<(Side, String)> = Vec::new();
        for s in &self.samples {
            for k in s.sent.keys() {
                if !names.iter().any(|(sd, n)| *sd == s.side && n == k) {
                    names.push((s.side, k.clone()));
                }
            }
        }
        let mut out = Vec::new();
        for (side, name) in names {
            let series = self.rate(|s| {
                if s.side == side {
                    s.sent.get(&name).copied()
                } else {
                    None
                }
            });
            let total: f64 = series.iter().map(|(_, r)| r * BIN).sum();
            if total >= (1 << 20) as f64 {
                let label = match side {
                    Side::Source => name,
                    Side::Destination => format!("dst {name}"),
                };
                out.push((label, series));
            }
        }
        out
    }

    /// Per 100 ms, the share of wall time the guest's vCPUs ran: none
    /// while paused on both sides, less the throttle, less the time vCPU
    /// threads waited on postcopy faults (the destination's own account).
    pub fn exec_ratio(&self) -> Vec<(f64, f64)> {
        let bins = self.bins();
        let (lo, n) = (bins.lo, bins.n);
        let mut run = vec![[0.0f64; 2]; n];
        let mut count = vec![[0.0f64; 2]; n];
        for s in &self.samples {
            let Some(i) = bins.index(s.t) else { continue };
            let k = (s.side == Side::Destination) as usize;
            count[i][k] += 1.0;
            if s.running {
                run[i][k] += 1.0 - s.throttle_pct / 100.0;
            }
        }
        let mut out: Vec<(f64, f64)> = (0..n)
            .map(|i| {
                let share = |k: usize| {
                    if count[i][k] > 0.0 {
                        run[i][k] / count[i][k]
                    } else {
                        0.0
                    }
                };
                (bins.start(i), share(0).max(share(1)).min(1.0))
            })
            .collect();
        for (t, r) in self.fault_bins().iter().map(|b| (b.t, b.exec_ratio)) {
            let i = ((t - lo) / BIN).round();
            if i >= 0.0 && (i as usize) < n {
                out[i as usize].1 *= r;
            }
        }
        out
    }

    /// The destination's postcopy fault bins, placed on this run's clock.
    pub fn fault_bins(&self) -> Vec<FaultBin> {
        let Some(stats) = &self.stats else {
            return Vec::new();
        };
        let post = &stats["postcopy"];
        let (Some(switch), Some(series)) = (
            post["switch_at_s"].as_f64(),
            post["faults"]["series"].as_array(),
        ) else {
            return Vec::new();
        };
        // The fault bins count from the VM's start there, which is the
        // "started" event (close to the switch).
        let started = self
            .events
            .iter()
            .find(|e| e.side == Side::Source && e.what == "started")
            .map_or(
                switch + stats["start_unix_s"].as_f64().unwrap_or(self.t0) - self.t0,
                |e| e.t,
            );
        series
            .iter()
            .map(|b| FaultBin {
                t: started + b["t_ms"].as_f64().unwrap_or(0.0) / 1e3,
                major: b["major"].as_f64().unwrap_or(0.0),
                minor: b["minor"].as_f64().unwrap_or(0.0),
                zero: b["zero"].as_f64().unwrap_or(0.0),
                async_worker: b["async_worker"].as_f64().unwrap_or(0.0),
                exec_ratio: b["exec_ratio"].as_f64().unwrap_or(1.0),
            })
            .collect()
    }

    /// Request latency (ms) per 100 ms: the mean of `ferry load`'s
    /// requests sent in the bin, else the service's own mean.
    pub fn latency_mean(&self) -> Vec<(f64, f64)> {
        let bins = self.bins();
        let mut sum = vec![0.0; bins.n];
        let mut cnt = vec![0.0; bins.n];
        let points: Vec<(f64, f64)> = if self.requests.is_empty() {
            self.samples
                .iter()
                .filter(|s| s.service_mean_us > 0.0)
                .map(|s| (s.t, s.service_mean_us / 1e3))
                .collect()
        } else {
            self.requests
                .iter()
                .filter(|r| r.ok)
                .map(|r| (r.t, r.ms))
                .collect()
        };
        for (t, ms) in points {
            if let Some(i) = bins.index(t) {
                sum[i] += ms;
                cnt[i] += 1.0;
            }
        }
        (0..bins.n)
            .filter(|&i| cnt[i] > 0.0)
            .map(|i| (bins.start(i), sum[i] / cnt[i]))
            .collect()
    }

    /// Figures for the comparison table (and `--json`).
    pub fn figures(&self) -> Value {
        let s = self.stats.as_ref();
        let f = |k: &str| s.and_then(|s| s[k].as_f64());
        let start = self
            .events
            .iter()
            .find(|e| e.side == Side::Source && e.what == "open")
            .map_or(0.0, |e| e.t);
        let end = self.end_at();
        let rate = self.progress_rate();
        let mean_in = |a: f64, b: f64| {
            let v: Vec<f64> = rate
                .iter()
                .filter(|(t, _)| *t + BIN > a && *t < b)
                .map(|(_, r)| *r)
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        };
        // Before: whole bins before the start, from the first one where the
        // workload made progress (a load that began late is no baseline).
        let first = rate
            .iter()
            .find(|(_, r)| *r > 0.0)
            .map_or(start, |(t, _)| *t);
        let before = mean_in(first.max(start - 10.0) + BIN, start - BIN);
        let during = mean_in(start, end.max(start + BIN));
        let lat: Vec<f64> = {
            let mut v: Vec<f64> = self
                .requests
                .iter()
                .filter(|r| r.ok)
                .map(|r| r.ms)
                .collect();
            v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
            v
        };
        let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).copied();
        let mut exec: Vec<f64> = self
            .exec_ratio()
            .iter()
            .filter(|(t, _)| *t + BIN > start && *t < end)
            .map(|(_, r)| *r)
            .collect();
        exec.sort_by(f64::total_cmp);
        let exec_min = exec.first().copied();
        // The typical 100 ms of the migration (a throttled guest's share;
        // the pause is a bin or two of it).
        let exec_median = exec.get(exec.len() / 2).copied();
        serde_json::json!({
            "run": self.name,
            "mode": self.mode(),
            "ok": self.stats.is_some(),
            "switch_at_s": self.switch_at(),
            "error": self.error,
            "total_s": f("total_secs"),
            "downtime_ms": f("downtime_ms"),
            "bytes": f("bytes"),
            "rounds": s.and_then(|s| s["rounds"].as_array().map(|a| a.len())),
            "major_faults": s.and_then(|s| s["postcopy"]["faults"]["major"].as_u64()),
            "progress_before_per_s": before,
            "progress_during_per_s": during,
            "during_vs_before": match (before, during) {
                (Some(b), Some(d)) if b > 0.0 => Some(d / b - 1.0),
                _ => None,
            },
            "exec_ratio_min": exec_min,
            "exec_ratio_median": exec_median,
            "requests": self.requests.len(),
            "request_errors": self.requests.iter().filter(|r| !r.ok).count(),
            "latency_p50_ms": pct(0.5),
            "latency_p99_ms": pct(0.99),
            "latency_max_ms": lat.last().copied(),
        })
    }
}

/// The 100 ms bins a run's series use: `n` whole bins from `lo`.
struct Bins {
    lo: f64,
    n: usize,
}

impl Bins {
    /// The bin holding time `t`, if one does.
    fn index(&self, t: f64) -> Option<usize> {
        let i = (t - self.lo) / BIN;
        (i >= 0.0 && (i as usize) < self.n).then_some(i as usize)
    }

    /// When bin `i` starts.
    fn start(&self, i: usize) -> f64 {
        self.lo + i as f64 * BIN
    }
}

/// One 100 ms bin of the destination's faults.
#[derive(Clone, Copy, Debug)]
pub struct FaultBin {
    pub t: f64,
    pub major: f64,
    pub minor: f64,
    pub zero: f64,
    pub async_worker: f64,
    pub exec_ratio: f64,
}

#[cfg(test)]
mod tests;
