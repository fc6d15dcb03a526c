//! `ferry migrate` between two `ferry run` processes over TCP: the workload
//! keeps running at the destination, memory verifies, and a failed migration
//! leaves the VM running at the source, ready for a later one.

mod common;
use common::{ferry, free_port, kvm_usable, progress, wait_listening, wait_status};

use ferry_vmm::devices::service::wire::{self, Op, Request, Response, Status};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// These tests pick free ports and run several VMMs each: run them one at a
/// time so one test's VMM can never take a port another just picked.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Kills its VMM when dropped, so a failing test leaves no VM running.
struct Reaper(Option<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(args: &[&str]) -> Child {
    spawn_env(args, &[])
}

fn spawn_env(args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Starts `ferry run --incoming ...` and returns once it listens (it says so
/// on stderr; probing the port instead could self-connect and steal it).
fn spawn_incoming(args: &[&str]) -> Child {
    spawn_incoming_logged(args).0
}

/// As [`spawn_incoming`], also keeping what the destination prints on stderr.
fn spawn_incoming_logged(args: &[&str]) -> (Child, std::sync::Arc<std::sync::Mutex<String>>) {
    spawn_incoming_logged_env(args, &[])
}

/// [`spawn_incoming_logged`] with `env` added to the VMM's environment.
fn spawn_incoming_logged_env(
    args: &[&str],
    env: &[(&str, &str)],
) -> (Child, std::sync::Arc<std::sync::Mutex<String>>) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = common::until_listening(&mut c);
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let l = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let mut l = l.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    (c, log)
}

#[test]
fn a_failed_migration_leaves_the_vm_running_and_a_later_one_succeeds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-mig");
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    let wl = "compute+dirty:rate=64,wss=32";
    let src = spawn(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--control",
        &src_sock,
        "--duration",
        "60s",
        "--json",
    ]);
    wait_status(&src_sock);

    // A destination of another shape refuses; the source keeps running.
    let bad_port = free_port();
    let bad_to = format!("tcp:127.0.0.1:{bad_port}");
    let mut bad = spawn_incoming(&[
        "run",
        "--mem",
        "64M",
        "--workload",
        wl,
        "--incoming",
        &bad_to,
    ]);
    let o = ferry(&["migrate", &src_sock, "--to", &bad_to]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("keeps running here") && err.contains("does not match"),
        "{err}"
    );
    // The refusing destination goes on waiting for a source that fits (a
    // mistaken or hostile peer never ends the wait, issue 32).
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        bad.try_wait().unwrap().is_none(),
        "the refusing destination still waits"
    );
    let _ = bad.kill();
    let _ = bad.wait();
    let a = wait_status(&src_sock);
    std::thread::sleep(Duration::from_millis(300));
    let b = wait_status(&src_sock);
    assert_eq!(b["state"], "running");
    assert!(progress(&b) > progress(&a), "the source VM still runs");

    // A matching destination: the VM moves, verified, and keeps running
    // there (over a Unix socket: the same session as TCP, on one host).
    let to = format!("unix:{}", dir.join("in.sock").display());
    let dst_sock = dir.join("dst.sock").to_string_lossy().into_owned();
    let dst = spawn_incoming(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--incoming",
        &to,
        "--control",
        &dst_sock,
        "--duration",
        "2s",
        "--json",
    ]);
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 128 * 256);
    assert!(stats["downtime_ms"].as_f64().unwrap() < 1000.0);
    let src_out = src.wait_with_output().unwrap();
    let src_summary: serde_json::Value = serde_json::from_slice(&src_out.stdout).unwrap();
    assert_eq!(src_summary["ending"], "migrated");
    let moved = progress(&wait_status(&dst_sock));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        progress(&wait_status(&dst_sock)) > moved,
        "the workload runs at the destination"
    );
    let dst_out = dst.wait_with_output().unwrap();
    assert!(dst_out.status.success());
}

#[test]
fn kv_clients_see_no_errors_across_a_migration() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-migkv");
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    let (svc_port, mig_port) = (free_port(), free_port());
    let svc = format!("127.0.0.1:{svc_port}");
    let to = format!("tcp:127.0.0.1:{mig_port}");
    let wl = "kv:workers=4,keys=4096,value=1024";
    // The source forwards its service port after the migration until killed.
    let _src = Reaper(Some(spawn(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        &svc,
        "--control",
        &src_sock,
        "--duration",
        "120s",
        "--quiet",
    ])));
    let _dst = Reaper(Some(spawn_incoming(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        "127.0.0.1:0",
        "--incoming",
        &to,
        "--duration",
        "8s",
    ])));
    wait_listening(svc_port, Duration::from_secs(10));
    let load = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "load",
            "--target",
            &svc,
            "--clients",
            "16",
            "--duration",
            "3s",
            "--json",
            "--quiet",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = load.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["wrong_values"], 0, "{v}");
    assert!(v["requests"].as_u64().unwrap() > 1000, "{v}");
}

/// Sends `req` on a new connection to `addr` and reads one answer (None if
/// the connection closed first); the stream stays open for more.
fn ask(s: &mut std::net::TcpStream, req: &Request) -> Option<Response> {
    use std::io::Write;
    s.write_all(&req.encode()).unwrap();
    let body = wire::read_frame(s, wire::MAX_BODY).ok()??;
    Some(Response::decode(&body).unwrap())
}

/// A request still in the guest's ring when the source pauses, with the
/// clients forwarded (no `--vm-address`): the pause does not wait for the
/// guest to answer it (it spins 2.5 s, past the 2 s a drain would wait);
/// the destination's guest answers it and the source hands the answer to
/// its client. A stranger cannot collect answers from the destination.
#[test]
fn a_request_in_flight_at_the_pause_is_answered_from_the_destination() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-miginflight");
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    let (svc_port, dst_svc_port, mig_port) = (free_port(), free_port(), free_port());
    let svc = format!("127.0.0.1:{svc_port}");
    let dst_svc = format!("127.0.0.1:{dst_svc_port}");
    let to = format!("tcp:127.0.0.1:{mig_port}");
    let wl = "kv:workers=4,keys=1024,value=64";
    let _src = Reaper(Some(spawn(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        &svc,
        "--control",
        &src_sock,
        "--duration",
        "60s",
        "--quiet",
    ])));
    let _dst = Reaper(Some(spawn_incoming(&[
        "run",
        "--mem",
        "128M",
        "--vcpus",
        "2",
        "--workload",
        wl,
        "--serve",
        &dst_svc,
        "--incoming",
        &to,
        "--duration",
        "30s",
    ])));
    wait_listening(svc_port, Duration::from_secs(10));
    let mut client = std::net::TcpStream::connect(&svc).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while ask(&mut client, &Request::new(Op::Info, 1, 0, 0))
        .unwrap()
        .status
        != Status::Ok
    {
        assert!(Instant::now() < deadline, "the guest's kv never got ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    // 2.5 s of guest time: surely in the ring when the VM pauses.
    use std::io::Write;
    client
        .write_all(&Request::new(Op::Slow, 42, 0, 2500).encode())
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let asked = Instant::now();
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let downtime = stats["downtime_ms"].as_f64().unwrap();
    assert!(
        downtime < 1000.0,
        "the pause waited for the guest: {downtime} ms"
    );
    let detail = stats["clients"]["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("1 request in flight at the pause answered there"),
        "{detail}"
    );
    let body = wire::read_frame(&mut client, wire::MAX_BODY)
        .unwrap()
        .unwrap();
    let answer = Response::decode(&body).unwrap();
    assert_eq!(
        (answer.status, answer.op, answer.id),
        (Status::Ok, Op::Slow as u8, 42)
    );
    assert!(asked.elapsed() < Duration::from_secs(15));
    // The client's connection goes on, forwarded to the destination.
    let r = ask(&mut client, &Request::new(Op::Get, 43, 7, 0)).unwrap();
    assert_eq!((r.status, r.id, r.key), (Status::Ok, 43, 7));
    // A stranger asking the destination for held answers is refused and
    // let go, token or no token.
    for (key, seed) in [(0, 0), (u64::MAX, 1)] {
        let mut stranger = std::net::TcpStream::connect(&dst_svc).unwrap();
        stranger
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let r = ask(&mut stranger, &Request::new(Op::Collect, 9, key, seed)).unwrap();
        assert_eq!(r.status, Status::BadRequest, "{r:?}");
        assert!(ask(&mut stranger, &Request::new(Op::Info, 10, 0, 0)).is_none());
    }
}

/// Forwards TCP connections from `listen` to `to`, flipping one byte of the
/// source-to-destination stream once `after` bytes have passed on one connection.
fn corrupting_proxy(to: u16, after: usize) -> u16 {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let flipped = Arc::new(AtomicBool::new(false));
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { break };
            let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", to)) else {
                continue;
            };
            let (mut c_r, mut c_w) = (client.try_clone().unwrap(), client);
            let (mut s_r, mut s_w) = (server.try_clone().unwrap(), server);
            let flipped = flipped.clone();
            std::thread::spawn(move || {
                let (mut buf, mut seen) = (vec![0u8; 65536], 0usize);
                while let Ok(n) = c_r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if seen + n > after && !flipped.swap(true, Ordering::SeqCst) {
                        let i = after.saturating_sub(seen).min(n - 1);
                        buf[i] ^= 0x40;
                    }
                    seen += n;
                    if s_w.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_w.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_r, &mut c_w);
            });
        }
    });
    port
}

#[test]
fn a_dead_destination_or_a_corrupt_frame_leaves_the_vm_running() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-migfail");
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    // 384 MiB of incompressible memory: round 0 takes long enough to interrupt.
    let wl = "compute+fill:content=worst,mib=384";
    let _src = Reaper(Some(spawn(&[
        "run",
        "--mem",
        "512M",
        "--workload",
        wl,
        "--control",
        &src_sock,
        "--duration",
        "120s",
        "--quiet",
    ])));
    wait_status(&src_sock);
    std::thread::sleep(Duration::from_millis(1500));
    let still_running = |what: &str| {
        let a = wait_status(&src_sock);
        std::thread::sleep(Duration::from_millis(300));
        let b = wait_status(&src_sock);
        assert_eq!(b["state"], "running", "after {what}");
        assert!(
            progress(&b) > progress(&a),
            "the source VM still runs after {what}"
        );
    };

    // 1. The destination is killed in the middle of the copy.
    let port = free_port();
    let to = format!("tcp:127.0.0.1:{port}");
    let mut dst = spawn_incoming(&["run", "--mem", "512M", "--workload", wl, "--incoming", &to]);
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        let _ = dst.kill();
        let _ = dst.wait();
    });
    // Paced so the copy is surely still running when the kill comes (an
    // unpaced loopback copy can end within 150 ms on an idle machine).
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--bandwidth", "200M"]);
    killer.join().unwrap();
    assert!(
        !o.status.success(),
        "migration to a killed destination must fail"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("keeps running here"));
    still_running("a killed destination");

    // 2. One byte flipped on the wire after 1 MiB.
    let port = free_port();
    let (dst, dst_log) = spawn_incoming_logged(&[
        "run",
        "--mem",
        "512M",
        "--workload",
        wl,
        "--incoming",
        &format!("tcp:127.0.0.1:{port}"),
    ]);
    let proxy = corrupting_proxy(port, 1 << 20);
    let o = ferry(&[
        "migrate",
        &src_sock,
        "--to",
        &format!("tcp:127.0.0.1:{proxy}"),
    ]);
    assert!(
        !o.status.success(),
        "a corrupt stream must fail the migration"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("keeps running here"), "{err}");
    let d = dst.wait_with_output().unwrap();
    assert!(
        !d.status.success(),
        "the destination refuses the corrupt stream and starts nothing"
    );
    std::thread::sleep(Duration::from_millis(100));
    let log = dst_log.lock().unwrap().clone();
    // Over TLS the record's authentication tag catches the flip before the
    // frame's CRC can (plaintext links: "checksum mismatch", tested in the
    // engine's frame tests).
    assert!(
        log.contains("decrypt") || log.contains("checksum mismatch"),
        "destination said: {log}"
    );
    still_running("a corrupt frame");
}

/// A real guest dirtying text-like pages, migrated compressed: memory
/// verifies page by page, the workload keeps running at the destination,
/// and the codec really carried the pages.
#[test]
fn compressed_migrations_verify_and_the_workload_continues() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-cmig");
    let wl = "dirty:rate=64,wss=32,pattern=random,content=text+fill:content=mixed,mib=32";
    for (i, extra) in [
        &["--compress", "xbzrle", "--compress-threads", "2"][..],
        &["--compress", "auto", "--bandwidth", "200M"][..],
        &["--compress", "zstd:3", "--no-pipeline"][..],
        &["--compress", "dedup", "--compress-backend", "cuda"][..],
    ]
    .iter()
    .enumerate()
    {
        let src_sock = dir
            .join(format!("src{i}.sock"))
            .to_string_lossy()
            .into_owned();
        let dst_sock = dir
            .join(format!("dst{i}.sock"))
            .to_string_lossy()
            .into_owned();
        let src = running_source(wl, &src_sock);
        let port = free_port();
        let to = format!("tcp:127.0.0.1:{port}");
        let dst = Reaper(Some(spawn_incoming(&[
            "run",
            "--mem",
            "128M",
            "--workload",
            wl,
            "--incoming",
            &to,
            "--control",
            &dst_sock,
            "--duration",
            "2s",
            "--json",
        ])));
        let stats = migrate_verified(&src_sock, &to, extra, &format!("{extra:?}"));
        let c = &stats["compression"];
        // With a GPU the CUDA backend coded it (the verify above checked it);
        // without one the CPU did, and the summary says why.
        if extra.contains(&"cuda") && c["backend"] != "cuda" {
            let note = c["backend_note"].as_str().unwrap_or_default();
            eprintln!("{note}");
            assert!(note.contains("CUDA backend cannot run"), "{c}");
        }
        if extra[1] != "auto" {
            assert!(
                c["encoded_in"].as_u64().unwrap() > c["encoded_out"].as_u64().unwrap(),
                "{extra:?}: {c}"
            );
        }
        let moved = progress(&wait_status(&dst_sock));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            progress(&wait_status(&dst_sock)) > moved,
            "{extra:?}: the workload runs at the destination"
        );
        drop(src);
        drop(dst);
    }
    // Bad values are refused before anything moves.
    let o = ferry(&[
        "migrate",
        "/nonexistent.sock",
        "--to",
        "tcp:127.0.0.1:1",
        "--compress",
        "gzip",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("gzip"));
}

#[test]
fn a_source_killed_mid_postcopy_is_reported_plainly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-pckill");
    let src_sock = dir.join("src.sock").to_string_lossy().into_owned();
    // 256 MiB written once (pushed at 16 MB/s after the switch: seconds),
    // and a small working set the guest keeps faulting on.
    let wl = "fill:content=worst,mib=256+dirty:rate=32,wss=16,pattern=random";
    let vm = ["run", "--mem", "512M", "--workload", wl, "--json"];
    let src = Reaper(Some(spawn(
        &[&vm[..], &["--control", &src_sock, "--duration", "60s"]].concat(),
    )));
    wait_status(&src_sock);
    std::thread::sleep(Duration::from_millis(1500));
    let to = format!("tcp:127.0.0.1:{}", free_port());
    let dst_sock = dir.join("dst.sock").to_string_lossy().into_owned();
    let (dst, log) = spawn_incoming_logged(
        &[
            &vm[..],
            &[
                "--incoming",
                &to,
                "--control",
                &dst_sock,
                "--reconnect-timeout",
                "2s",
            ],
        ]
        .concat(),
    );
    let mut dst = Reaper(Some(dst));
    // Slow enough that the push takes seconds.
    let mut m = Reaper(Some(
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["migrate", &src_sock, "--to", &to, "--mode", "postcopy"])
            .args(["--bandwidth", "16M", "--json"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    // The VM runs there before its memory has arrived.
    while wait_status(&dst_sock)["state"] != "running" {
        assert!(Instant::now() < deadline, "postcopy never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !log.lock().unwrap().contains("migration received"),
        "postcopy ended before the source could be killed"
    );
    std::thread::sleep(Duration::from_millis(500));
    drop(src); // SIGKILL: the source and every page only it held are gone.
    let deadline = Instant::now() + Duration::from_secs(45);
    let status = loop {
        if let Some(s) = dst.0.as_mut().unwrap().try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the destination hangs after losing its source: {}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let log = log.lock().unwrap().clone();
    // It waited for the source to come back first, then said what it lost.
    assert!(
        log.contains("postcopy paused")
            && log.contains("did not come back")
            && log.contains("pages never arrived")
            && log.contains("the VM started here is stopped"),
        "{log}"
    );
    let _ = m.0.as_mut().unwrap().wait();
}

/// A VMM waiting for its migration populates its RAM in the background by
/// default (--prealloc waiting) (status shows how far), stops when a source is
/// admitted, gives that memory back when the source says at the opening
/// that it may switch (a postcopy needs the pages still to come missing),
/// and a postcopy into it (which would see zeros where a late populate
/// refilled them) moves the VM whole.
#[test]
fn a_waiting_vmm_preallocates_in_the_background_and_a_postcopy_into_it_is_whole() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-mig-prealloc");
    let sock = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let (src_sock, dst_sock) = (sock("src.sock"), sock("dst.sock"));
    let wl = "fill:content=worst,mib=96+dirty:rate=32,wss=16";
    let mut src = spawn(&[
        "run",
        "--mem",
        "256M",
        "--workload",
        wl,
        "--control",
        &src_sock,
        "--duration",
        "60s",
        "--prealloc",
        "off",
    ]);
    let to = format!("tcp:127.0.0.1:{}", free_port());
    let mut dst = spawn_incoming(&[
        "run",
        "--mem",
        "256M",
        "--workload",
        wl,
        "--incoming",
        &to,
        "--control",
        &dst_sock,
        "--duration",
        "2s",
    ]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = wait_status(&dst_sock);
        assert_eq!(st["state"], "waiting", "{st}");
        let p = &st["preallocated"];
        if p["bytes"] == 256u64 << 20 && p["running"] == false {
            break;
        }
        assert!(Instant::now() < deadline, "never preallocated: {st}");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_status(&src_sock);
    std::thread::sleep(Duration::from_millis(1500));
    let o = ferry(&[
        "migrate", &src_sock, "--to", &to, "--mode", "postcopy", "--verify", "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 256 * 256, "{stats}");
    // The destination gave its populated RAM back at the opening (v13), so
    // the pause did not punch it out page by page.
    assert_eq!(stats["destination_released_bytes"], 256u64 << 20, "{stats}");
    let _ = src.wait();
    let _ = dst.kill();
    let _ = dst.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 128 MiB source VMM running `wl` behind control socket `sock`, its
/// workload under way (half a second past its first status).
fn running_source(wl: &str, sock: &str) -> Reaper {
    let src = Reaper(Some(spawn(&[
        "run",
        "--mem",
        "128M",
        "--workload",
        wl,
        "--control",
        sock,
        "--duration",
        "60s",
        "--json",
    ])));
    wait_status(sock);
    std::thread::sleep(Duration::from_millis(500));
    src
}

/// Migrates the VM at `src_sock` to `to` with `--verify` and `extra`;
/// returns its JSON stats, once it succeeded and verified all of a
/// 128 MiB VM's pages (`what` names the case in a failure).
fn migrate_verified(src_sock: &str, to: &str, extra: &[&str], what: &str) -> serde_json::Value {
    let mut args = vec!["migrate", src_sock, "--to", to, "--verify", "--json"];
    args.extend_from_slice(extra);
    let o = ferry(&args);
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 128 * 256, "{what}");
    stats
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A VM whose data another VM on the destination's host already holds
/// (both run with --share-pages; protocol v14) moves with those pages sent
/// as references: a fraction of the bytes on the wire, and memory still
/// verifies page for page at the destination.
#[test]
fn pages_another_vm_on_the_destination_holds_are_not_sent_again() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-mig-share");
    let sock = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let (sib_sock, src_sock, dst_sock) = (sock("sib.sock"), sock("src.sock"), sock("dst.sock"));
    let share = sock("share");
    let env = [("FERRY_SHARE_DIR", share.as_str())];
    // The same data set in both (the guest's fill is seeded alike).
    let (wl, mib) = ("fill:content=worst,mib=96", 96u64);
    let run = |sock: &str| -> Vec<String> {
        [
            "run",
            "--mem",
            "256M",
            "--workload",
            wl,
            "--control",
            sock,
            "--duration",
            "60s",
        ]
        .map(String::from)
        .to_vec()
    };
    let mut sib_args = run(&sib_sock);
    sib_args.push("--share-pages".into());
    let _sibling = Reaper(Some(spawn_env(&strs(&sib_args), &env)));
    // The source does not share: only the destination's host counts.
    let src = Reaper(Some(spawn(&strs(&run(&src_sock)))));
    let to = format!("tcp:127.0.0.1:{}", free_port());
    let mut dst_args = run(&dst_sock);
    dst_args.extend(["--incoming".into(), to.clone(), "--share-pages".into()]);
    let dst = Reaper(Some(spawn_incoming_logged_env(&strs(&dst_args), &env).0));
    for s in [&sib_sock, &src_sock] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while progress(&wait_status(s)) < mib << 20 {
            assert!(Instant::now() < deadline, "{s} never filled its memory");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let o = ferry(&["migrate", &src_sock, "--to", &to, "--verify", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stats["verified_pages"], 256 * 256, "{stats}");
    let data_pages = mib << 8;
    let offered = stats["shared_offered"].as_u64().unwrap();
    let shared = stats["shared_pages"].as_u64().unwrap();
    assert!(offered >= data_pages, "{stats}");
    assert!(shared >= data_pages * 95 / 100, "{stats}");
    // What went on the wire is what the sibling did not hold: the guest's
    // own pages, not the data set.
    let bytes = stats["bytes"].as_u64().unwrap();
    assert!(bytes < (mib << 20) / 5, "{bytes} bytes sent: {stats}");
    // The VM runs on at the destination, with its data.
    let st = wait_status(&dst_sock);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(progress(&st), mib << 20, "{st}");
    drop(src);
    drop(dst);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A precopy leaves out a dirty page whose bytes are those it last sent:
/// a guest that rewrites its pages with what they held (zeros over zeros)
/// has its rounds after the first made almost only of such pages. One that
/// writes random bytes has only those it wrote before round 0 sent them
/// and not since (the log still holds them dirty): about 0.1 here. Memory
/// verifies either way: a page wrongly left out would differ from what the
/// source sent last.
#[test]
fn pages_dirtied_without_a_change_are_not_sent_again() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return;
    }
    let (dir, _scratch) = common::Scratch::new("ferry-same");
    for content in ["zero", "random"] {
        // (The fill makes round 0 long enough for the guest to dirty pages.)
        let wl = format!(
            "dirty:rate=512,wss=32,pattern=random,content={content}+fill:content=worst,mib=64"
        );
        let src_sock = dir
            .join(format!("src-{content}.sock"))
            .to_string_lossy()
            .into_owned();
        let src = running_source(&wl, &src_sock);
        let to = format!("tcp:127.0.0.1:{}", free_port());
        let dst = Reaper(Some(spawn_incoming(&[
            "run",
            "--mem",
            "128M",
            "--workload",
            &wl,
            "--incoming",
            &to,
            "--duration",
            "2s",
            "--json",
        ])));
        let stats = migrate_verified(&src_sock, &to, &[], content);
        // Every round after the first: pages sent (with data or as zero
        // ranges) against pages left out.
        let rounds = stats["rounds"].as_array().unwrap();
        let field = |r: &serde_json::Value, f: &str| r[f].as_u64().unwrap();
        let (mut sent, mut same) = (0, 0);
        for r in &rounds[1..] {
            sent += field(r, "pages") + field(r, "zero_pages");
            same += field(r, "unchanged_pages");
        }
        assert_eq!(
            same,
            field(&stats, "unchanged_pages"),
            "{content}: the rounds add up"
        );
        assert_eq!(
            field(&rounds[0], "unchanged_pages"),
            0,
            "nothing sent before"
        );
        let share = same as f64 / (same + sent).max(1) as f64;
        eprintln!("{content}: {same} pages left out, {sent} sent again ({share:.3})");
        if content == "zero" {
            assert!(same >= 200, "{content}: {same} left out, {sent} sent");
            assert!(share > 0.9, "{content}: {share}");
            // Its rounds cost the link nothing: auto-converge leaves it be.
            for r in rounds {
                assert_eq!(field(r, "throttle_pct"), 0, "{content}: {r}");
            }
        } else {
            assert!(same + sent >= 200, "{content}: rounds after the first");
            assert!(share < 0.5, "{content}: {share}");
        }
        drop(src);
        drop(dst);
    }
}
