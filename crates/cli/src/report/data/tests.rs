//! Timelines read back into runs and series: what each sample and event
//! counts for, and the lines the parser skips or refuses.

use super::*;

const TIMELINE: &str = r#"{"type":"header","t":100.0,"mode":"precopy"}
{"type":"sample","side":"source","t":99.0,"running":true,"guest":{"progress":[10]},"links":{}}
{"type":"sample","side":"source","t":99.5,"running":true,"guest":{"progress":[60]},"links":{}}
{"type":"event","side":"source","t":100.0,"what":"open","detail":""}
{"type":"sample","side":"source","t":100.05,"running":true,"guest":{"progress":[70]},"links":{"bulk0":[0,0]}}
{"type":"sample","side":"source","t":100.15,"running":true,"guest":{"progress":[75]},"links":{"bulk0":[2097152,0]}}
{"type":"event","side":"source","t":100.2,"what":"phase","detail":"switching"}
{"type":"sample","side":"source","t":100.25,"running":false,"guest":{"progress":[75]},"links":{"bulk0":[2097152,0]}}
{"type":"sample","side":"destination","t":100.35,"running":true,"guest":{"progress":[80]},"links":{}}
{"type":"sample","side":"destination","t":100.45,"running":true,"guest":{"progress":[90]},"links":{}}
{"type":"sample","side":"destination","t":100.55,"running":true,"guest":{"progress":[90]},"links":{}}
{"type":"event","side":"source","t":100.3,"what":"phase","detail":"succeeded"}
{"type":"summary","ok":true,"stats":{"total_secs":0.3,"downtime_ms":5.0,"bytes":2097152,"rounds":[{},{}]}}
"#;

#[test]
fn a_timeline_reads_back_into_series() {
    let r = Run::parse("t", TIMELINE).unwrap();
    assert_eq!(r.samples.len(), 8);
    assert!((r.switch_at().unwrap() - 0.2).abs() < 1e-9);
    assert!((r.end_at() - 0.3).abs() < 1e-9);
    // 2 MiB in one bin on bulk0: 20 MiB/s.
    let bw = r.bandwidth();
    assert_eq!(bw.len(), 1);
    assert_eq!(bw[0].0, "bulk0");
    let peak = bw[0].1.iter().map(|(_, x)| *x).fold(0.0, f64::max);
    assert!((peak - 2097152.0 / BIN).abs() < 1.0);
    // The counter runs on at the destination: 10 -> 90 in all.
    let total: f64 = r.progress_rate().iter().map(|(_, x)| x * BIN).sum();
    assert!((total - 80.0).abs() < 1e-6, "{total}");
    // Paused on the source with no destination sample yet: 0.
    let ex = r.exec_ratio();
    let at = |t: f64| ex.iter().find(|(b, _)| (b - t).abs() < 1e-6).unwrap().1;
    assert_eq!(at(0.2), 0.0);
    assert_eq!(at(0.4), 1.0);
    let f = r.figures();
    assert_eq!(f["downtime_ms"], 5.0);
    assert_eq!(f["rounds"], 2);
}

#[test]
fn a_paused_source_between_destination_samples_counts_nothing_twice() {
    let text = r#"{"type":"header","t":100.0,"mode":"postcopy"}
{"type":"sample","side":"source","t":100.0,"running":true,"guest":{"progress":[100]},"links":{}}
{"type":"sample","side":"destination","t":100.12,"running":true,"guest":{"progress":[130]},"links":{}}
{"type":"sample","side":"source","t":100.13,"running":false,"guest":{"progress":[110]},"links":{}}
{"type":"sample","side":"destination","t":100.22,"running":true,"guest":{"progress":[150]},"links":{}}
{"type":"summary","ok":true,"stats":{"total_secs":0.3,"downtime_ms":5.0,"bytes":0,"rounds":[]}}
"#;
    let r = Run::parse("t", text).unwrap();
    let total: f64 = r.progress_rate().iter().map(|(_, x)| x * BIN).sum();
    assert!((total - 50.0).abs() < 1e-6, "{total}");
}

#[test]
fn a_throttled_source_beside_a_waiting_destination_runs_its_unthrottled_share() {
    let text = r#"{"type":"header","t":100.0,"mode":"precopy"}
{"type":"event","side":"source","t":100.0,"what":"open","detail":""}
{"type":"sample","side":"source","t":100.01,"running":true,"throttle_pct":60,"links":{}}
{"type":"sample","side":"destination","t":100.02,"running":false,"state":"waiting","links":{}}
{"type":"sample","side":"source","t":100.05,"running":true,"throttle_pct":60,"links":{}}
{"type":"sample","side":"destination","t":100.06,"running":false,"state":"waiting","links":{}}
{"type":"summary","ok":true,"stats":{"total_secs":0.1,"downtime_ms":1.0,"bytes":0,"rounds":[]}}
"#;
    let r = Run::parse("t", text).unwrap();
    let ex = r.exec_ratio();
    assert!((ex[0].1 - 0.4).abs() < 1e-9, "{ex:?}");
}

#[test]
fn a_line_absurdly_far_from_the_start_is_skipped_not_binned() {
    // Found by fuzz/timeline: one sample 6.7e58 s after the start made
    // every series ask for that many 100 ms bins (capacity overflow).
    let far = "6".repeat(60);
    let text = format!(
        r#"{{"type":"header","t":100.0,"mode":"postcopy"}}
{{"type":"sample","side":"source","t":100.5,"running":true,"guest":{{"progress":[1]}},"links":{{}}}}
{{"type":"sample","side":"source","t":{far},"running":true,"guest":{{"progress":[9]}},"links":{{}}}}
{{"type":"event","side":"source","t":-1e300,"what":"phase","detail":"switching"}}
"#
    );
    let r = Run::parse("t", &text).unwrap();
    assert_eq!(r.samples.len(), 1, "the far sample is skipped");
    assert!(r.events.is_empty(), "so is the far event");
    let (lo, hi) = r.span();
    assert!(hi - lo < 2.0, "{lo}..{hi}");
    assert_eq!(r.progress_rate().len(), r.exec_ratio().len());
    assert!(r.figures().is_object());
}

#[test]
fn not_a_timeline_says_so() {
    assert!(Run::parse("x", "").is_err());
    assert!(Run::parse("x", "{\"type\":\"sample\"}\n").is_err());
    assert!(Run::parse("x", "garbage\n").is_err());
}
