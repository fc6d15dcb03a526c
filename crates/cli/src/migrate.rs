//! `ferry migrate`: asks a VM's VMM (through its control socket) to live-migrate
//! it, shows progress, and ends with a table of what the migration cost.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use ferry_vmm::control::{ControlClient, MigrateRequest, Request};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::format;

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// The source VM's control socket.
    socket: PathBuf,
    /// Destination, tcp:HOST:PORT (a `ferry run --incoming` there).
    #[arg(long)]
    to: String,
    /// Migration mode.
    #[arg(long, default_value = "precopy", value_parser = ["precopy"])]
    mode: String,
    /// Parallel bulk connections (default: 2, or 1 on a single core).
    #[arg(long)]
    streams: Option<u16>,
    /// Stop iterating when the rest fits this downtime (ms).
    #[arg(long, default_value_t = 10.0)]
    downtime_ms: f64,
    /// Most dirty rounds before stop-and-copy.
    #[arg(long, default_value_t = 30)]
    max_rounds: u32,
    /// Compare per-page hashes of all memory at the end.
    #[arg(long)]
    verify: bool,
    /// Limit the migration's bandwidth: bytes/s with K/M/G suffix (e.g. 100M),
    /// or bits/s ending in "bit" (e.g. 1gbit, 500mbit).
    #[arg(long, value_parser = parse_rate)]
    bandwidth: Option<u64>,
    /// Never throttle the vCPUs (auto-converge is on by default).
    #[arg(long)]
    no_auto_converge: bool,
    /// Compression: auto (measure and pick per batch), none, rle, xbzrle,
    /// dedup, lz4, zstd or zstd:LEVEL.
    #[arg(long, default_value = "none", value_parser = parse_compress)]
    compress: String,
    /// Where the codecs run: cpu, or cuda (falls back to the CPU, saying
    /// so, where no CUDA device is found).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    compress_backend: String,
    /// Fetch, encode and send in turn on one thread per stream instead of
    /// the three-stage pipeline.
    #[arg(long)]
    no_pipeline: bool,
    /// Encoder threads per bulk stream.
    #[arg(long, default_value_t = 1)]
    compress_threads: u8,
    /// xbzrle page cache per encoder thread (e.g. 64M).
    #[arg(long, value_parser = parse_mem_size)]
    xbzrle_cache: Option<u64>,
    /// dedup chunk cache per encoder thread (e.g. 64M).
    #[arg(long, value_parser = parse_mem_size)]
    dedup_cache: Option<u64>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_compress(s: &str) -> Result<String, String> {
    s.parse::<ferry_migration::Compress>()?;
    Ok(s.to_string())
}

fn parse_mem_size(s: &str) -> Result<u64, String> {
    ferry_vmm::boot::layout::parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64M)"))
}

/// Parses `100M` (bytes/s) or `1gbit` (bits/s) into bytes per second.
fn parse_rate(s: &str) -> Result<u64, String> {
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

pub fn migrate(args: MigrateArgs) -> Result<ExitCode> {
    ferry_vmm::control::parse_tcp(&args.to).map_err(anyhow::Error::msg)?;
    let mut c = ControlClient::connect(&args.socket)?;
    let req = Request::Migrate(MigrateRequest {
        to: args.to.clone(),
        streams: args
            .streams
            .unwrap_or_else(ferry_migration::precopy::default_streams),
        downtime_ms: args.downtime_ms,
        max_rounds: args.max_rounds,
        verify: args.verify,
        auto_converge: !args.no_auto_converge,
        bandwidth: args.bandwidth,
        compress: args.compress.clone(),
        compress_backend: args.compress_backend.clone(),
        pipeline: !args.no_pipeline,
        compress_threads: args.compress_threads,
        xbzrle_cache: args.xbzrle_cache,
        dedup_cache: args.dedup_cache,
    });
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
        let rem = p["remaining_pages"].as_f64().unwrap_or(0.0) * 4096.0;
        let rate = p["throughput"].as_f64().unwrap_or(0.0);
        let eta = if rate > 0.0 {
            format!("{:.2} s", rem / rate)
        } else {
            "?".into()
        };
        bar.set_message(format!(
            "{:<14} round {:>3}  remaining {:>10}  rate {:>12}  sent {:>10}  ETA {eta}",
            p["phase"].as_str().unwrap_or(""),
            p["round"],
            format::bytes(rem),
            format!("{}/s", format::bytes(rate)),
            format::bytes(p["bytes"].as_f64().unwrap_or(0.0)),
        ));
    });
    bar.finish_and_clear();
    let stats = reply?["stats"].take();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else {
        print_table(&args.to, &stats);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(to: &str, s: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!("── ferry migrate: precopy to {to} ─────────────────────────────────");
    println!("total time   {:.3} s", f(&s["total_secs"]));
    let d = &s["downtime_parts"];
    println!(
        "downtime     {:.2} ms  (pause {:.2}, last round {:.2}, state {:.2}, verify {:.2}, destination {:.2})",
        f(&s["downtime_ms"]), f(&d["pause"]), f(&d["last_round"]), f(&d["save_state"]), f(&d["verify"]), f(&d["destination"])
    );
    println!(
        "sent         {} on the wire: {} pages, {} zero pages (as ranges), state {}",
        format::bytes(f(&s["bytes"])),
        s["pages"],
        s["zero_pages"],
        format::bytes(f(&s["state_bytes"]))
    );
    println!("converged    {}", s["converged"].as_str().unwrap_or(""));
    println!(
        "host CPU     source {:.3} s, destination {:.3} s (migration threads)",
        f(&s["source_cpu_s"]),
        f(&s["destination_cpu_s"])
    );
    let c = &s["compression"];
    if c["asked"].as_str().is_some_and(|a| a != "none") {
        let (i, o) = (f(&c["encoded_in"]), f(&c["encoded_out"]));
        println!(
            "compression  {} ({}): batches {}; {} of pages became {}{}{}",
            c["asked"].as_str().unwrap_or(""),
            if c["pipeline"] == true {
                "pipelined"
            } else {
                "no pipeline"
            },
            c["batches"]
                .as_str()
                .filter(|b| !b.is_empty())
                .unwrap_or("none"),
            format::bytes(i),
            format::bytes(o),
            if i > 0.0 {
                format!(" (ratio {:.2})", i / o.max(1.0))
            } else {
                String::new()
            },
            c["note"]
                .as_str()
                .map(|n| format!("; {n}"))
                .unwrap_or_default(),
        );
        if let Some(n) = c["backend_note"].as_str() {
            println!("backend      {n}");
        }
    }
    if s["verified_pages"].as_u64().unwrap_or(0) > 0 {
        println!(
            "verified     {} pages identical on both sides",
            s["verified_pages"]
        );
    }
    println!(
        "{:>6} {:>10} {:>10} {:>12} {:>10} {:>14} {:>14} {:>9}",
        "round", "pages", "zero", "bytes", "secs", "throughput", "dirty rate", "throttle"
    );
    for r in s["rounds"].as_array().into_iter().flatten() {
        println!(
            "{:>6} {:>10} {:>10} {:>12} {:>10.4} {:>14} {:>14} {:>8}%",
            r["round"].as_u64().unwrap_or(0),
            r["pages"].as_u64().unwrap_or(0),
            r["zero_pages"].as_u64().unwrap_or(0),
            format::bytes(f(&r["bytes"])),
            f(&r["secs"]),
            format!("{}/s", format::bytes(f(&r["throughput"]))),
            format!("{}/s", format::bytes(f(&r["dirty_rate"]))),
            r["throttle_pct"].as_u64().unwrap_or(0),
        );
    }
}
