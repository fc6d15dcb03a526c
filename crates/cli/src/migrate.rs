//! `ferry migrate`: asks a VM's VMM (through its control socket) to live-migrate
//! it, shows progress, and ends with a table of what the migration cost
//! (printed by `migrate/table.rs`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_migration::{defaults, AutoConverge};
use ferry_migration::{
    BackendKind, Compress, CompressOptions, Endpoint, MigrateOptions, MigrationStats, Mode,
    PostcopyAfter, Progress, Rank, SplitOptions,
};
use ferry_vmm::control::{ControlClient, MigrateRequest, Request};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

use crate::format;
use table::print_table;

mod table;

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// The source VM's control socket.
    socket: PathBuf,
    /// Destination: tcp:HOST:PORT, or unix:PATH on this host (a `ferry run
    /// --incoming` there). With --resume: where the destination is now, if
    /// it moved.
    /// (--main with --mode split: the main host.)
    #[arg(long, alias = "main", required_unless_present_any = ["resume", "subs", "registry"])]
    to: Option<Endpoint>,
    /// Continue this VM's postcopy migration that paused on a broken link
    /// (the destination must still wait for it: its --reconnect-timeout).
    #[arg(long)]
    resume: bool,
    /// Postcopy: how long to keep reconnecting after the link broke before
    /// reporting "postcopy paused" (then --resume continues it).
    #[arg(long, value_parser = crate::format::parse_duration,
          default_value = format::ms_arg(defaults::RECONNECT_TIMEOUT_MS))]
    reconnect_timeout: Duration,
    /// Migration mode: precopy, postcopy (run at the destination at once,
    /// memory follows on demand), hybrid (precopy, then postcopy if it
    /// has not converged after --postcopy-after), split (the hot part to a
    /// main host, the rest to memory servers: --sub, --main-budget) or
    /// gather (a split VM back to one host: run it on its main host).
    #[arg(long, default_value_t = Mode::default())]
    mode: Mode,
    /// Split: the memory servers (`ferry memserver`) that hold what the
    /// main host does not, comma-separated tcp:HOST:PORT.
    #[arg(long = "sub", value_delimiter = ',')]
    subs: Vec<Endpoint>,
    /// Split: the host registry to place the VM by when --sub is not
    /// given (etcds://HOST:PORT (TLS), etcd://HOST:PORT or dir:PATH; default: this machine's):
    /// the main host is --main, or the waiting VMM offering most memory;
    /// the rest goes to the memory servers with most room.
    #[arg(long)]
    registry: Option<String>,
    /// Split: guest memory the main host holds (e.g. 256M); the hottest
    /// chunks go there.
    #[arg(long, value_parser = parse_mem_size)]
    main_budget: Option<u64>,
    /// Split: pages per chunk, the unit of placement and paging (a power
    /// of two up to 4096).
    #[arg(long, default_value_t = defaults::CHUNK_PAGES)]
    chunk_pages: u32,
    /// Split: how chunks are ranked hot or cold: clock or aging.
    #[arg(long, default_value_t = Rank::default())]
    rank: Rank,
    /// Split: copies of every chunk on the memory servers (2: the VM
    /// survives losing one server).
    #[arg(long, default_value_t = defaults::REPLICAS)]
    replicas: u8,
    /// Postcopy: pages sent on each side of a faulting page (0 = only the page).
    #[arg(long, default_value_t = defaults::PREFETCH)]
    prefetch: u32,
    /// Postcopy: hold the background push this long after the switch
    /// (e.g. 2s, at most 20s), so at first only the pages the guest asks
    /// for cross the link.
    #[arg(long, value_parser = crate::format::parse_duration_or_zero,
          default_value = format::ms_arg(defaults::PUSH_DELAY_MS))]
    push_delay: Duration,
    /// Hybrid: switch to postcopy after this many dirty rounds (e.g. 3) or
    /// seconds (e.g. 2.5s) without converging, or whichever of both comes
    /// first (e.g. 3|20s).
    #[arg(long, default_value_t = PostcopyAfter::default())]
    postcopy_after: PostcopyAfter,
    /// Postcopy and hybrid: a third host's `ferry standby` (HOST:PORT) that
    /// is sent the pages the destination still lacks right after the switch
    /// and finishes the move from them if this source dies.
    #[arg(long, value_parser = crate::format::tcp_endpoint)]
    safety_net: Option<ferry_migration::Endpoint>,
    /// With --safety-net: the standby finishes the move. This source sends
    /// each page the destination lacks once, to the standby (answering the
    /// destination's faults meanwhile), and hands the move over once it
    /// holds them all: the standby pushes them on from its host while this
    /// source waits, holding every page, in case it fails.
    #[arg(long, requires = "safety_net")]
    net_finishes: bool,
    /// Parallel bulk connections (default: 2, or 1 on a single core).
    #[arg(long)]
    streams: Option<u16>,
    /// Stop iterating when the rest fits this downtime (ms).
    #[arg(long, default_value_t = defaults::DOWNTIME_MS)]
    downtime_ms: f64,
    /// Most dirty rounds before stop-and-copy.
    #[arg(long, default_value_t = defaults::MAX_ROUNDS)]
    max_rounds: u32,
    /// Compare per-page hashes of all memory at the end.
    #[arg(long)]
    verify: bool,
    /// Limit the migration's bandwidth: bytes/s with K/M/G suffix (e.g. 100M),
    /// or bits/s ending in "bit" (e.g. 1gbit, 500mbit).
    #[arg(long, value_parser = parse_rate)]
    bandwidth: Option<u64>,
    /// Leave the bottleneck's queue to the VM's own traffic (the default):
    /// precopy rounds pace their streams below the rate at which the path
    /// starts queueing (their TCP round trip over its shortest), so the
    /// VM's clients do not wait behind the migration. A delay the pacing
    /// does not drain (a busy receiver) does not slow the move.
    #[arg(long, conflicts_with = "own_link")]
    share_link: bool,
    /// The link is the migration's own: precopy rounds send as fast as TCP
    /// goes (or --bandwidth), even if the VM's clients wait behind them.
    /// (Postcopy's push leaves the queue to the VM's traffic regardless.)
    #[arg(long)]
    own_link: bool,
    /// Never throttle the vCPUs (auto-converge is on by default).
    #[arg(long)]
    no_auto_converge: bool,
    /// Auto-converge: throttle when a round leaves more than this share of
    /// what it sent dirty again and, at that ratio, the rounds left would
    /// not bring the rest under the downtime target.
    #[arg(long, value_name = "RATIO", default_value_t = defaults::AUTO_CONVERGE_TRIGGER_RATIO)]
    auto_converge_trigger: f64,
    /// Auto-converge: the first throttle, % of vCPU time taken away.
    #[arg(long, value_name = "PCT", default_value_t = defaults::AUTO_CONVERGE_INITIAL_PCT)]
    auto_converge_initial: u32,
    /// Auto-converge: % more taken away at each further round that does
    /// not converge.
    #[arg(long, value_name = "PCT", default_value_t = defaults::AUTO_CONVERGE_STEP_PCT)]
    auto_converge_step: u32,
    /// Auto-converge: the most vCPU time taken away (%).
    #[arg(long, value_name = "PCT", default_value_t = defaults::AUTO_CONVERGE_MAX_PCT)]
    auto_converge_max: u32,
    /// Compression: auto (measure and pick per batch), none, rle, xbzrle,
    /// dedup, lz4, zstd or zstd:LEVEL.
    #[arg(long, default_value_t = CompressOptions::default().compress)]
    compress: Compress,
    /// Where the codecs run: cpu, or cuda (falls back to the CPU, saying
    /// so, where no CUDA device is found).
    #[arg(long, default_value_t = CompressOptions::default().backend)]
    compress_backend: BackendKind,
    /// Fetch, encode and send in turn on one thread per stream instead of
    /// the three-stage pipeline.
    #[arg(long)]
    no_pipeline: bool,
    /// Encoder threads per bulk stream.
    #[arg(long, default_value_t = defaults::COMPRESS_THREADS)]
    compress_threads: u8,
    /// xbzrle page cache per encoder thread (e.g. 64M).
    #[arg(long, value_parser = parse_mem_size)]
    xbzrle_cache: Option<u64>,
    /// dedup chunk cache per encoder thread (e.g. 64M).
    #[arg(long, value_parser = parse_mem_size)]
    dedup_cache: Option<u64>,
    /// Write the migration's timeline here (JSON lines every 10 ms from
    /// both sides, events, and the summary; `ferry report` draws it).
    /// Default: a new file under $FERRY_RUNS_DIR, else
    /// ~/.local/state/ferry/migrations.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Write no timeline (and so wait for no tail of one).
    #[arg(long, conflicts_with = "timeline")]
    no_timeline: bool,
    /// How long the destination's part of the timeline goes on after the
    /// switch (precopy) or the last page (postcopy); `ferry migrate`
    /// returns that much later (e.g. 1s, 0s).
    #[arg(long, value_parser = crate::format::parse_duration_or_zero,
          default_value = format::ms_arg(defaults::TIMELINE_TAIL_MS.into()))]
    timeline_tail: Duration,
    /// The one-time migration token the destination demands (printed by
    /// its `ferry run --incoming … --token auto`).
    #[arg(long)]
    token: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

impl MigrateArgs {
    /// The source VM's control socket.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// True if this command opens a link itself (not the VMM): a split
    /// placed from the registry, which an `etcds://` registry answers over
    /// mutual TLS with this host's credentials.
    pub fn opens_a_link(&self) -> bool {
        self.mode == Mode::Split && self.subs.is_empty() && !self.resume
    }

    /// The engine's options, checked here so a bad value never reaches the VMM.
    fn options(&self) -> Result<MigrateOptions> {
        let base = MigrateOptions::default();
        let mut caches = base.compression.caches;
        caches.xbzrle_bytes = self.xbzrle_cache.unwrap_or(caches.xbzrle_bytes);
        caches.dedup_bytes = self.dedup_cache.unwrap_or(caches.dedup_bytes);
        let o = MigrateOptions {
            mode: self.mode,
            prefetch: self.prefetch,
            push_delay_ms: self.push_delay.as_millis().min(u64::MAX as u128) as u64,
            postcopy_after: self.postcopy_after,
            reconnect_timeout_ms: self.reconnect_timeout.as_millis() as u64,
            safety_net: self.safety_net.clone(),
            net_finishes: self.net_finishes,
            timeline_tail_ms: match self.no_timeline {
                true => 0,
                false => self.timeline_tail.as_millis().min(u32::MAX as u128) as u32,
            },
            token: self.token.clone().map(ferry_migration::MigrationToken),
            streams: self.streams.unwrap_or(base.streams),
            downtime_ms: self.downtime_ms,
            max_rounds: self.max_rounds,
            verify: self.verify,
            auto_converge: !self.no_auto_converge,
            auto_converge_tuning: AutoConverge {
                trigger_ratio: self.auto_converge_trigger,
                initial_pct: self.auto_converge_initial,
                step_pct: self.auto_converge_step,
                max_pct: self.auto_converge_max,
            },
            bandwidth: self.bandwidth.map(|b| b as f64),
            share_link: !self.own_link,
            compression: CompressOptions {
                compress: self.compress,
                backend: self.compress_backend,
                pipeline: !self.no_pipeline,
                workers: self.compress_threads,
                caches,
            },
            split: SplitOptions {
                subs: self.subs.clone(),
                main_budget: self.main_budget.unwrap_or(0),
                chunk_pages: self.chunk_pages,
                rank: self.rank,
                replicas: self.replicas,
            },
            ..base
        };
        if self.mode != Mode::Split && (!self.subs.is_empty() || self.main_budget.is_some()) {
            anyhow::bail!("--sub and --main-budget are for --mode split");
        }
        if self.safety_net.is_some() && !matches!(self.mode, Mode::Postcopy | Mode::Hybrid) {
            anyhow::bail!("--safety-net is for --mode postcopy or hybrid (the pages a destination lacks after the switch)");
        }
        if self.mode == Mode::Split && self.main_budget.is_none() && !self.subs.is_empty() {
            anyhow::bail!("--mode split needs --main-budget (the memory the main host holds)");
        }
        if self.mode == Mode::Split && self.subs.is_empty() {
            // Placed from the registry later (migrate()).
            return Ok(o);
        }
        o.check().map_err(anyhow::Error::msg)?;
        Ok(o)
    }
}

fn parse_mem_size(s: &str) -> Result<u64, String> {
    ferry_vmm::boot::layout::parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64M)"))
}

/// Parses `100M` (bytes/s) or `1gbit` (bits/s) into bytes per second.
pub(crate) fn parse_rate(s: &str) -> Result<u64, String> {
    let lower = s.trim().to_ascii_lowercase();
    let bytes = match lower.strip_suffix("bit") {
        Some(bits) => ferry_vmm::boot::layout::parse_size(bits).map(|b| {
            // Link rates use powers of ten: 1gbit = 10^9 bits/s.
            let scale = match bits.chars().last() {
                Some('k') => 1000.0 / 1024.0,
                Some('m') => 1e6 / (1u64 << 20) as f64,
                Some('g') => 1e9 / (1u64 << 30) as f64,
                _ => 1.0,
            };
            (b as f64 * scale / 8.0) as u64
        }),
        None => ferry_vmm::boot::layout::parse_size(&lower),
    };
    match bytes {
        Some(b) if b > 0 => Ok(b),
        _ => Err(format!("'{s}' is not a rate (e.g. 100M bytes/s or 1gbit)")),
    }
}

/// Where the timeline goes: as asked (made absolute: the VMM writes it
/// from its own directory), or a new file in the runs directory.
fn timeline_path(args: &MigrateArgs, mode: &str) -> Result<Option<PathBuf>> {
    if args.no_timeline {
        return Ok(None);
    }
    let path = match &args.timeline {
        Some(p) => p.clone(),
        None => runs_dir().join(format!(
            "{}-{mode}-{}.jsonl",
            format::utc_stamp(std::time::SystemTime::now()),
            std::process::id()
        )),
    };
    Ok(Some(if path.is_absolute() {
        path
    } else {
        std::env::current_dir()
            .context("cannot tell the current directory")?
            .join(path)
    }))
}

/// Split without --sub: asks the registry for a main host and memory
/// servers (ferry_registry::place), fills in the servers and the main
/// host's budget, and returns the main host.
fn place_from_registry(
    args: &MigrateArgs,
    options: &mut MigrateOptions,
    mem_bytes: u64,
) -> Result<Endpoint> {
    let registry = ferry_registry::open(
        args.registry.as_deref(),
        crate::security::credentials_for_registry(args.registry.as_deref())?,
    )?;
    let hosts = registry.hosts()?;
    let sp = &mut options.split;
    let chunk_bytes = u64::from(sp.chunk_pages) * 4096;
    let main = args.to.as_ref().map(|t| {
        let t = t.to_string();
        t.strip_prefix("tcp:").unwrap_or(&t).to_string()
    });
    let req = ferry_registry::placement::Request {
        chunks: mem_bytes.div_ceil(chunk_bytes),
        chunk_bytes,
        main: main.as_deref(),
        main_budget: args.main_budget,
        replicas: u32::from(sp.replicas),
    };
    let placed = ferry_registry::place(&hosts, &req)
        .with_context(|| format!("no split placement in the registry {}", registry.describe()))?;
    sp.main_budget = placed.main_chunks * chunk_bytes;
    sp.subs = placed
        .subs
        .iter()
        .map(|s| {
            format!("tcp:{}", s.addr)
                .parse()
                .map_err(anyhow::Error::msg)
        })
        .collect::<Result<_>>()?;
    if !args.json {
        eprintln!(
            "ferry: placed by {}: main {} ({} chunks), memory servers {}",
            registry.describe(),
            placed.main_name,
            placed.main_chunks,
            placed
                .subs
                .iter()
                .map(|s| format!("{} ({} chunks)", s.name, s.chunks))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    format!("tcp:{}", placed.main_addr)
        .parse()
        .map_err(anyhow::Error::msg)
}

/// Where timelines go by default.
pub fn runs_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_RUNS_DIR") {
        return d.into();
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir);
    state.join("ferry/migrations")
}

pub fn migrate(args: MigrateArgs) -> Result<ExitCode> {
    let options = args.options()?;
    let timeline = timeline_path(
        &args,
        if args.resume {
            "resume"
        } else {
            options.mode.name()
        },
    )?;
    let mut c = ControlClient::connect(&args.socket)?;
    let mut options = options;
    let mut to = args.to.clone();
    if options.mode == Mode::Split && options.split.subs.is_empty() {
        let mem_bytes = c.call(&Request::Status)?["mem_bytes"]
            .as_u64()
            .context("the VMM did not say how much memory the VM has")?;
        to = Some(place_from_registry(&args, &mut options, mem_bytes)?);
        options.check().map_err(anyhow::Error::msg)?;
    }
    let req = match &to {
        _ if args.resume => Request::MigrateResume {
            to: args.to.clone(),
            reconnect_timeout_ms: Some(options.reconnect_timeout_ms),
            timeline: timeline.clone(),
        },
        Some(to) => Request::Migrate(MigrateRequest {
            to: to.clone(),
            options: options.clone(),
            timeline: timeline.clone(),
        }),
        None => anyhow::bail!("--to is needed (where to migrate)"),
    };
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    let reply = c.call_with_progress(&req, &mut |p| {
        let Ok(p) = Progress::deserialize(p) else {
            return;
        };
        let rem = p.remaining_pages as f64 * 4096.0;
        let rate = p.throughput;
        let eta = if rate > 0.0 {
            format!("{:.2} s", rem / rate)
        } else {
            "?".into()
        };
        bar.set_message(format!(
            "{:<14} round {:>3}  remaining {:>10}  rate {:>12}  sent {:>10}  ETA {eta}",
            p.phase.to_string(),
            p.round,
            format::bytes(rem),
            format!("{}/s", format::bytes(rate)),
            format::bytes(p.bytes as f64),
        ));
    });
    bar.finish_and_clear();
    let mut reply = reply?;
    let stats: MigrationStats = serde_json::from_value(reply["stats"].take())
        .context("the VMM's migration report does not parse")?;
    let written = reply["timeline"].as_str().map(str::to_string);
    if let Some(e) = reply["timeline_error"].as_str() {
        eprintln!("ferry: warning: {e}");
    }
    if args.json {
        let mut v = serde_json::to_value(&stats)?;
        v["timeline"] = serde_json::json!(written);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let to = args
            .to
            .as_ref()
            .map_or("the destination".into(), |t| t.to_string());
        print_table(&to, &stats);
        if let Some(p) = &written {
            println!("timeline     {p}  (ferry report {p})");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests;
