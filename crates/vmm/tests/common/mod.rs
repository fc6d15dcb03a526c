//! Shared by the integration tests that need KVM.
// Each test file uses its own subset of these.
#![allow(dead_code)]

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

/// Every test's TCP links speak mutual TLS, as ferry's do: a throwaway
/// fleet (one CA, one host valid for 127.0.0.1) made once per test binary
/// and installed as this process's security.
pub fn secure() {
    static FLEET: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    FLEET.get_or_init(|| {
        // One per test binary, made anew each run (named after the process,
        // test runs would leave one each).
        let exe = std::env::current_exe().ok();
        let name = exe.as_deref().and_then(|e| e.file_stem());
        let name = name.map_or("tests".into(), |s| s.to_string_lossy().into_owned());
        let dir = std::env::temp_dir().join(format!("ferry-test-fleet-vmm-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        let fleet = ferry_migration::transport::Security::local_fleet(&dir).expect("a test fleet");
        ferry_migration::transport::install(fleet);
    });
}
