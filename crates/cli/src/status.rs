//! `ferry status` and `ferry ctl`: clients of a VM's control socket.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use ferry_vmm::control::{ControlClient, Request};
use serde_json::Value;

/// Control actions `ferry ctl` sends.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Action {
    /// Print the VM's state (as `ferry status`).
    Status,
    /// Stop the vCPUs.
    Pause,
    /// Run them again.
    Resume,
    /// Stop the VM.
    Quit,
    /// Print the guest's counters.
    Metrics,
    /// Write the guest's non-zero pages to --out (codec benchmarks use it
    /// as real guest memory).
    Dump,
}

pub fn status(socket: &Path, json: bool, metrics: bool) -> Result<ExitCode> {
    let mut c = ControlClient::connect(socket)?;
    let mut s = c.call(&Request::Status)?;
    if metrics {
        s["metrics"] = c.call(&Request::Metrics)?["metrics"].take();
    }
    if json {
        println!("{s}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("state       {}", s["state"].as_str().unwrap_or("?"));
    println!("VMM pid     {}", s["pid"]);
    println!("vCPUs       {}", s["vcpus"]);
    println!(
        "memory      {}",
        crate::format::bytes(s["mem_bytes"].as_f64().unwrap_or(0.0))
    );
    println!("workloads   {}", s["workloads"].as_str().unwrap_or("?"));
    println!(
        "APF         {}",
        if s["apf"] == Value::Bool(true) {
            "on"
        } else {
            "off"
        }
    );
    println!("migrations  {} incoming", s["migrations"]);
    println!("uptime      {:.1} s", s["uptime_s"].as_f64().unwrap_or(0.0));
    for d in s["disks"].as_array().into_iter().flatten() {
        let b = |k: &str| crate::format::bytes(d[k].as_f64().unwrap_or(0.0));
        println!(
            "disk {}      {} {} ({}): read {} in {} requests, written {} in {}",
            d["index"],
            d["backend"].as_str().unwrap_or("?"),
            d["path"].as_str().unwrap_or("?"),
            b("size"),
            b("read_bytes"),
            d["reads"],
            b("write_bytes"),
            d["writes"]
        );
    }
    if let Some(c) = s["disk_check"].as_object() {
        println!(
            "disk check  {} phase, {} blocks checked, {} bad, {:.0} IOPS",
            c["phase"].as_str().unwrap_or("?"),
            c["blocks_checked"],
            c["bad_blocks"],
            c["iops"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(l) = s["links"].as_str() {
        println!("links       {l}");
    }
    if let Some(w) = s["incoming"].as_object() {
        println!(
            "waiting     on {}{}{}{}",
            w["endpoint"].as_str().unwrap_or("?"),
            if w["tls"] == true {
                ", mutual TLS"
            } else {
                ", plaintext"
            },
            w["from"]
                .as_str()
                .map(|f| format!(", only from {f}"))
                .unwrap_or_default(),
            w["token"]
                .as_str()
                .map(|t| format!(", token {t}"))
                .unwrap_or_default()
        );
    }
    let sp = &s["split"];
    if sp.is_object() {
        let n = |k: &str| sp[k].as_u64().unwrap_or(0);
        println!(
            "split       {} of {} chunks here (budget {}); paged in {} chunks ({} pages), out {} ({} pages, {} clean: nothing sent); page-in p50 {:.0} µs, p99 {:.0} µs{}{}",
            n("resident_chunks"),
            n("chunks"),
            n("budget_chunks"),
            n("page_ins"),
            n("pages_in"),
            n("page_outs"),
            n("pages_out"),
            n("clean_drops"),
            sp["page_in_p50_us"].as_f64().unwrap_or(0.0),
            sp["page_in_p99_us"].as_f64().unwrap_or(0.0),
            match n("reconnects") {
                0 => String::new(),
                r => format!("; {r} memory server reconnects"),
            },
            match sp["failure"].as_str() {
                Some(f) => format!("; FAILED: {f}"),
                None => String::new(),
            }
        );
    }
    println!(
        "access      {}",
        access_line(&s["access"]).unwrap_or_else(|| "off".into())
    );
    if metrics {
        println!("metrics     {}", s["metrics"]);
    }
    Ok(ExitCode::SUCCESS)
}

pub fn ctl(socket: &Path, action: Action, out: Option<PathBuf>, json: bool) -> Result<ExitCode> {
    if matches!(action, Action::Status) {
        return status(socket, json, false);
    }
    let mut c = ControlClient::connect(socket)?;
    let req = match action {
        Action::Status => Request::Status,
        Action::Pause => Request::Pause,
        Action::Resume => Request::Resume,
        Action::Quit => Request::Quit,
        Action::Metrics => Request::Metrics,
        Action::Dump => Request::Dump {
            path: out
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
        },
    };
    let reply = c.call(&req)?;
    if json || matches!(action, Action::Metrics | Action::Dump) {
        println!("{reply}");
    } else {
        println!("ok");
    }
    Ok(ExitCode::SUCCESS)
}

/// Access tracking's state and cost in one line (None when it is off).
pub fn access_line(a: &Value) -> Option<String> {
    let state = a["state"].as_str()?;
    let f = |k: &str| a[k].as_f64().unwrap_or(0.0);
    if state == "failed" && f("periods") == 0.0 {
        return Some(format!(
            "unavailable: {}",
            a["error"].as_str().unwrap_or("no reason given")
        ));
    }
    let mut line = format!(
        "{state}: {} periods of {} ms, {:.0} pages armed per period (1/{}, a fault per {} pages, \
         writes by {}), {:.0} minor faults/s, arm {:.2} ms, fault service {:.1} µs, vCPU time lost ≈{:.2}%",
        a["periods"],
        a["period_ms"],
        f("pages_armed_per_arm"),
        a["share"],
        a["grain_pages"],
        a["writes"].as_str().unwrap_or("sample"),
        f("minor_faults_per_s"),
        f("arm_us_mean") / 1e3,
        f("fault_service_us_mean"),
        f("vcpu_time_lost_pct"),
    );
    if let Some(e) = a["error"].as_str() {
        line.push_str(&format!(" ({e})"));
    }
    Some(line)
}
