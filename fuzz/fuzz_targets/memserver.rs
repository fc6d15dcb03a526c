//! A memory server, whole: one real `MemServer` per process on a Unix
//! socket, and per input a client that says Hello, opens a store of a
//! layout (the standard one, or any regions the input names), sends frames
//! of every kind a client may send (pages, zero runs, drops, syncs, page
//! requests, fetches, lists, others) and closes the store.
//!
//! Checks: the server answers only with frames a client reads (HelloAck,
//! StoreAck, StoreHeld, Pages, Abort); a page it hands out holds content
//! this input wrote to that address (never another VM's or garbage), and
//! lies in the store's layout; and after every input the server still
//! serves: a second client opens and closes the same store.
#![no_main]

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use ferry_fuzz::peer::IO_TIMEOUT;
use ferry_fuzz::{frame, init, kind_of, Input};
use ferry_migration::memserver::{MemServer, StoreAck, StoreFetch, StoreHeld, StoreOpen};
use ferry_migration::protocol::{self, Hello, Kind, Role, VERSION_MAX, VERSION_STORE};
use ferry_migration::transport::{Endpoint, Listener};
use ferry_migration::GpaPages;
use libfuzzer_sys::fuzz_target;

/// The server's socket, started once.
fn server() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("ferry-fuzz-memserver-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener =
            Listener::bind(&Endpoint::Unix(path.clone())).expect("bind the memory server");
        let server = MemServer::new(1 << 16);
        std::thread::spawn(move || {
            let _ = server.serve(&listener);
        });
        path
    })
}

/// Sends `wire` on a new connection and reads every answer until the
/// server closes it.
fn exchange(wire: Vec<u8>) -> Vec<u8> {
    let mut s = UnixStream::connect(server()).expect("the memory server accepts");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.set_write_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let mut w = s.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&wire);
        let _ = w.shutdown(Shutdown::Write);
    });
    let mut back = Vec::new();
    let read = s.read_to_end(&mut back);
    let _ = writer.join();
    if let Err(e) = read {
        panic!("the memory server kept the connection open: {e}");
    }
    back
}

fn opening(vm: &str, regions: &[(u64, u64)], reserve_pages: u64) -> Vec<u8> {
    let mut wire = Vec::new();
    let hello = Hello {
        version_min: VERSION_STORE,
        version_max: VERSION_MAX,
        role: Role::Store,
        session: 0,
        streams: 0,
    };
    protocol::send(&mut wire, Kind::Hello, &hello).expect("to a Vec");
    let open = StoreOpen {
        vm: vm.to_string(),
        regions: regions.to_vec(),
        reserve_pages,
        secret: ferry_migration::memserver::StoreSecret([9; 32]),
    };
    protocol::send(&mut wire, Kind::StoreOpen, &open).expect("to a Vec");
    wire
}

/// Reads the server's answers; returns the pages it handed out.
fn answers(bytes: &[u8]) -> Vec<(u64, Vec<u8>)> {
    let mut r = bytes;
    let mut pages = Vec::new();
    loop {
        let f = match protocol::read_frame(&mut r) {
            Ok(f) => f,
            Err(protocol::ProtocolError::Closed) | Err(protocol::ProtocolError::Aborted(_)) => {
                break
            }
            Err(e) => panic!("the server's answers do not read back: {e}"),
        };
        match f.kind {
            Kind::HelloAck => drop(protocol::decode::<u16>(&f, f.kind).expect("a HelloAck")),
            Kind::StoreAck => drop(protocol::decode::<StoreAck>(&f, f.kind).expect("a StoreAck")),
            Kind::StoreHeld => {
                drop(protocol::decode::<StoreHeld>(&f, f.kind).expect("a StoreHeld"))
            }
            Kind::Pages => {
                let (gpas, data) = protocol::decode_pages(&f.body).expect("a Pages body");
                for (i, g) in gpas.into_iter().enumerate() {
                    pages.push((g, data[i * 4096..][..4096].to_vec()));
                }
            }
            other => panic!("the server answered with {other:?}"),
        }
    }
    pages
}

fuzz_target!(|data: &[u8]| {
    init();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let vm = format!("fuzz-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    let mut input = Input::new(data);
    let regions: Vec<(u64, u64)> = if input.u8().is_multiple_of(4) {
        (0..input.u8() % 4)
            .map(|_| (input.u64(), input.u64()))
            .collect()
    } else {
        ferry_fuzz::memory::LAYOUT.to_vec()
    };
    let addrs: Vec<u64> = ferry_fuzz::memory::LAYOUT
        .iter()
        .flat_map(|&(g, s)| (0..s / 4096).map(move |i| g + i * 4096))
        .collect();
    let reserve = u64::from(input.u16());
    let mut wire = opening(&vm, &regions, reserve);
    // Every content this input writes, per address.
    let mut written: Vec<(u64, Vec<u8>)> = Vec::new();
    while !input.is_empty() {
        let sel = input.u8();
        let pick = |input: &mut Input| addrs[usize::from(input.u8()) % addrs.len()];
        let (kind, body) = match sel % 10 {
            0 | 1 => {
                let n = 1 + usize::from(input.u8() % 4);
                let gpas: Vec<u64> = (0..n).map(|_| pick(&mut input)).collect();
                let mut data = Vec::new();
                for &g in &gpas {
                    let p = input.page();
                    written.push((g, p.clone()));
                    data.extend(p);
                }
                (Kind::Pages, protocol::encode_pages(&gpas, &data))
            }
            2 => {
                let runs = vec![GpaPages::new(pick(&mut input), u64::from(input.u8() % 4))];
                let kind = if input.bool() {
                    Kind::ZeroRanges
                } else {
                    Kind::StoreDrop
                };
                (kind, postcard::to_stdvec(&runs).expect("encodes"))
            }
            3 => (
                Kind::StoreSync,
                postcard::to_stdvec(&input.u64()).expect("encodes"),
            ),
            4 => {
                let gpas: Vec<u64> = (0..input.u8() % 3).map(|_| pick(&mut input)).collect();
                (
                    Kind::PageRequest,
                    postcard::to_stdvec(&gpas).expect("encodes"),
                )
            }
            5 => {
                let ask = StoreFetch {
                    runs: vec![GpaPages::new(pick(&mut input), u64::from(input.u8() % 6))],
                    drop: input.bool(),
                };
                (
                    Kind::StoreFetch,
                    postcard::to_stdvec(&ask).expect("encodes"),
                )
            }
            6 => (Kind::StoreList, Vec::new()),
            7 => {
                // Any body for the requests that carry one.
                let kind = [
                    Kind::Pages,
                    Kind::ZeroRanges,
                    Kind::StoreDrop,
                    Kind::PageRequest,
                    Kind::StoreFetch,
                ][usize::from(input.u8() % 5)];
                (kind, input.chunk().to_vec())
            }
            8 => (kind_of(input.u8()), input.chunk().to_vec()),
            _ => {
                // A frame with a wrong checksum: its pages may land in place
                // before the check, so they count as written.
                let body = input.chunk().to_vec();
                if let Ok((gpas, data)) = protocol::decode_pages(&body) {
                    for (i, g) in gpas.into_iter().enumerate() {
                        written.push((g, data[i * 4096..][..4096].to_vec()));
                    }
                }
                let mut f = frame(Kind::Pages, &body);
                f[12] ^= 1;
                wire.extend(f);
                continue;
            }
        };
        if kind == Kind::Pages {
            if let Ok((gpas, data)) = protocol::decode_pages(&body) {
                for (i, g) in gpas.into_iter().enumerate() {
                    written.push((g, data[i * 4096..][..4096].to_vec()));
                }
            }
        }
        wire.extend(frame(kind, &body));
    }
    wire.extend(frame(Kind::StoreClose, &[]));

    for (g, content) in answers(&exchange(wire)) {
        assert!(
            regions
                .iter()
                .any(|&(base, size)| g >= base && g - base < size),
            "page {g:#x} outside the store's layout"
        );
        assert!(
            written.iter().any(|(w, c)| *w == g && *c == content),
            "page {g:#x} handed out with content this client never wrote"
        );
    }

    // The server still serves: the same store opens and closes.
    let mut wire = opening(&vm, &regions, 0);
    wire.extend(frame(Kind::StoreClose, &[]));
    let back = exchange(wire);
    let f = protocol::read_frame(&mut &back[..]);
    assert!(
        matches!(f, Ok(ref f) if f.kind == Kind::HelloAck),
        "the server no longer answers a Hello: {f:?}"
    );
});
