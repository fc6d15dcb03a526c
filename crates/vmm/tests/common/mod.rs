//! Shared by the integration tests that need KVM.

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
