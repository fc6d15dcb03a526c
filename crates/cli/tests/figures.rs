//! What `ferry` says is what happened (issue 56, item 5), each with an
//! answer known in advance: `ferry load` ends at its duration whatever its
//! target does and counts what it sent, and `--tls-dir` on a command that
//! opens no link of its own is refused with the reason.

mod common;
use common::kvm_usable;

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn ferry(args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry");
    (o, t.elapsed())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A listener that accepts every connection and never answers: a VM whose
/// service stopped serving. Its connections stay open while it lives.
fn silent_listener() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().flatten() {
            held.push(s);
        }
    });
    addr
}

/// An address that refuses: a port bound, then closed.
fn refusing_address() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `ferry load --duration 10s` ran 19.4 s when its VM's destination stopped
/// serving: each client waited 10 s for an answer, then 5 s to reconnect.
#[test]
fn load_ends_at_its_duration_when_nothing_answers() {
    let target = silent_listener();
    let (o, took) = two_second_load(&target, "echo");
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // Each client sent one request and waited for it to the end.
    assert_eq!(v["requests"], 4, "{v}");
    assert_eq!(v["unanswered"], 4, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["connect_failures"], 0, "{v}");
    assert_eq!(v["reconnects"], 0, "{v}");
    eprintln!("silent target: 2 s load ended after {took:?}");
}

/// `ferry load --duration 2s` of 4 clients doing `op` against `target`,
/// which must end within 3 s; what it printed and how long it took.
fn two_second_load(target: &str, op: &str) -> (Output, Duration) {
    let (o, took) = ferry(&[
        "load",
        "--target",
        target,
        "--op",
        op,
        "--clients",
        "4",
        "--duration",
        "2s",
        "--json",
        "--quiet",
    ]);
    assert!(
        took < Duration::from_secs(3),
        "a 2 s load ran {took:?}: {}",
        stderr(&o)
    );
    (o, took)
}

/// A refused connection is a failed connect, not a request: nothing was
/// sent.
#[test]
fn load_against_a_refusing_address_ends_on_time_and_sends_nothing() {
    let target = refusing_address();
    let (o, took) = two_second_load(&target, "nop");
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["requests"], 0, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert!(v["connect_failures"].as_u64().unwrap() >= 4, "{v}");
    eprintln!("refusing target: 2 s load ended after {took:?}");
}

/// Waiting for a kv guest to serve ends at --wait-ready, not 10 s later,
/// whether its VMM answers nothing or does not listen yet.
#[test]
fn load_waits_for_a_silent_guest_only_as_long_as_told() {
    let target = silent_listener();
    let (o, took) = ferry(&[
        "load",
        "--target",
        &target,
        "--wait-ready",
        "1s",
        "--duration",
        "2s",
        "--quiet",
    ]);
    assert!(!o.status.success());
    assert!(
        took < Duration::from_secs(2),
        "waited {took:?}: {}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("--wait-ready 1.0 s"), "{}", stderr(&o));
    let target = refusing_address();
    let (o, took) = ferry(&["load", "--target", &target, "--wait-ready", "1s", "--quiet"]);
    assert!(!o.status.success());
    assert!(
        (Duration::from_millis(800)..Duration::from_secs(2)).contains(&took),
        "waited {took:?}: {}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("cannot connect to"), "{}", stderr(&o));
}

/// `ferry migrate --tls-dir DIR` was accepted and changed nothing: the
/// source VMM connects with its own credentials.
#[test]
fn tls_dir_on_a_command_that_opens_no_link_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("ferry-figures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let none = dir.join("no-vm.sock");
    let none = none.to_str().unwrap();
    for (args, needle) in [
        (
            vec!["--tls-dir", d, "migrate", none, "--to", "tcp:127.0.0.1:1"],
            "--tls-dir has no effect on `ferry migrate`: the VMM at",
        ),
        (
            vec!["migrate", none, "--to", "tcp:127.0.0.1:1", "--tls-dir", d],
            "connects with its own credentials",
        ),
        (
            vec!["--tls-dir", d, "status", none],
            "--tls-dir has no effect on `ferry status`",
        ),
        (
            vec!["--tls-dir", d, "handover", none],
            "to the `ferry run` that starts a VMM",
        ),
        (
            vec!["--tls-dir", d, "load", "--target", "127.0.0.1:1"],
            "service device in plaintext",
        ),
        // --insecure likewise: the VMM's links are as it was started.
        (
            vec!["--insecure", "migrate", none, "--to", "tcp:127.0.0.1:1"],
            "--insecure has no effect on `ferry migrate`: the VMM at",
        ),
        (
            vec!["migrate", none, "--to", "tcp:127.0.0.1:1", "--insecure"],
            "give --insecure to the `ferry run` that starts a VMM",
        ),
    ] {
        let (o, _) = ferry(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
    // Where it is used (a split placed from a registry), it is accepted:
    // the command goes on to fail for another reason.
    let (o, _) = ferry(&[
        "--tls-dir",
        d,
        "migrate",
        none,
        "--mode",
        "split",
        "--registry",
        "dir:/nonexistent",
    ]);
    assert!(!stderr(&o).contains("no effect"), "{}", stderr(&o));

    // With a VMM to ask, the refusal says what it was started with.
    if kvm_usable() {
        let sock = dir.join("vm.sock");
        let sock = sock.to_str().unwrap();
        let mut vm = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["--insecure", "run", "--control", sock, "--duration", "20s"])
            .args(["--mem", "64M", "--quiet"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !std::path::Path::new(sock).exists() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (o, _) = ferry(&["--tls-dir", d, "migrate", sock, "--to", "tcp:127.0.0.1:1"]);
        let _ = vm.kill();
        let _ = vm.wait();
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("own credentials (started with --insecure)"),
            "{}",
            stderr(&o)
        );
        eprintln!("{}", stderr(&o).trim());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
