//! Peers of a memory server for the hostile-input tests: the legitimate
//! owner of a VM (pages put through the engine's client, checked back by
//! hash) and a hand-driven connection that sends whatever a test wants.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use ferry_migration::memserver::{MemServer, StoreAck, StoreClient, StoreOpen, StoreSecret};
use ferry_migration::protocol::{self, Hello, Kind, Role};
use ferry_migration::transport::Conn;
use ferry_migration::GpaPages;
use ferry_migration::{Endpoint, Listener};

pub const PAGE: usize = 4096;
pub const T: Duration = Duration::from_secs(5);
/// Every test VM's layout: 256 + 256 pages.
pub const LAYOUT: &[(u64, u64)] = &[(0, 1 << 20), (1 << 32, 1 << 20)];
/// The owner's VM id.
pub const OWNER_VM: &str = "8f3a6c0d2b9e4711";

/// A server with `limits` on loopback, and whether its accept loop still
/// runs (the handle ends when `serve` returns).
pub fn server(
    pages: u64,
    limits: ferry_migration::memserver::Limits,
) -> (Arc<MemServer>, Endpoint, std::thread::JoinHandle<()>) {
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".parse().unwrap())).unwrap();
    let at = l.endpoint();
    let s = MemServer::with_limits(pages, limits);
    let s2 = s.clone();
    let t = std::thread::spawn(move || {
        let r = s2.serve(&l);
        eprintln!("memory server loop ended: {r:?}");
    });
    (s, at, t)
}

/// The secret named by `seed`.
pub fn secret(seed: u8) -> StoreSecret {
    StoreSecret([seed; 32])
}

/// An open of `vm` in the test layout.
pub fn open(vm: &str, reserve: u64, secret: StoreSecret) -> StoreOpen {
    StoreOpen {
        vm: vm.into(),
        regions: LAYOUT.to_vec(),
        reserve_pages: reserve,
        secret,
    }
}

/// Page `gpa`'s content for the owner.
pub fn content(gpa: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (gpa >> 12) as u8 ^ (i as u8).wrapping_mul(31) ^ 0xa5)
        .collect()
}

/// The owner's pages: 40 in region 0, 20 in region 1.
pub fn owner_gpas() -> Vec<u64> {
    (0..40u64)
        .map(|i| i * 0x1000)
        .chain((0..20u64).map(|i| (1 << 32) + i * 0x3000))
        .collect()
}

/// The owner opens its VM (secret 1) and puts its pages.
pub fn owner_puts(at: &Endpoint) -> StoreClient {
    let (mut c, _) = StoreClient::open(at, T, &open(OWNER_VM, 60, secret(1))).unwrap();
    let gpas = owner_gpas();
    let data: Vec<u8> = gpas.iter().flat_map(|&g| content(g)).collect();
    c.put(&gpas, &data).unwrap();
    assert_eq!(c.sync().unwrap().held_pages, 60);
    c
}

/// The owner's pages are all there, byte for byte (by hash), and nothing
/// else: fetched over a fresh owner connection, which proves the server
/// still serves.
pub fn owner_intact(at: &Endpoint) {
    let (mut c, ack) = StoreClient::open(at, T, &open(OWNER_VM, 0, secret(1)))
        .expect("the server still serves the owner");
    assert_eq!(ack.held_pages, 60, "the owner's pages are all held");
    let want: std::collections::HashMap<u64, u64> = owner_gpas()
        .into_iter()
        .map(|g| (g, protocol::page_hash(&content(g))))
        .collect();
    let runs: Vec<GpaPages> = LAYOUT
        .iter()
        .map(|&(g, s)| GpaPages::new(g, s / PAGE as u64))
        .collect();
    let mut seen = 0;
    c.fetch_runs(&runs, false, |_, gpas, data| {
        for (j, g) in gpas.iter().enumerate() {
            let h = protocol::page_hash(&data[j * PAGE..][..PAGE]);
            assert_eq!(want.get(g), Some(&h), "page {g:#x} changed");
            seen += 1;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, 60);
}

/// The Hello of a Store connection speaking v9 and up.
pub fn store_hello() -> Hello {
    Hello {
        version_min: protocol::VERSION_TRUST,
        version_max: protocol::VERSION_MAX,
        role: Role::Store,
        session: 0,
        streams: 0,
    }
}

/// A hand-driven Store connection that said Hello (v9) and opened `o`.
pub fn raw_open(at: &Endpoint, o: &StoreOpen) -> Result<(Conn, StoreAck), String> {
    let hello = store_hello();
    let mut c = Conn::open(at, T, &hello).map_err(|e| e.to_string())?;
    c.flush().map_err(|e| e.to_string())?;
    let _: u16 = c.recv(Kind::HelloAck).map_err(|e| e.to_string())?;
    c.send(Kind::StoreOpen, o).map_err(|e| e.to_string())?;
    let ack: StoreAck = c.recv(Kind::StoreAck).map_err(|e| e.to_string())?;
    Ok((c, ack))
}

/// The reason a hand-driven open of `o` is refused.
pub fn refused(at: &Endpoint, o: &StoreOpen) -> String {
    match raw_open(at, o) {
        Ok(_) => panic!("VM {} opened", o.vm),
        Err(e) => e,
    }
}

/// Writes a frame header announcing `len` body bytes of `kind` (and no body).
pub fn announce(c: &mut Conn, kind: Kind, len: u32) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&protocol::MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&(kind as u16).to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    c.writer().write_all(&h).unwrap();
    c.flush().unwrap();
}

/// What the server says next: its Abort's reason (or how the read failed).
pub fn next_error(c: &mut Conn) -> String {
    match protocol::read_frame(c.reader()) {
        Ok(f) => panic!("expected a refusal, got {:?}", f.kind),
        Err(e) => e.to_string(),
    }
}
