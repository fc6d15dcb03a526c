//! A migration's timeline on one side: every 10 ms, what the engine's
//! [`Telemetry`] says (phase, round, bytes per connection), what the guest
//! did (workload counters, the request service's answers and their
//! latency), and every 100 ms the host CPU each thread of this VMM used.
//! Events (rounds, the switch, a broken link) go in as they happen.
//!
//! Lines are JSON, one object each, tagged `"type"`: `"sample"` or
//! `"event"`, and `"side"`: `"source"` or `"destination"`. docs/timeline.md
//! lists every field. The source's file also holds the destination's lines
//! (sent back over the migration's control connection, and checked line by
//! line first: [`peer`]) and the summary.
//!
//! The timeline reads its VM through [`Sampled`], which the VM implements:
//! the VM owns its [`Watch`], so the timeline must not import the VM.

pub mod peer;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_memory::MemoryError;
use ferry_migration::{unix_now, Telemetry};
use serde_json::{json, Value};

use crate::devices::service::ServiceDevice;
use crate::metrics::MetricsSnapshot;
use crate::vstate::run_control::ReportedState;

/// What a timeline sample reads from the VM it records (the VM implements
/// it; see the module header).
pub trait Sampled: Sync {
    /// What the VM is doing now ("waiting" before its vCPUs start).
    fn reported_state(&self) -> ReportedState;
    /// Guest TSC frequency (kHz).
    fn tsc_khz(&self) -> u64;
    /// The guest's metrics page, read now.
    fn metrics(&self) -> Result<MetricsSnapshot, MemoryError>;
    /// How many workloads the guest runs.
    fn workload_count(&self) -> usize;
    /// The service device, if the VM has one.
    fn service(&self) -> Option<&Arc<ServiceDevice>>;
    /// The VM's migration watch.
    fn watch(&self) -> &Watch;
    /// Per disk, what its device did so far: [reads, writes, bytes read,
    /// bytes written] (none without disks).
    fn disk_io(&self) -> Vec<[u64; 4]> {
        Vec::new()
    }
}

/// How often the timeline samples.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(10);
/// Thread CPU is read every this many samples (it costs a /proc read per
/// thread, and the kernel counts it in 10 ms ticks anyway).
const CPU_EVERY: u32 = 10;

/// One migration's recording on one side.
pub struct Recorder {
    side: &'static str,
    tel: Arc<Telemetry>,
    lines: Mutex<Vec<u8>>,
    peer: Mutex<Vec<u8>>,
    stop: AtomicBool,
}

impl Recorder {
    /// A recorder for `side` ("source" or "destination") of a migration.
    pub fn new(side: &'static str) -> Arc<Recorder> {
        Arc::new(Recorder {
            side,
            tel: Telemetry::new(),
            lines: Mutex::new(Vec::new()),
            peer: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        })
    }

    /// The live figures the engine fills.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.tel
    }

    /// Samples `vm` every 10 ms until [`Recorder::stop`]; run it on a
    /// thread of its own.
    pub fn sample_until_stopped(&self, vm: &dyn Sampled) {
        let mut prev = Prev::default();
        let mut next = Instant::now();
        let mut n = 0u32;
        while !self.stop.load(Ordering::Relaxed) {
            // A destination may wait hours for its source: its timeline
            // starts when the source connects.
            if self.side == "destination" && self.tel.phase() == ferry_migration::LivePhase::Pending
            {
                std::thread::sleep(SAMPLE_EVERY);
                next = Instant::now();
                continue;
            }
            let cpu = n.is_multiple_of(CPU_EVERY);
            let line = sample(self.side, vm, &self.tel, &mut prev, cpu);
            self.push(&line);
            self.drain_events();
            n += 1;
            next += SAMPLE_EVERY;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                next = now; // fell behind (a busy host): do not burst
            }
        }
        self.drain_events();
    }

    /// Ends [`Recorder::sample_until_stopped`] after its current sample.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    fn push(&self, v: &Value) {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        // Serializing a Value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *lines, v);
        lines.push(b'\n');
    }

    fn drain_events(&self) {
        for e in self.tel.take_events() {
            self.push(&json!({
                "type": "event", "side": self.side, "t": e.t,
                "what": e.what, "detail": e.detail,
            }));
        }
    }

    /// A copy of this side's lines so far.
    pub fn lines(&self) -> Vec<u8> {
        self.drain_events();
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Keeps the other side's lines (the destination's, at the source):
    /// only those a destination writes, each written anew ([`peer`]); what
    /// was dropped is an event in this side's lines.
    pub fn set_peer_lines(&self, lines: Vec<u8>) {
        let checked = peer::check(&lines);
        if checked.dropped > 0 {
            let why = checked.first_why.unwrap_or_default();
            tracing::warn!(
                dropped = checked.dropped,
                "the destination's timeline: {why}"
            );
            self.tel.event(
                "timeline",
                format!(
                    "dropped {} lines of the destination's timeline (the first: {why})",
                    checked.dropped
                ),
            );
        }
        *self.peer.lock().unwrap_or_else(|e| e.into_inner()) = checked.lines;
    }

    /// Writes the whole timeline to `path`: a header, both sides' lines
    /// and `summary` (the migration's result) last.
    pub fn write(
        &self,
        path: &std::path::Path,
        header: Value,
        summary: Value,
    ) -> std::io::Result<()> {
        use std::io::Write;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        serde_json::to_writer(&mut f, &header)?;
        f.write_all(b"\n")?;
        f.write_all(&self.lines())?;
        f.write_all(&self.peer.lock().unwrap_or_else(|e| e.into_inner()))?;
        serde_json::to_writer(&mut f, &summary)?;
        f.write_all(b"\n")?;
        f.flush()
    }
}

/// What the previous sample read (the service's latency is a running sum).
#[derive(Default)]
struct Prev {
    answered: u64,
    latency_ticks: u64,
}

/// One sample line.
fn sample(side: &str, vm: &dyn Sampled, tel: &Telemetry, prev: &mut Prev, cpu: bool) -> Value {
    let t = tel.snapshot();
    let links: BTreeMap<&str, [u64; 2]> = t
        .links
        .iter()
        .map(|(n, s, r)| (n.as_str(), [*s, *r]))
        .collect();
    let mut v = json!({
        "type": "sample", "side": side, "t": unix_now(),
        "phase": t.phase, "round": t.round, "remaining_pages": t.remaining_pages,
        "processed_bytes": t.processed_bytes, "dirty_rate": t.dirty_rate,
        "throttle_pct": t.throttle_pct, "links": links,
        "state": vm.reported_state(),
        // True only while vCPUs run: a destination waiting for its VM
        // runs none (the execution ratio counts on it).
        "running": vm.reported_state() == ReportedState::Running,
    });
    let tsc_khz = vm.tsc_khz().max(1) as f64;
    // Reads only pages in memory: safe at a postcopy destination too.
    let metrics = vm.metrics().ok();
    if let Some(m) = metrics {
        if m.valid() {
            let n = vm.workload_count();
            let c = m.cpu_totals();
            v["guest"] = json!({
                "progress": (0..n).map(|i| m.progress(i)).collect::<Vec<_>>(),
                "ticks": c.ticks,
                "apf_not_present": c.apf_not_present,
            });
        }
    }
    if let Some(s) = vm.service() {
        let answered = s.stats.responses.load(Ordering::Relaxed);
        let ticks = s.stats.latency_ticks.load(Ordering::Relaxed);
        let max = s.stats.latency_max_ticks.swap(0, Ordering::Relaxed);
        let n = answered.saturating_sub(prev.answered);
        let mean_us = if n > 0 {
            ticks.saturating_sub(prev.latency_ticks) as f64 / n as f64 / tsc_khz * 1e3
        } else {
            0.0
        };
        v["service"] = json!({
            "answered": answered,
            "mean_us": (mean_us * 10.0).round() / 10.0,
            "max_us": (max as f64 / tsc_khz * 1e4).round() / 10.0,
            "forwarded": s.stats.forwarded.load(Ordering::Relaxed),
        });
        prev.answered = answered;
        prev.latency_ticks = ticks;
    }
    let disks = vm.disk_io();
    if !disks.is_empty() {
        v["disks"] = json!(disks);
    }
    if cpu {
        v["cpu_ms"] = json!(thread_cpu_ms());
    }
    v
}

/// CPU time each thread of this process used so far (ms), keyed by
/// "name/tid" (vCPU threads are named vcpuN).
fn thread_cpu_ms() -> BTreeMap<String, u64> {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // "tid (comm) state ..." : comm may hold spaces, so split at ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields after comm: state is 0; utime is 11, stime 12.
        let ticks = |i: usize| rest.get(i).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        let ms = (ticks(11) + ticks(12)) * 1000 / hz;
        out.insert(format!("{comm}/{}", e.file_name().to_string_lossy()), ms);
    }
    out
}

/// How much of the time before a migration its timeline starts with (the
/// guest's baseline), when the VMM keeps a history.
pub const PRE_ROLL: Duration = Duration::from_secs(3);

/// The recorder of the migration a VM is in, if any (the engine's trait
/// calls and the metrics endpoint find it here), and the samples of the
/// last few seconds before it.
#[derive(Default)]
pub struct Watch {
    current: Mutex<Option<Arc<Recorder>>>,
    /// The last migration's live figures, kept after it ended (metrics).
    last: Mutex<Option<Arc<Telemetry>>>,
    /// Sample lines of the last [`PRE_ROLL`] while no migration runs.
    history: Mutex<std::collections::VecDeque<(Instant, Vec<u8>)>>,
}

/// Samples `vm` every 10 ms while no migration runs, keeping the last
/// [`PRE_ROLL`] for the next migration's timeline. The thread ends with
/// the VM.
pub fn keep_history<V: Sampled + Send + 'static>(vm: &Arc<V>) {
    let weak = Arc::downgrade(vm);
    let _ = std::thread::Builder::new()
        .name("history".into())
        .spawn(move || {
            let idle = Telemetry::new();
            let mut prev = Prev::default();
            let mut n = 0u32;
            while let Some(vm) = weak.upgrade() {
                if vm.watch().current().is_none() {
                    let line = sample(
                        "source",
                        &*vm,
                        &idle,
                        &mut prev,
                        n.is_multiple_of(CPU_EVERY),
                    );
                    let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
                    bytes.push(b'\n');
                    let mut h = vm.watch().history.lock().unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    while h
                        .front()
                        .is_some_and(|(t, _)| now.duration_since(*t) > PRE_ROLL)
                    {
                        h.pop_front();
                    }
                    h.push_back((now, bytes));
                }
                n += 1;
                drop(vm);
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
}

impl Watch {
    /// The recorder now, if a migration runs.
    pub fn current(&self) -> Option<Arc<Recorder>> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The running or, failing that, the last migration's figures.
    pub fn latest(&self) -> Option<Arc<Telemetry>> {
        self.current()
            .map(|r| r.tel.clone())
            .or_else(|| self.last.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Runs `f` with `rec` recording `vm` on a thread of its own; the
    /// source's timeline starts with the history before it.
    pub fn record<T>(&self, vm: &dyn Sampled, rec: &Arc<Recorder>, f: impl FnOnce() -> T) -> T {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(rec.clone());
        let history: Vec<(Instant, Vec<u8>)> = self
            .history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        if rec.side == "source" {
            let mut lines = rec.lines.lock().unwrap_or_else(|e| e.into_inner());
            for (_, l) in history {
                lines.extend_from_slice(&l);
            }
        }
        let out = std::thread::scope(|s| {
            let sampler = std::thread::Builder::new()
                .name("timeline".into())
                .spawn_scoped(s, || rec.sample_until_stopped(vm));
            let out = f();
            rec.stop();
            if let Ok(h) = sampler {
                let _ = h.join();
            }
            out
        });
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(rec.tel.clone());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_migration::LivePhase;

    /// A VM as the timeline sees it, without KVM.
    struct Fake {
        state: ReportedState,
        watch: Watch,
    }

    impl Sampled for Fake {
        fn reported_state(&self) -> ReportedState {
            self.state
        }
        fn tsc_khz(&self) -> u64 {
            1_000_000
        }
        fn metrics(&self) -> Result<MetricsSnapshot, MemoryError> {
            Err(MemoryError::Empty)
        }
        fn workload_count(&self) -> usize {
            1
        }
        fn service(&self) -> Option<&Arc<ServiceDevice>> {
            None
        }
        fn watch(&self) -> &Watch {
            &self.watch
        }
    }

    fn fake(state: ReportedState) -> Fake {
        Fake {
            state,
            watch: Watch::default(),
        }
    }

    fn lines(bytes: &[u8]) -> Vec<Value> {
        bytes
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect()
    }

    #[test]
    fn a_sample_says_what_it_could_read() {
        let tel = Telemetry::new();
        let mut prev = Prev::default();
        let v = sample(
            "source",
            &fake(ReportedState::Paused),
            &tel,
            &mut prev,
            false,
        );
        assert_eq!(v["type"], "sample");
        assert_eq!(v["side"], "source");
        assert_eq!(v["running"], false);
        assert_eq!(v["phase"], "pending");
        // No metrics page and no service device: no guest or service part.
        assert!(v.get("guest").is_none() && v.get("service").is_none());
        assert!(v.get("cpu_ms").is_none());
        let v = sample(
            "destination",
            &fake(ReportedState::Running),
            &tel,
            &mut prev,
            true,
        );
        assert_eq!(v["running"], true);
        assert_eq!(v["state"], "running");
        // A destination waiting for its VM runs no guest.
        let v = sample(
            "destination",
            &fake(ReportedState::Waiting),
            &tel,
            &mut prev,
            false,
        );
        assert_eq!(
            (v["running"].clone(), v["state"].clone()),
            (json!(false), json!("waiting"))
        );
        let v = sample(
            "destination",
            &fake(ReportedState::Running),
            &tel,
            &mut prev,
            true,
        );
        let cpu = v["cpu_ms"].as_object().unwrap();
        assert!(cpu.keys().all(|k| k.contains('/')), "{cpu:?}");
    }

    #[test]
    fn recording_sets_the_current_migration_and_keeps_its_figures() {
        let vm = fake(ReportedState::Running);
        vm.watch
            .history
            .lock()
            .unwrap()
            .push_back((Instant::now(), b"{\"before\":1}\n".to_vec()));
        let rec = Recorder::new("source");
        let out = vm.watch.record(&vm, &rec, || {
            let now = vm.watch.current().expect("a migration runs");
            assert!(Arc::ptr_eq(&now, &rec));
            rec.telemetry().event("round", "1");
            std::thread::sleep(SAMPLE_EVERY * 3);
            7
        });
        assert_eq!(out, 7);
        assert!(vm.watch.current().is_none());
        assert!(Arc::ptr_eq(&vm.watch.latest().unwrap(), rec.telemetry()));
        let got = lines(&rec.lines());
        // The source's timeline starts with the history before it.
        assert_eq!(got[0], json!({"before": 1}));
        assert!(got.iter().any(|l| l["type"] == "sample"));
        assert!(got
            .iter()
            .any(|l| l["type"] == "event" && l["what"] == "round" && l["side"] == "source"));
        assert!(vm.watch.history.lock().unwrap().is_empty());
    }

    #[test]
    fn a_destination_samples_nothing_until_its_source_connects() {
        let vm = fake(ReportedState::Paused);
        vm.watch
            .history
            .lock()
            .unwrap()
            .push_back((Instant::now(), b"{\"before\":1}\n".to_vec()));
        let rec = Recorder::new("destination");
        vm.watch.record(&vm, &rec, || {
            std::thread::sleep(SAMPLE_EVERY * 3);
        });
        assert_eq!(rec.telemetry().phase(), LivePhase::Pending);
        assert!(rec.lines().is_empty(), "no history, no samples");
    }

    #[test]
    fn the_written_timeline_is_header_lines_peer_lines_summary() {
        let rec = Recorder::new("source");
        rec.push(&json!({"type": "sample", "n": 1}));
        rec.set_peer_lines(b"{\"type\":\"sample\",\"side\":\"destination\",\"t\":1.0}\n".to_vec());
        let dir = std::env::temp_dir().join(format!("ferry-timeline-{}", std::process::id()));
        let path = dir.join("sub").join("t.jsonl");
        rec.write(&path, json!({"type": "header"}), json!({"type": "summary"}))
            .unwrap();
        let got = lines(&std::fs::read(&path).unwrap());
        let kinds: Vec<&str> = got.iter().map(|l| l["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["header", "sample", "sample", "summary"]);
        assert_eq!(got[2]["side"], "destination");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
