//! Options as they travel (JSON): what is left out takes the defaults, and
//! options written before a field existed still parse.

use super::*;

#[test]
fn options_travel_as_json_and_fill_in_defaults() {
    let o: MigrateOptions =
        serde_json::from_str(r#"{"verify":true,"compression":{"compress":"zstd:3"}}"#).unwrap();
    assert!(o.verify);
    assert_eq!(o.compression.compress, Compress::Fixed(Method::Zstd(3)));
    assert_eq!(o.max_rounds, defaults::MAX_ROUNDS);
    assert_eq!(o.mode, Mode::Precopy);
    let back: MigrateOptions = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
    assert_eq!(back, o);
    assert!(o.check().is_ok());
    assert!(serde_json::from_str::<MigrateOptions>(r#"{"mode":"teleport"}"#).is_err());
    assert!(
        serde_json::from_str::<MigrateOptions>(r#"{"compression":{"compress":"gzip"}}"#).is_err()
    );
    let bad = MigrateOptions {
        streams: 0,
        ..Default::default()
    };
    assert!(bad.check().unwrap_err().contains("streams"));
    let held = MigrateOptions {
        mode: Mode::Postcopy,
        push_delay_ms: defaults::MAX_PUSH_DELAY_MS + 1,
        ..Default::default()
    };
    assert!(held.check().unwrap_err().contains("at most"));
    let precopy_held = MigrateOptions {
        push_delay_ms: 1000,
        ..Default::default()
    };
    assert!(precopy_held
        .check()
        .unwrap_err()
        .contains("postcopy and hybrid"));
    assert!("teleport".parse::<Mode>().unwrap_err().contains("postcopy"));
    let o: MigrateOptions =
        serde_json::from_str(r#"{"mode":"hybrid","postcopy_after":"1.5s","prefetch":0}"#).unwrap();
    assert_eq!(o.mode, Mode::Hybrid);
    assert_eq!(o.postcopy_after, PostcopyAfter::Secs(1.5));
    assert_eq!("4".parse(), Ok(PostcopyAfter::Rounds(4)));
    assert!("-1s".parse::<PostcopyAfter>().is_err());
    assert!("soon".parse::<PostcopyAfter>().is_err());
    let back: MigrateOptions = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
    assert_eq!(back, o);
}

#[test]
fn options_from_before_auto_converge_tuning_still_parse() {
    // What a ferry without the auto-converge steps sent over the
    // control socket: every field it had, auto-converge off.
    let old = r#"{"mode":"precopy","streams":2,"downtime_ms":10.0,"max_rounds":30,
        "verify":false,"auto_converge":false,"bandwidth":null,"timeout_ms":30000,
        "compression":{"compress":"none","pipeline":true,"workers":1,
        "caches":{"xbzrle_bytes":67108864,"dedup_bytes":67108864},"backend":"cpu"},
        "prefetch":8,"push_delay_ms":0,"postcopy_after":"3","reconnect_timeout_ms":30000,
        "timeline_tail_ms":1000,"split":{"subs":[],"main_budget":0,"chunk_pages":256,
        "rank":"clock","replicas":1}}"#;
    let o: MigrateOptions = serde_json::from_str(old).unwrap();
    assert!(!o.auto_converge);
    assert_eq!(o.auto_converge_tuning, AutoConverge::default());
    assert_eq!(o.streams, 2);
    assert!(o.check().is_ok());
    // A part of the steps fills in the rest.
    let o: MigrateOptions =
        serde_json::from_str(r#"{"auto_converge_tuning":{"max_pct":50}}"#).unwrap();
    assert!(o.auto_converge);
    assert_eq!(o.auto_converge_tuning.max_pct, 50);
    assert_eq!(
        o.auto_converge_tuning.initial_pct,
        defaults::AUTO_CONVERGE_INITIAL_PCT
    );
}
