//! ferry's NBD client against the real servers a fleet would run:
//! `qemu-nbd` (qemu-utils) serving a raw image over a Unix socket and
//! `nbdkit` serving memory over TCP, plaintext and TLS. What is written
//! is read back and found in the image itself; refusals are said; a server
//! killed and started again under a client costs a wait, not an error.
//! Each test says loudly and skips when its server is not installed
//! (scripts/setup.sh installs both).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_nbd::client::Options;
use ferry_nbd::{Client, NbdError, NbdUri};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn have(tool: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        eprintln!("SKIPPED: {tool} is not installed (scripts/setup.sh installs it)");
    }
    found
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-nbd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// qemu-nbd serving `image` (raw) as export `disk` on `sock`.
fn qemu_nbd(image: &Path, sock: &Path) -> Server {
    let _ = std::fs::remove_file(sock);
    let child = Command::new("qemu-nbd")
        .args([
            "-f",
            "raw",
            "-x",
            "disk",
            "--persistent",
            "--shared=4",
            "--cache=none",
            "-k",
        ])
        .arg(sock)
        .arg(image)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("qemu-nbd listens", || sock.exists());
    Server(child)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// nbdkit serving `size` of memory on 127.0.0.1:`port`, with `extra`
/// flags before the plugin.
fn nbdkit(port: u16, size: &str, extra: &[&str]) -> Server {
    let child = Command::new("nbdkit")
        .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string()])
        .args(extra)
        .args(["memory", size])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("nbdkit listens", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    Server(child)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn unix(sock: &Path) -> NbdUri {
    NbdUri::parse(&format!("nbd+unix:///disk?socket={}", sock.display())).unwrap()
}

#[test]
fn what_is_written_through_qemu_nbd_is_in_the_image() {
    if !have("qemu-nbd") {
        return;
    }
    let dir = scratch("qemu");
    let image = dir.join("disk.raw");
    std::fs::write(&image, vec![0xeeu8; 8 << 20]).unwrap();
    let sock = dir.join("nbd.sock");
    let _server = qemu_nbd(&image, &sock);
    let c = Client::connect(&unix(&sock), None, Options::default()).unwrap();
    let e = c.export();
    assert_eq!(e.size, 8 << 20);
    assert!(e.flush && !e.read_only, "{e:?}");

    // A write larger than one request, at an odd place, then flushed.
    let data = pattern(7, 3 << 20 | 4096);
    c.write_at(&data, 1 << 20, false).unwrap();
    c.write_at(&pattern(9, 512), 512, true).unwrap();
    c.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_at(&mut back, 1 << 20).unwrap();
    assert!(back == data, "read back what was written");
    let on_disk = std::fs::read(&image).unwrap();
    assert!(
        on_disk[1 << 20..(1 << 20) + data.len()] == data[..],
        "in the image"
    );
    assert_eq!(on_disk[512..1024], pattern(9, 512)[..]);
    assert_eq!(on_disk[0], 0xee, "untouched bytes stay");

    // Zeroes and discards read back as zeroes.
    c.write_zeroes(1 << 20, 64 << 10).unwrap();
    let mut z = vec![1u8; 64 << 10];
    c.read_at(&mut z, 1 << 20).unwrap();
    assert!(z.iter().all(|&b| b == 0));
    c.trim(2 << 20, 1 << 20).unwrap();

    // Requests the export cannot take are refused before they are sent.
    let mut one = [0u8; 1];
    let e = c.read_at(&mut one, 8 << 20).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    assert!(c.write_at(&[0], u64::MAX, false).is_err());
    // The link is still good after a refusal.
    c.read_at(&mut one, 0).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_export_and_a_stranger_are_refused_in_words() {
    if !have("qemu-nbd") {
        return;
    }
    let dir = scratch("refused");
    let image = dir.join("disk.raw");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let sock = dir.join("nbd.sock");
    let _server = qemu_nbd(&image, &sock);
    let uri = NbdUri::parse(&format!("nbd+unix:///nope?socket={}", sock.display())).unwrap();
    let e = Client::connect(&uri, None, Options::default())
        .err()
        .unwrap();
    assert!(
        matches!(e, NbdError::Refused { .. }) && e.to_string().contains("nope"),
        "{e}"
    );
    // Something that is not an NBD server.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        use std::io::Write;
        let (mut s, _) = listener.accept().unwrap();
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
    });
    let uri = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/x")).unwrap();
    let e = Client::connect(&uri, None, Options::default())
        .err()
        .unwrap();
    assert!(matches!(e, NbdError::NotNbd(_)), "{e}");
    t.join().unwrap();
    // Nobody there.
    let uri = NbdUri::parse(&format!("nbd://127.0.0.1:{}/x", free_port())).unwrap();
    let e = Client::connect(&uri, None, Options::default())
        .err()
        .unwrap();
    assert!(e.is_link_break(), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_server_killed_and_started_again_costs_a_wait_not_an_error() {
    if !have("qemu-nbd") {
        return;
    }
    let dir = scratch("restart");
    let image = dir.join("disk.raw");
    std::fs::write(&image, vec![0u8; 4 << 20]).unwrap();
    let sock = dir.join("nbd.sock");
    let server = qemu_nbd(&image, &sock);
    let c = Client::connect(&unix(&sock), None, Options::default()).unwrap();
    c.write_at(&pattern(1, 4096), 0, true).unwrap();
    drop(server); // killed
    let (image2, sock2) = (image.clone(), sock.clone());
    let again = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        qemu_nbd(&image2, &sock2)
    });
    // Issued while nobody serves: it waits for the server, then lands.
    let t = Instant::now();
    c.write_at(&pattern(2, 4096), 8192, true).unwrap();
    let waited = t.elapsed();
    let _server = again.join().unwrap();
    assert!(waited >= Duration::from_millis(1000), "waited {waited:?}");
    assert_eq!(c.reconnects(), 1);
    let on_disk = std::fs::read(&image).unwrap();
    assert_eq!(on_disk[..4096], pattern(1, 4096)[..]);
    assert_eq!(on_disk[8192..12288], pattern(2, 4096)[..]);
    // A server that stays away fails the request after the bound.
    drop(_server);
    let c = {
        let s = qemu_nbd(&image, &sock);
        let opts = Options {
            timeout: Duration::from_secs(2),
            reconnect_within: Duration::from_secs(1),
        };
        let c = Client::connect(&unix(&sock), None, opts).unwrap();
        drop(s);
        c
    };
    let e = c.write_at(&pattern(3, 512), 0, false).unwrap_err();
    assert!(e.is_link_break(), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nbdkit_over_tcp_and_a_read_only_export() {
    if !have("nbdkit") {
        return;
    }
    let port = free_port();
    let _server = nbdkit(port, "16M", &[]);
    let uri = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap();
    let c = Client::connect(&uri, None, Options::default()).unwrap();
    assert_eq!(c.export().size, 16 << 20);
    let data = pattern(5, 1 << 20);
    c.write_at(&data, 4096, false).unwrap();
    c.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_at(&mut back, 4096).unwrap();
    assert!(back == data);

    let port = free_port();
    let _ro = nbdkit(port, "1M", &["-r"]);
    let uri = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap();
    let c = Client::connect(&uri, None, Options::default()).unwrap();
    assert!(c.export().read_only);
    let e = c.write_at(&[1], 0, false).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
}

#[test]
fn nbdkit_with_tls_takes_ferrys_certificates_and_refuses_plaintext() {
    if !have("nbdkit") {
        return;
    }
    let dir = scratch("tls");
    let host = ferry_tls::pki::local_fleet(&dir, "store").unwrap();
    // nbdkit's names for the same files.
    let kit = dir.join("nbdkit");
    std::fs::create_dir_all(&kit).unwrap();
    for (from, to) in [
        ("ca.pem", "ca-cert.pem"),
        ("cert.pem", "server-cert.pem"),
        ("key.pem", "server-key.pem"),
    ] {
        std::fs::copy(host.join(from), kit.join(to)).unwrap();
    }
    let port = free_port();
    let certs = format!("--tls-certificates={}", kit.display());
    let _server = nbdkit(port, "4M", &["--tls=require", &certs, "--tls-verify-peer"]);
    let creds = ferry_tls::Credentials::load(&host).unwrap();
    let uri = NbdUri::parse(&format!("nbds://127.0.0.1:{port}/")).unwrap();
    let c = Client::connect(&uri, Some(Arc::clone(&creds)), Options::default()).unwrap();
    c.write_at(&pattern(4, 65536), 0, false).unwrap();
    let mut back = vec![0u8; 65536];
    c.read_at(&mut back, 0).unwrap();
    assert!(back == pattern(4, 65536));
    // Plaintext to a server that requires TLS: told to use nbds://.
    let plain = NbdUri::parse(&format!("nbd://127.0.0.1:{port}/")).unwrap();
    let e = Client::connect(&plain, None, Options::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("nbds://"), "{e}");
    // nbds:// without credentials is a clear error, before any traffic.
    let e = Client::connect(&uri, None, Options::default())
        .err()
        .unwrap();
    assert!(matches!(e, NbdError::Tls(_)), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
