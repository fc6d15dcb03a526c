//! Shared storage as the papers ran it, on lab hosts: the disk image on a
//! storage host (ferry-h3, served by a real qemu-nbd over TCP), the VM on
//! ferry-h1 moving to ferry-h2 by precopy and then postcopy across the lab
//! link. Its guest writes every block of 64 MiB of disk first and checks
//! every block it reads; its RAM is mostly empty. After each move the guest
//! checks more blocks, none bad; RAM verifies; and the migration sent far
//! less than the disk holds: nothing of the disk crossed the link.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::lab::{in_host, lab_up};
use common::{disk_check, disk_status_until, kvm_usable, wait_status, Reaper, Scratch};

const MIB: u64 = 1 << 20;
const NBD: &str = "nbd://10.77.0.3:10809/disk";

/// qemu-nbd on the storage host, serving `image` as `disk` on its TCP port.
fn storage_host(image: &std::path::Path) -> Reaper {
    let server = Command::new("ip")
        .args([
            "netns", "exec", "ferry-h3", "qemu-nbd", "-f", "raw", "-x", "disk",
        ])
        .args([
            "--persistent",
            "--shared=8",
            "-b",
            "10.77.0.3",
            "-p",
            "10809",
        ])
        .arg(image)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect_timeout(
        &"10.77.0.3:10809".parse().unwrap(),
        Duration::from_millis(200),
    )
    .is_err()
    {
        // (The test runs outside the namespaces: the lab's bridge routes it.)
        assert!(Instant::now() < deadline, "qemu-nbd listens within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    Reaper(server)
}

fn wait_for_socket(sock: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::path::Path::new(sock).exists() {
        assert!(Instant::now() < deadline, "{sock}: the VMM did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_vm_on_a_storage_hosts_nbd_export_moves_between_lab_hosts_and_its_disk_stays() {
    if !kvm_usable() || !common::have_qemu_nbd() {
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = Scratch::new("ferry-disk-lab");
    let image = dir.join("shared.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let _server = storage_host(&image);
    let wl = "disk:rw=mixed,bs=4k,qd=8,mib=64";
    let vm = [
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--disk",
        NBD,
        "--quiet",
    ];
    let mut sock = dir.join("h1.sock").display().to_string();
    let _src = Reaper(
        in_host("ferry-h1", &vm)
            .args(["--control", &sock, "--duration", "120s"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_socket(&sock);
    // Every block written once (the fill), and some checked after.
    disk_status_until(&sock, 60, |s| {
        disk_check(s, "blocks_written") >= 64 * MIB / 4096 && disk_check(s, "blocks_checked") > 300
    });
    let mut vms = Vec::new();
    let hops = [
        ("precopy", "ferry-h2", "10.77.0.2"),
        ("postcopy", "ferry-h1", "10.77.0.1"),
    ];
    for (i, (mode, host, ip)) in hops.into_iter().enumerate() {
        let to = format!("tcp:{ip}:{}", 7460 + i);
        let dst_sock = dir.join(format!("{host}-{i}.sock")).display().to_string();
        vms.push(Reaper(
            in_host(host, &vm)
                .args([
                    "--incoming",
                    &to,
                    "--control",
                    &dst_sock,
                    "--duration",
                    "120s",
                ])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        ));
        wait_for_socket(&dst_sock);
        let from = if i == 0 { "ferry-h1" } else { "ferry-h2" };
        let o = in_host(from, &["migrate", &sock, "--to", &to, "--mode", mode])
            .args(["--verify", "--json"])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(stats["verified_pages"], 128 * 256, "{mode}: {stats}");
        let sent = stats["bytes"].as_u64().unwrap();
        eprintln!(
            "{mode} {from} -> {host}: {:.1} MiB sent for a VM with 64 MiB written on its disk, downtime {:.2} ms",
            sent as f64 / MIB as f64,
            stats["downtime_ms"].as_f64().unwrap()
        );
        // Its disk holds 64 MiB the guest wrote; a move that copied it
        // would send at least that much.
        assert!(sent < 32 * MIB, "{mode}: {sent} bytes sent: {stats}");
        sock = dst_sock;
        let at = disk_check(&wait_status(&sock), "blocks_checked");
        let after = disk_status_until(&sock, 30, |s| disk_check(s, "blocks_checked") > at + 300);
        assert_eq!(after["state"], "running", "{mode}");
        for k in ["bad_blocks", "io_errors"] {
            assert_eq!(disk_check(&after, k), 0, "{mode}: {}", after["disk_check"]);
        }
        assert_eq!(
            after["disks"][0]["path"]
                .as_str()
                .map(|p| p.contains("10.77.0.3")),
            Some(true)
        );
    }
    let tag = disk_check(&wait_status(&sock), "tag");
    let o = common::ferry(&["ctl", &sock, "quit"]);
    assert!(o.status.success());
    drop(vms);
    common::assert_image_stamped(&image, tag, 64);
}
