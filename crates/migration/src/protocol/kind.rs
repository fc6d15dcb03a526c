//! The message kinds: the `kind` field of every frame header, and the
//! number each one has on the wire. A number is never reused; a new kind
//! comes with a new protocol version (the comment on each says which one
//! added it), and a receiver refuses numbers it does not know, so an old
//! peer fails loudly instead of misreading.

/// Message kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// Opens a connection: versions, role.
    Hello = 1,
    /// Accepts a Hello: chosen version.
    HelloAck = 2,
    /// Guest memory layout and vCPU count.
    Layout = 3,
    /// A batch of pages: count, addresses, contents.
    Pages = 4,
    /// Ranges of zero pages.
    ZeroRanges = 5,
    /// End of a round: how many frames each bulk stream carried in it.
    RoundDone = 6,
    /// VM state (vCPUs, devices).
    State = 7,
    /// Per-page hashes for end-to-end verification.
    Verify = 8,
    /// Everything sent: restore and run.
    Complete = 9,
    /// The destination runs the VM.
    Started = 10,
    /// Give up; the reason is in the body.
    Abort = 11,
    /// Receipt of a round (destination to source).
    RoundAck = 12,
    /// v2, first frame of a compressed bulk stream: its codec caches.
    Codec = 13,
    /// v2: a batch of pages in ferry-codec's encoding.
    Encoded = 14,
    /// v3, source to destination before Complete: the VM will start before
    /// these pages arrive (one or more frames, the last one marked).
    PostcopyPlan = 15,
    /// v3, destination to source on the demand connection: pages a vCPU
    /// waits for.
    PageRequest = 16,
    /// v3, destination to source: every page arrived (and verified); the
    /// source may let go. Body: the destination's fault report.
    Finished = 17,
    /// v4, destination to source on a Resume connection: the pages still
    /// missing after a broken link (one or more frames, the last one marked).
    PostcopyResume = 18,
    /// v5, source to destination right after Layout: whether the VM's
    /// clients can move with it (its own address and service port), or None.
    ClientsPlan = 19,
    /// v5, destination to source: it takes the clients over, or why not.
    ClientsAnswer = 20,
    /// v5, source to destination just before Complete when the clients
    /// move: their connections, checkpointed (opaque to the engine).
    Clients = 21,
    /// v6, source to destination after the clients plan: how long to go on
    /// sampling after the VM started there (or every page arrived) before
    /// sending the timeline back (ms, u32).
    TimelineAsk = 22,
    /// v6, destination to source last, after Started (precopy) or Finished
    /// (postcopy) and the tail: the destination's timeline, zstd-compressed
    /// JSON lines (empty when it kept none).
    Timeline = 23,
    /// v7, memory server: opens (or joins) a VM's store.
    StoreOpen = 24,
    /// v7, memory server: pages held and room left.
    StoreAck = 25,
    /// v7, memory server: answer with StoreAck once everything sent before
    /// has landed.
    StoreSync = 26,
    /// v7, memory server: forget these runs.
    StoreDrop = 27,
    /// v7, memory server: what do you hold for this VM?
    StoreList = 28,
    /// v7, memory server: runs held (one or more frames, the last marked).
    StoreHeld = 29,
    /// v7, memory server: free this VM's store.
    StoreClose = 30,
    /// v8, memory server: send the held pages of these runs, run by run
    /// (each run in frames of at most MAX_BATCH pages, held ones only, so
    /// the first run's answer comes first), forgetting them if asked.
    StoreFetch = 31,
    /// v8, source to the main host after Layout: split migration's plan
    /// (chunk size, memory servers, where each chunk lives, the budget).
    SplitPlan = 32,
    /// v8, a split VM's main host to the gathering destination: pull these
    /// runs from these memory servers before any page from the main host.
    GatherPlan = 33,
    /// v8, the gathering destination: everything on the servers landed.
    GatherReady = 34,
    /// v9, source to destination right after HelloAck: the one-time
    /// migration token it was given (`Option<String>`).
    Token = 35,
    /// v11: a source to its postcopy safety net: what to hold and whom to
    /// serve (a [`StandbyPlan`](super::StandbyPlan)).
    StandbyPlan = 36,
    /// v11: the safety net holds every page it was sent.
    StandbyHeld = 37,
    /// v11: the source lives (every second while the net stands by).
    StandbyBeat = 38,
    /// v12, source to destination after TimelineAsk: hash every page as it
    /// lands (`bool`; a verified precopy).
    HashAsk = 39,
    /// v12, in the pause: the digests of the pages' hashes as they were
    /// sent (`Vec<u64>`), for the destination to hold against its own.
    VerifyDigests = 40,
    /// v13, source to destination after HashAsk: this migration may switch
    /// to postcopy or split (`bool`).
    SwitchAhead = 41,
    /// v13, the destination's answer to a `true` SwitchAhead: memory it had
    /// populated ahead of the stream is missing again (`u64`, the bytes
    /// given back).
    SwitchReady = 42,
    /// v14, source to destination after SwitchAhead (or SwitchReady): it
    /// may send pages another VM on the destination's host already holds
    /// as references (`bool`).
    ShareAsk = 43,
    /// v14, the destination's answer to a `true` ShareAsk: the seeded
    /// hashes of the pages its host's other VMs hold (a [`SharedOffer`],
    /// one or more frames, the last one marked).
    ///
    /// [`SharedOffer`]: super::SharedOffer
    SharedOffer = 44,
    /// v14, on a bulk stream: pages sent as references to content the
    /// destination's host holds (`crate::shared`'s layout).
    SharedPages = 45,
    /// v14, destination to source before a RoundAck: referenced pages it
    /// could not find as referenced (runs); the source sends them again.
    SharedMissed = 46,
    /// v16, source to destination after ShareAsk (or SharedOffer): when the
    /// clients stay on the source (forwarded), a token (`Option<[u8; 16]>`)
    /// under which the destination is to hold the answers to requests in
    /// flight at the pause for the source to collect; None: nothing to hold.
    AnswersAsk = 47,
    /// v16, the destination's answer to a `Some` AnswersAsk (`bool`): it
    /// holds them, so the source's pause need not wait for the guest to
    /// answer what is in its ring.
    AnswersHeld = 48,
    /// Source to its standby once it holds every page (`--net-finishes`):
    /// the source leaves; the standby finishes the move from here.
    StandbyTakeOver = 49,
    /// v17, source to destination before a hybrid's pause (one or more
    /// [`DropAhead`](super::DropAhead) messages, the last marked): pages the guest dirtied
    /// since they were sent, which the destination drops now, while the VM
    /// still runs on the source, instead of in the pause.
    DropAhead = 50,
    /// v17, the destination's answer to a DropAhead's last frame (`u64`):
    /// the pages it dropped.
    DroppedAhead = 51,
    /// v18, source to destination after AnswersAsk (or AnswersHeld): the
    /// ownership claim the source holds (`Option<Vec<u8>>`, ≤ 4 KiB, the
    /// VMM's own encoding), which the destination takes the VM from before
    /// its first instruction there; None: the source runs unfenced.
    Owner = 52,
}

impl Kind {
    /// The kind numbered `v` on the wire, if this build knows it.
    pub(super) fn from_u16(v: u16) -> Option<Kind> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => HelloAck,
            3 => Layout,
            4 => Pages,
            5 => ZeroRanges,
            6 => RoundDone,
            7 => State,
            8 => Verify,
            9 => Complete,
            10 => Started,
            11 => Abort,
            12 => RoundAck,
            13 => Codec,
            14 => Encoded,
            15 => PostcopyPlan,
            16 => PageRequest,
            17 => Finished,
            18 => PostcopyResume,
            19 => ClientsPlan,
            20 => ClientsAnswer,
            21 => Clients,
            22 => TimelineAsk,
            23 => Timeline,
            24 => StoreOpen,
            25 => StoreAck,
            26 => StoreSync,
            27 => StoreDrop,
            28 => StoreList,
            29 => StoreHeld,
            30 => StoreClose,
            31 => StoreFetch,
            32 => SplitPlan,
            33 => GatherPlan,
            34 => GatherReady,
            35 => Token,
            36 => StandbyPlan,
            37 => StandbyHeld,
            38 => StandbyBeat,
            39 => HashAsk,
            40 => VerifyDigests,
            41 => SwitchAhead,
            42 => SwitchReady,
            43 => ShareAsk,
            44 => SharedOffer,
            45 => SharedPages,
            46 => SharedMissed,
            47 => AnswersAsk,
            48 => AnswersHeld,
            49 => StandbyTakeOver,
            50 => DropAhead,
            51 => DroppedAhead,
            52 => Owner,
            _ => return None,
        })
    }
}

/// The kind's name, for errors ("unexpected X while waiting for Y").
pub(super) fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Hello => "Hello",
        Kind::HelloAck => "HelloAck",
        Kind::Layout => "Layout",
        Kind::Pages => "Pages",
        Kind::ZeroRanges => "ZeroRanges",
        Kind::RoundDone => "RoundDone",
        Kind::State => "State",
        Kind::Verify => "Verify",
        Kind::Complete => "Complete",
        Kind::Started => "Started",
        Kind::Abort => "Abort",
        Kind::RoundAck => "RoundAck",
        Kind::Codec => "Codec",
        Kind::Encoded => "Encoded",
        Kind::PostcopyPlan => "PostcopyPlan",
        Kind::PageRequest => "PageRequest",
        Kind::Finished => "Finished",
        Kind::PostcopyResume => "PostcopyResume",
        Kind::ClientsPlan => "ClientsPlan",
        Kind::ClientsAnswer => "ClientsAnswer",
        Kind::Clients => "Clients",
        Kind::TimelineAsk => "TimelineAsk",
        Kind::Timeline => "Timeline",
        Kind::StoreOpen => "StoreOpen",
        Kind::StoreAck => "StoreAck",
        Kind::StoreSync => "StoreSync",
        Kind::StoreDrop => "StoreDrop",
        Kind::StoreList => "StoreList",
        Kind::StoreHeld => "StoreHeld",
        Kind::StoreClose => "StoreClose",
        Kind::StoreFetch => "StoreFetch",
        Kind::SplitPlan => "SplitPlan",
        Kind::GatherPlan => "GatherPlan",
        Kind::GatherReady => "GatherReady",
        Kind::Token => "Token",
        Kind::StandbyPlan => "StandbyPlan",
        Kind::StandbyHeld => "StandbyHeld",
        Kind::StandbyBeat => "StandbyBeat",
        Kind::HashAsk => "HashAsk",
        Kind::VerifyDigests => "VerifyDigests",
        Kind::SwitchAhead => "SwitchAhead",
        Kind::SwitchReady => "SwitchReady",
        Kind::ShareAsk => "ShareAsk",
        Kind::SharedOffer => "SharedOffer",
        Kind::SharedPages => "SharedPages",
        Kind::SharedMissed => "SharedMissed",
        Kind::AnswersAsk => "AnswersAsk",
        Kind::AnswersHeld => "AnswersHeld",
        Kind::StandbyTakeOver => "StandbyTakeOver",
        Kind::DropAhead => "DropAhead",
        Kind::DroppedAhead => "DroppedAhead",
        Kind::Owner => "Owner",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_number_reads_back_and_no_other_does() {
        let known: Vec<(u16, Kind)> = (0..=u16::MAX)
            .filter_map(|v| Kind::from_u16(v).map(|k| (v, k)))
            .collect();
        // 1..=52, no gaps, each the enum's own discriminant.
        assert_eq!(known.len(), 52);
        for (i, (v, k)) in known.iter().enumerate() {
            assert_eq!(*v, i as u16 + 1);
            assert_eq!(*k as u16, *v);
        }
        assert_eq!(Kind::from_u16(0), None);
        assert_eq!(Kind::from_u16(53), None);
    }

    #[test]
    fn names_match_the_kinds() {
        for k in (1..=52).filter_map(Kind::from_u16) {
            assert_eq!(kind_name(k), format!("{k:?}"));
        }
    }

    #[test]
    fn the_numbers_docs_protocol_md_gives_hold() {
        // A few fixed points of the table in docs/protocol.md: changing
        // one breaks every peer already deployed.
        assert_eq!(Kind::Hello as u16, 1);
        assert_eq!(Kind::Pages as u16, 4);
        assert_eq!(Kind::Abort as u16, 11);
        assert_eq!(Kind::Encoded as u16, 14);
        assert_eq!(Kind::PostcopyPlan as u16, 15);
        assert_eq!(Kind::StoreOpen as u16, 24);
        assert_eq!(Kind::SplitPlan as u16, 32);
        assert_eq!(Kind::GatherReady as u16, 34);
        assert_eq!(Kind::StandbyPlan as u16, 36);
        assert_eq!(Kind::VerifyDigests as u16, 40);
        assert_eq!(Kind::SwitchReady as u16, 42);
        assert_eq!(Kind::SharedMissed as u16, 46);
        assert_eq!(Kind::AnswersHeld as u16, 48);
    }
}
