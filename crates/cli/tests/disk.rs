//! A VM with a virtio-blk disk (docs/disks.md), on real KVM: the guest's
//! disk workload checks every block it reads against what it wrote, the
//! image on the host holds its stamped blocks, a block corrupted behind
//! the guest's back is counted bad, the device's byte counters match what
//! the workload did, and a VM with a disk refuses to migrate or be handed
//! over (disk migration is not built yet).

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::{disk_check, disk_status_until, ferry, kvm_usable, wait_status, Reaper, Scratch};

const MIB: u64 = 1 << 20;

/// Starts a VM with one disk (created, 64 MiB) running `workload`.
fn start(dir: &Path, workload: &str) -> (Reaper, String, String) {
    let sock = dir.join("vm.sock").display().to_string();
    let image = dir.join("disk.img").display().to_string();
    let disk = format!("{image},size=64M,create");
    let vm = common::vm_with_disk(&sock, workload, &disk, 60);
    (vm, sock, image)
}

fn quit(sock: &str) {
    let o = ferry(&["ctl", sock, "quit"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn the_disk_workload_checks_every_block_and_the_image_holds_its_stamps() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-mixed");
    let (mut vm, sock, image) = start(&dir, "disk:rw=mixed,bs=4k,qd=8,mib=8");
    let first = disk_status_until(&sock, 20, |s| disk_check(s, "blocks_checked") > 500);
    std::thread::sleep(Duration::from_secs(2));
    let later = wait_status(&sock);
    let (c0, c1) = (
        disk_check(&first, "blocks_checked"),
        disk_check(&later, "blocks_checked"),
    );
    assert!(c1 > c0 + 500, "blocks_checked {c0} -> {c1} in 2 s");
    assert_eq!(
        disk_check(&later, "bad_blocks"),
        0,
        "{}",
        later["disk_check"]
    );
    assert_eq!(disk_check(&later, "io_errors"), 0);
    assert!(later["disk_check"]["iops"].as_f64().unwrap() > 100.0);
    let disk = &later["disks"][0];
    assert_eq!(disk["backend"], "raw");
    assert_eq!(disk["size"].as_u64(), Some(64 * MIB));
    assert!(disk["write_bytes"].as_u64().unwrap() >= 8 * MIB, "{disk}");
    assert!(disk["read_bytes"].as_u64().unwrap() > 0, "{disk}");
    assert_eq!(disk["bad_requests"].as_u64(), Some(0));
    let tag = disk_check(&later, "tag");
    quit(&sock);
    let _ = vm.0.wait();
    // Every block of the 8 MiB it uses was written at least once (the
    // fill), so every one holds a good stamp for its own block number.
    common::assert_image_stamped(Path::new(&image), tag, 8);
    let f = std::fs::File::open(&image).unwrap();
    let mut block = vec![0u8; 4096];
    // Past what it uses, the image is untouched.
    f.read_exact_at(&mut block, 8 * MIB).unwrap();
    assert!(block.iter().all(|b| *b == 0));
}

#[test]
fn a_block_corrupted_behind_the_guests_back_is_counted_bad() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-corrupt");
    // 1 MiB: 256 blocks, so random reads come back to the bad one soon.
    let (_vm, sock, image) = start(&dir, "disk:rw=randread,bs=4k,qd=4,mib=1");
    let s = disk_status_until(&sock, 20, |s| {
        s["disk_check"]["phase"] == "run" && disk_check(s, "blocks_checked") > 100
    });
    assert_eq!(disk_check(&s, "bad_blocks"), 0, "{}", s["disk_check"]);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap();
    f.write_all_at(&[0x5a; 4096], 17 * 4096).unwrap();
    f.sync_data().unwrap();
    let s = disk_status_until(&sock, 20, |s| disk_check(s, "bad_blocks") > 0);
    assert_eq!(disk_check(&s, "first_bad_lba"), 18, "{}", s["disk_check"]);
    assert_eq!(
        disk_check(&s, "bad_lost"),
        disk_check(&s, "bad_blocks"),
        "{}",
        s["disk_check"]
    );
    quit(&sock);
}

#[test]
fn seqwrite_of_m_mib_writes_m_mib_and_reads_it_back() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-seq");
    let (_vm, sock, _image) = start(&dir, "disk:rw=seqwrite,bs=4k,qd=16,mib=4");
    let s = disk_status_until(&sock, 30, |s| s["disk_check"]["phase"] == "done");
    let d = &s["disks"][0];
    assert_eq!(d["write_bytes"].as_u64(), Some(4 * MIB), "{d}");
    assert_eq!(d["writes"].as_u64(), Some(1024), "{d}");
    assert_eq!(d["read_bytes"].as_u64(), Some(4 * MIB), "{d}");
    assert_eq!(d["reads"].as_u64(), Some(1024), "{d}");
    assert_eq!(disk_check(&s, "blocks_written"), 1024);
    assert_eq!(disk_check(&s, "blocks_checked"), 1024);
    assert_eq!(disk_check(&s, "bad_blocks"), 0);
    assert_eq!(s["metrics"]["workloads"][0]["result"].as_u64(), Some(1));
    quit(&sock);
}

#[test]
fn a_vm_with_a_local_disk_refuses_to_migrate() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-stay");
    let (_vm, sock, image) = start(&dir, "disk:rw=randwrite,bs=4k,qd=4,mib=4");
    disk_status_until(&sock, 20, |s| disk_check(s, "blocks_written") > 100);
    // Nothing listens there: a migration that started would fail to
    // connect; this one must be refused before that, with the reason.
    let to = format!("tcp:127.0.0.1:{}", common::free_port());
    let o = ferry(&["migrate", &sock, "--to", &to]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("moving a local disk is not built yet"),
        "{err}"
    );
    // Nor does a destination take a local image.
    let o = ferry(&["run", "--incoming", &to, "--disk", &image]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("a local image cannot move yet"), "{err}");
    // The VM runs on here, writing.
    let before = disk_check(&wait_status(&sock), "blocks_written");
    let s = disk_status_until(&sock, 10, |s| {
        disk_check(s, "blocks_written") > before + 100
    });
    assert_eq!(s["state"], "running");
    assert_eq!(s["migrations"].as_u64(), Some(0));
    quit(&sock);
}

/// A handover (same host) takes the disk with the VM: the new process opens
/// the same image, the requests in flight finish in the pause, and the
/// guest's driver goes on with the new process's device; its own check of
/// every block it reads finds nothing lost, stale or torn.
#[test]
fn a_vm_with_a_local_disk_is_handed_over_with_it() {
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = Scratch::new("ferry-disk-handover");
    let (_vm, sock, image) = start(&dir, "disk:rw=mixed,bs=4k,qd=8,mib=8");
    disk_status_until(&sock, 20, |s| disk_check(s, "blocks_checked") > 300);
    for round in 0..2 {
        let before = wait_status(&sock);
        let o = ferry(&["handover", &sock, "--verify", "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let figures: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(figures["verified_pages"].as_u64() > Some(0), "{figures}");
        let at = disk_check(&wait_status(&sock), "blocks_checked");
        let after = disk_status_until(&sock, 20, |s| disk_check(s, "blocks_checked") > at + 300);
        assert_eq!(after["state"], "running");
        assert_ne!(
            after["pid"], before["pid"],
            "round {round}: another process runs it"
        );
        for k in ["bad_blocks", "io_errors"] {
            assert_eq!(
                disk_check(&after, k),
                0,
                "round {round}: {}",
                after["disk_check"]
            );
        }
        assert!(disk_check(&after, "blocks_checked") > disk_check(&before, "blocks_checked"));
        let d = &after["disks"][0];
        let canonical = std::fs::canonicalize(&image).unwrap();
        assert_eq!(d["path"], canonical.display().to_string(), "{d}");
        assert!(d["reads"].as_u64() > Some(0), "{d}");
    }
    let tag = disk_check(&wait_status(&sock), "tag");
    quit(&sock);
    std::thread::sleep(Duration::from_millis(300));
    common::assert_image_stamped(Path::new(&image), tag, 8);
}
