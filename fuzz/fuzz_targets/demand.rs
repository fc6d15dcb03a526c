//! Demand requests at a postcopy source: PageRequest frames from the
//! destination (a list of guest addresses each), answered by the source's
//! real demand thread (`SourcePages::serve_demand`) with Pages frames: the
//! requested page and its unsent neighbours.
//!
//! Checks: the source answers only with Pages frames of whole pages of
//! guest memory, each holding that page's content; every requested page
//! that is guest memory is answered, first in its answer, and a page goes
//! out by prefetch at most once; a request naming an address outside
//! guest memory ends the thread with an error (after answering the ones
//! before it), never a panic; a request of another kind is refused.
#![no_main]

use ferry_fuzz::{frame, init, Input, Memory, Peer};
use ferry_migration::protocol::{self, Kind};
use ferry_migration::GpaPages;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    init();
    let mut input = Input::new(data);
    let memory = Memory::standard();
    for g in memory.page_addrs() {
        let mut p = vec![0u8; 4096];
        p[..8].copy_from_slice(&g.to_le_bytes());
        p[4095] = 0x5a;
        memory.write(g, &p);
    }
    let prefetch = u32::from(input.u8() % 6);
    // Pages still pending at the source: a few runs of guest memory.
    let addrs = memory.page_addrs();
    let pending: Vec<GpaPages> = (0..input.u8() % 6)
        .map(|_| {
            GpaPages::new(
                addrs[usize::from(input.u8()) % addrs.len()],
                u64::from(input.u8() % 8),
            )
        })
        .collect();
    // The requests: mostly PageRequest bodies, some other kinds.
    let mut wire = Vec::new();
    // What each frame asks for; None: not a request the source can read.
    let mut asked: Vec<Option<Vec<u64>>> = Vec::new();
    while !input.is_empty() {
        let sel = input.u8();
        if sel % 8 == 7 {
            wire.extend(frame(Kind::RoundDone, input.chunk()));
            asked.push(None);
            continue;
        }
        let body = if sel.is_multiple_of(2) {
            // Addresses drawn from memory (and near it).
            let n = usize::from(input.u8() % 5);
            let gpas: Vec<u64> = (0..n)
                .map(|_| {
                    addrs[usize::from(input.u8()) % addrs.len()] + u64::from(input.u8() % 3) * 0x800
                })
                .collect();
            postcard::to_stdvec(&gpas).expect("encodes")
        } else {
            input.chunk().to_vec()
        };
        asked.push(postcard::from_bytes(&body).ok());
        wire.extend(frame(Kind::PageRequest, &body));
    }

    let (mut conn, peer) = Peer::connect(wire);
    let served =
        ferry_migration::fuzzing::serve_demand(memory.views(), &pending, prefetch, &mut conn);
    drop(conn);
    let answers = peer.answers();

    // Every answer is a Pages frame of real pages with their content.
    let mut r = &answers[..];
    let mut sent: Vec<u64> = Vec::new();
    let mut frames: Vec<Vec<u64>> = Vec::new();
    loop {
        match protocol::read_frame(&mut r) {
            Ok(f) => {
                assert_eq!(f.kind, Kind::Pages, "the source answered with {:?}", f.kind);
                let (gpas, data) =
                    protocol::decode_pages(&f.body).expect("a well-formed Pages body");
                for (i, &g) in gpas.iter().enumerate() {
                    assert_eq!(
                        Some(&data[i * 4096..][..4096]),
                        memory.page(g).as_deref(),
                        "page {g:#x} sent with other content"
                    );
                }
                sent.extend(&gpas);
                frames.push(gpas);
            }
            Err(protocol::ProtocolError::Closed) => break,
            Err(e) => panic!("the source's answers do not read back: {e}"),
        }
    }
    // Each requested page in guest memory is answered, in order, until the
    // first frame that is not a readable request of guest pages.
    let mut expect_error = false;
    let mut requested = Vec::new();
    'requests: for gpas in &asked {
        let Some(gpas) = gpas else {
            expect_error = true;
            break;
        };
        for &g in gpas {
            if !memory.views().iter().any(|v| v.contains(g)) {
                expect_error = true;
                break 'requests;
            }
            requested.push(g & !4095);
        }
    }
    let first_pages: Vec<u64> = frames.iter().filter_map(|f| f.first().copied()).collect();
    let mut it = first_pages.iter();
    for g in &requested {
        assert!(
            it.any(|x| x == g),
            "requested page {g:#x} not answered first"
        );
    }
    // Prefetched pages (not asked for) go out once at most.
    let mut extra: Vec<u64> = sent
        .iter()
        .copied()
        .filter(|g| !requested.contains(g))
        .collect();
    extra.sort_unstable();
    let n = extra.len();
    extra.dedup();
    assert_eq!(extra.len(), n, "a prefetched page went out twice");
    match served {
        Ok(d) => {
            assert!(!expect_error, "a bad request was served");
            assert_eq!(d.pages, sent.len() as u64);
            assert_eq!(d.requests, requested.len() as u64);
        }
        Err(e) => {
            assert!(expect_error, "good requests failed: {e}");
            assert!(!e.to_string().is_empty());
        }
    }
});
