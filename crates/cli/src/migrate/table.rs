//! The table `ferry migrate` ends with: what the migration cost (time,
//! downtime and its parts, bytes, CPU, compression), each round, and
//! postcopy's faults.

use ferry_migration::MigrationStats;

use crate::format;

pub(super) fn print_table(to: &str, s: &MigrationStats) {
    println!(
        "── ferry migrate: {} to {to} ─────────────────────────────────",
        s.mode
    );
    println!("total time   {:.3} s", s.total_secs);
    let d = &s.downtime_parts;
    println!(
        "downtime     {:.2} ms  (pause {:.2}, last round {:.2}, state {:.2}, verify {:.2}, clients {:.2}, destination {:.2})",
        s.downtime_ms, d.pause, d.last_round, d.save_state, d.verify, d.clients, d.destination
    );
    if s.verified_pages > 0 && s.verify_after_ms > 0.0 {
        // v12: pages were hashed as they went and landed; the pause only
        // compared digests, and this side's memory was checked afterwards.
        println!(
            "             of which --verify {:.2} ms (digests of what was sent and what landed); this side's memory was checked against what it sent after the VM started there ({:.1} ms, outside the downtime)",
            d.verify_share(),
            s.verify_after_ms
        );
    } else if s.verified_pages > 0 && d.verify_share() > 0.0 {
        println!(
            "             of which --verify {:.2} ms (source {:.2}, destination {:.2}): both sides hash the paused memory, inside the downtime; without --verify about {:.2} ms",
            d.verify_share(),
            d.verify,
            d.destination_verify,
            (s.downtime_ms - d.verify_share()).max(0.0)
        );
    }
    if s.destination_released_bytes > 0 {
        println!(
            "             the destination gave back {} it had populated ahead, before the first page (this mode may switch, which needs the pages still to come missing)",
            format::bytes(s.destination_released_bytes as f64)
        );
    }
    if s.shared_offered > 0 {
        println!(
            "shared       {} pages sent as references to what the destination's host holds ({} offered by its other VMs; {} missed and sent again): {} not sent",
            s.shared_pages,
            s.shared_offered,
            s.shared_missed,
            format::bytes(s.shared_pages.saturating_sub(s.shared_missed) as f64 * 4096.0)
        );
    }
    for d in &s.disks {
        let how = match d.how.as_str() {
            "shared" => "stayed on its shared storage, attached by the destination".to_string(),
            other => other.to_string(),
        };
        println!(
            "disk {}       {} {}: {how}; {} sent",
            d.index,
            d.backend,
            d.path,
            format::bytes(d.bytes as f64)
        );
    }
    if let Some(c) = &s.clients {
        if c.moved {
            println!(
                "clients      moved with the VM: {} connections; {}; this VMM exits",
                c.connections, c.detail
            );
        } else {
            println!("clients      {}", c.detail);
        }
    }
    println!(
        "sent         {} on the wire: {} pages, {} zero pages (as ranges), state {}",
        format::bytes(s.bytes as f64),
        s.pages,
        s.zero_pages,
        format::bytes(s.state_bytes as f64)
    );
    if s.unchanged_pages > 0 {
        println!(
            "unchanged    {} dirty pages held what they last sent: {} not sent again",
            s.unchanged_pages,
            format::bytes(s.unchanged_pages as f64 * 4096.0)
        );
    }
    println!("converged    {}", s.converged);
    if let Some(g) = &s.gather {
        println!(
            "gather       {} pages pulled from {} memory servers in {:.3} s ({} chunks were there), the rest from the main host; it paged in {} chunks meanwhile",
            g.pulled_pages,
            g.servers.len(),
            g.pull_secs,
            g.remote_chunks,
            g.page_ins
        );
    }
    if let Some(sp) = &s.split {
        println!(
            "split        {} of {} chunks ({} pages each) on the main host (budget {}), ranked by {} over {} periods of history",
            sp.main_chunks, sp.chunks, sp.chunk_pages, sp.budget_chunks, sp.rank, sp.history_periods
        );
        for m in &sp.servers {
            println!(
                "             {}: {} chunks, {} pages, {}",
                m.addr,
                m.chunks,
                m.pages,
                format::bytes(m.bytes as f64)
            );
        }
    }
    println!(
        "host CPU     source {:.3} s, destination {:.3} s (migration threads)",
        s.source_cpu_s, s.destination_cpu_s
    );
    let c = &s.compression;
    if c.asked != "none" {
        let (i, o) = (c.encoded_in as f64, c.encoded_out as f64);
        println!(
            "compression  {} ({}): batches {}; {} of pages became {}{}{}",
            c.asked,
            if c.pipeline {
                "pipelined"
            } else {
                "no pipeline"
            },
            if c.batches.is_empty() {
                "none"
            } else {
                &c.batches
            },
            format::bytes(i),
            format::bytes(o),
            if i > 0.0 {
                format!(" (ratio {:.2})", i / o.max(1.0))
            } else {
                String::new()
            },
            c.note
                .as_ref()
                .map(|n| format!("; {n}"))
                .unwrap_or_default(),
        );
        if let Some(n) = &c.backend_note {
            println!("backend      {n}");
        }
    }
    if s.verified_pages > 0 {
        println!(
            "verified     {} pages identical on both sides",
            s.verified_pages
        );
    }
    if let Some(p) = &s.postcopy {
        print_postcopy(p);
    }
    if s.rounds.is_empty() {
        return;
    }
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>12} {:>10} {:>14} {:>14} {:>9}",
        "round",
        "pages",
        "zero",
        "unchanged",
        "bytes",
        "secs",
        "throughput",
        "dirty rate",
        "throttle"
    );
    for r in &s.rounds {
        println!(
            "{:>6} {:>10} {:>10} {:>10} {:>12} {:>10.4} {:>14} {:>14} {:>8}%",
            r.round,
            r.pages,
            r.zero_pages,
            r.unchanged_pages,
            format::bytes(r.bytes as f64),
            r.secs,
            format!("{}/s", format::bytes(r.throughput)),
            format!("{}/s", format::bytes(r.dirty_rate)),
            r.throttle_pct,
        );
    }
}

fn print_postcopy(p: &ferry_migration::PostcopyStats) {
    let f = &p.faults;
    println!(
        "postcopy     switched at {:.3} s; {} pages pending, all there {:.3} s after the switch",
        p.switch_at_s, p.pending_pages, p.secs
    );
    if p.dropped_ahead_pages > 0 {
        println!(
            "  dropped    {} of them at the destination before the pause (the VM still ran here)",
            p.dropped_ahead_pages
        );
    }
    if p.pauses > 0 {
        println!(
            "  paused     {} time(s) on a broken link, {:.3} s in all; resumed with no page lost",
            p.pauses, p.paused_s
        );
    }
    println!(
        "  sent       pushed {} pages + {} zero; {} requests answered with {} pages ({} prefetched)",
        p.pushed_pages, p.pushed_zero_pages, p.requests, p.demand_pages, p.prefetched_pages
    );
    println!(
        "  faults     {} ({} major, {} minor, {} zero-filled, {} duplicate); taken by vCPU threads {}, by KVM's async workers {}, by the VMM {}",
        f.faults, f.major, f.minor, f.zero, f.duplicate, f.vcpu_thread, f.async_worker, f.host
    );
    println!(
        "  guest      {} faults absorbed by async page faults (another task ran), {} stopped a vCPU",
        f.apf_absorbed
            .map_or("unknown".to_string(), |a| a.to_string()),
        f.blocked
    );
    if f.latency_us.count > 0 {
        println!(
            "  latency    major fault to wake: p50 {:.0} µs, p99 {:.0} µs, p99.9 {:.0} µs, max {:.0} µs, mean {:.0} µs",
            f.latency_us.p50,
            f.latency_us.p99,
            f.latency_us.p999,
            f.latency_us.max,
            f.latency_us.mean
        );
    }
    let worst = f.series.iter().map(|b| b.exec_ratio).fold(1.0f64, f64::min);
    println!(
        "  exec ratio lowest in a 100 ms window {:.2} ({} windows; vCPU-thread waits)",
        worst,
        f.series.len()
    );
}
