//! Migrations across the network stack: lab hosts are network namespaces
//! joined by a bridge; the VM moves from ferry-h1 to ferry-h2 over TCP, and
//! load-generator clients run on ferry-h3. Each scenario of issue 4 (idle,
//! dirty at several rates, 2 vCPUs, kv under load) must pass --verify, keep
//! its workload counting at the destination and, under load, cost clients
//! no errors.

mod common;
use common::kvm_usable;

use std::process::{Child, Command, Output, Stdio};
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

/// Kills a VMM left behind by a failed assertion.
struct Reaper(Option<Child>);
impl Reaper {
    fn output(mut self) -> Output {
        self.0.take().unwrap().wait_with_output().unwrap()
    }
}
impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Scenario {
    workload: &'static str,
    vcpus: &'static str,
    /// Clients of the kv service on ferry-h3 during the migration.
    load: bool,
}

fn json(out: &[u8]) -> serde_json::Value {
    serde_json::from_slice(out)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(out)))
}

fn migrate_across(sc: &Scenario, n: u16) {
    let dir = std::env::temp_dir().join(format!("ferry-lab-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src_sock, dst_sock) = (dir.join("src.sock"), dir.join("dst.sock"));
    let (src_sock, dst_sock) = (src_sock.to_str().unwrap(), dst_sock.to_str().unwrap());
    let to = format!("tcp:10.77.0.2:{}", 7400 + n);
    let svc = format!("10.77.0.1:{}", 7500 + n);
    let common = [
        "run",
        "--mem",
        "128M",
        "--vcpus",
        sc.vcpus,
        "--workload",
        sc.workload,
        "--quiet",
        "--json",
    ];
    let mut dst = in_host("ferry-h2", &common);
    dst.args(["--incoming", &to, "--control", dst_sock, "--duration", "3s"]);
    let mut src = in_host("ferry-h1", &common);
    src.args(["--control", src_sock, "--duration", "60s"]);
    if sc.load {
        dst.args(["--serve", "10.77.0.2:0"]);
        src.args(["--serve", &svc]);
    }
    let dst = Reaper(Some(dst.stdout(Stdio::piped()).spawn().unwrap()));
    let src = Reaper(Some(src.stdout(Stdio::piped()).spawn().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(std::path::Path::new(src_sock).exists() && std::path::Path::new(dst_sock).exists()) {
        assert!(
            Instant::now() < deadline,
            "{}: VMMs did not start",
            sc.workload
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The service listens before the control socket exists.
    let load = sc.load.then(|| {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            "ferry-h3",
            ferry(),
            "load",
            "--target",
            &svc,
        ])
        .args(["--clients", "8", "--duration", "3s", "--json", "--quiet"]);
        Reaper(Some(c.stdout(Stdio::piped()).spawn().unwrap()))
    });
    std::thread::sleep(Duration::from_millis(700));
    let m = in_host(
        "ferry-h1",
        &["migrate", src_sock, "--to", &to, "--verify", "--json"],
    )
    .output()
    .unwrap();
    assert!(
        m.status.success(),
        "{}: {}",
        sc.workload,
        String::from_utf8_lossy(&m.stderr)
    );
    let stats = json(&m.stdout);
    assert_eq!(stats["verified_pages"], 128 * 256, "{}", sc.workload);
    if let Some(load) = load {
        let v = json(&load.output().stdout);
        assert_eq!(v["errors"], 0, "{}: {v}", sc.workload);
        assert_eq!(v["wrong_values"], 0, "{}: {v}", sc.workload);
        assert!(v["requests"].as_u64().unwrap() > 1000, "{v}");
    }
    let d = dst.output();
    assert!(d.status.success(), "{}: destination failed", sc.workload);
    let d = json(&d.stdout);
    assert_eq!(d["incoming"], true);
    // A source with a service keeps forwarding clients until it is killed;
    // the others end by themselves once migrated.
    if sc.load {
        drop(src);
        assert!(
            d["workloads"][0]["progress"].as_u64().unwrap() > 0,
            "{}: kv served requests at the destination",
            sc.workload
        );
        return;
    }
    let s = json(&src.output().stdout);
    assert_eq!(s["ending"], "migrated", "{}", sc.workload);
    for (i, w) in s["workloads"].as_array().unwrap().iter().enumerate() {
        if w["spec"].as_str().unwrap_or_default().starts_with("idle") {
            continue; // nothing to count
        }
        let (before, after) = (
            w["progress"].as_u64().unwrap(),
            d["workloads"][i]["progress"].as_u64().unwrap(),
        );
        assert!(
            after > before,
            "{}: workload {i} continued at the destination: {before} -> {after}",
            sc.workload
        );
    }
}

#[test]
fn vms_migrate_between_namespace_hosts_with_verification() {
    if !kvm_usable() {
        return;
    }
    let up = Command::new(ferry())
        .args(["lab", "up", "3"])
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
    let scenarios = [
        Scenario {
            workload: "idle",
            vcpus: "1",
            load: false,
        },
        Scenario {
            workload: "compute+dirty:rate=64,wss=32,pattern=random",
            vcpus: "1",
            load: false,
        },
        Scenario {
            workload: "compute+dirty:rate=256,wss=64,pattern=random",
            vcpus: "2",
            load: false,
        },
        Scenario {
            workload: "dirty:rate=1024,wss=64,pattern=random",
            vcpus: "2",
            load: false,
        },
        Scenario {
            workload: "kv:workers=2,keys=4096,value=1024",
            vcpus: "2",
            load: true,
        },
    ];
    for (n, sc) in scenarios.iter().enumerate() {
        migrate_across(sc, n as u16);
    }
}
