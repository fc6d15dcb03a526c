//! The `ferry` binary as a user meets it: bad input gets a clear error and a
//! non-zero exit (never a panic); a good run prints its summary and JSON.

mod common;
use common::kvm_usable;

use std::process::{Command, Output};
use std::time::Duration;

fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .expect("run ferry")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs ferry and checks it failed cleanly with `needle` in its message.
fn refused(args: &[&str], needle: &str) {
    let o = ferry(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected '{needle}' in: {err}"
    );
}

#[test]
fn bad_flags_and_specs_are_refused_clearly() {
    refused(
        &["run", "--workload", "dirt"],
        "valid workloads: idle, dirty, memtouch",
    );
    refused(
        &["run", "--workload", "dirty:speed=4"],
        "valid: rate, wss, pattern, content, tasks",
    );
    refused(
        &["run", "--workload", "sort:mib=x"],
        "expected MiB, at least 1",
    );
    refused(&["run", "--mem", "12Q"], "is not a size");
    refused(&["run", "--duration", "forever"], "is not a duration");
    refused(&["run", "--mem", "16M", "--duration", "1s"], "too small");
    refused(
        &["run", "--mem", "67108865", "--duration", "1s"],
        "multiple of the 4 KiB page",
    );
    refused(&["run", "--vcpus", "9", "--duration", "1s"], "out of range");
    refused(
        &["run", "--kvm", "/nonexistent/kvm", "--duration", "1s"],
        "cannot open /nonexistent/kvm",
    );
    refused(
        &["run", "--kernel", "/nonexistent.elf", "--duration", "1s"],
        "cannot read guest kernel",
    );
    refused(
        &["status", "/nonexistent/ferry.sock"],
        "no VM answers on /nonexistent/ferry.sock",
    );
}

#[test]
fn a_malformed_kernel_is_refused() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-cli");
    let bad = dir.join("bad.elf");
    std::fs::write(&bad, b"\x7fELF garbage that is not a kernel").unwrap();
    refused(
        &["run", "--kernel", bad.to_str().unwrap(), "--duration", "1s"],
        "not a valid ELF",
    );
    refused(
        &["run", "--kernel", "/bin/true", "--duration", "1s"],
        "guest kernel",
    );
}

#[test]
fn sort_run_reports_json() {
    if !kvm_usable() {
        return;
    }
    let o = ferry(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        "sort:mib=8",
        "--json",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON summary on stdout");
    assert_eq!(v["ending"], "workloads_done");
    assert_eq!(v["workloads"][0]["result"], "ok");
    assert_eq!(v["workloads"][0]["tasks_done"], 1);
    assert!(v["boot_to_first_sample_ms"].as_f64().unwrap() < 1000.0);
}

#[test]
fn run_writes_a_timeline_and_status_answers() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-tl");
    let tl = dir.join("t.jsonl");
    let sock = dir.join("vm.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "run",
            "--mem",
            "64M",
            "--workload",
            "compute",
            "--duration",
            "3s",
            "--quiet",
        ])
        .arg("--timeline")
        .arg(&tl)
        .arg("--control")
        .arg(&sock)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = None;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        let o = ferry(&["status", sock.to_str().unwrap(), "--json"]);
        if o.status.success() {
            status = Some(serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap());
            break;
        }
    }
    let status = status.expect("ferry status answers while the VM runs");
    assert_eq!(status["state"], "running");
    assert_eq!(status["workloads"], "compute");
    assert!(child.wait().unwrap().success());
    let text = std::fs::read_to_string(&tl).unwrap();
    let samples: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 10 ms samples over ~3 s; a loaded machine may miss some.
    assert!(samples.len() > 150, "only {} samples", samples.len());
    let first = samples[0]["progress"][0].as_u64().unwrap();
    let last = samples.last().unwrap()["progress"][0].as_u64().unwrap();
    assert!(
        last > first,
        "compute progress advances across the timeline"
    );
}

/// An idle VM whose RAM is all populated costs the host next to no CPU.
/// The samplers read the guest's metrics page 100 times a second, asking
/// first whether it holds data; asked with a SEEK_HOLE, the kernel walked
/// every populated page after it, and such a VM (or a destination that
/// populated while it waited) kept more than a core busy.
#[test]
fn an_idle_vm_with_all_its_ram_populated_leaves_the_cpu_alone() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-idle-cpu");
    let sock = dir.join("vm.sock").to_string_lossy().into_owned();
    let vm = common::spawn_reaped(&[
        "run",
        "--mem",
        "1G",
        "--prealloc",
        "now",
        "--workload",
        "idle",
        "--duration",
        "30s",
        "--quiet",
        "--control",
        &sock,
    ]);
    // It populates its RAM before it boots ("waiting" until then).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = common::wait_status(&sock);
        if status["state"] == "running" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never ran: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let cpu_s = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", vm.0.id())).unwrap();
        // After the command's closing parenthesis come fields 3 (state)
        // on; utime and stime are fields 14 and 15, in clock ticks (100 a
        // second on Linux's x86 ABI).
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        ticks as f64 / 100.0
    };
    let before = cpu_s();
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_s() - before;
    // Idle: ~0.01 s of CPU in 3 s; with the SEEK_HOLE, ~4 s.
    assert!(
        used < 0.6,
        "an idle 1 GiB VM used {used:.2} s of CPU in 3 s"
    );
}

/// A command that runs `ferry args` as uid/gid 65534 (nobody), or None
/// (saying why) where this test cannot switch users.
fn as_nobody(args: &[&str]) -> Option<Command> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: running ferry as another uid needs root");
        return None;
    }
    let found = |name: &str| {
        ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(name))
            .find(|p| p.exists())
    };
    let ferry = env!("CARGO_BIN_EXE_ferry");
    if let Some(setpriv) = found("setpriv") {
        let mut c = Command::new(setpriv);
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", ferry]);
        c.args(args);
        return Some(c);
    }
    if let Some(runuser) = found("runuser") {
        let mut c = Command::new(runuser);
        // nobody is uid 65534 on Debian and its kin.
        c.args(["-u", "nobody", "--", ferry]).args(args);
        return Some(c);
    }
    eprintln!(
        "SKIP: neither setpriv nor runuser is installed (util-linux); cannot act as another uid"
    );
    None
}

/// Issue 32: a VMM's control socket serves its own user and root, never
/// another uid. As it is made (0600) another uid cannot even connect, and
/// `ferry` says whose socket it is; loosened by hand (0666), the VMM
/// checks the caller's uid and refuses every request, a `quit` included.
/// The owner (root here) is served throughout and the guest runs on.
#[test]
fn the_control_socket_refuses_another_uid_and_serves_its_owner() {
    if !kvm_usable() {
        return;
    }
    // A directory another uid may pass through (temp_dir is 1777).
    let (dir, _scratch) = common::Scratch::new("ferry-cli-uid");
    let sock = dir.join("vm.sock");
    let sock_s = sock.to_str().unwrap();
    let Some(mut probe) = as_nobody(&["ctl", sock_s, "status"]) else {
        return;
    };
    let _vm = common::spawn_reaped(&[
        "run",
        "--mem",
        "64M",
        "--workload",
        "dirty:rate=16,wss=8",
        "--control",
        sock_s,
        "--duration",
        "60s",
    ]);
    let before = common::progress(&common::wait_status(sock_s));
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&sock).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the socket is owner-only");

    let o = probe.output().unwrap();
    let err = stderr(&o);
    eprintln!("uid 65534, socket 0600: {}", err.trim());
    assert!(
        !o.status.success(),
        "uid 65534 got an answer: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains(sock_s)
            && err.contains("not open to uid 65534")
            && err.contains("uid 0, the socket's owner")
            && err.contains("permission denied"),
        "{err}"
    );

    // The mode loosened after the fact: the VMM itself refuses.
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    for action in ["status", "quit"] {
        let o = as_nobody(&["ctl", sock_s, action])
            .unwrap()
            .output()
            .unwrap();
        let err = stderr(&o);
        eprintln!("uid 65534, socket 0666, {action}: {}", err.trim());
        assert!(!o.status.success(), "{action} as uid 65534 was served");
        assert!(
            err.contains("serves its own user (uid 0) and root, not uid 65534"),
            "{action}: {err}"
        );
    }

    // The owner is still served, and the refused `quit` did nothing.
    std::thread::sleep(Duration::from_millis(300));
    let after = common::wait_status(sock_s);
    assert_eq!(after["state"], "running", "{after}");
    assert!(common::progress(&after) > before, "the guest ran on");
    let o = ferry(&["ctl", sock_s, "status", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
}
