//! What a migration measured (definitions in shared DESIGN.md, "Measurements").

use std::time::Duration;

/// One precopy round.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundStats {
    /// 0 = full copy; the last is the stop-and-copy round.
    pub round: u32,
    /// Non-zero pages sent.
    pub pages: u64,
    /// Zero pages sent as ranges.
    pub zero_pages: u64,
    /// Bytes written to the sockets.
    pub bytes: u64,
    /// Wall time of the round.
    pub secs: f64,
    /// Bytes per second achieved.
    pub throughput: f64,
    /// Guest dirty rate measured over the round (bytes/s).
    pub dirty_rate: f64,
    /// Auto-converge throttle in force during the round (percent).
    pub throttle_pct: u32,
    /// Page bytes that went through a codec, and the bytes they became.
    pub encoded_in: u64,
    /// Wire bytes of the encoded batches.
    pub encoded_out: u64,
    /// Dirty pages left out: their bytes were those last sent.
    #[serde(default)]
    pub unchanged_pages: u64,
}

/// A whole migration, as the source saw it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MigrationStats {
    /// When the migration started (seconds since the Unix epoch, this
    /// host's clock): lines its times up with other records.
    #[serde(default)]
    pub start_unix_s: f64,
    /// Start to source released (seconds).
    pub total_secs: f64,
    /// Source vCPUs paused to destination vCPUs running (ms), measured at
    /// the source: pause until the destination's Started arrived.
    pub downtime_ms: f64,
    /// Every round.
    pub rounds: Vec<RoundStats>,
    /// Bytes on the wire, all connections.
    pub bytes: u64,
    /// Non-zero pages sent (all rounds).
    pub pages: u64,
    /// Dirty pages not sent again, all rounds: their bytes were those last
    /// sent.
    #[serde(default)]
    pub unchanged_pages: u64,
    /// Zero pages sent as ranges.
    pub zero_pages: u64,
    /// Encoded VM state bytes.
    pub state_bytes: u64,
    /// Pages compared end to end (0 without --verify).
    pub verified_pages: u64,
    /// A verified precopy (v12): hashing this side's memory against what
    /// it sent, after the VM started at the destination (ms; outside the
    /// downtime).
    #[serde(default)]
    pub verify_after_ms: f64,
    /// The mode that ran.
    pub mode: crate::options::Mode,
    /// Why precopy stopped iterating.
    pub converged: String,
    /// Where the VM's request service listens at the destination, if it has one.
    pub destination_service: Option<String>,
    /// Host CPU seconds the migration used on the source (engine threads).
    pub source_cpu_s: f64,
    /// Host CPU seconds the migration used on the destination (its report).
    pub destination_cpu_s: f64,
    /// Where the downtime went (ms): pausing the vCPUs, the last round,
    /// saving the state, hashing for verification, and the destination's
    /// restore and start (with the network round trip).
    pub downtime_parts: DowntimeParts,
    /// Compression asked for ("none", "auto", a codec) and what happened.
    pub compression: CompressionStats,
    /// What happened after the switch (postcopy and hybrid that switched).
    pub postcopy: Option<PostcopyStats>,
    /// What became of the VM's clients, if it has a request service.
    #[serde(default)]
    pub clients: Option<ClientsOutcome>,
    /// Split migration: how memory was shared out.
    #[serde(default)]
    pub split: Option<SplitStats>,
    /// Gather: what the destination pulled from the memory servers.
    #[serde(default)]
    pub gather: Option<GatherStats>,
    /// Guest RAM the destination had populated ahead of the stream and
    /// gave back at the opening, before any page landed, because this
    /// migration may switch to postcopy or split (protocol v13).
    #[serde(default)]
    pub destination_released_bytes: u64,
    /// Distinct pages the destination's host offered to share: what its
    /// other VMs hold (protocol v14).
    #[serde(default)]
    pub shared_offered: u64,
    /// Pages sent as references to those instead of as data.
    #[serde(default)]
    pub shared_pages: u64,
    /// References the destination could not resolve (sent again).
    #[serde(default)]
    pub shared_missed: u64,
    /// The VM's disks and how each moved (the VMM fills it in; empty
    /// without disks).
    #[serde(default)]
    pub disks: Vec<DiskMove>,
    /// Bytes of disk blocks sent (0 while every disk is on shared storage).
    #[serde(default)]
    pub disk_bytes: u64,
}

/// How one disk moved with its VM.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DiskMove {
    /// Which disk.
    pub index: usize,
    /// `nbd` (shared storage) or `raw` (an image on the source host).
    pub backend: String,
    /// The export's address or the image's path.
    pub path: String,
    /// `shared`: it stayed on its server and the destination attached it.
    pub how: String,
    /// Bytes of its blocks sent.
    pub bytes: u64,
}

/// What a gather pulled from the memory servers.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GatherStats {
    /// The memory servers.
    pub servers: Vec<String>,
    /// Chunks they held when the gather began.
    pub remote_chunks: u64,
    /// Pages the destination pulled from them.
    pub pulled_pages: u64,
    /// Seconds the pull took (all servers at once).
    pub pull_secs: f64,
    /// Chunks the main host paged in while it was gathered (the guest
    /// runs on).
    pub page_ins: u64,
    /// Chunks it paged out meanwhile: none, or the servers' copies would
    /// no longer be what the destination pulled.
    pub page_outs: u64,
}

/// How a split migration shared the VM's memory out.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SplitStats {
    /// The VM's id on the memory servers (what `ferry memserver` lists; not
    /// a secret: each server's store is bound to a secret only the main
    /// host holds).
    pub vm: String,
    /// Pages per chunk.
    pub chunk_pages: u32,
    /// Chunks in all.
    pub chunks: u64,
    /// Chunks placed on the main host.
    pub main_chunks: u64,
    /// Chunks the main host may hold.
    pub budget_chunks: u64,
    /// The ranking (clock or aging).
    pub rank: String,
    /// Periods of access history the ranking saw (0: none, chunks went
    /// in address order).
    pub history_periods: u64,
    /// Per memory server.
    pub servers: Vec<SplitServerStats>,
}

/// One memory server's share of a split migration.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SplitServerStats {
    /// Where it listens.
    pub addr: String,
    /// Chunks placed there.
    pub chunks: u64,
    /// Pages sent there (re-sends included).
    pub pages: u64,
    /// Bytes sent there.
    pub bytes: u64,
}

/// What became of the VM's service clients at a migration.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClientsOutcome {
    /// True if the address and connections moved with the VM; false if the
    /// source forwards them.
    pub moved: bool,
    /// How many connections moved.
    pub connections: u64,
    /// What the destination did, or why they did not move.
    pub detail: String,
}

/// The postcopy phase: from the destination's start until every page
/// arrived.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PostcopyStats {
    /// Seconds from the migration's start to the switch (the pause).
    pub switch_at_s: f64,
    /// Pages the destination did not hold at the switch.
    pub pending_pages: u64,
    /// Of those, pages it dropped before the pause, while the VM still ran
    /// on the source (hybrid, v17): the pause dropped only the rest.
    #[serde(default)]
    pub dropped_ahead_pages: u64,
    /// Pages the background pusher sent (with data), and zero pages it sent
    /// as ranges.
    pub pushed_pages: u64,
    /// Zero pages among the pushed, sent as ranges.
    pub pushed_zero_pages: u64,
    /// Of the pushed, pages the VM's access tracker had seen used lately
    /// (pushed before the rest).
    #[serde(default)]
    pub pushed_hot_pages: u64,
    /// Page requests answered, and pages sent in answer: the requested
    /// page (always) plus its not-yet-sent neighbours.
    pub requests: u64,
    /// Pages sent on the demand connection.
    pub demand_pages: u64,
    /// Of those, neighbours sent ahead of a fault (prefetch).
    pub prefetched_pages: u64,
    /// Started to every page confirmed (seconds).
    pub secs: f64,
    /// The destination's account of its faults.
    pub faults: FaultReport,
    /// Times the link broke and the postcopy paused, then resumed.
    pub pauses: u32,
    /// Seconds spent paused (link broken, reconnecting).
    pub paused_s: f64,
    /// Bytes sent to the safety net's standby (`--safety-net`), and
    /// whether it held every page before the move ended.
    #[serde(default)]
    pub safety_net_bytes: u64,
    /// The standby held every pending page before the move ended.
    #[serde(default)]
    pub safety_net_armed: bool,
    /// The source handed the move over once the standby held every page,
    /// and the standby finished it (`--net-finishes`): the fault report is
    /// the standby's to get, and this side's is empty.
    #[serde(default)]
    pub handed_over: bool,
}

/// Faults the destination took on missing memory, and what they cost.
///
/// Kinds: `major` waited for a page over the network; `minor` found its page
/// already arrived; `zero` touched memory the source never had data in
/// (filled locally); `duplicate` faulted on a page already waited for. Who
/// faulted (userfaultfd's thread id): a vCPU thread (`vcpu_thread`: the vCPU
/// waited in the host), a KVM async-page-fault worker (`async_worker`: KVM
/// took the fault off the vCPU) or the VMM's own threads (`host`). An
/// async-worker fault is absorbed by the guest only when the guest was told
/// of it and parked one task ("page not present"); otherwise KVM halts the
/// vCPU until the page is there. The guest's own count over the phase says
/// how many were absorbed (`apf_absorbed`); `blocked` is every fault that
/// stopped a vCPU.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultReport {
    /// Every fault event read.
    pub faults: u64,
    /// Fetched over the network.
    pub major: u64,
    /// Already arrived.
    pub minor: u64,
    /// Filled with zeros locally.
    pub zero: u64,
    /// A further fault on a page already waited for.
    pub duplicate: u64,
    /// Taken by vCPU threads.
    pub vcpu_thread: u64,
    /// Taken by KVM's async-page-fault workers.
    pub async_worker: u64,
    /// Taken by the VMM's own threads.
    pub host: u64,
    /// Faults the guest absorbed (its 'page not present' events over the
    /// phase), when the VM can tell.
    pub apf_absorbed: Option<u64>,
    /// Faults that stopped a vCPU: vCPU-thread faults, and async-worker
    /// faults the guest did not absorb.
    pub blocked: u64,
    /// Major faults, fault read to page landed (µs).
    pub latency_us: Latency,
    /// Major fault service time histogram: (upper bound µs, count), powers of two.
    pub histogram: Vec<(u64, u64)>,
    /// Per 100 ms from the start: faults by kind and the guest's execution ratio.
    pub series: Vec<FaultBin>,
    /// Pages received on the demand connection (requested and prefetched).
    pub demand_pages: u64,
    /// Pending pages filled (UFFDIO_COPY or ZEROPAGE), from either connection.
    pub supplied_pages: u64,
    /// Pages that arrived a second time and were dropped (first copy wins).
    pub kept_pages: u64,
}

/// Percentiles of a latency distribution.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    #[serde(default)]
    pub p999: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Latency {
    /// Summarises samples (any order).
    pub fn of(mut v: Vec<f64>) -> Latency {
        if v.is_empty() {
            return Latency::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Latency {
            count: v.len() as u64,
            p50: at(0.5),
            p99: at(0.99),
            p999: at(0.999),
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// 100 ms of the postcopy phase at the destination.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultBin {
    /// Start of the bin, ms after the VM started.
    pub t_ms: u64,
    /// Major faults.
    pub major: u64,
    /// Minor faults.
    pub minor: u64,
    /// Zero-filled faults.
    pub zero: u64,
    /// Faults taken by async-page-fault workers.
    pub async_worker: u64,
    /// Per vCPU, ms of the bin its thread spent waiting on faults.
    pub blocked_ms: Vec<f64>,
    /// Share of vCPU time not waiting on faults in vCPU threads (1 =
    /// untouched; vCPUs KVM halted for an async fault are not in it).
    pub exec_ratio: f64,
}

/// What compression did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompressionStats {
    /// What was asked for.
    pub asked: String,
    /// Batches per method, e.g. "rle 812, none 6".
    pub batches: String,
    /// Fetch, encode and send on separate threads.
    pub pipeline: bool,
    /// Where the codecs ran ("cpu", "cuda").
    pub backend: String,
    /// Why the backend asked for did not run, if so.
    pub backend_note: Option<String>,
    /// Page bytes that went through a codec.
    pub encoded_in: u64,
    /// Wire bytes of the encoded batches.
    pub encoded_out: u64,
    /// Link bandwidth the policy used (bytes/s), when it measured or was told one.
    pub link_bandwidth: Option<f64>,
    /// Why compression was not used although asked for, if so.
    pub note: Option<String>,
}

/// Downtime broken down by phase (ms).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DowntimeParts {
    /// vCPUs out of KVM_RUN and parked.
    pub pause: f64,
    /// Reading the last dirty log and sending those pages.
    pub last_round: f64,
    /// Saving the VM state.
    pub save_state: f64,
    /// Hashing every page (only with verification).
    pub verify: f64,
    /// Checkpointing the clients' connections and sending them.
    #[serde(default)]
    pub clients: f64,
    /// From Complete sent to Started received.
    pub destination: f64,
    /// Of `destination`, what the destination spent hashing its memory
    /// for verification (its report, at most `destination`; 0 without
    /// --verify or when pages were hashed as they landed).
    #[serde(default)]
    pub destination_verify: f64,
}

impl DowntimeParts {
    /// Of the downtime, what --verify's hashing took on both sides: the
    /// downtime without it is this much shorter (both sides hash the
    /// paused memory, so the hashing is inside the downtime).
    pub fn verify_share(&self) -> f64 {
        self.verify + self.destination_verify
    }
}

/// What the destination reports in its Started message.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StartedReport {
    /// Its request service address, if the VM has one.
    pub service: Option<String>,
    /// Host CPU seconds its receiving threads used.
    pub cpu_s: f64,
    /// v5: Complete to vCPUs started (ms).
    pub restore_ms: f64,
    /// v5: hashing its memory for verification (ms).
    pub verify_ms: f64,
    /// v5: what it did with the clients that moved.
    pub clients: Option<String>,
}

/// Started's body before protocol v5.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StartedReportV1 {
    pub service: Option<String>,
    pub cpu_s: f64,
}

/// Where a migration is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Copying memory while the guest runs.
    #[default]
    Copy,
    /// The guest is paused; the rest goes out.
    StopAndCopy,
    /// Hashing memory for verification.
    Verify,
    /// Running at the destination; memory follows on demand and in the
    /// background.
    Postcopy,
    /// Postcopy with the link broken: reconnecting (the VM runs at the
    /// destination, its missing pages wait here).
    PostcopyPaused,
    /// Postcopy: the safety net's standby holds every page the destination
    /// lacks and finishes the move (`--net-finishes`); the source sends
    /// nothing more and waits, as its backup, for it to end.
    HandedOver,
    /// Finished.
    Done,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Copy => "copy",
            Phase::StopAndCopy => "stop-and-copy",
            Phase::Verify => "verify",
            Phase::Postcopy => "postcopy",
            Phase::PostcopyPaused => "postcopy paused",
            Phase::HandedOver => "handed over",
            Phase::Done => "done",
        })
    }
}

/// What the destination saw.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DestinationStats {
    /// Pages written.
    pub pages: u64,
    /// Zero pages.
    pub zero_pages: u64,
    /// Rounds.
    pub rounds: u32,
    /// Pages verified (0 without verification).
    pub verified_pages: u64,
    /// Complete received to vCPUs started (ms).
    pub restore_ms: f64,
    /// Hashing this side's memory for verification (ms).
    #[serde(default)]
    pub verify_ms: f64,
    /// What became of the VM's clients: restored here, or left with the
    /// source's forwarder.
    #[serde(default)]
    pub clients: Option<String>,
    /// Faults taken after a postcopy switch.
    pub postcopy: Option<FaultReport>,
    /// Times a postcopy paused on a broken link and resumed.
    pub postcopy_pauses: u32,
    /// Seconds it spent paused (vCPUs touching a missing page waited).
    pub postcopy_paused_s: f64,
    /// Pages landed from this host's other VMs by reference (v14).
    #[serde(default)]
    pub shared_pages: u64,
    /// References that did not resolve here (the source sent them again).
    #[serde(default)]
    pub shared_missed: u64,
}

/// Live progress for a bar.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Current round.
    pub round: u32,
    /// Pages left in it.
    pub remaining_pages: u64,
    /// Bytes/s of the last round.
    pub throughput: f64,
    /// Bytes sent so far.
    pub bytes: u64,
    /// Where the migration is.
    pub phase: Phase,
    /// Once the VM runs at the destination before the migration ends
    /// (postcopy): where its request service listens there, so the source
    /// can forward clients at once.
    #[serde(default)]
    pub destination_service: Option<String>,
}

pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// CPU time the calling thread has used, in seconds.
pub(crate) fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Sums CPU seconds from several threads.
#[derive(Default)]
pub(crate) struct CpuMeter(std::sync::atomic::AtomicU64);

impl CpuMeter {
    /// Adds `secs` (kept in nanoseconds).
    pub(crate) fn add(&self, secs: f64) {
        self.0
            .fetch_add((secs * 1e9) as u64, std::sync::atomic::Ordering::Relaxed);
    }
    /// Total in seconds.
    pub(crate) fn secs(&self) -> f64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles_are_the_sorted_samples_at_their_ranks() {
        // 1..=1000 in reverse: the rank of q is round(999 q).
        let l = Latency::of((1..=1000).rev().map(f64::from).collect());
        assert_eq!(l.count, 1000);
        assert_eq!((l.p50, l.p99, l.p999, l.max), (501.0, 990.0, 999.0, 1000.0));
        assert_eq!(l.mean, 500.5);
        assert_eq!(Latency::of(Vec::new()), Latency::default());
    }
}
