//! One real value of every control and memory-server message, encoded as
//! ferry encodes it: the seeds of the targets that read control frames.

use ferry_migration::fuzzing::CodecSetup;
use ferry_migration::fuzzing::{GatherPlan, SplitPlan};
use ferry_migration::memserver::{StoreAck, StoreFetch, StoreHeld, StoreOpen};
use ferry_migration::protocol::{Kind, PostcopyPlan, PostcopyResume, Role, RoundDone, VERSION_MAX};
use ferry_migration::GpaPages;
use ferry_migration::{ClientsAnswer, ClientsPlan, FaultReport, StartedReport};

use super::{enc, hello, layout, TIMELINE};
use crate::memory::LAYOUT;

/// Every control and memory-server message, one real value each, as
/// (kind, body).
pub(super) fn messages() -> Vec<(Kind, Vec<u8>)> {
    let runs = vec![GpaPages::new(0x1000, 3), GpaPages::new(0x10_0000, 1)];
    let servers = vec!["tcp:10.0.0.2:7000".parse().expect("an endpoint")];
    vec![
        (Kind::Hello, enc(&hello(Role::Control, 1))),
        (Kind::HelloAck, enc(&VERSION_MAX)),
        (Kind::Layout, enc(&layout())),
        (
            Kind::RoundDone,
            enc(&RoundDone {
                round: 2,
                frames: vec![10, 7],
            }),
        ),
        (Kind::RoundAck, enc(&2u32)),
        (Kind::Started, enc(&StartedReport::default())),
        (
            Kind::Codec,
            enc(&CodecSetup {
                xbzrle_bytes: 64 << 20,
                dedup_bytes: 64 << 20,
                shards: 2,
            }),
        ),
        (
            Kind::PostcopyPlan,
            enc(&PostcopyPlan {
                pending: runs.clone(),
                last: true,
                prefetch: 8,
                verify: true,
                guest_apf_base: Some(3),
            }),
        ),
        (Kind::PageRequest, enc(&vec![0x3000u64, 0x10_1000])),
        (Kind::Finished, enc(&FaultReport::default())),
        (
            Kind::PostcopyResume,
            enc(&PostcopyResume {
                missing: runs.clone(),
                last: false,
            }),
        ),
        (
            Kind::ClientsPlan,
            enc(&Some(ClientsPlan {
                ip: "10.0.0.9".parse().expect("an address"),
                port: 7001,
                connections: 12,
            })),
        ),
        (
            Kind::ClientsAnswer,
            enc(&ClientsAnswer::Stay("no service device".into())),
        ),
        (Kind::TimelineAsk, enc(&500u32)),
        (Kind::HashAsk, enc(&true)),
        (Kind::VerifyDigests, enc(&vec![0u64; 2])),
        (Kind::SwitchAhead, enc(&true)),
        (Kind::SwitchReady, enc(&(256u64 << 20))),
        (Kind::ShareAsk, enc(&true)),
        (
            Kind::SharedOffer,
            enc(&ferry_migration::protocol::SharedOffer {
                seed: 7,
                keys: vec![1, 5, 900],
                last: true,
            }),
        ),
        (Kind::SharedMissed, enc(&runs)),
        (Kind::AnswersAsk, enc(&Some([7u8; 16]))),
        (Kind::AnswersHeld, enc(&true)),
        (
            Kind::Owner,
            enc(&Some(
                br#"{"vm":"web","epoch":3,"holder":{"host":"h1","pid":7,"id":9}}"#.to_vec(),
            )),
        ),
        (
            Kind::Timeline,
            ferry_migration::fuzzing::pack_lines(TIMELINE.as_bytes()),
        ),
        (
            Kind::StoreOpen,
            enc(&StoreOpen {
                vm: "vm-1".into(),
                regions: LAYOUT.to_vec(),
                reserve_pages: 8,
                secret: ferry_migration::memserver::StoreSecret([7; 32]),
            }),
        ),
        (
            Kind::StoreAck,
            enc(&StoreAck {
                held_pages: 3,
                free_pages: 100,
                idle_secs: 300,
            }),
        ),
        (Kind::StoreSync, enc(&7u64)),
        (Kind::StoreDrop, enc(&runs)),
        (
            Kind::StoreHeld,
            enc(&StoreHeld {
                runs: runs.clone(),
                last: true,
            }),
        ),
        (
            Kind::StoreFetch,
            enc(&StoreFetch {
                runs: runs.clone(),
                drop: true,
            }),
        ),
        (
            Kind::SplitPlan,
            enc(&SplitPlan {
                vm: "vm-1".into(),
                chunk_pages: 4,
                servers: servers.clone(),
                places: vec![0, 0, 1, 0, 1, 0, 0],
                homes: vec![1; 7],
                mirrors: vec![0; 7],
                budget_chunks: 5,
                rank: Default::default(),
                secrets: vec![ferry_migration::memserver::StoreSecret([7; 32]); 2],
            }),
        ),
        (
            Kind::GatherPlan,
            enc(&GatherPlan {
                vm: "vm-1".into(),
                secrets: vec![ferry_migration::memserver::StoreSecret([7; 32]); servers.len()],
                servers,
                pulls: vec![runs.clone()],
            }),
        ),
        (Kind::GatherReady, enc(&12u64)),
        (Kind::ZeroRanges, enc(&runs)),
        (
            Kind::Abort,
            b"the destination VM has no service device".to_vec(),
        ),
        (Kind::Verify, Vec::new()),
        (Kind::Complete, Vec::new()),
    ]
}
