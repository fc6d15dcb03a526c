//! Lab hosts (network namespaces made by `ferry lab up`) for the tests
//! that cross a real network stack.

use std::process::Command;

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
}
impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new(ferry()).args(["lab", "down"]).output();
    }
}

/// Brings up three lab hosts, or says why it cannot and returns None.
pub fn lab_up() -> Option<Lab> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let up = Command::new(ferry())
        .args(["lab", "up", "3"])
        .output()
        .unwrap();
    if !up.status.success() {
        eprintln!(
            "SKIP: cannot create network namespaces here: {}",
            String::from_utf8_lossy(&up.stderr)
        );
        return None;
    }
    Some(Lab { _serial: guard })
}
