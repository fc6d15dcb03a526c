//! How to migrate: one options type, parsed once (by the CLI or a control
//! client), carried as it is to the VMM and into the engine. Its defaults
//! are spelled here and nowhere else.

use serde::{Deserialize, Serialize};

use ferry_codec::{CacheSizes, Method};

mod auto_converge;
mod codec_choice;
pub use auto_converge::AutoConverge;
pub use codec_choice::Compress;

/// The defaults, for the CLI's help text as much as for the engine.
pub mod defaults {
    /// Downtime target (ms).
    pub const DOWNTIME_MS: f64 = 10.0;
    /// Most dirty rounds before the stop-and-copy.
    pub const MAX_ROUNDS: u32 = 30;
    /// How long to wait for the peer at each step (ms).
    pub const TIMEOUT_MS: u64 = 30_000;
    /// Encoder threads per bulk stream.
    pub const COMPRESS_THREADS: u8 = 1;
    /// Most bulk streams.
    pub const MAX_STREAMS: u16 = 16;
    /// Postcopy: pages sent on each side of a faulting page (the paper's N).
    pub const PREFETCH: u32 = 8;
    /// Most prefetch pages on each side.
    pub const MAX_PREFETCH: u32 = 512;
    /// Postcopy: the longest hold on the background push (ms). A
    /// destination that hears nothing for its session timeout (30 s by
    /// default) while pages are missing takes the link for broken, and
    /// with no fault and no push nothing crosses it.
    pub const MAX_PUSH_DELAY_MS: u64 = 20_000;
    /// Split: pages per chunk, the unit of placement and remote paging
    /// (the S-memV paper found 256 best).
    pub const CHUNK_PAGES: u32 = 256;
    /// Split: largest chunk (pages).
    pub const MAX_CHUNK_PAGES: u32 = 4096;
    /// Hybrid: precopy rounds before switching to postcopy.
    pub const POSTCOPY_AFTER_ROUNDS: u32 = 3;
    /// Postcopy, source: how long to keep reconnecting after the link
    /// broke before reporting "postcopy paused" and waiting for
    /// `ferry migrate --resume` (ms).
    pub const RECONNECT_TIMEOUT_MS: u64 = 30_000;
    /// How long the destination's timeline goes on after the switch (ms):
    /// long enough to see the guest settle at its new host.
    pub const TIMELINE_TAIL_MS: u32 = 1_000;
    /// Postcopy, destination: how long a paused postcopy waits for its
    /// source to come back before the VM is given up (ms): longer than the
    /// source's own retrying, so an operator has time to resume by hand.
    pub const INCOMING_RECONNECT_TIMEOUT_MS: u64 = 300_000;
    /// Bulk streams where there is more than one core (one where there is
    /// a single core: [`super::default_streams`]).
    pub const STREAMS: u16 = 2;
    /// Split: copies of every chunk on the memory servers.
    pub const REPLICAS: u8 = 1;
    /// Postcopy: hold on the background push after the switch (ms); none.
    pub const PUSH_DELAY_MS: u64 = 0;
    /// Auto-converge is on unless asked off.
    pub const AUTO_CONVERGE: bool = true;
    /// Precopy's rounds leave the bottleneck's queue to the VM's own
    /// traffic unless asked not to (`--own-link`).
    pub const SHARE_LINK: bool = true;
    /// Auto-converge throttles when the guest dirtied more than this share
    /// of what the round could send (and the rounds left would not catch
    /// it at that ratio).
    pub const AUTO_CONVERGE_TRIGGER_RATIO: f64 = 0.5;
    /// Auto-converge's first throttle (% of vCPU time taken away).
    pub const AUTO_CONVERGE_INITIAL_PCT: u32 = 20;
    /// Auto-converge: how much more each further round takes away (%).
    pub const AUTO_CONVERGE_STEP_PCT: u32 = 10;
    /// Auto-converge's strongest throttle (%): the guest keeps a sliver.
    pub const AUTO_CONVERGE_MAX_PCT: u32 = 99;
}

/// Migration modes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Copy memory while the guest runs, round after round, then stop and
    /// copy the rest.
    #[default]
    Precopy,
    /// Pause, move the state, run on the destination at once; memory
    /// follows on demand (faults) and in the background.
    Postcopy,
    /// Precopy rounds, then postcopy if they have not converged within
    /// [`MigrateOptions::postcopy_after`].
    Hybrid,
    /// Precopy to a main host that holds the hot part of memory (its
    /// budget) while the rest goes straight to memory servers; the main
    /// host pages chunks in and out afterwards ([`SplitOptions`]).
    Split,
    /// Brings a split VM back to one host: the destination pulls what the
    /// memory servers hold, then takes the main host's part by precopy,
    /// while the main host keeps paging (without paging out).
    Gather,
}

impl Mode {
    /// Every mode this build has.
    pub const ALL: [Mode; 5] = [
        Mode::Precopy,
        Mode::Postcopy,
        Mode::Hybrid,
        Mode::Split,
        Mode::Gather,
    ];

    /// The mode's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precopy => "precopy",
            Mode::Postcopy => "postcopy",
            Mode::Hybrid => "hybrid",
            Mode::Split => "split",
            Mode::Gather => "gather",
        }
    }

    /// True if the VM may run at the destination before all its memory
    /// arrived.
    pub fn may_postcopy(self) -> bool {
        matches!(self, Mode::Postcopy | Mode::Hybrid)
    }
}

/// When hybrid gives up on precopy: after this many dirty rounds, or this
/// long after the start, or whichever comes first. Written `3` (rounds),
/// `2.5s`, or `3|20s`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PostcopyAfter {
    /// Dirty rounds after the full copy.
    Rounds(u32),
    /// Seconds since the migration started.
    Secs(f64),
    /// Whichever comes first: rounds that did not converge, or a deadline
    /// (a fleet drain's: a slow link cannot stretch the rounds past it).
    Either(u32, f64),
}

impl Default for PostcopyAfter {
    fn default() -> Self {
        PostcopyAfter::Rounds(defaults::POSTCOPY_AFTER_ROUNDS)
    }
}

impl std::str::FromStr for PostcopyAfter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("'{s}' is neither a round count (3), seconds (2.5s), nor both (3|20s)");
        if let Some((rounds, secs)) = s.split_once('|') {
            return match (rounds.parse::<Self>(), secs.parse::<Self>()) {
                (Ok(PostcopyAfter::Rounds(n)), Ok(PostcopyAfter::Secs(x))) => {
                    Ok(PostcopyAfter::Either(n, x))
                }
                _ => Err(bad()),
            };
        }
        if let Some(secs) = s.strip_suffix('s') {
            let v: f64 = secs.parse().map_err(|_| bad())?;
            if !(v >= 0.0 && v.is_finite()) {
                return Err(bad());
            }
            return Ok(PostcopyAfter::Secs(v));
        }
        s.parse().map(PostcopyAfter::Rounds).map_err(|_| bad())
    }
}

impl std::fmt::Display for PostcopyAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PostcopyAfter::Rounds(n) => write!(f, "{n}"),
            PostcopyAfter::Secs(s) => write!(f, "{s}s"),
            PostcopyAfter::Either(n, s) => write!(f, "{n}|{s}s"),
        }
    }
}

impl Serialize for PostcopyAfter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PostcopyAfter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Mode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode '{s}' (this ferry has: {})", names.join(", "))
            })
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How split migration ranks chunks: which are hot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rank {
    /// The clock algorithm: pages accessed in the last period.
    #[default]
    Clock,
    /// The aging algorithm: 8 periods of history, recent ones weigh most.
    Aging,
}

impl std::str::FromStr for Rank {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "clock" => Ok(Rank::Clock),
            "aging" => Ok(Rank::Aging),
            _ => Err(format!("unknown rank '{s}' (clock or aging)")),
        }
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Rank::Clock => "clock",
            Rank::Aging => "aging",
        })
    }
}

/// Split migration: where the memory the main host does not hold goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SplitOptions {
    /// Memory servers (sub-hosts), `ferry memserver` each.
    pub subs: Vec<crate::transport::Endpoint>,
    /// Guest memory the main host holds, bytes (rounded down to chunks).
    pub main_budget: u64,
    /// Pages per chunk: a power of two.
    pub chunk_pages: u32,
    /// How chunks are ranked (hot ones go to the main host).
    pub rank: Rank,
    /// Copies of every chunk not on the main host, each on its own server
    /// (2: the VM survives the loss of one server).
    pub replicas: u8,
}

impl Default for SplitOptions {
    fn default() -> Self {
        SplitOptions {
            subs: Vec::new(),
            main_budget: 0,
            chunk_pages: defaults::CHUNK_PAGES,
            rank: Rank::Clock,
            replicas: defaults::REPLICAS,
        }
    }
}

/// Where the codecs run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// ferry-codec on the CPU.
    #[default]
    Cpu,
    /// The CUDA kernels (the CPU where no GPU is found, saying so).
    Cuda,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" => Ok(BackendKind::Cuda),
            _ => Err(format!("unknown compress backend '{s}' (cpu or cuda)")),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Compression settings of a migration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CompressOptions {
    /// The codec choice.
    pub compress: Compress,
    /// Fetch, encode and send on separate threads with bounded buffers
    /// (false: one thread does all three in turn, per stream).
    pub pipeline: bool,
    /// Encoder threads (shards) per bulk stream.
    pub workers: u8,
    /// Cache sizes per shard (mirrored at the destination).
    pub caches: CacheSizes,
    /// Where the codecs run.
    pub backend: BackendKind,
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions {
            compress: Compress::Fixed(Method::None),
            pipeline: true,
            workers: defaults::COMPRESS_THREADS,
            caches: CacheSizes::default(),
            backend: BackendKind::Cpu,
        }
    }
}

impl CompressOptions {
    /// True when batches may be encoded (protocol v2 streams).
    pub fn enabled(&self) -> bool {
        self.compress != Compress::Fixed(Method::None)
    }
}

/// A one-time migration token: a waiting destination started with
/// `--token` takes a migration only from a source that presents it. It
/// never appears in logs (its Debug is redacted).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MigrationToken(pub String);

impl MigrationToken {
    /// A new random token: 128 bits from the kernel, as 32 hex digits.
    pub fn generate() -> std::io::Result<MigrationToken> {
        let mut b = [0u8; 16];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
        Ok(MigrationToken(
            b.iter().map(|x| format!("{x:02x}")).collect(),
        ))
    }

    /// True if `other` is this token, compared in constant time.
    pub fn matches(&self, other: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), other.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
    }
}

impl std::fmt::Debug for MigrationToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MigrationToken(..)")
    }
}

/// How to migrate. The fields come in sections by the modes that read
/// them; every one has a default (`#[serde(default)]`), so a request may
/// name only what it changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MigrateOptions {
    // ── Every mode ──────────────────────────────────────────────────────
    /// The mode.
    pub mode: Mode,
    /// Parallel bulk connections.
    pub streams: u16,
    /// Compare per-page hashes at the end.
    pub verify: bool,
    /// Most bytes per second on the wire, all streams together.
    pub bandwidth: Option<f64>,
    /// Precopy rounds pace their streams by the queue they find at the
    /// bottleneck, leaving it to the VM's own traffic (see
    /// [`crate::governor`]; on by default); off: as fast as TCP goes (or
    /// `bandwidth`).
    pub share_link: bool,
    /// How long to wait for the peer at each step (ms).
    pub timeout_ms: u64,
    /// Compression and the pipelined data path.
    pub compression: CompressOptions,
    /// How long the destination goes on sampling its timeline after the
    /// VM started there (precopy) or every page arrived (postcopy), before
    /// sending it back (ms; the source waits that long after the switch).
    pub timeline_tail_ms: u32,
    /// The one-time token the destination demands (`ferry run --token`),
    /// sent on the control connection (v9).
    pub token: Option<MigrationToken>,

    // ── Precopy rounds (precopy, and the rounds of hybrid, split, gather) ──
    /// Stop iterating when the rest would take at most this long (ms).
    pub downtime_ms: f64,
    /// Stop iterating after this many dirty rounds regardless.
    pub max_rounds: u32,
    /// Throttle the vCPUs step by step when the guest dirties memory faster
    /// than the link carries it.
    pub auto_converge: bool,
    /// Auto-converge's steps (when `auto_converge` is on).
    pub auto_converge_tuning: AutoConverge,

    // ── Postcopy (postcopy, and hybrid after its switch) ─────────────────
    /// Postcopy: pages sent on each side of a faulting page, when not sent yet.
    pub prefetch: u32,
    /// Postcopy: how long after the switch the background push waits
    /// (ms), so only the pages the guest asks for cross the link at first
    /// (the yabusame paper's setting: demand paging alone, the push later).
    pub push_delay_ms: u64,
    /// Hybrid: when to stop precopy and switch.
    pub postcopy_after: PostcopyAfter,
    /// Postcopy: how long to keep reconnecting after a broken link (ms).
    pub reconnect_timeout_ms: u64,
    /// Postcopy: a third host's `ferry standby` that holds the pages the
    /// destination lacks at the switch and resumes the postcopy in the
    /// source's place if the source dies (`--safety-net`).
    pub safety_net: Option<crate::transport::Endpoint>,
    /// Postcopy with a safety net: the net finishes the move
    /// (`--net-finishes`). The source pushes nothing to the destination:
    /// it answers faults and sends each pending page once, to the standby,
    /// and hands the move over once the standby holds them all; the standby
    /// then pushes them to the destination while the source waits as its
    /// backup. Each page leaves the source's host once (without it: once
    /// to each), and the source's link is free sooner.
    pub net_finishes: bool,

    // ── Split ────────────────────────────────────────────────────────────
    /// Split: the memory servers, the main host's budget, the chunks.
    pub split: SplitOptions,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            mode: Mode::default(),
            streams: default_streams(),
            verify: false,
            bandwidth: None,
            share_link: defaults::SHARE_LINK,
            timeout_ms: defaults::TIMEOUT_MS,
            compression: CompressOptions::default(),
            timeline_tail_ms: defaults::TIMELINE_TAIL_MS,
            token: None,
            downtime_ms: defaults::DOWNTIME_MS,
            max_rounds: defaults::MAX_ROUNDS,
            auto_converge: defaults::AUTO_CONVERGE,
            auto_converge_tuning: AutoConverge::default(),
            prefetch: defaults::PREFETCH,
            push_delay_ms: defaults::PUSH_DELAY_MS,
            postcopy_after: PostcopyAfter::default(),
            reconnect_timeout_ms: defaults::RECONNECT_TIMEOUT_MS,
            safety_net: None,
            net_finishes: false,
            split: SplitOptions::default(),
        }
    }
}

impl MigrateOptions {
    /// The per-step timeout.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.timeout_ms.max(1))
    }

    /// How long postcopy keeps reconnecting after a broken link.
    pub fn reconnect_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.reconnect_timeout_ms)
    }

    /// Refuses values no migration can use, saying which and why.
    pub fn check(&self) -> Result<(), String> {
        let max_cache = crate::encoded::MAX_CACHE_BYTES;
        let shards = crate::encoded::MAX_SHARDS;
        let c = &self.compression;
        if self.timeline_tail_ms > 60_000 {
            return Err("the timeline tail must be at most 60 s".into());
        }
        if !(1..=defaults::MAX_STREAMS).contains(&self.streams) {
            return Err(format!("streams must be 1 to {}", defaults::MAX_STREAMS));
        }
        if !(self.downtime_ms >= 0.0 && self.downtime_ms.is_finite()) {
            return Err(format!(
                "downtime target {} ms is not a duration",
                self.downtime_ms
            ));
        }
        if self.bandwidth.is_some_and(|b| !(b > 0.0 && b.is_finite())) {
            return Err("the bandwidth limit must be positive".into());
        }
        if self.prefetch > defaults::MAX_PREFETCH {
            return Err(format!(
                "prefetch must be 0 to {} pages",
                defaults::MAX_PREFETCH
            ));
        }
        if self.push_delay_ms > 0 && !matches!(self.mode, Mode::Postcopy | Mode::Hybrid) {
            return Err(format!(
                "a push delay is for postcopy and hybrid; {} has no push after a switch",
                self.mode
            ));
        }
        if self.net_finishes && self.safety_net.is_none() {
            return Err(
                "a net that finishes the move needs a safety net (a standby's address)".into(),
            );
        }
        if self.push_delay_ms > defaults::MAX_PUSH_DELAY_MS {
            return Err(format!(
                "the push delay must be at most {} s (a destination that hears nothing for its session timeout takes the link for broken)",
                defaults::MAX_PUSH_DELAY_MS / 1000
            ));
        }
        self.auto_converge_tuning.check()?;
        if !(1..=shards).contains(&c.workers) {
            return Err(format!("compress threads must be 1 to {shards}"));
        }
        if self.mode == Mode::Split {
            let sp = &self.split;
            if sp.subs.is_empty() {
                return Err("split needs at least one memory server (--sub)".into());
            }
            if sp.subs.len() > 255 {
                return Err("split takes at most 255 memory servers".into());
            }
            if !sp.chunk_pages.is_power_of_two() || sp.chunk_pages > defaults::MAX_CHUNK_PAGES {
                return Err(format!(
                    "chunk pages must be a power of two from 1 to {}",
                    defaults::MAX_CHUNK_PAGES
                ));
            }
            if !(1..=2).contains(&sp.replicas) {
                return Err("replicas must be 1 or 2".into());
            }
            if usize::from(sp.replicas) > sp.subs.len() {
                return Err(format!(
                    "{} replicas need as many memory servers (--sub), {} given",
                    sp.replicas,
                    sp.subs.len()
                ));
            }
            if sp.main_budget < u64::from(sp.chunk_pages) * crate::ranges::PAGE {
                return Err("the main host's budget must hold at least one chunk".into());
            }
        }
        for (bytes, name) in [
            (c.caches.xbzrle_bytes, "xbzrle"),
            (c.caches.dedup_bytes, "dedup"),
        ] {
            if !(8192..=max_cache).contains(&bytes) {
                return Err(format!(
                    "the {name} cache must be 8 KiB to {} MiB",
                    max_cache >> 20
                ));
            }
        }
        Ok(())
    }
}

/// Bulk streams by default: two, unless there is a single core. One sending
/// thread saturates its core with the kernel's socket work while the
/// receiver idles; a second stream fills the other core even where both ends
/// share two cores (round 0 +35-40% here, bench/results/throughput.md).
pub fn default_streams() -> u16 {
    match std::thread::available_parallelism().map(|n| n.get()) {
        Ok(1) => 1,
        _ => defaults::STREAMS,
    }
}

#[cfg(test)]
mod tests;
