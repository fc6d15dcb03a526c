//! Builds the test guest (freestanding C, system gcc and ld) with the crate,
//! so `cargo build` yields a ferry that carries its own guest kernel.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let guest = manifest.join("../../guest");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("guest");
    println!("cargo:rerun-if-changed={}", guest.display());
    for dir in ["include", "lib", "kernel", "user"] {
        println!("cargo:rerun-if-changed={}", guest.join(dir).display());
    }
    let status = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&guest)
        .arg(format!("O={}", out.display()))
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run make to build the guest (install make and gcc): {e}")
        });
    assert!(
        status.success(),
        "building the guest kernel failed (see the gcc output above)"
    );
}
