//! The timeline files `ferry report` reads: JSON lines written by both
//! sides of a migration (the destination's lines arrive from the peer in
//! the Timeline message, zstd-packed, and are written into the file as
//! they came), and the CSV log of `ferry load`. Read by the report's own
//! parser (crates/cli/src/report/data.rs, compiled in here as it is) and
//! turned into every series and figure the report draws.
//!
//! The first byte picks the input's form: a whole file; a peer's Timeline
//! body (unpacked by `telemetry::unpack_lines` and placed between a header
//! and a summary line as the source's VMM writes it); or a file and a
//! load log.
//!
//! Checks: parsing and every series end (no panic, no unbounded
//! allocation); a run's samples and events come out in time order; series
//! have one point per 100 ms bin of the run's span.
#![no_main]

#[allow(dead_code)]
#[path = "../../crates/cli/src/report/data.rs"]
mod data;

use ferry_fuzz::Input;
use ferry_migration::fuzzing::unpack_lines;
use libfuzzer_sys::fuzz_target;

fn exercise(run: &mut data::Run, load: Option<&str>) {
    if let Some(csv) = load {
        let _ = run.add_load_text(csv, "load.csv");
    }
    for w in run.samples.windows(2) {
        assert!(w[0].t <= w[1].t, "samples out of order");
    }
    for w in run.events.windows(2) {
        assert!(w[0].t <= w[1].t, "events out of order");
    }
    let _ = run.span();
    let _ = run.mode();
    let _ = run.switch_at();
    let _ = run.end_at();
    let progress = run.progress_rate();
    let exec = run.exec_ratio();
    assert_eq!(progress.len(), exec.len(), "series of different bins");
    let _ = run.answered_rate();
    let _ = run.bandwidth();
    let _ = run.fault_bins();
    let _ = run.latency_mean();
    let figures = run.figures();
    assert!(figures.is_object());
}

fuzz_target!(|bytes: &[u8]| {
    ferry_fuzz::init();
    let mut input = Input::new(bytes);
    let form = input.u8() % 3;
    let text = match form {
        1 => {
            // The source's file: its header, the peer's unpacked lines, its summary.
            let Ok(peer) = unpack_lines(input.rest()) else {
                return;
            };
            let mut t = String::from("{\"type\":\"header\",\"t\":100.0,\"mode\":\"precopy\"}\n");
            t.push_str(&String::from_utf8_lossy(&peer));
            t.push_str("{\"type\":\"summary\",\"ok\":true,\"stats\":{}}\n");
            t
        }
        _ => String::from_utf8_lossy(input.chunk()).into_owned(),
    };
    let load = (form == 2).then(|| String::from_utf8_lossy(input.rest()).into_owned());
    if let Ok(mut run) = data::Run::parse("fuzz", &text) {
        exercise(&mut run, load.as_deref());
    }
});
