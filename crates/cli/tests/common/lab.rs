//! Lab hosts (network namespaces made by `ferry lab up`) for the tests
//! that cross a real network stack.

use std::process::{Command, Stdio};

/// The ferry under test.
pub fn ferry() -> &'static str {
    env!("CARGO_BIN_EXE_ferry")
}

/// Runs ferry on lab host `host`, as that host: its own certificate is at
/// /etc/ferry/tls there (`ferry lab up` put it), so the test binary's own
/// FERRY_TLS_DIR (for loopback tests) must not reach it.
pub fn in_host(host: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", host, ferry()]).args(args);
    c.env_remove("FERRY_TLS_DIR");
    c
}

/// The lab hosts, taken down when dropped. One test at a time holds them:
/// the tests of a binary share the same namespaces (and cargo runs test
/// binaries one after another).
pub struct Lab {
    _serial: std::sync::MutexGuard<'static, ()>,
    /// The lab's lock, held for the test: `bench/chaos.py` and other lab
    /// users on this machine take it too (closing the file releases it).
    _lock: std::fs::File,
}
impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new(ferry()).args(["lab", "down"]).output();
    }
}

/// Where every user of the lab's namespaces takes turns (flock).
pub const LAB_LOCK: &str = "/tmp/ferry-lab.lock";

/// Waits for the lab's lock and holds it while the file lives.
fn lab_lock() -> std::fs::File {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LAB_LOCK)
        .unwrap();
    // SAFETY: flock on an fd this function owns; it blocks until the lock
    // is free and has no memory effects.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(
        r,
        0,
        "flock {LAB_LOCK}: {}",
        std::io::Error::last_os_error()
    );
    f
}

/// Brings up three lab hosts, or says why it cannot and returns None.
pub fn lab_up() -> Option<Lab> {
    lab_up_n(3)
}

/// Brings up `n` lab hosts, or says why it cannot and returns None.
pub fn lab_up_n(n: u32) -> Option<Lab> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lock = lab_lock();
    let up = Command::new(ferry())
        .args(["lab", "up", &n.to_string()])
        .output()
        .unwrap();
    if !up.status.success() {
        eprintln!(
            "SKIP: cannot create network namespaces here: {}",
            String::from_utf8_lossy(&up.stderr)
        );
        return None;
    }
    Some(Lab {
        _serial: guard,
        _lock: lock,
    })
}

/// A real etcd on lab host ferry-h3 (10.77.0.3:2379) over mutual TLS: its
/// certificate from the lab CA, and only clients with a lab host's
/// certificate served (`--client-cert-auth`); its data in `dir`. The
/// process and the registry address (`etcds://…`), or None without an
/// etcd binary.
pub fn tls_etcd_on_h3(dir: &std::path::Path) -> Option<(std::process::Child, String)> {
    let etcd = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    // etcd over mutual TLS (issue 32): its certificate from the lab
    // CA, and only clients with a lab host's certificate served.
    let tls = dir.join("etcd-tls");
    pki(&[
        "issue",
        "etcd-lab",
        "--dir",
        "/run/ferry-lab/ca",
        "--out",
        tls.to_str().unwrap(),
        "--san",
        "10.77.0.3",
    ]);
    let file = |f: &str| tls.join(f).to_str().unwrap().to_string();
    let data = dir.join("etcd");
    let c = Command::new("ip")
        .args(["netns", "exec", "ferry-h3", etcd, "--name", "lab"])
        .args(["--data-dir", data.to_str().unwrap()])
        .args([
            "--listen-client-urls",
            "https://10.77.0.3:2379",
            "--advertise-client-urls",
            "https://10.77.0.3:2379",
        ])
        .args([
            "--listen-peer-urls",
            "http://10.77.0.3:2380",
            "--initial-advertise-peer-urls",
            "http://10.77.0.3:2380",
        ])
        .args(["--initial-cluster", "lab=http://10.77.0.3:2380"])
        .args([
            "--cert-file",
            &file("cert.pem"),
            "--key-file",
            &file("key.pem"),
        ])
        .args(["--trusted-ca-file", &file("ca.pem"), "--client-cert-auth"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Some((c, "etcds://10.77.0.3:2379".to_string()))
}

/// `ferry pki ARGS`, which must succeed.
pub fn pki(args: &[&str]) {
    let o = Command::new(ferry())
        .arg("pki")
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "ferry pki {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}
