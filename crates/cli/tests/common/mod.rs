//! Shared by the integration tests that need KVM.
// Each test file uses its own subset of these.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Runs the ferry under test with `args` and waits for it.
pub fn ferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .output()
        .unwrap()
}

/// A TCP port free on loopback right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
