//! A memory server under attack, over real sockets: each attack of issue 32
//! is refused with a clear reason, and afterwards the server still serves
//! the legitimate owner of a VM, whose pages are intact (checked by hash).

mod common;

use std::time::{Duration, Instant};

use common::store_peer::*;
use ferry_migration::memserver::{Limits, StoreAck, StoreClient, StoreFetch, StoreHeld, StoreOpen};
use ferry_migration::protocol::{self, Hello, Kind, Role};
use ferry_migration::transport::Conn;
use ferry_migration::GpaPages;

#[test]
fn a_fetch_of_2_40_pages_is_refused_before_anything_is_allocated() {
    common::secure();
    let (_srv, at, _) = server(1024, Limits::default());
    let _owner = owner_puts(&at);
    // Its own store: a stranger may make one, but not make the server
    // collect 2^40 addresses for it.
    let (mut c, _) = raw_open(&at, &open("attacker", 0, secret(9))).unwrap();
    let ask = StoreFetch {
        runs: vec![GpaPages::new(0, 1 << 40)],
        drop: false,
    };
    c.send(Kind::StoreFetch, &ask).unwrap();
    let e = next_error(&mut c);
    assert!(e.contains("not inside VM attacker's memory"), "{e}");
    // Runs each inside the layout but more pages in all than it has.
    let (mut c, _) = raw_open(&at, &open("attacker", 0, secret(9))).unwrap();
    let ask = StoreFetch {
        runs: vec![GpaPages::new(0, 256); 3],
        drop: false,
    };
    c.send(Kind::StoreFetch, &ask).unwrap();
    let e = next_error(&mut c);
    assert!(e.contains("768 pages, over the limit of 512"), "{e}");
    owner_intact(&at);
}

#[test]
fn a_drop_that_wraps_is_refused_and_clears_nothing() {
    common::secure();
    let (srv, at, _) = server(1024, Limits::default());
    let _owner = owner_puts(&at);
    // The attacker's own pages, then a drop whose second run's bytes wrap
    // (2^52 + 1 pages of 4096 bytes is one page modulo 2^64).
    let (mut mine, _) = StoreClient::open(&at, T, &open("attacker", 0, secret(9))).unwrap();
    mine.put(&[0x1000, 0x2000], &vec![7u8; 2 * PAGE]).unwrap();
    assert_eq!(mine.sync().unwrap().held_pages, 2);
    let (mut c, _) = raw_open(&at, &open("attacker", 0, secret(9))).unwrap();
    let runs = vec![GpaPages::new(0x1000, 1), GpaPages::new(0, (1 << 52) + 1)];
    c.send(Kind::StoreDrop, &runs).unwrap();
    let e = next_error(&mut c);
    assert!(e.contains("not inside VM attacker's memory"), "{e}");
    // Checked before anything changed: the first, valid run was not
    // dropped either.
    assert_eq!(mine.sync().unwrap().held_pages, 2);
    assert!(srv.vms().contains(&("attacker".to_string(), 2)));
    owner_intact(&at);
}

#[test]
fn opens_past_the_capacity_or_with_a_huge_layout_are_refused() {
    common::secure();
    let (srv, at, _) = server(128, Limits::default());
    let _owner = owner_puts(&at); // reserves 60 of 128
    assert_eq!(srv.free_pages(), 68);
    // 16 regions of 1 TiB: refused before a bitmap is made.
    let mut huge = open("huge", 0, secret(9));
    huge.regions = (0..16u64).map(|i| (i << 41, 1 << 40)).collect();
    let e = refused(&at, &huge);
    assert!(
        e.contains("bad layout") && e.contains("maps at most"),
        "{e}"
    );
    // Overlapping regions, and 17 of them.
    huge.regions = vec![(0, 1 << 20), (1 << 19, 1 << 20)];
    let e = refused(&at, &huge);
    assert!(e.contains("overlaps"), "{e}");
    huge.regions = (0..17u64).map(|i| (i << 20, 4096)).collect();
    let e = refused(&at, &huge);
    assert!(e.contains("17 regions"), "{e}");
    // Reservations count: 68 free, so 69 is refused, 60 taken, then 9 is.
    let e = refused(&at, &open("r1", 69, secret(9)));
    assert!(e.contains("68 pages free, 69 asked for VM r1"), "{e}");
    let (_keep, ack) = raw_open(&at, &open("r1", 60, secret(9))).unwrap();
    assert_eq!(ack.free_pages, 8);
    let e = refused(&at, &open("r2", 9, secret(9)));
    assert!(e.contains("8 pages free, 9 asked for VM r2"), "{e}");
    assert_eq!(srv.free_pages(), 8, "refused opens take nothing");
    owner_intact(&at);
}

#[test]
fn a_stranger_cannot_read_write_or_drop_another_vms_pages() {
    common::secure();
    let (_srv, at, _) = server(1024, Limits::default());
    let mut owner = owner_puts(&at);
    // Knowing the VM id is not enough: another secret is refused at open,
    // before it can fetch, put or drop anything.
    for wrong in [secret(0), secret(2)] {
        let e = refused(&at, &open(OWNER_VM, 0, wrong));
        assert!(
            e.contains(&format!("not the owner of VM {OWNER_VM}")),
            "{e}"
        );
    }
    let mut flipped = secret(1);
    flipped.0[31] ^= 0x80;
    let e = StoreClient::open(&at, T, &open(OWNER_VM, 0, flipped))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not the owner"), "{e}");
    // A v8 client (no secrets) is refused outright.
    let old = Hello {
        version_min: protocol::VERSION_STORE,
        version_max: protocol::VERSION_SPLIT,
        role: Role::Store,
        session: 0,
        streams: 0,
    };
    let mut c = Conn::open(&at, T, &old).unwrap();
    c.flush().unwrap();
    let e = next_error(&mut c);
    assert!(e.contains("memory servers need protocol v9"), "{e}");
    // The owner's connection, open all along, still works, and so does a
    // new one; its pages are intact.
    let mut out = Vec::new();
    owner.fetch(&[0x5000], &mut out).unwrap();
    assert_eq!(out, content(0x5000));
    owner_intact(&at);
}

#[test]
fn silent_idle_and_excess_connections_are_closed_and_the_owner_goes_on() {
    common::secure();
    let limits = Limits {
        max_connections: 6,
        handshake: Duration::from_millis(400),
        idle: Duration::from_secs(2),
        ..Limits::default()
    };
    let (srv, at, _) = server(1024, limits);
    let owner = owner_puts(&at);
    drop(owner);
    let tcp = || std::net::TcpStream::connect(at.to_string().trim_start_matches("tcp:")).unwrap();
    // Silent TCP connections never pass the listener's gate (no TLS
    // handshake): they take no slot here, and the gate drops them.
    let silent: Vec<_> = (0..50).map(|_| tcp()).collect();
    // Connections that said Hello and nothing more fill every slot.
    let hello = store_hello();
    let said_hello = || {
        let mut c = Conn::open(&at, T, &hello).unwrap();
        c.flush().unwrap();
        c
    };
    let idle: Vec<Conn> = (0..6).map(|_| said_hello()).collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    while srv.connections_now() < 6 {
        assert!(
            Instant::now() < deadline,
            "{} slots taken",
            srv.connections_now()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // One more is told why and closed.
    let mut extra = said_hello();
    let e = next_error(&mut extra);
    assert!(e.contains("serves 6 connections already"), "{e}");
    // Those that never sent StoreOpen are closed after the handshake
    // limit, with a reason.
    let t0 = Instant::now();
    for mut c in idle {
        let _: u16 = c.recv(Kind::HelloAck).unwrap();
        let why = next_error(&mut c);
        assert!(why.contains("no Hello and StoreOpen within"), "{why:?}");
    }
    drop(silent);
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(2), "closed after {waited:?}");
    // The owner is served again; a connection of it left idle past the
    // server's limit is closed there, and reopened by the client.
    let (mut c, ack) = StoreClient::open(&at, T, &open(OWNER_VM, 0, secret(1))).unwrap();
    assert_eq!((ack.held_pages, ack.idle_secs), (60, 2));
    // Closed once 2 s passed (seen within 0.5 s), after 1 s for the
    // client to read why.
    std::thread::sleep(Duration::from_millis(4000));
    assert_eq!(srv.connections_now(), 0, "the idle connection was closed");
    let mut out = Vec::new();
    c.fetch(&[0x3000], &mut out).unwrap();
    assert_eq!(out, content(0x3000));
    owner_intact(&at);
}

/// A memory server that opens stores as a real one does and answers each
/// connection's StoreList with the next of `answers`.
type Answer = Box<dyn FnOnce(&mut Conn) + Send>;

fn lying_server(answers: Vec<Answer>) -> ferry_migration::Endpoint {
    let l = ferry_migration::Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap()).unwrap();
    let at = l.endpoint();
    std::thread::spawn(move || {
        for answer in answers {
            let Ok((mut c, hello)) = l.accept_hello(T) else {
                return;
            };
            std::thread::spawn(move || {
                let v = protocol::negotiate(&hello).unwrap();
                c.send(Kind::HelloAck, &v).unwrap();
                let _: StoreOpen = c.recv(Kind::StoreOpen).unwrap();
                let ack = StoreAck {
                    held_pages: 1,
                    free_pages: 0,
                    idle_secs: 0,
                };
                c.send(Kind::StoreAck, &ack).unwrap();
                assert_eq!(c.read_frame().unwrap().kind, Kind::StoreList);
                answer(&mut c);
                // Held open: the client must not need the close to stop.
                std::thread::sleep(Duration::from_secs(3));
            });
        }
    });
    at
}

fn held(c: &mut Conn, runs: Vec<GpaPages>, last: bool) -> bool {
    protocol::send(c.writer(), Kind::StoreHeld, &StoreHeld { runs, last }).is_ok()
        && c.flush().is_ok()
}

#[test]
fn a_lying_memory_server_cannot_make_its_client_list_without_end() {
    common::secure();
    let answers: Vec<Answer> = vec![
        // The same run again and again, never the last frame.
        Box::new(|c| {
            for _ in 0..1000 {
                if !held(c, vec![GpaPages::new(0, 1)], false) {
                    return;
                }
            }
        }),
        // Empty frames that never end.
        Box::new(|c| {
            for _ in 0..1000 {
                if !held(c, vec![], false) {
                    return;
                }
            }
        }),
        // A 32 MiB frame announced, nothing sent.
        Box::new(|c| announce(c, Kind::StoreHeld, protocol::MAX_BODY as u32)),
        // A list that says it holds 2^40 runs.
        Box::new(|c| {
            let mut count = Vec::new();
            let mut n: u64 = 1 << 40;
            while n >= 0x80 {
                count.push((n as u8) | 0x80);
                n >>= 7;
            }
            count.push(n as u8);
            let _ = c.send_frame(Kind::StoreHeld, &count);
        }),
        // A run outside the VM's memory.
        Box::new(|c| {
            held(c, vec![GpaPages::new(1 << 40, 1)], true);
        }),
    ];
    let n = answers.len();
    let at = lying_server(answers);
    let mut said = Vec::new();
    for _ in 0..n {
        let (mut c, _) = StoreClient::open(&at, T, &open(OWNER_VM, 0, secret(1))).unwrap();
        let t = Instant::now();
        let e = c.list().expect_err("the answer is refused").to_string();
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{e} after {:?}",
            t.elapsed()
        );
        said.push(e);
    }
    assert!(said[0].contains("not after the run before"), "{}", said[0]);
    assert!(
        said[1].contains("empty frame that is not the last"),
        "{}",
        said[1]
    );
    assert!(said[2].contains("limit of a list"), "{}", said[2]);
    assert!(
        said[3].contains("1099511627776 runs in one frame"),
        "{}",
        said[3]
    );
    assert!(
        said[4].contains("not inside the VM's memory"),
        "{}",
        said[4]
    );
    // A truthful server's list still comes through whole.
    let (_srv, at, _) = server(1024, Limits::default());
    let mut owner = owner_puts(&at);
    let runs = owner.list().unwrap();
    assert_eq!(ferry_migration::fuzzing::total_pages(&runs), 60);
}
