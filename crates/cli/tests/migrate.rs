//! `ferry migrate` between two `ferry run` processes over TCP: the workload
//! keeps running at the destination, memory verifies, and a failed migration
//! leaves the VM running at the source, ready for a later one.

mod common;
use common::kvm_usable;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// These tests pick free ports and run several VMMs each: run them one at a
/// time so one test's VMM can never take a port another just picked.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .unwrap()
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Starts `ferry run --incoming ...` and returns once it listens (it says so
/// on stderr; probing the port instead could self-connect and steal it).
fn spawn_incoming(args: &[&str]) -> Child {
    use std::io::BufRead;
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(c.stderr.take().unwrap()).lines();
    loop {
        let line = lines
            .next()
            .expect("the destination said it listens")
            .unwrap();
        if line.contains("waiting for an incoming migration") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    c
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_status(sock: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let o = ferry(&["status", sock, "--json", "--metrics"]);
        if o.status.success() {
            return serde_json::from_slice(&o.stdout).unwrap();
        }
        assert!(Instant::now() < deadline, "no VM answered on {sock}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn progress(status: &serde_json::Value) -> u64 {
    status["metrics"]["workloads"][0]["progress"]
        .as_u64()
        .unwrap()
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    // A connect to a port nobody listens on can "succeed" by connecting the
    // socket to itself (TCP simultaneous open): only a real peer counts.
    let listening = || {
        std::net::TcpStream::connect(("127.0.0.1", port))
            .is_ok_and(|s| s.local_addr().ok() != s.peer_addr().ok())
    };
    while !listening() {
        assert!(Instant::now() < deadline, "destination never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_failed_migration_leaves_the_vm_running_and_a_later_one_succeeds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferry-mig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    let wl = "compute+dirty:rate=64,wss=32";
    let src = spawn(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--control",
        &src_sock,
        "--duration",
        "60s",
        "--json",
    ]);
    wait_status(&src_sock);

    // A destination of another shape refuses; the source keeps running.
    let bad_port = free_port();
    let bad_to = format!("tcp:127.0.0.1:{bad_port}");
    let mut bad = spawn_incoming(&[
        "run",
        "--mem",
        "64M",
        "--workload",
        wl,
        "--incoming",
        &bad_to,
    ]);
    let o = ferry(&["migrate", &src_sock, "--to", &bad_to]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("keeps running here") && err.contains("does not match"),
        "{err}"
    );
    assert!(
        !bad.wait().unwrap().success(),
        "the refusing destination exits with an error"
    );
    let a = wait_status(&src_sock);
    std::thread::sleep(Duration::from_millis(300));
    let b = wait_status(&src_sock);
    assert_eq!(b["state"], "running");
    assert!(progress(&b) > progress(&a), "the source VM still runs");

    // A matching destination: the VM moves, verified, and keeps running there.
    let port = free_port();
    let to = format!("tcp:127.0.0.1:{port}");
    let dst_sock = dir.join("dst.sock").to_string_lossy().into_owned();
    let dst = spawn_incoming(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--incoming",
        &to,
        "--control",
        &dst_sock,
        "--duration",
        "2s",
        "--json",
    ]);
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 128 * 256);
    assert!(stats["downtime_ms"].as_f64().unwrap() < 1000.0);
    let src_out = src.wait_with_output().unwrap();
    let src_summary: serde_json::Value = serde_json::from_slice(&src_out.stdout).unwrap();
    assert_eq!(src_summary["ending"], "migrated");
    let moved = progress(&wait_status(&dst_sock));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        progress(&wait_status(&dst_sock)) > moved,
        "the workload runs at the destination"
    );
    let dst_out = dst.wait_with_output().unwrap();
    assert!(dst_out.status.success());
}

#[test]
fn kv_clients_see_no_errors_across_a_migration() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferry-migkv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    let (svc_port, mig_port) = (free_port(), free_port());
    let svc = format!("127.0.0.1:{svc_port}");
    let to = format!("tcp:127.0.0.1:{mig_port}");
    let wl = "kv:workers=4,keys=4096,value=1024";
    // The source forwards its service port after the migration until killed.
    let mut src = spawn(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        &svc,
        "--control",
        &src_sock,
        "--quiet",
    ]);
    let dst = spawn_incoming(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        "127.0.0.1:0",
        "--incoming",
        &to,
        "--duration",
        "8s",
    ]);
    wait_listening(svc_port);
    let load = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "load",
            "--target",
            &svc,
            "--clients",
            "16",
            "--duration",
            "3s",
            "--json",
            "--quiet",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = load.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let _ = src.kill();
    let _ = src.wait();
    drop(dst);
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["wrong_values"], 0, "{v}");
    assert!(v["requests"].as_u64().unwrap() > 1000, "{v}");
}
