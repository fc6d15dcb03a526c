//! Access tracking as `ferry run` users see it: on by its flag, its
//! periods, faults and cost in `ferry status`, the guest running on.

mod common;
use common::{ferry, kvm_usable, progress, spawn_reaped as spawn, wait_status as status};

use std::time::Duration;

/// A `ferry run` with `args`, its control socket in a directory of its
/// own (`tag` names it), running for at most a minute.
fn vm(tag: &str, args: &[&str]) -> (common::Reaper, String) {
    let dir = std::env::temp_dir().join(format!("ferry-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("vm.sock").to_string_lossy().into_owned();
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--control", &sock, "--duration", "60s"]);
    (spawn(&all), sock)
}

#[test]
fn status_reports_access_tracking_and_the_guest_runs_on() {
    if !kvm_usable() {
        return;
    }
    let (_vm, sock) = vm(
        "access",
        &[
            "--mem",
            "128M",
            "--workload",
            "dirty:rate=32,wss=16",
            "--access-period",
            "200",
        ],
    );
    let first = status(&sock);
    if first["access"]["state"] == "failed" && first["access"]["periods"] == 0 {
        eprintln!(
            "SKIP: access tracking unavailable here: {}",
            first["access"]["error"]
        );
        return;
    }
    std::thread::sleep(Duration::from_secs(2));
    let a = status(&sock);
    std::thread::sleep(Duration::from_millis(300));
    let b = status(&sock);
    let acc = &b["access"];
    eprintln!("access: {acc}");
    assert_eq!(acc["state"], "tracking", "{acc}");
    assert_eq!(acc["period_ms"], 200);
    assert_eq!(acc["share"], 8);
    assert!(acc["periods"].as_u64().unwrap() >= 3, "{acc}");
    assert!(acc["minor_faults_total"].as_u64().unwrap() > 0, "{acc}");
    assert!(acc["pages_armed_per_arm"].as_f64().unwrap() > 0.0, "{acc}");
    assert!(progress(&b) > progress(&a), "the dirty workload advances");

    let o = ferry(&["status", &sock]);
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text.lines().find(|l| l.starts_with("access")).unwrap();
    assert!(
        line.contains("tracking:")
            && line.contains("minor faults/s")
            && line.contains("vCPU time lost"),
        "{line}"
    );
    eprintln!("{line}");
}

#[test]
fn access_tracking_is_on_by_default_with_sampled_writes() {
    if !kvm_usable() {
        return;
    }
    let (_vm, sock) = vm("access-default", &["--mem", "64M"]);
    let acc = status(&sock)["access"].clone();
    if acc["state"] == "failed" && acc["periods"] == 0 {
        eprintln!("SKIP: access tracking unavailable here: {}", acc["error"]);
        return;
    }
    assert_eq!(acc["state"], "tracking", "{acc}");
    assert_eq!(acc["period_ms"], 1000, "{acc}");
    assert_eq!(acc["writes"], "sample", "{acc}");
    assert_eq!(acc["grain_pages"], 64, "{acc}");
    for bad in ["3", "1024", "0"] {
        let o = ferry(&["run", "--access-grain", bad, "--duration", "1s"]);
        assert!(!o.status.success(), "--access-grain {bad} accepted");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("power of two"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn access_tracking_can_be_turned_off() {
    if !kvm_usable() {
        return;
    }
    let (_vm, sock) = vm("access-off", &["--mem", "64M", "--access-period", "0"]);
    assert!(status(&sock)["access"].is_null());
    let o = ferry(&["status", &sock]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("access      off"));
    let o = ferry(&["run", "--access-share", "0", "--duration", "1s"]);
    assert!(!o.status.success());
}
