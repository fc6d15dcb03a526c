//! The service device end to end: a VM running the kv workload answers real
//! TCP clients (`ferry load`), and bad frames are refused without harming the
//! VM or other clients.

mod common;
use common::kvm_usable;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferry_vmm::devices::service::wire::{self, Op, Request, Response, Status};

/// A `ferry run` serving kv; stopped on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(vcpus: u32, workload: &str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args([
                "run",
                "--mem",
                "256M",
                "--vcpus",
                &vcpus.to_string(),
                "--workload",
                workload,
            ])
            .args(["--serve", "127.0.0.1:0", "--duration", "60s"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("ferry run printed its service address")
                .unwrap();
            if let Some(a) = line.strip_prefix("ferry: service device listening on ") {
                break a.trim().to_string();
            }
        };
        // Keep draining stderr so the VMM never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn load(addr: &str, args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["load", "--target", addr, "--json", "--quiet"])
        .args(args)
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON from ferry load ({e}): {}",
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

#[test]
fn kv_answers_10000_mixed_requests_from_32_clients() {
    if !kvm_usable() {
        return;
    }
    let s = Server::start(2, "kv:workers=4,keys=4096,value=512");
    let v = load(
        &s.addr,
        &[
            "--clients",
            "32",
            "--requests",
            "10000",
            "--duration",
            "60s",
        ],
    );
    assert_eq!(v["requests"], 10000, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["wrong_values"], 0, "{v}");
    assert!(
        v["sets"].as_u64().unwrap() > 500,
        "a mix of GET and SET: {v}"
    );
    assert!(v["gets"].as_u64().unwrap() > 7000, "{v}");
}

fn read_response(s: &mut TcpStream) -> Option<Response> {
    let body = wire::read_frame(s, wire::MAX_BODY).ok()??;
    Response::decode(&body).ok()
}

#[test]
fn malformed_and_oversized_frames_get_errors_and_others_keep_being_served() {
    if !kvm_usable() {
        return;
    }
    let s = Server::start(1, "kv:workers=2,keys=256,value=64");
    // Wait until the guest serves (INFO answered).
    let v = load(&s.addr, &["--clients", "1", "--requests", "10"]);
    assert_eq!(v["errors"], 0, "{v}");

    let mut good = TcpStream::connect(&s.addr).unwrap();
    good.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();

    // Unknown op in an intact frame: an error answer, connection stays usable.
    let mut bad = TcpStream::connect(&s.addr).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut frame = Request::new(Op::Get, 7, 1, 0).encode();
    frame[4] = 99;
    bad.write_all(&frame).unwrap();
    let r = read_response(&mut bad).expect("an answer to a bad op");
    assert_eq!(r.status, Status::BadRequest);
    assert!(r.message().contains("unknown op 99"), "{}", r.message());
    bad.write_all(&Request::new(Op::Get, 8, 1, 0).encode())
        .unwrap();
    let r = read_response(&mut bad).expect("the same connection still works");
    assert_eq!((r.status, r.id), (Status::Ok, 8));

    // Key out of range: the guest says so.
    bad.write_all(&Request::new(Op::Get, 9, 1 << 40, 0).encode())
        .unwrap();
    assert_eq!(read_response(&mut bad).unwrap().status, Status::BadKey);

    // Oversized frame: an error answer, then the connection is closed.
    let mut huge = TcpStream::connect(&s.addr).unwrap();
    huge.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    huge.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let r = read_response(&mut huge).expect("an answer to an oversized frame");
    assert_eq!(r.status, Status::TooLarge);
    assert!(r.message().contains("exceeds the limit"), "{}", r.message());
    let mut rest = Vec::new();
    assert_eq!(
        huge.read_to_end(&mut rest).unwrap_or(0),
        0,
        "then the connection closes"
    );

    // A truncated frame from a client that vanishes harms nobody.
    let mut cut = TcpStream::connect(&s.addr).unwrap();
    cut.write_all(&[200, 0, 0, 0, 1, 2, 3]).unwrap();
    drop(cut);

    // Meanwhile the well-behaved client is answered, with a correct value.
    good.write_all(&Request::new(Op::Get, 1, 5, 0).encode())
        .unwrap();
    let r = read_response(&mut good).expect("the good client is served");
    assert_eq!(r.status, Status::Ok);
    assert_eq!(r.value, wire::value(64, 5, r.seed));
    let v = load(&s.addr, &["--clients", "4", "--requests", "500"]);
    assert_eq!(
        (v["errors"].as_u64(), v["wrong_values"].as_u64()),
        (Some(0), Some(0)),
        "{v}"
    );
}
