//! The batch planning on made-up runs (blocks keep their stream and shard,
//! a stop-and-copy packs without mixing shards), and a raw round over TLS
//! and unix links: Pages frames go sealed only where both ends allow it.

use super::*;
use crate::transport::Stream;

#[test]
fn batches_stay_inside_blocks_and_blocks_keep_their_stream() {
    let p = PAGE as u64;
    let r = GpaPages::new;
    // Fragmented runs of one block travel as one batch.
    let runs = [r(0, 3), r(4 * p, 3), r(8 * p, 1500), r(3000 * p, 10)];
    let dealt = deal(&runs, 2);
    assert_eq!(
        dealt[0],
        vec![
            vec![r(0, 3), r(4 * p, 3), r(8 * p, 1016)],
            vec![r(3000 * p, 10)]
        ]
    );
    assert_eq!(dealt[1], vec![vec![r(1024 * p, 484)]]);
    // Same page, same stream and shard, whatever run it arrives in.
    let again = deal(&[r(1100 * p, 1)], 2);
    assert_eq!(again[1], vec![vec![r(1100 * p, 1)]]);
    assert_eq!(
        shard_of(&vec![r(1024 * p, 1)], 2, 3),
        shard_of(&vec![r(2047 * p, 1)], 2, 3)
    );
    assert_ne!(
        shard_of(&vec![r(0, 1)], 1, 2),
        shard_of(&vec![r(1024 * p, 1)], 1, 2)
    );
}

#[test]
fn a_stop_and_copy_packs_scattered_blocks_without_mixing_shards() {
    let p = PAGE as u64;
    let r = GpaPages::new;
    // One page in each of blocks 0, 2, 4, 6 (stream 0 of 2): one shard,
    // one batch; two shards: blocks 0 and 4 apart from 2 and 6.
    let runs = [r(0, 1), r(2048 * p, 1), r(4096 * p, 1), r(6144 * p, 1)];
    let dealt = deal(&runs, 2).swap_remove(0);
    assert_eq!(dealt.len(), 4);
    assert_eq!(
        pack_items(dealt.clone(), 2, 1),
        vec![vec![
            r(0, 1),
            r(2048 * p, 1),
            r(4096 * p, 1),
            r(6144 * p, 1)
        ]]
    );
    let packed = pack_items(dealt, 2, 2);
    for item in &packed {
        let s = shard_of(item, 2, 2);
        assert!(
            item.iter().all(|&x| shard_of(&vec![x], 2, 2) == s),
            "{packed:?}"
        );
    }
    assert_eq!(packed.iter().map(Vec::len).sum::<usize>(), 4);
    // Never more than a batch holds.
    let full = vec![
        vec![r(0, 1000)],
        vec![r(2048 * p, 30)],
        vec![r(4096 * p, 20)],
    ];
    assert_eq!(
        pack_items(full, 2, 1),
        vec![vec![r(0, 1000)], vec![r(2048 * p, 30), r(4096 * p, 20)]]
    );
}

/// The content of guest page `n` in [`round_frames`]' guest.
fn byte_of(i: usize) -> u8 {
    (i % 251) as u8 | 1
}

/// The Pages frames one raw round sends over `(a, b)`, as read at `b`:
/// (sealed, checksum holds) for each; every page read must hold what
/// the guest had.
fn round_frames(a: Stream, b: Stream, may_seal: bool) -> Vec<(bool, bool)> {
    let t = Some(std::time::Duration::from_secs(5));
    let mut conns = [Conn::new(a, t).unwrap()];
    let mut peer = Conn::new(b, t).unwrap();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        while let Ok(h) = crate::protocol::read_header(peer.reader()) {
            let mut body = vec![0u8; h.len as usize];
            std::io::Read::read_exact(peer.reader(), &mut body).unwrap();
            if h.kind == crate::protocol::Kind::Pages {
                seen.push((h.sealed, crate::checksum::crc32c(&body) == h.crc));
                let (gpas, data) = crate::protocol::decode_pages(&body).unwrap();
                for (gpa, page) in gpas.iter().zip(data.chunks_exact(PAGE)) {
                    let at = *gpa as usize;
                    let want: Vec<u8> = (at..at + PAGE).map(byte_of).collect();
                    assert!(page == &want[..], "page {gpa:#x} arrived changed");
                }
            }
        }
        seen
    });
    // 1023 pages: records and sealing bursts of every fill, and a
    // last record short of four pages.
    const N: u64 = 1023;
    let mut mem: Vec<u8> = (0..N as usize * PAGE).map(byte_of).collect();
    // SAFETY: `mem` outlives the round and nothing else touches it.
    let regions = [unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
    let mut sender = PageSender::new(
        &CompressOptions::default(),
        &crate::compress::Backend::cpu(),
        false,
        1,
        None,
        &[],
    )
    .sealing(may_seal);
    let runs = [GpaPages::new(0, N)];
    let (stats, _) = sender
        .send_round(
            &regions,
            &mut conns,
            &runs,
            &[],
            0,
            None,
            &CpuMeter::default(),
        )
        .unwrap();
    assert_eq!(stats.pages, N);
    drop(conns);
    reader.join().unwrap()
}

#[test]
fn pages_go_sealed_only_over_a_link_that_seals_to_a_peer_that_reads_them() {
    let dir = std::env::temp_dir().join(format!("ferry-sender-{}", std::process::id()));
    let (a, b) = crate::transport::tls_pair(&dir);
    let tls = round_frames(a, b, true);
    assert!(
        !tls.is_empty() && tls.iter().all(|&(sealed, _)| sealed),
        "{tls:?}"
    );
    let (a, b) = crate::transport::tls_pair(&dir);
    let old_peer = round_frames(a, b, false);
    assert!(
        !old_peer.is_empty() && old_peer.iter().all(|&f| f == (false, true)),
        "{old_peer:?}"
    );
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let plain = round_frames(Stream::unix(a), Stream::unix(b), true);
    assert!(
        !plain.is_empty() && plain.iter().all(|&f| f == (false, true)),
        "{plain:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
