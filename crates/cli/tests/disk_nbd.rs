//! A VM whose disk is an export of a real NBD server (qemu-nbd from
//! qemu-utils, serving a raw image over a Unix socket), on real KVM: the
//! guest's disk workload checks every block it reads, the image behind the
//! server holds its stamped blocks, and a server killed and started again
//! under the running VM costs its guest a wait, not a bad block or an I/O
//! error. Skips loudly without qemu-nbd (scripts/setup.sh installs it).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{disk_check, disk_status_until, ferry, kvm_usable, wait_status, Scratch};

const MIB: u64 = 1 << 20;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn have_qemu_nbd() -> bool {
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

/// qemu-nbd serving `image` as export `disk` on `sock`.
fn serve(image: &Path, sock: &Path) -> Server {
    let _ = std::fs::remove_file(sock);
    let child = Command::new("qemu-nbd")
        .args([
            "-f",
            "raw",
            "-x",
            "disk",
            "--persistent",
            "--shared=8",
            "-k",
        ])
        .arg(sock)
        .arg(image)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "qemu-nbd listens within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    Server(child)
}

/// A 64 MiB image served by qemu-nbd, and a VM running `workload` on it.
fn vm_on_nbd(dir: &Path, workload: &str) -> (common::Reaper, Server, String, PathBuf, PathBuf) {
    let image = dir.join("shared.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let nbd_sock = dir.join("nbd.sock");
    let server = serve(&image, &nbd_sock);
    let sock = dir.join("vm.sock").display().to_string();
    let disk = format!("nbd+unix:///disk?socket={}", nbd_sock.display());
    let vm = common::vm_with_disk(&sock, workload, &disk, 90);
    (vm, server, sock, image, nbd_sock)
}

#[test]
fn a_vm_on_an_nbd_export_checks_every_block_and_the_image_holds_them() {
    if !kvm_usable() || !have_qemu_nbd() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-nbd");
    let (mut vm, _server, sock, image, _) = vm_on_nbd(&dir, "disk:rw=mixed,bs=4k,qd=8,mib=8");
    let first = disk_status_until(&sock, 30, |s| disk_check(s, "blocks_checked") > 300);
    std::thread::sleep(Duration::from_secs(2));
    let later = wait_status(&sock);
    assert!(disk_check(&later, "blocks_checked") > disk_check(&first, "blocks_checked"));
    assert_eq!(
        disk_check(&later, "bad_blocks"),
        0,
        "{}",
        later["disk_check"]
    );
    assert_eq!(disk_check(&later, "io_errors"), 0);
    let d = &later["disks"][0];
    assert_eq!(d["backend"], "nbd", "{d}");
    assert_eq!(d["size"].as_u64(), Some(64 * MIB));
    assert!(d["write_bytes"].as_u64().unwrap() >= 8 * MIB, "{d}");
    let tag = disk_check(&later, "tag");
    let o = ferry(&["ctl", &sock, "quit"]);
    assert!(o.status.success());
    let _ = vm.0.wait();
    // The server's image holds every block the guest wrote, stamped.
    common::assert_image_stamped(&image, tag, 8);
}

#[test]
fn an_nbd_server_killed_and_started_again_under_a_running_vm_costs_a_wait() {
    if !kvm_usable() || !have_qemu_nbd() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-nbd-restart");
    let (_vm, server, sock, image, nbd_sock) = vm_on_nbd(&dir, "disk:rw=mixed,bs=4k,qd=4,mib=4");
    disk_status_until(&sock, 30, |s| disk_check(s, "blocks_checked") > 200);
    drop(server); // killed with the guest's requests in flight
    std::thread::sleep(Duration::from_secs(2));
    let during = wait_status(&sock);
    let _server = serve(&image, &nbd_sock);
    let before = disk_check(&during, "blocks_checked");
    let after = disk_status_until(&sock, 40, |s| {
        disk_check(s, "blocks_checked") > before + 200
            && s["disks"][0]["reconnects"].as_u64() >= Some(1)
    });
    assert_eq!(
        disk_check(&after, "bad_blocks"),
        0,
        "{}",
        after["disk_check"]
    );
    assert_eq!(
        disk_check(&after, "io_errors"),
        0,
        "{}",
        after["disk_check"]
    );
    assert_eq!(after["state"], "running");
}
