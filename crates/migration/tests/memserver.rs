//! A memory server on loopback, through the client the engine uses: pages
//! put, synced, fetched back intact, dropped, listed; the capacity holds;
//! strangers and bad frames get a clear refusal and the server lives on.

mod common;

use std::io::Write;
use std::time::Duration;

use ferry_migration::memserver::{StoreClient, StoreOpen, StoreSecret};
use ferry_migration::protocol::{self, Hello, Kind, Role};
use ferry_migration::transport::Conn;
use ferry_migration::GpaPages;

const PAGE: usize = 4096;
const T: Duration = Duration::from_secs(5);

fn open(vm: &str, reserve: u64) -> StoreOpen {
    StoreOpen {
        vm: vm.into(),
        regions: vec![(0, 1 << 20), (1 << 32, 1 << 20)],
        reserve_pages: reserve,
        secret: secret(vm),
    }
}

/// The owner's secret of test VM `vm` (fixed, so every connection of the
/// test opens as the owner).
fn secret(vm: &str) -> StoreSecret {
    let mut b = [0x5a; 32];
    for (i, c) in vm.bytes().enumerate() {
        b[i % 32] ^= c;
    }
    StoreSecret(b)
}

/// Page `gpa`'s test content.
fn content(gpa: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (gpa >> 12) as u8 ^ (i as u8).wrapping_mul(7))
        .collect()
}

#[test]
fn pages_round_trip_and_the_capacity_holds() {
    common::secure();
    let (srv, at) = common::mem_server(64);
    let (mut a, ack) = StoreClient::open(&at, T, &open("vm1", 40)).unwrap();
    // The reservation is kept for vm1: no one else may take it.
    assert_eq!((ack.held_pages, ack.free_pages), (0, 24));
    let gpas: Vec<u64> = (0..40u64)
        .map(|i| {
            if i < 20 {
                i * 0x1000
            } else {
                (1 << 32) + i * 0x1000
            }
        })
        .collect();
    let data: Vec<u8> = gpas.iter().flat_map(|&g| content(g)).collect();
    a.put(&gpas, &data).unwrap();
    let ack = a.sync().unwrap();
    assert_eq!((ack.held_pages, ack.free_pages), (40, 24));
    // A second connection for the same VM sees the same store.
    let (mut b, ack) = StoreClient::open(&at, T, &open("vm1", 0)).unwrap();
    assert_eq!(ack.held_pages, 40);
    let want = [gpas[25], gpas[3], gpas[4]];
    let mut out = Vec::new();
    b.fetch(&want, &mut out).unwrap();
    let expect: Vec<u8> = want.iter().flat_map(|&g| content(g)).collect();
    assert!(out == expect, "fetched pages differ");
    b.drop_runs(&[GpaPages::new(0, 10)]).unwrap();
    let ack = b.sync().unwrap();
    assert_eq!((ack.held_pages, ack.free_pages), (30, 34));
    assert_eq!(
        b.list().unwrap(),
        [
            GpaPages::new(0xa000, 10),
            GpaPages::new((1 << 32) + 0x14000, 20)
        ]
    );
    // A page no longer held is refused by name.
    let e = b.fetch(&[0], &mut out).unwrap_err().to_string();
    assert!(e.contains("not held"), "{e}");
    // Another VM may not reserve more than is free, nor outgrow it.
    let e = StoreClient::open(&at, T, &open("vm2", 35))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("34 pages free"), "{e}");
    let (mut c, _) = StoreClient::open(&at, T, &open("vm2", 0)).unwrap();
    let many: Vec<u64> = (0..35u64).map(|i| i * 0x1000).collect();
    c.put(&many, &vec![1u8; 35 * PAGE]).unwrap();
    let e = c.sync().unwrap_err().to_string();
    assert!(e.contains("full"), "{e}");
    // The layout of a held VM cannot change.
    let mut other = open("vm1", 0);
    other.regions = vec![(0, 2 << 20)];
    let e = StoreClient::open(&at, T, &other).err().unwrap().to_string();
    assert!(e.contains("layout"), "{e}");
    // Closing frees the store once its last connection is gone.
    a.close().unwrap();
    drop(b);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(srv.vms().iter().filter(|(v, _)| v == "vm1").count(), 0);
    assert!(srv.free_pages() >= 64 - 35);
}

#[test]
fn a_reservation_left_unfilled_goes_back_when_its_last_connection_ends() {
    // Found by a hostile fleet host: it opened a store under a VM id of its
    // own, reserved all the free room and went; the room stayed taken and
    // the next real reservation was refused.
    common::secure();
    let (srv, at) = common::mem_server(64);
    let (mut greedy, ack) = StoreClient::open(&at, T, &open("greedy", 64)).unwrap();
    assert_eq!(ack.free_pages, 0);
    let e = StoreClient::open(&at, T, &open("real", 8))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("0 pages free"), "{e}");
    // It fills 4 of its 64 pages, then disconnects without closing.
    let gpas: Vec<u64> = (0..4u64).map(|i| i * 0x1000).collect();
    greedy.put(&gpas, &vec![7u8; 4 * PAGE]).unwrap();
    greedy.sync().unwrap();
    drop(greedy);
    let t0 = std::time::Instant::now();
    while srv.free_pages() != 60 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(srv.free_pages(), 60, "the 60 unfilled pages are free again");
    assert_eq!(
        srv.vms(),
        [("greedy".to_string(), 4)],
        "what it holds stays"
    );
    let (real, ack) = StoreClient::open(&at, T, &open("real", 8)).unwrap();
    assert_eq!(ack.free_pages, 52);
    real.close().unwrap();
}

#[test]
fn strangers_and_bad_frames_are_refused_and_the_server_lives_on() {
    common::secure();
    let (srv, at) = common::mem_server(16);
    // A migration control connection is not for a memory server.
    let hello = Hello {
        version_min: 1,
        version_max: protocol::VERSION_MAX,
        role: Role::Control,
        session: 1,
        streams: 1,
    };
    let mut c = Conn::open(&at, T, &hello).unwrap();
    c.flush().unwrap();
    let e = protocol::read_frame(c.reader()).unwrap_err().to_string();
    assert!(e.contains("memory server"), "{e}");
    // Clients too old for memory servers (v8 ones had no owner secrets).
    let old = Hello {
        version_min: 1,
        version_max: 6,
        role: Role::Store,
        session: 0,
        streams: 0,
    };
    for max in [6, protocol::VERSION_SPLIT] {
        let mut c = Conn::open(
            &at,
            T,
            &Hello {
                version_max: max,
                ..old.clone()
            },
        )
        .unwrap();
        c.flush().unwrap();
        let e = protocol::read_frame(c.reader()).unwrap_err().to_string();
        assert!(e.contains("memory servers need protocol v9"), "{e}");
    }
    // Not a ferry peer at all.
    let mut s = std::net::TcpStream::connect(at.to_string().trim_start_matches("tcp:")).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(s);
    // A corrupt Pages frame after a good open: refused, with the reason.
    let store_hello = Hello {
        role: Role::Store,
        version_max: protocol::VERSION_MAX,
        ..old
    };
    let mut c = Conn::open(&at, T, &store_hello).unwrap();
    c.flush().unwrap();
    let _: u16 = c.recv(Kind::HelloAck).unwrap();
    c.send(Kind::StoreOpen, &open("vm", 0)).unwrap();
    let _: ferry_migration::memserver::StoreAck = c.recv(Kind::StoreAck).unwrap();
    let mut raw = Vec::new();
    protocol::write_frame(
        &mut raw,
        Kind::Pages,
        &protocol::encode_pages(&[0x1000], &[9u8; PAGE]),
    )
    .unwrap();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    c.writer().write_all(&raw).unwrap();
    c.flush().unwrap();
    let e = protocol::read_frame(c.reader()).unwrap_err().to_string();
    assert!(e.contains("checksum"), "{e}");
    // The server still serves, and the corrupt page did not land.
    let (mut good, ack) = StoreClient::open(&at, T, &open("vm", 0)).unwrap();
    assert_eq!(ack.held_pages, 0);
    good.put(&[0x2000], &[3u8; PAGE]).unwrap();
    assert_eq!(good.sync().unwrap().held_pages, 1);
    assert_eq!(srv.free_pages(), 15);
}
