//! A memory server's own resources under attack: the memory that request
//! bodies may take, and descriptors running out. Each test measures the
//! whole process (its resident memory, its descriptor limit), so they run
//! one at a time in a binary of their own.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::store_peer::*;
use ferry_migration::memserver::limits::MAX_LIST_BODY;
use ferry_migration::memserver::{Limits, StoreClient};
use ferry_migration::protocol::{Kind, MAX_BODY};

/// One test at a time: both look at the whole process.
static ALONE: Mutex<()> = Mutex::new(());

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn bodies_announced_but_not_sent_cost_no_memory_and_the_owner_goes_on() {
    common::secure();
    let _one = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let (srv, at, _) = server(1024, Limits::default());
    let _owner = owner_puts(&at);
    let room = Limits::default().buffer_bytes;
    let before = resident_bytes();
    // 40 connections announce 32 MiB bodies (the protocol's limit), 40
    // more a body at the server's own limit for a list; none sends a byte
    // of it.
    let mut over = Vec::new();
    let mut under = Vec::new();
    for i in 0..80 {
        let (mut c, _) = raw_open(&at, &open(&format!("b{i}"), 0, secret(9))).unwrap();
        if i < 40 {
            announce(&mut c, Kind::StoreDrop, MAX_BODY as u32);
            over.push(c);
        } else {
            announce(&mut c, Kind::StoreDrop, MAX_LIST_BODY);
            under.push(c);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let grew = resident_bytes().saturating_sub(before);
    eprintln!(
        "80 connections announcing bodies: resident memory +{} MiB, buffer room {} -> {} MiB",
        grew >> 20,
        room >> 20,
        srv.buffer_room() >> 20
    );
    assert!(
        grew < 64 << 20,
        "resident memory grew by {} MiB",
        grew >> 20
    );
    for mut c in over {
        let e = next_error(&mut c);
        assert!(
            e.contains("over this memory server's 1310784-byte limit"),
            "{e}"
        );
    }
    // The others hold buffer room (not memory: each may keep 64 KiB
    // without asking) while they wait; the owner is served meanwhile.
    let held = room - srv.buffer_room();
    assert!(
        held >= 40 * (u64::from(MAX_LIST_BODY) - (64 << 10)),
        "{held}"
    );
    let t = Instant::now();
    owner_intact(&at);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    drop(under);
    let deadline = Instant::now() + Duration::from_secs(5);
    while srv.buffer_room() != room && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(srv.buffer_room(), room, "all buffer room came back");
}

fn nofile() -> libc::rlimit {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r
}

fn set_nofile(r: &libc::rlimit) {
    // SAFETY: setrlimit reads the struct we pass.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, r) }, 0);
}

#[test]
fn running_out_of_descriptors_does_not_end_the_server() {
    common::secure();
    let _one = ALONE.lock().unwrap_or_else(|e| e.into_inner());
    let (_srv, at, serving) = server(1024, Limits::default());
    let _owner = owner_puts(&at);
    let saved = nofile();
    // Every descriptor number below a low limit taken, but one: a client
    // connection takes it, and the server's accept finds none (EMFILE).
    set_nofile(&libc::rlimit {
        rlim_cur: 256,
        ..saved
    });
    let mut fillers = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        fillers.push(f);
    }
    fillers.pop();
    // The listener's gate accepts for the server: its accept fails with
    // EMFILE (logged, retried) while the descriptors are gone.
    let client = std::net::TcpStream::connect(at.to_string().trim_start_matches("tcp:"));
    std::thread::sleep(Duration::from_millis(500));
    drop(fillers);
    drop(client);
    set_nofile(&saved);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!serving.is_finished(), "the accept loop ended");
    // It serves on: the owner's pages are there, and a new VM can move in.
    owner_intact(&at);
    let (mut c, _) = StoreClient::open(&at, T, &open("after", 0, secret(3))).unwrap();
    c.put(&[0], &vec![1u8; PAGE]).unwrap();
    assert_eq!(c.sync().unwrap().held_pages, 1);
}
