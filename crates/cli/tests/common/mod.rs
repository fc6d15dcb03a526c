//! Shared by the integration tests that need KVM.
// Each test file uses its own subset of these.
#![allow(dead_code)]

pub mod lab;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A test's scratch directory, removed when the test ends well. A failing
/// test keeps it (its logs and sockets), to be looked at.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A fresh, empty `NAME-<pid>` in the temp directory (one a run before
    /// left with the same pid is cleared) and its guard: the directory and
    /// the Scratch.
    pub fn new(name: &str) -> (PathBuf, Scratch) {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (dir.clone(), Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Removes `/tmp/PREFIX<pid>` directories of test processes that have
/// ended (a directory kept for a whole test binary cannot be removed by
/// that binary).
pub fn sweep_stale(prefix: &str) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Every ferry these tests start speaks mutual TLS on its TCP links, as a
/// host of a fleet made here once per test binary with `ferry pki` (one
/// host valid for 127.0.0.1): FERRY_TLS_DIR points at it, and children
/// inherit it. Each helper below calls this first; a test that starts
/// ferry itself calls it too.
pub fn fleet() {
    static FLEET: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    FLEET.get_or_init(|| {
        // Lives as long as the test binary: what earlier binaries left is
        // swept here instead.
        sweep_stale("ferry-cli-fleet-");
        let dir = std::env::temp_dir().join(format!("ferry-cli-fleet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (ca, host) = (dir.join("ca"), dir.join("host"));
        let bin = env!("CARGO_BIN_EXE_ferry");
        let ok = |args: &[&str]| {
            let o = Command::new(bin).args(args).output().unwrap();
            assert!(
                o.status.success(),
                "ferry {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        ok(&["pki", "init", "--dir", ca.to_str().unwrap()]);
        ok(&[
            "pki",
            "issue",
            "test-host",
            "--dir",
            ca.to_str().unwrap(),
            "--out",
            host.to_str().unwrap(),
            "--san",
            "127.0.0.1",
        ]);
        // Set before any test thread starts a child that reads it.
        std::env::set_var("FERRY_TLS_DIR", &host);
    });
}

/// Runs the ferry under test with `args` and waits for it.
pub fn ferry(args: &[&str]) -> Output {
    fleet();
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .unwrap()
}

/// A TCP port free on loopback right now, and never one this test process
/// was given before: two ports asked for in a row could otherwise be one
/// (each listener is closed before the next bind), and a VMM told to serve
/// and listen on it exits.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    fleet();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Waits until something listens on 127.0.0.1:`port`, at most `within`.
pub fn wait_listening(port: u16, within: Duration) {
    let deadline = Instant::now() + within;
    // A connect to a port nobody listens on can "succeed" by connecting the
    // socket to itself (TCP simultaneous open): only a real peer counts.
    let listening = || {
        std::net::TcpStream::connect(("127.0.0.1", port))
            .is_ok_and(|s| s.local_addr().ok() != s.peer_addr().ok())
    };
    while !listening() {
        assert!(
            Instant::now() < deadline,
            "nothing listened on 127.0.0.1:{port} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True if /dev/kvm can be opened; otherwise says loudly that the test skips.
pub fn kvm_usable() -> bool {
    fleet();
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP: /dev/kvm is not usable here ({e}); this test needs KVM");
            false
        }
    }
}

/// A process killed when dropped, so a failing test leaves no VM running.
pub struct Reaper(pub Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the ferry under test with `args`, its output discarded.
pub fn spawn_reaped(args: &[&str]) -> Reaper {
    fleet();
    Reaper(
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A 256 MiB VM with one disk (`--disk` `disk`) running `workload` for
/// up to `secs`, its control socket at `sock`, once it answers.
pub fn vm_with_disk(sock: &str, workload: &str, disk: &str, secs: u32) -> Reaper {
    let duration = format!("{secs}s");
    let vm = spawn_reaped(&[
        "run",
        "--mem",
        "256M",
        "--workload",
        workload,
        "--disk",
        disk,
        "--control",
        sock,
        "--duration",
        &duration,
    ]);
    wait_status(sock);
    vm
}

/// Every 4 KiB block of the first `mib` MiB of `image` holds a good stamp
/// of the disk workload tagged `tag` for its own block number, written at
/// least once.
pub fn assert_image_stamped(image: &std::path::Path, tag: u64, mib: u64) {
    use ferry_vmm::workload::disk::{check_block, BlockCheck};
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(image).unwrap();
    let mut block = vec![0u8; 4096];
    for lba in 0..(mib << 20) / 4096 {
        f.read_exact_at(&mut block, lba * 4096).unwrap();
        assert!(
            matches!(check_block(&block, tag, lba), BlockCheck::Good { generation } if generation >= 1),
            "block {lba}: {:?}",
            check_block(&block, tag, lba)
        );
    }
}

/// A field of the guest disk workload's check in a status (0 if absent).
pub fn disk_check(s: &serde_json::Value, field: &str) -> u64 {
    s["disk_check"][field].as_u64().unwrap_or(0)
}

/// `ferry status --json` of the VM at `sock` until `done` says so (within
/// `secs`; the last disk check and disks said if not).
pub fn disk_status_until(
    sock: &str,
    secs: u64,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let s = wait_status(sock);
        if done(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "not reached within {secs} s; last: {} {}",
            s["disk_check"],
            s["disks"]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `ferry status --json --metrics` of the VM at `sock`, once it answers
/// (within 10 s).
pub fn wait_status(sock: &str) -> serde_json::Value {
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

/// The first workload's progress counter in a [`wait_status`] answer.
pub fn progress(status: &serde_json::Value) -> u64 {
    status["metrics"]["workloads"][0]["progress"]
        .as_u64()
        .unwrap()
}

/// True if qemu-nbd (qemu-utils) is here; else says the test is skipped.
pub fn have_qemu_nbd() -> bool {
    let ok = Command::new("qemu-nbd")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: qemu-nbd is not installed (scripts/setup.sh installs qemu-utils)");
    }
    ok
}

/// Starts `ferry ARGS` (a `run --incoming`) and returns once it listens
/// (it says so on stderr; probing the port instead could self-connect and
/// steal it); the rest of its stderr is read and dropped.
pub fn spawn_listening(args: &[&str]) -> Reaper {
    fleet();
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = until_listening(&mut c);
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    Reaper(c)
}

/// Reads a `ferry run --incoming` child's stderr (piped) until it says it
/// listens; the rest of its lines, for the caller to read or drop.
pub fn until_listening(
    c: &mut Child,
) -> std::io::Lines<std::io::BufReader<std::process::ChildStderr>> {
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(c.stderr.take().unwrap()).lines();
    let mut said = String::new();
    loop {
        let Some(Ok(line)) = lines.next() else {
            panic!("the destination ended before it listened; it said:\n{said}");
        };
        if line.contains("waiting for an incoming migration") {
            return lines;
        }
        said.push_str(&line);
        said.push('\n');
    }
}
