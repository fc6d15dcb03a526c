//! Protocol versions: the range this build speaks, what each version added
//! (one `VERSION_*` constant per feature, which the modes check before
//! using it), and the negotiation a destination runs on a control Hello.
//!
//! Each side speaks `VERSION_MIN..=VERSION_MAX`; the destination picks the
//! highest version both speak, or refuses with both ranges named. Version 1
//! is the base protocol (precopy: Hello, Layout, Pages, ZeroRanges, rounds,
//! State, Verify, Complete, Started, Abort); v2 added compressed bulk
//! streams (Codec, Encoded: `crate::encoded`), which a source uses only
//! with a v2 peer. A session holds the agreed version as its [`Caps`],
//! which the engine asks by name (`caps.early_state()`), never by number.

use super::{Hello, ProtocolError};

/// Oldest protocol version this build speaks.
pub const VERSION_MIN: u16 = 1;
/// Newest protocol version this build speaks.
pub const VERSION_MAX: u16 = 18;
/// The first version with postcopy (PostcopyPlan, PageRequest, Finished).
pub const VERSION_POSTCOPY: u16 = 3;
/// The first version where a postcopy survives a broken link (Resume
/// connections, PostcopyResume).
pub const VERSION_RESUME: u16 = 4;
/// The first version where the VM's clients move with it (ClientsPlan,
/// ClientsAnswer, Clients; Started reports restore and verify times).
pub const VERSION_CLIENTS: u16 = 5;
/// The first version where the destination sends its timeline back
/// (TimelineAsk, Timeline).
pub const VERSION_TIMELINE: u16 = 6;
/// The first version with memory servers (Role::Store and the Store*
/// messages; see memserver).
pub const VERSION_STORE: u16 = 7;
/// The first version with split migration (SplitPlan to the main host,
/// StoreFetch on memory servers).
pub const VERSION_SPLIT: u16 = 8;
/// The first version of a fleet that does not trust its network: the
/// source sends the migration token after HelloAck (Token), a StoreOpen
/// carries its owner's secret and a GatherPlan each store's secret. A
/// destination that demands a token, and every memory server, refuse older
/// peers.
pub const VERSION_TRUST: u16 = 9;
/// The first version where a bulk stream over a link that seals every
/// byte (TLS) carries its Pages frames without a checksum (the frame flag
/// SEALED): the record's AEAD tag already checks each byte, and the CRC
/// was a pass over every page on each side for nothing.
pub const VERSION_SEALED_PAGES: u16 = 10;
/// The first version with a postcopy safety net (Role::Standby and the
/// Standby* kinds): a third host holds the pages a destination still
/// lacks and resumes the postcopy if the source dies.
pub const VERSION_STANDBY: u16 = 11;
/// The first version where a verified precopy compares pages hashed as
/// they were sent and as they landed (HashAsk after TimelineAsk, and
/// VerifyDigests in the pause instead of Verify): no pass over memory in
/// the pause (`crate::verify`).
pub const VERSION_LANDED_HASHES: u16 = 12;
/// The first version where the source says at the opening whether it may
/// switch to postcopy or split (SwitchAhead after HashAsk), and a
/// destination that populated its memory ahead of the stream gives that
/// back before answering (SwitchReady): such a switch needs the pages
/// still to come missing, and punching populated ones out in the pause
/// cost about 250 ms a GiB.
pub const VERSION_SWITCH_AHEAD: u16 = 13;
/// The first version where pages another VM on the destination's host
/// already holds may travel as references (ShareAsk, SharedOffer,
/// SharedPages, SharedMissed; `crate::shared`): a drain of VMs holding the
/// same data sends it once per destination host.
pub const VERSION_SHARED_PAGES: u16 = 14;
/// The first version where a precopy's source sends State (and the
/// Clients that move) as the pause begins, before the last round, and the
/// destination restores them while that round arrives: Complete then only
/// starts the VM, and the restores (about 0.2 ms of KVM calls here, 2 ms
/// for 128 connections) leave the downtime.
pub const VERSION_EARLY_STATE: u16 = 15;
/// The first version where a source whose clients stay (forwarded) need
/// not wait, in the pause, for the guest to answer the requests in its
/// ring: the destination holds those answers (AnswersAsk, AnswersHeld) and
/// the source collects them from its service once the VM runs there.
pub const VERSION_ANSWERS_FOLLOW: u16 = 16;
/// The first version where a hybrid's source, once it has chosen to
/// switch, names the pages dirtied since they were sent (DropAhead) and
/// the destination drops them while the VM still runs on the source: the
/// pause then drops only what was dirtied since (each drop is a hole
/// punched in guest memory, ~4 µs, and a kv guest left ~25,000 of them
/// for the pause).
pub const VERSION_DROP_AHEAD: u16 = 17;
/// The first version where the source names the ownership claim it holds
/// (Owner, after AnswersAsk) and a fenced destination takes the VM from
/// exactly that claim, through the registry, before its first instruction
/// there (docs/safety.md): a VM never runs twice.
pub const VERSION_OWNER: u16 = 18;

/// What a session may use, decided once from the version both sides
/// agreed on: the modes ask it by name, never by number, so a feature's
/// version is written once, here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps(u16);

/// `name() -> bool`: the agreed version is at least `version`.
macro_rules! caps {
    ($($(#[$doc:meta])* $name:ident = $version:expr;)*) => {
        impl Caps {
            $(
                $(#[$doc])*
                pub const fn $name(self) -> bool {
                    self.0 >= $version
                }
            )*
        }
    };
}

impl Caps {
    /// The capabilities of protocol version `version`.
    pub const fn of(version: u16) -> Caps {
        Caps(version)
    }

    /// The version they come from (for messages and the records).
    pub const fn version(self) -> u16 {
        self.0
    }
}

caps! {
    /// Compressed bulk streams (Codec, Encoded), v2.
    compressed_streams = 2;
    /// Postcopy (the switch, demand and push).
    postcopy = VERSION_POSTCOPY;
    /// A paused postcopy resumed on a new link.
    resume = VERSION_RESUME;
    /// The VM's clients move with it (ClientsPlan, Started's report).
    clients = VERSION_CLIENTS;
    /// The destination's timeline comes back.
    timeline = VERSION_TIMELINE;
    /// Memory servers (stores).
    store = VERSION_STORE;
    /// Split and gather.
    split = VERSION_SPLIT;
    /// A one-time token and owner secrets (admission).
    trust = VERSION_TRUST;
    /// Pages sealed by TLS, without their own checksum.
    sealed_pages = VERSION_SEALED_PAGES;
    /// The postcopy safety net's standby.
    standby = VERSION_STANDBY;
    /// Verification of what landed, hashed outside the pause.
    landed_hashes = VERSION_LANDED_HASHES;
    /// The destination readies a switch at the opening (SwitchReady).
    switch_ahead = VERSION_SWITCH_AHEAD;
    /// Pages the destination's host already holds (SharedPages).
    shared_pages = VERSION_SHARED_PAGES;
    /// State (and the clients) before the last round.
    early_state = VERSION_EARLY_STATE;
    /// The clients' answers follow the VM.
    answers_follow = VERSION_ANSWERS_FOLLOW;
    /// Pages dropped ahead of a postcopy switch.
    drop_ahead = VERSION_DROP_AHEAD;
    /// The source's ownership claim (Owner).
    owner = VERSION_OWNER;
}

/// Picks the version both sides speak, or says why there is none.
pub fn negotiate(h: &Hello) -> Result<u16, ProtocolError> {
    let v = h.version_max.min(VERSION_MAX);
    if v < h.version_min.max(VERSION_MIN) {
        return Err(ProtocolError::Version {
            min: h.version_min,
            max: h.version_max,
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Role;

    fn hello(min: u16, max: u16) -> Hello {
        Hello {
            version_min: min,
            version_max: max,
            role: Role::Control,
            session: 0,
            streams: 1,
        }
    }

    #[test]
    fn overlapping_ranges_pick_the_highest_common_version() {
        assert_eq!(negotiate(&hello(1, 18)).unwrap(), VERSION_MAX);
        assert_eq!(negotiate(&hello(1, 17)).unwrap(), VERSION_DROP_AHEAD);
        assert_eq!(negotiate(&hello(1, 16)).unwrap(), VERSION_ANSWERS_FOLLOW);
        assert_eq!(negotiate(&hello(1, 15)).unwrap(), VERSION_EARLY_STATE);
        assert_eq!(negotiate(&hello(1, 13)).unwrap(), VERSION_SWITCH_AHEAD);
        assert_eq!(negotiate(&hello(1, 12)).unwrap(), VERSION_LANDED_HASHES);
        assert_eq!(negotiate(&hello(1, 11)).unwrap(), VERSION_STANDBY);
        assert_eq!(negotiate(&hello(1, 10)).unwrap(), VERSION_SEALED_PAGES);
        assert_eq!(negotiate(&hello(1, 9)).unwrap(), VERSION_TRUST);
        assert_eq!(negotiate(&hello(0, u16::MAX)).unwrap(), VERSION_MAX);
        assert_eq!(negotiate(&hello(1, 1)).unwrap(), 1);
        assert_eq!(negotiate(&hello(0, 1)).unwrap(), 1);
        assert_eq!(negotiate(&hello(2, 2)).unwrap(), 2);
        assert_eq!(negotiate(&hello(2, 3)).unwrap(), 3);
        assert_eq!(negotiate(&hello(3, 4)).unwrap(), VERSION_RESUME);
        assert_eq!(
            negotiate(&hello(VERSION_MAX, VERSION_MAX + 5)).unwrap(),
            VERSION_MAX
        );
    }

    #[test]
    fn each_capability_starts_at_its_version_and_stays() {
        let at = |v: u16| Caps::of(v);
        assert!(!at(1).compressed_streams() && at(2).compressed_streams());
        assert!(!at(VERSION_POSTCOPY - 1).postcopy() && at(VERSION_POSTCOPY).postcopy());
        assert!(!at(VERSION_TRUST - 1).trust() && at(VERSION_TRUST).trust());
        assert!(!at(VERSION_EARLY_STATE - 1).early_state());
        assert!(at(VERSION_EARLY_STATE).early_state());
        assert!(!at(VERSION_DROP_AHEAD - 1).drop_ahead() && at(VERSION_DROP_AHEAD).drop_ahead());
        assert!(!at(VERSION_MAX - 1).owner() && at(VERSION_MAX).owner());
        // The newest version has every capability, the oldest none.
        let all = |c: Caps| {
            [
                c.compressed_streams(),
                c.postcopy(),
                c.resume(),
                c.clients(),
                c.timeline(),
                c.store(),
                c.split(),
                c.trust(),
                c.sealed_pages(),
                c.standby(),
                c.landed_hashes(),
                c.switch_ahead(),
                c.shared_pages(),
                c.early_state(),
                c.answers_follow(),
                c.drop_ahead(),
                c.owner(),
            ]
        };
        assert!(all(at(VERSION_MAX)).iter().all(|x| *x));
        assert!(all(at(VERSION_MIN)).iter().all(|x| !*x));
        assert_eq!(at(13).version(), 13);
    }

    #[test]
    fn disjoint_ranges_are_refused_naming_both() {
        for (min, max) in [
            (VERSION_MAX + 1, VERSION_MAX + 2),
            (0, 0),
            // An inverted range overlaps nothing.
            (5, 3),
        ] {
            let e = negotiate(&hello(min, max)).unwrap_err();
            assert!(
                matches!(e, ProtocolError::Version { min: a, max: b } if (a, b) == (min, max)),
                "{e:?}"
            );
            assert_eq!(
                e.to_string(),
                format!(
                    "peer speaks protocol versions {min}..={max}, \
                     this ferry speaks {VERSION_MIN}..={VERSION_MAX}"
                )
            );
        }
    }

    #[test]
    fn every_feature_version_is_one_this_build_speaks() {
        let features = [
            VERSION_POSTCOPY,
            VERSION_RESUME,
            VERSION_CLIENTS,
            VERSION_TIMELINE,
            VERSION_STORE,
            VERSION_SPLIT,
            VERSION_TRUST,
            VERSION_SEALED_PAGES,
            VERSION_STANDBY,
            VERSION_LANDED_HASHES,
            VERSION_SWITCH_AHEAD,
            VERSION_SHARED_PAGES,
            VERSION_EARLY_STATE,
            VERSION_ANSWERS_FOLLOW,
            VERSION_DROP_AHEAD,
            VERSION_OWNER,
        ];
        assert!(features.windows(2).all(|w| w[0] < w[1]), "{features:?}");
        assert!(features
            .iter()
            .all(|v| (VERSION_MIN..=VERSION_MAX).contains(v)));
        // The newest feature is the newest version: a new constant comes
        // with a new VERSION_MAX.
        assert_eq!(features.last(), Some(&VERSION_MAX));
    }
}
