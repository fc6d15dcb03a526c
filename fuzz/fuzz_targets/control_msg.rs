//! Every message a peer sends on a control or memory-server connection:
//! the first byte picks the kind, the rest is its body, decoded as the side
//! that receives it decodes it (`protocol::decode`, then that side's own
//! check where it has one: RoundDone's stream count, Verify's hashes,
//! Codec's limits, a SplitPlan against this VM's chunks, a GatherPlan's
//! shape, the Timeline's unpacking, the State's and Clients' decoding).
//!
//! Checks: every decoded message re-encodes stably; each side check's
//! verdict is the one its rule gives (Verify accepts exactly this side's
//! hashes; Codec accepts exactly what is within its limits; a Timeline
//! never unpacks past its cap).
#![no_main]

use ferry_fuzz::{init, kind_of, postcard_round_trip, Memory};
use ferry_migration::fuzzing::{unpack_lines, ChunkMap, GatherPlan, SplitPlan, MAX_TIMELINE_BYTES};
use ferry_migration::fuzzing::{CodecSetup, MAX_CACHE_BYTES, MAX_SHARDS};
use ferry_migration::memserver::{StoreAck, StoreFetch, StoreHeld, StoreOpen};
use ferry_migration::protocol::{
    self, Frame, Hello, Kind, Layout, PostcopyPlan, PostcopyResume, RoundDone,
};
use ferry_migration::GpaPages;
use ferry_migration::{ClientsAnswer, ClientsPlan};
use ferry_migration::{FaultReport, StartedReport};
use ferry_vmm::devices::service::ServiceDevice;
use ferry_vmm::VmState;
use libfuzzer_sys::fuzz_target;

/// Decodes through the engine's own `protocol::decode` and checks the
/// value re-encodes stably.
fn decode<T>(f: &Frame) -> Option<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let got = protocol::decode::<T>(f, f.kind);
    let again = postcard_round_trip::<T>(&f.body);
    assert_eq!(got.is_ok(), again.is_some(), "decode and postcard disagree");
    got.ok()
}

fuzz_target!(|data: &[u8]| {
    init();
    let Some((&k, body)) = data.split_first() else {
        return;
    };
    let f = Frame {
        kind: kind_of(k),
        body: body.to_vec(),
    };
    let memory = Memory::standard();
    let regions = memory.views();
    match f.kind {
        Kind::Hello => drop(decode::<Hello>(&f)),
        Kind::HelloAck => drop(decode::<u16>(&f)),
        Kind::Token => drop(decode::<Option<String>>(&f)),
        Kind::Layout => drop(decode::<Layout>(&f)),
        Kind::RoundDone => {
            let streams = 2;
            match ferry_migration::fuzzing::round_done(&f, streams) {
                Ok(rd) => assert_eq!(rd.frames.len(), streams),
                Err(_) => {
                    if let Some(rd) = decode::<RoundDone>(&f) {
                        assert_ne!(rd.frames.len(), streams, "a good RoundDone refused");
                    }
                }
            }
        }
        Kind::RoundAck | Kind::TimelineAsk => drop(decode::<u32>(&f)),
        Kind::StoreSync
        | Kind::GatherReady
        | Kind::StandbyHeld
        | Kind::SwitchReady
        | Kind::DroppedAhead => {
            let _ = decode::<u64>(&f);
        }
        Kind::StandbyPlan => drop(decode::<ferry_migration::protocol::StandbyPlan>(&f)),
        Kind::StandbyBeat | Kind::StandbyTakeOver => {}
        Kind::HashAsk | Kind::SwitchAhead | Kind::ShareAsk | Kind::AnswersHeld => {
            let _ = decode::<bool>(&f);
        }
        Kind::AnswersAsk => drop(decode::<Option<[u8; 16]>>(&f)),
        // The claim's bytes are the VMM's to judge (ferry_vmm::owner); the
        // destination checks their size before anything reads them.
        Kind::Owner => drop(decode::<Option<Vec<u8>>>(&f)),
        Kind::SharedOffer => drop(decode::<ferry_migration::protocol::SharedOffer>(&f)),
        Kind::SharedMissed => drop(decode::<Vec<ferry_migration::GpaPages>>(&f)),
        Kind::VerifyDigests => {
            // This side's memory is zero: only digests of zero pages (0
            // each, one per 16 MiB) may pass.
            let verdict = ferry_migration::fuzzing::verify_digests(&regions, &f);
            if let (Ok(_), Some(d)) = (&verdict, decode::<Vec<u64>>(&f)) {
                assert!(d.iter().all(|&x| x == 0), "digests of data passed");
            }
        }
        Kind::Verify => {
            // This side's hashes of its (zero) memory.
            let mine: Vec<u64> = memory
                .page_addrs()
                .iter()
                .map(|&g| protocol::page_hash(&memory.page(g).unwrap_or_default()))
                .collect();
            let theirs: Vec<u8> = mine.iter().flat_map(|h| h.to_le_bytes()).collect();
            let verdict = ferry_migration::fuzzing::verify(&regions, &mine, &f.body);
            assert_eq!(
                verdict.is_ok(),
                f.body == theirs,
                "Verify must accept exactly this side's hashes"
            );
        }
        Kind::Started => {
            drop(decode::<StartedReport>(&f));
            // Before v5: StartedReportV1 { service, cpu_s }.
            drop(decode::<(Option<String>, f64)>(&f));
        }
        Kind::Codec => {
            if let Some(setup) = decode::<CodecSetup>(&f) {
                let within = (1..=MAX_SHARDS).contains(&setup.shards)
                    && setup.xbzrle_bytes <= MAX_CACHE_BYTES
                    && setup.dedup_bytes <= MAX_CACHE_BYTES;
                assert_eq!(setup.check().is_ok(), within);
            }
        }
        Kind::PostcopyPlan => drop(decode::<PostcopyPlan>(&f)),
        Kind::PostcopyResume => drop(decode::<PostcopyResume>(&f)),
        Kind::DropAhead => drop(decode::<ferry_migration::protocol::DropAhead>(&f)),
        Kind::PageRequest => drop(decode::<Vec<u64>>(&f)),
        Kind::Finished => drop(decode::<FaultReport>(&f)),
        Kind::ClientsPlan => drop(decode::<Option<ClientsPlan>>(&f)),
        Kind::ClientsAnswer => drop(decode::<ClientsAnswer>(&f)),
        Kind::Clients => {
            if let Ok(conns) = ServiceDevice::fuzz_decode_clients(&f.body) {
                for (_, pending, cp) in conns {
                    assert!(pending.len() <= f.body.len());
                    assert!(cp.send_queue.len() + cp.recv_queue.len() <= f.body.len());
                }
            }
        }
        Kind::State => {
            if let Ok(state) = VmState::decode(&f.body) {
                let once = state.encode().expect("a decoded state encodes");
                let again = VmState::decode(&once).expect("and decodes");
                assert_eq!(again.encode().expect("encodes"), once);
            }
        }
        Kind::Timeline => {
            if let Ok(lines) = unpack_lines(&f.body) {
                assert!(lines.len() as u64 <= MAX_TIMELINE_BYTES);
            }
        }
        Kind::ZeroRanges | Kind::StoreDrop => drop(decode::<Vec<GpaPages>>(&f)),
        Kind::StoreOpen => drop(decode::<StoreOpen>(&f)),
        Kind::StoreAck => drop(decode::<StoreAck>(&f)),
        Kind::StoreHeld => drop(decode::<StoreHeld>(&f)),
        Kind::StoreFetch => drop(decode::<StoreFetch>(&f)),
        Kind::SplitPlan => {
            if let Some(plan) = decode::<SplitPlan>(&f) {
                let map = ChunkMap::new(&regions, plan.chunk_pages);
                if plan.check(&map).is_ok() {
                    let n = map.chunks();
                    assert!(plan.places.len() == n && plan.homes.len() == n);
                    for (c, (&p, &h)) in plan.places.iter().zip(&plan.homes).enumerate() {
                        assert!(usize::from(h) <= plan.servers.len() && h != 0);
                        assert!(p == 0 || p == h, "chunk {c} away from its home");
                    }
                    // Every page of the VM lies in a chunk the plan places.
                    for g in memory.page_addrs() {
                        assert!(map.chunk_of(g).is_some_and(|c| c < n));
                    }
                }
            }
        }
        Kind::GatherPlan => drop(decode::<GatherPlan>(&f)),
        // Raw or empty bodies: Pages, Encoded (their own targets), Abort
        // (text), Complete, StoreList, StoreClose (nothing).
        Kind::Abort => {
            let mut wire = Vec::new();
            protocol::write_frame(&mut wire, Kind::Abort, &f.body).expect("to a Vec");
            match protocol::read_frame(&mut &wire[..]) {
                Err(protocol::ProtocolError::Aborted(reason)) => {
                    assert_eq!(reason, String::from_utf8_lossy(&f.body))
                }
                other => panic!("an Abort frame read as {other:?}"),
            }
        }
        Kind::Pages
        | Kind::Encoded
        | Kind::SharedPages
        | Kind::Complete
        | Kind::StoreList
        | Kind::StoreClose => {}
    }
});
