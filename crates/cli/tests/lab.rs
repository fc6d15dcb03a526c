//! A migration across the network stack: two lab hosts (network namespaces
//! joined by a bridge), the VM moves from ferry-h1 to ferry-h2 over TCP.

mod common;
use common::kvm_usable;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ferry() -> &'static str {
    env!("CARGO_BIN_EXE_ferry")
}

fn in_host(host: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", host, ferry()]).args(args);
    c
}

struct Lab;
impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new(ferry()).args(["lab", "down"]).output();
    }
}

#[test]
fn vm_migrates_between_namespace_hosts_with_verification() {
    if !kvm_usable() {
        return;
    }
    let up = Command::new(ferry())
        .args(["lab", "up", "2"])
        .output()
        .unwrap();
    if !up.status.success() {
        eprintln!(
            "SKIP: cannot create network namespaces here: {}",
            String::from_utf8_lossy(&up.stderr)
        );
        return;
    }
    let _lab = Lab;
    let dir = std::env::temp_dir().join(format!("ferry-lab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src_sock, dst_sock) = (dir.join("src.sock"), dir.join("dst.sock"));
    let (src_sock, dst_sock) = (src_sock.to_str().unwrap(), dst_sock.to_str().unwrap());
    let wl = "compute+dirty:rate=64,wss=32,pattern=random";
    let dst = in_host(
        "ferry-h2",
        &[
            "run",
            "--mem",
            "128M",
            "--workload",
            wl,
            "--quiet",
            "--json",
        ],
    )
    .args([
        "--incoming",
        "tcp:10.77.0.2:7400",
        "--control",
        dst_sock,
        "--duration",
        "2s",
    ])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let src = in_host(
        "ferry-h1",
        &[
            "run",
            "--mem",
            "128M",
            "--workload",
            wl,
            "--quiet",
            "--json",
        ],
    )
    .args(["--control", src_sock, "--duration", "60s"])
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(std::path::Path::new(src_sock).exists() && std::path::Path::new(dst_sock).exists()) {
        assert!(Instant::now() < deadline, "VMMs did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let m = in_host(
        "ferry-h1",
        &[
            "migrate",
            src_sock,
            "--to",
            "tcp:10.77.0.2:7400",
            "--verify",
            "--json",
        ],
    )
    .output()
    .unwrap();
    assert!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&m.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 128 * 256);
    let s: serde_json::Value =
        serde_json::from_slice(&src.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(s["ending"], "migrated");
    let d = dst.wait_with_output().unwrap();
    assert!(d.status.success());
    let d: serde_json::Value = serde_json::from_slice(&d.stdout).unwrap();
    let (before, after) = (
        s["workloads"][0]["progress"].as_u64().unwrap(),
        d["workloads"][0]["progress"].as_u64().unwrap(),
    );
    assert!(
        after > before,
        "compute continued at the destination: {before} -> {after}"
    );
    assert_eq!(d["incoming"], true);
}
