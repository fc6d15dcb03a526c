//! `ferry handover`: asks a VM's VMM to hand the VM to a new VMM process on
//! the same host (memory shared, not copied), shows the steps, and ends
//! with a table of what it cost.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use ferry_vmm::control::{ControlClient, Request};
use ferry_vmm::handover::HandoverStats;

use crate::format;

#[derive(clap::Args)]
pub struct HandoverArgs {
    /// The VM's control socket (the path stays the same afterwards).
    socket: PathBuf,
    /// The ferry binary the new VMM runs, e.g. a newer release (default:
    /// the one the VMM runs now).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Compare per-page hashes of guest memory as both processes map it
    /// (the hashing adds to the downtime).
    #[arg(long)]
    verify: bool,
    /// Print the figures as JSON on stdout.
    #[arg(long)]
    json: bool,
}

impl HandoverArgs {
    /// The VM's control socket.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }
}

pub fn handover(args: HandoverArgs) -> Result<ExitCode> {
    let binary = match &args.binary {
        Some(b) => Some(
            std::fs::canonicalize(b)
                .with_context(|| format!("--binary {}: no such file", b.display()))?
                .display()
                .to_string(),
        ),
        None => None,
    };
    let mut c = ControlClient::connect(&args.socket)?;
    let reply = c.call_with_progress(
        &Request::Handover {
            binary,
            verify: args.verify,
        },
        &mut |p| {
            if let Some(step) = p["step"].as_str() {
                eprintln!("ferry: {step}");
            }
        },
    )?;
    let stats: HandoverStats =
        serde_json::from_value(reply["stats"].clone()).context("bad handover figures")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else {
        print_table(&args.socket, &stats);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(socket: &std::path::Path, s: &HandoverStats) {
    println!("── ferry handover ────────────────────────────────────────────────");
    println!("new VMM      pid {} ({})", s.new_pid, s.binary);
    println!("control      {} (same path)", socket.display());
    println!("total time   {:.2} ms", s.total_ms);
    println!(
        "downtime     {:.3} ms (pause + save {:.3} ms, restore in the new VMM {:.3} ms)",
        s.downtime_ms, s.save_ms, s.restore_ms
    );
    println!(
        "build        {:.2} ms in the new VMM, before the pause",
        s.build_ms
    );
    if s.verified_pages > 0 {
        println!(
            "verified     {} pages hashed alike in both VMMs ({:.1} ms of the downtime here; the new VMM's hashing is part of its restore)",
            s.verified_pages, s.verify_ms
        );
    }
    println!(
        "memory       {} handed over, {} copied",
        format::bytes(s.guest_memory_bytes as f64),
        format::bytes(s.memory_bytes_copied as f64)
    );
    println!(
        "socket       {} (VM state {})",
        format::bytes(s.socket_bytes as f64),
        format::bytes(s.state_bytes as f64)
    );
    if s.service_pause_ms > 0.0 {
        println!(
            "service      {} connections moved ({} unread bytes with them), clients paused {:.2} ms",
            s.connections,
            s.pending_client_bytes,
            s.service_pause_ms
        );
    }
    println!(
        "host CPU     {:.1} ms old VMM, {:.1} ms new VMM",
        s.source_cpu_s * 1e3,
        s.destination_cpu_s * 1e3
    );
}
