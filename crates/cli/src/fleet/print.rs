//! What `ferry drain` prints: the plan, a line per move while it runs (and
//! a total with rate and ETA), and the summary table.

use std::io::Write;

use ferry_fleet::drain::{self, MoveReport, MoveState};

use crate::format;

/// A drain's progress on stderr: at a terminal the lines are redrawn in
/// place four times a second; elsewhere (a log) a line is printed when a
/// move changes phase; with `--json`, nothing.
pub(super) struct DrainProgress {
    on: bool,
    live: bool,
    shown: usize,
    states: Vec<MoveState>,
    t0: std::time::Instant,
    last: std::time::Instant,
}

impl DrainProgress {
    pub(super) fn new(on: bool) -> Self {
        let now = std::time::Instant::now();
        DrainProgress {
            on,
            live: on && std::io::IsTerminal::is_terminal(&std::io::stderr()),
            shown: 0,
            states: Vec::new(),
            t0: now,
            last: now - std::time::Duration::from_secs(1),
        }
    }

    pub(super) fn show(&mut self, moves: &[MoveReport]) {
        if !self.on {
            return;
        }
        let mut err = std::io::stderr();
        let lines = progress_lines(moves, self.t0.elapsed().as_secs_f64());
        if !self.live {
            for (i, m) in moves.iter().enumerate() {
                if self.states.get(i) != Some(&m.state) {
                    let _ = writeln!(err, "{}", lines[i]);
                }
            }
            self.states = moves.iter().map(|m| m.state).collect();
            return;
        }
        if self.last.elapsed() < std::time::Duration::from_millis(250) {
            return;
        }
        self.last = std::time::Instant::now();
        if self.shown > 0 {
            // Back over the lines drawn last time.
            let _ = write!(err, "\x1b[{}A", self.shown);
        }
        for l in &lines {
            let _ = writeln!(err, "\x1b[2K{l}");
        }
        self.shown = lines.len();
    }
}

pub(super) fn print_plan(plan: &drain::Plan) {
    println!("drain {}: {} VMs to move", plan.from, plan.moves.len());
    for m in &plan.moves {
        println!(
            "  {:<20} {:>9} -> {:<16} {:<8} ({})",
            m.vm,
            format::bytes(m.mem_bytes as f64),
            m.to,
            m.mode.name(),
            m.why
        );
    }
    for (vm, why) in &plan.unplaced {
        println!("  {vm:<20} stays: no host has room ({why})");
    }
}

/// A line per VM and a total with rate and ETA.
fn progress_lines(moves: &[MoveReport], secs: f64) -> Vec<String> {
    let mut out: Vec<String> = moves
        .iter()
        .map(|m| {
            let state = match m.state {
                MoveState::Waiting => "waiting".to_string(),
                MoveState::Preparing => "preparing".to_string(),
                MoveState::Moving => format!(
                    "moving  {} sent, {} pages left",
                    format::bytes(m.bytes as f64),
                    m.remaining_pages
                ),
                MoveState::Done => format!(
                    "done    {:.1} s, downtime {:.1} ms",
                    m.secs,
                    m.downtime_ms.unwrap_or(0.0)
                ),
                MoveState::Failed => format!("failed  {}", m.errors.last().map_or("", |e| e)),
                MoveState::LeftAlone => {
                    format!("left alone  {}", m.errors.last().map_or("", |e| e))
                }
            };
            format!("  {:<20} -> {:<16} {}", m.vm, m.to, state)
        })
        .collect();
    let total: u64 = moves.iter().map(|m| m.mem_bytes).sum();
    let done: u64 = moves
        .iter()
        .filter(|m| m.state == MoveState::Done)
        .map(|m| m.mem_bytes)
        .sum();
    let sent: u64 = moves.iter().map(|m| m.bytes).sum();
    let rate = sent as f64 / secs.max(1e-3);
    let eta = if rate > 0.0 {
        format!("{:.0} s", total.saturating_sub(done) as f64 / rate)
    } else {
        "?".into()
    };
    out.push(format!(
        "  total: {}/{} VMs, {} of {} RAM moved, {} sent at {}/s, ETA {eta}",
        moves.iter().filter(|m| m.state == MoveState::Done).count(),
        moves.len(),
        format::bytes(done as f64),
        format::bytes(total as f64),
        format::bytes(sent as f64),
        format::bytes(rate)
    ));
    out
}

pub(super) fn print_summary(r: &drain::DrainReport) {
    println!(
        "── drain {} ─────────────────────────────────────────────",
        r.host
    );
    println!(
        "{:<20} {:<16} {:<8} {:>9} {:>8} {:>11} {:>10}  result",
        "vm", "to", "mode", "mem", "secs", "downtime ms", "sent"
    );
    for m in &r.moves {
        let verified = m
            .verified_pages
            .map_or(String::new(), |p| format!(", {p} pages verified"));
        let result = match m.state {
            MoveState::Done if m.errors.is_empty() && m.postcopy && m.standby.is_some() => {
                format!(
                    "moved (postcopy with a standby on {}){verified}",
                    m.standby.as_deref().unwrap_or_default()
                )
            }
            MoveState::Done if m.errors.is_empty() => format!("moved{verified}"),
            MoveState::Done => format!("moved after {} failed tries", m.errors.len()),
            MoveState::LeftAlone => format!(
                "LEFT ALONE (where it runs is not known; nothing was stopped): {}",
                m.errors.last().map_or("", |e| e)
            ),
            _ => format!(
                "stays on {}: {}",
                r.host,
                m.errors.last().map_or("not started", |e| e)
            ),
        };
        println!(
            "{:<20} {:<16} {:<8} {:>9} {:>8.2} {:>11} {:>10}  {result}",
            m.vm,
            m.to,
            if m.postcopy {
                "postcopy"
            } else {
                m.mode.name()
            },
            format::bytes(m.mem_bytes as f64),
            m.secs,
            m.downtime_ms.map_or("-".into(), |d| format!("{d:.2}")),
            format::bytes(m.bytes as f64),
        );
    }
    for (vm, why) in &r.unplaced {
        println!("{vm:<20} stays on {}: no host has room ({why})", r.host);
    }
    println!(
        "{} in {:.1} s{}",
        if r.emptied() {
            format!("{} emptied", r.host)
        } else {
            format!("{} NOT emptied", r.host)
        },
        r.secs,
        if r.cancelled { " (cancelled)" } else { "" }
    );
}
