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
}

/// A whole migration, as the source saw it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MigrationStats {
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
    /// Zero pages sent as ranges.
    pub zero_pages: u64,
    /// Encoded VM state bytes.
    pub state_bytes: u64,
    /// Pages compared end to end (0 without --verify).
    pub verified_pages: u64,
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
    /// From Complete sent to Started received.
    pub destination: f64,
}

/// What the destination reports in its Started message.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StartedReport {
    /// Its request service address, if the VM has one.
    pub service: Option<String>,
    /// Host CPU seconds its receiving threads used.
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
    /// Finished.
    Done,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Copy => "copy",
            Phase::StopAndCopy => "stop-and-copy",
            Phase::Verify => "verify",
            Phase::Done => "done",
        })
    }
}

/// What the destination saw.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct IncomingStats {
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

/// The kernel's latest delivery-rate sample of a TCP connection (bytes/s):
/// what the path really carries, measured from its ACKs.
pub(crate) fn delivery_rate(fd: std::os::fd::RawFd) -> Option<f64> {
    // SAFETY: tcp_info is plain integers; all zeros is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which we own.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_delivery_rate) + 8;
    (r == 0 && len as usize >= needed && info.tcpi_delivery_rate > 0)
        .then_some(info.tcpi_delivery_rate as f64)
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
