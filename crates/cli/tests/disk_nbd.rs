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
    if !kvm_usable() || !common::have_qemu_nbd() {
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
    if !kvm_usable() || !common::have_qemu_nbd() {
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

/// `ferry run --incoming` on `to` with the same disk and workload, once it
/// listens.
fn incoming(to: &str, sock: &str, workload: &str, disk: &str) -> common::Reaper {
    common::spawn_listening(&[
        "run",
        "--mem",
        "256M",
        "--workload",
        workload,
        "--disk",
        disk,
        "--incoming",
        to,
        "--control",
        sock,
        "--duration",
        "60s",
    ])
}

/// A VM on shared storage moves by precopy, postcopy and hybrid: the
/// destination attaches the same export, the guest's requests in flight
/// finish in the pause, its memory verifies (pages the device wrote
/// included), and its own check of every block it reads after the move
/// finds nothing lost, stale or torn; the server's image holds every block.
#[test]
fn a_vm_on_shared_nbd_storage_moves_in_every_mode_and_its_disk_checks_clean() {
    if !kvm_usable() || !common::have_qemu_nbd() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-nbd-move");
    let wl = "disk:rw=mixed,bs=4k,qd=8,mib=16";
    let (_vm, _server, mut sock, image, nbd_sock) = vm_on_nbd(&dir, wl);
    let disk = format!("nbd+unix:///disk?socket={}", nbd_sock.display());
    disk_status_until(&sock, 30, |s| disk_check(s, "blocks_checked") > 300);
    let mut tag = 0;
    let mut vms = Vec::new();
    for (i, mode) in ["precopy", "postcopy", "hybrid"].into_iter().enumerate() {
        let to = format!("tcp:127.0.0.1:{}", common::free_port());
        let dst_sock = dir.join(format!("dst{i}.sock")).display().to_string();
        vms.push(incoming(&to, &dst_sock, wl, &disk));
        let before = wait_status(&sock);
        // The last move ends with the table a person reads; the others
        // with --json.
        let json = mode != "hybrid";
        let timeline = dir.join(format!("{mode}.jsonl")).display().to_string();
        let mut args = vec!["migrate", &sock, "--to", &to, "--mode", mode, "--verify"];
        args.extend(["--timeline", &timeline]);
        if json {
            args.push("--json");
        }
        let o = ferry(&args);
        assert!(
            o.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        if json {
            let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(stats["verified_pages"], 256 * 256, "{mode}: {stats}");
            assert_eq!(stats["disk_bytes"], 0, "{mode}: {stats}");
            assert_eq!(stats["disks"][0]["how"], "shared", "{mode}: {stats}");
            assert_eq!(stats["disks"][0]["backend"], "nbd", "{mode}: {stats}");
        } else {
            let table = String::from_utf8_lossy(&o.stdout);
            let line = table
                .lines()
                .find(|l| l.starts_with("disk 0"))
                .unwrap_or_default();
            assert!(
                line.contains("nbd")
                    && line.contains("stayed on its shared storage")
                    && line.ends_with("; 0 B sent"),
                "{table}"
            );
        }
        // The timeline has each side's disk counters: the source's device
        // worked before the switch, the destination's after.
        assert_disk_io_on_both_sides(&timeline, mode);
        sock = dst_sock;
        // The guest goes on checking blocks there, on the same export.
        let at = disk_check(&wait_status(&sock), "blocks_checked");
        let after = disk_status_until(&sock, 30, |s| disk_check(s, "blocks_checked") > at + 300);
        assert_eq!(after["state"], "running", "{mode}");
        assert_eq!(after["migrations"].as_u64(), Some(i as u64 + 1), "{mode}");
        for k in ["bad_blocks", "io_errors"] {
            assert_eq!(disk_check(&after, k), 0, "{mode}: {}", after["disk_check"]);
        }
        assert!(
            disk_check(&after, "blocks_checked") > disk_check(&before, "blocks_checked"),
            "{mode}: the check's count moved with the VM"
        );
        let d = &after["disks"][0];
        assert_eq!(d["backend"], "nbd", "{d}");
        assert!(
            d["reads"].as_u64() > Some(0),
            "{mode}: the destination's device serves the guest: {d}"
        );
        tag = disk_check(&after, "tag");
    }
    let o = ferry(&["ctl", &sock, "quit"]);
    assert!(o.status.success());
    drop(vms);
    common::assert_image_stamped(&image, tag, 16);
}

/// In a migration's timeline, each side's samples carry the disk's counters
/// ([reads, writes, bytes read, bytes written]), and the guest's I/O
/// advanced them on the source (before the pause) and on the destination
/// (once it ran the VM).
fn assert_disk_io_on_both_sides(timeline: &str, mode: &str) {
    let text = std::fs::read_to_string(timeline).unwrap();
    for side in ["source", "destination"] {
        let io: Vec<Vec<u64>> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["type"] == "sample" && v["side"] == side)
            .filter_map(|v| serde_json::from_value(v["disks"][0].clone()).ok())
            .collect();
        assert!(
            !io.is_empty(),
            "{mode}: no {side} sample with disk counters"
        );
        let (first, last) = (&io[0], &io[io.len() - 1]);
        assert_eq!(first.len(), 4, "{mode}: {first:?}");
        assert!(
            last[1] > first[1] && last[3] > first[3],
            "{mode}: the {side}'s disk wrote nothing while recorded: {first:?} .. {last:?}"
        );
        assert!(io
            .windows(2)
            .all(|w| w[0].iter().zip(&w[1]).all(|(a, b)| a <= b)));
    }
}
