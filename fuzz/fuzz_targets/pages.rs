//! Raw page bodies as a destination lands them: a Pages body read off a
//! socket by `pagein::read_pages` (addresses checked, data read in place
//! into guest memory, checksum checked after) into the real precopy sink
//! (`DirectSink`), beside `protocol::decode_pages`; and a ZeroRanges body
//! as a bulk stream lands it. The first byte picks which, and whether the
//! Pages frame's checksum is honest, wrong, or absent (a sealed frame,
//! which this plaintext link must refuse).
//!
//! Checks (Pages): both decoders agree on the body's shape, and a decoded
//! body re-encodes to itself; pages land only when every address is a
//! page of guest memory and the checksum holds, and then memory holds
//! exactly their data; a refused frame leaves memory outside its own
//! pages untouched; a sealed frame never lands and changes nothing.
//! (ZeroRanges): a body lands only when every run lies inside one region,
//! and then those pages read as zero, and nothing else changed.
//! (SharedPages, v14): references to another VM's pages land only when
//! every address is a page of guest memory, the frame holds at most a
//! batch and it misses no more pages than the VM has (an honest source
//! names a page once a round, so the engine refuses more; this target once
//! took that refusal for a fault, and its own run found the input,
//! corpus/pages/shared-more-misses-than-pages, from fuzz/src/seeds.rs); then each page whose reference names that VM's page by key and
//! BLAKE3 id holds exactly that page, the rest are reported missed, and
//! nothing else changed.
#![no_main]

use std::sync::OnceLock;

use ferry_fuzz::{init, Memory, Peer};
use ferry_migration::fuzzing::SiblingIndex;
use ferry_migration::protocol::{self, Header, Kind};
use ferry_migration::sink::DirectSink;
use ferry_migration::GpaPages;
use libfuzzer_sys::fuzz_target;

/// Fills memory with a pattern that differs page by page.
fn pattern(memory: &Memory) {
    for g in memory.page_addrs() {
        memory.write(g, &vec![(g >> 12) as u8 | 1; 4096]);
    }
}

/// What a Pages frame's header says of its body.
#[derive(Clone, Copy, PartialEq)]
enum Check {
    Honest,
    Wrong,
    /// No checksum: the SEALED flag, refused from a link that does not seal.
    Sealed,
}

fn pages(memory: &Memory, check: Check, body: &[u8]) {
    pattern(memory);
    let before = memory.snapshot();
    let regions = memory.views();
    let sink = DirectSink::new(memory);
    let crc = match check {
        Check::Honest => ferry_migration::fuzzing::crc32c(body),
        Check::Wrong => ferry_migration::fuzzing::crc32c(body) ^ 1,
        Check::Sealed => 0,
    };
    let h = Header {
        kind: Kind::Pages,
        len: body.len() as u32,
        crc,
        sealed: check == Check::Sealed,
    };
    let (mut conn, peer) = Peer::connect(body.to_vec());
    let (mut scratch, mut buf) = (Vec::new(), Vec::new());
    let landed = ferry_migration::fuzzing::read_pages(
        conn.reader(),
        &h,
        &regions,
        &sink,
        &mut scratch,
        &mut buf,
    );
    drop(conn);
    drop(peer);
    let decoded = protocol::decode_pages(body);
    if let Ok((gpas, data)) = &decoded {
        assert_eq!(protocol::encode_pages(gpas, data), body);
    }
    match landed {
        Ok(n) => {
            let (gpas, data) = decoded.expect("read_pages took a body decode_pages refuses");
            assert!(
                check == Check::Honest,
                "pages landed under a wrong or no checksum"
            );
            assert_eq!(n as usize, gpas.len());
            // The last copy of a page repeated in the frame wins.
            for (i, &g) in gpas.iter().enumerate().rev() {
                if gpas[i + 1..].contains(&g) {
                    continue;
                }
                assert_eq!(
                    memory.page(g).as_deref(),
                    Some(&data[i * 4096..][..4096]),
                    "page {g:#x} does not hold what came"
                );
            }
        }
        Err(_) => {
            // Only the frame's own addresses may have been written (in place,
            // before the checksum failed); a sealed frame none at all.
            let mine: Vec<u64> = match check {
                Check::Sealed => Vec::new(),
                _ => decoded.map(|(g, _)| g).unwrap_or_default(),
            };
            let after = memory.snapshot();
            for (k, g) in memory.page_addrs().iter().enumerate() {
                if !mine.contains(g) {
                    assert!(
                        after[k * 4096..][..4096] == before[k * 4096..][..4096],
                        "a refused frame changed page {g:#x}"
                    );
                }
            }
        }
    }
}

fn zero_ranges(memory: &Memory, body: &[u8]) {
    pattern(memory);
    let before = memory.snapshot();
    let regions = memory.views();
    let sink = DirectSink::new(memory);
    let result = ferry_migration::fuzzing::zero_ranges(&regions, &sink, body);
    let runs: Option<Vec<GpaPages>> = postcard::from_bytes(body).ok();
    let inside = |r: &GpaPages| {
        r.gpa.is_multiple_of(4096)
            && regions.iter().any(|v| {
                let (start, end) = (
                    u128::from(v.gpa()),
                    u128::from(v.gpa()) + u128::from(v.size()),
                );
                let g = u128::from(r.gpa);
                // The run's first address is a page of the region (even
                // an empty run's), and its end is too.
                g >= start && g < end && g + u128::from(r.pages) * 4096 <= end
            })
    };
    let after = memory.snapshot();
    match result {
        Ok(zeroed) => {
            let runs = runs.expect("landed a body that does not decode");
            assert!(runs.iter().all(inside), "a run outside guest memory landed");
            assert_eq!(zeroed, runs.iter().map(|r| r.pages).sum::<u64>());
            for (k, g) in memory.page_addrs().iter().enumerate() {
                let hit = runs
                    .iter()
                    .any(|r| *g >= r.gpa && *g - r.gpa < r.pages * 4096);
                let page = &after[k * 4096..][..4096];
                if hit {
                    assert!(page.iter().all(|&b| b == 0), "page {g:#x} not zeroed");
                } else {
                    assert!(page == &before[k * 4096..][..4096], "page {g:#x} changed");
                }
            }
        }
        Err(_) => {
            if let Some(runs) = runs {
                assert!(!runs.iter().all(inside), "good zero ranges refused");
            }
        }
    }
}

/// The other VM: 16 pages of a pattern, and its index under seed 1.
fn sibling() -> &'static (ferry_memory::MemfdRegion, SiblingIndex) {
    static SIBLING: OnceLock<(ferry_memory::MemfdRegion, SiblingIndex)> = OnceLock::new();
    SIBLING.get_or_init(|| {
        let r = ferry_memory::MemfdRegion::new("sibling", 0, 16 * 4096).expect("a memfd");
        for p in 0..16usize {
            // SAFETY: page p of the region's live mapping.
            unsafe { std::ptr::write_bytes(r.host_addr().add(p * 4096), 0x40 + p as u8, 4096) };
        }
        let fd = r.fd().try_clone_to_owned().expect("a dup");
        let peer = ferry_memory::PeerRegion::open("sibling", 16 * 4096, fd).expect("a mapping");
        let index = SiblingIndex::build(vec![peer], 1);
        (r, index)
    })
}

/// A reference as the wire has it (the engine's own type is private: this
/// is a second reading of the same layout).
#[derive(serde::Deserialize)]
struct Ref {
    gpa: u64,
    key: u64,
    id: [u8; 16],
}

fn shared_pages(memory: &Memory, body: &[u8]) {
    pattern(memory);
    let before = memory.snapshot();
    let regions = memory.views();
    let sink = DirectSink::new(memory);
    let (_, index) = sibling();
    let result = ferry_migration::fuzzing::shared_pages(&regions, &sink, body, index);
    let refs: Option<Vec<Ref>> = postcard::from_bytes(body).ok();
    let in_memory = |g: u64| memory.page(g).is_some() && g.is_multiple_of(4096);
    // What each sibling page is: (key, id, content).
    let theirs: Vec<(u64, [u8; 16], Vec<u8>)> = (0..16u8)
        .map(|p| {
            let page = vec![0x40 + p; 4096];
            let key = xxhash_rust::xxh3::xxh3_64_with_seed(&page, 1);
            let mut id = [0u8; 16];
            id.copy_from_slice(&blake3::hash(&page).as_bytes()[..16]);
            (key, id, page)
        })
        .collect();
    let after = memory.snapshot();
    match result {
        Ok((landed, missed)) => {
            let refs = refs.expect("landed a body that does not decode");
            assert!(
                refs.len() <= protocol::MAX_BATCH,
                "an over-long frame landed"
            );
            assert!(
                refs.iter().all(|r| in_memory(r.gpa)),
                "a page outside memory landed"
            );
            let resolves = |r: &Ref| theirs.iter().find(|t| t.0 == r.key && t.1 == r.id);
            assert_eq!(
                landed as usize,
                refs.iter().filter(|r| resolves(r).is_some()).count()
            );
            let missed_pages: u64 = missed.iter().map(|r| r.pages).sum();
            let mut want_missed: Vec<u64> = refs
                .iter()
                .filter(|r| resolves(r).is_none())
                .map(|r| r.gpa)
                .collect();
            want_missed.sort_unstable();
            want_missed.dedup();
            assert_eq!(
                missed_pages as usize,
                want_missed.len(),
                "missed pages miscounted"
            );
            for (k, g) in memory.page_addrs().iter().enumerate() {
                let page = &after[k * 4096..][..4096];
                // The last reference to a page that resolves wins.
                match refs
                    .iter()
                    .rev()
                    .filter(|r| r.gpa == *g)
                    .find_map(|r| resolves(r))
                {
                    Some(t) => assert!(page == &t.2[..], "page {g:#x} is not the page named"),
                    None => assert!(page == &before[k * 4096..][..4096], "page {g:#x} changed"),
                }
            }
        }
        Err(_) => {
            if let Some(refs) = refs {
                // More misses than the VM has pages is no honest source.
                let resolves = |r: &Ref| theirs.iter().any(|t| t.0 == r.key && t.1 == r.id);
                let misses = refs.iter().filter(|r| !resolves(r)).count();
                assert!(
                    refs.len() > protocol::MAX_BATCH
                        || !refs.iter().all(|r| in_memory(r.gpa))
                        || misses > memory.page_addrs().len(),
                    "good references refused"
                );
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    init();
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let memory = Memory::standard();
    match mode % 5 {
        0 => pages(&memory, Check::Honest, body),
        1 => pages(&memory, Check::Wrong, body),
        2 => zero_ranges(&memory, body),
        3 => pages(&memory, Check::Sealed, body),
        _ => shared_pages(&memory, body),
    }
});
