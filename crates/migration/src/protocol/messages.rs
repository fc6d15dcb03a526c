//! The structured messages: postcard (serde) bodies, the types both sides
//! build and read (Hello and its Role, Layout, RoundDone, the postcopy
//! plan and resume lists), and the helpers that send a message as one
//! frame and read one back as the type expected. Messages with raw bodies
//! (Pages, ZeroRanges) are in pages.rs; other modes' messages live with
//! their mode (session/, memserver/, split/) and use the same helpers.

use std::io::{Read, Write};

use super::kind::kind_name;
use super::{read_frame, write_frame, Frame, Kind, ProtocolError};
use crate::ranges::GpaPages;

/// Role of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    /// The control connection.
    Control,
    /// Bulk page stream number n.
    Bulk(u16),
    /// Demand pages: faults and their answers, never behind bulk data.
    Demand,
    /// Descriptor passing (same host, Unix socket).
    Fds,
    /// v4: the control connection again, after a link broke during
    /// postcopy (same session id).
    Resume,
    /// v7: a connection to a memory server.
    Store,
    /// v11: a source to its postcopy safety net.
    Standby,
}

impl Role {
    /// The connection's name in timelines and metrics (a resumed control
    /// connection counts as the control connection).
    pub fn link_name(self) -> String {
        match self {
            Role::Control | Role::Resume => "control".into(),
            Role::Bulk(i) => format!("bulk{i}"),
            Role::Demand => "demand".into(),
            Role::Fds => "fds".into(),
            Role::Store => "store".into(),
            Role::Standby => "standby".into(),
        }
    }
}

/// Opens a connection.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    /// Oldest version the sender speaks.
    pub version_min: u16,
    /// Newest version the sender speaks.
    pub version_max: u16,
    /// This connection's role.
    pub role: Role,
    /// Session id chosen by the source (ties bulk connections to the control one).
    pub session: u64,
    /// Bulk streams that will follow (control only).
    pub streams: u16,
}

/// Guest memory layout and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// (guest physical address, bytes) per region.
    pub regions: Vec<(u64, u64)>,
    /// vCPUs.
    pub vcpus: u32,
}

/// End of a round.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RoundDone {
    /// Round number (0 = full copy).
    pub round: u32,
    /// Frames each bulk stream sent in this round.
    pub frames: Vec<u64>,
}

/// Part of the postcopy plan: pages the source still has to send after the
/// switch (everything else the destination holds already, or is zero).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PostcopyPlan {
    /// Runs of pending pages (this frame's share).
    #[serde(deserialize_with = "at_most_plan_runs")]
    pub pending: Vec<GpaPages>,
    /// True on the plan's last frame.
    pub last: bool,
    /// Pages sent on each side of a requested page.
    pub prefetch: u32,
    /// The source will send page hashes at the end: record what lands.
    pub verify: bool,
    /// The guest's count of absorbed async page faults at the pause, if the
    /// VM keeps one (the destination reports the phase's share).
    pub guest_apf_base: Option<u64>,
}

/// Part of a DropAhead (v17): pages dirtied since they were sent, for the
/// destination to drop before the pause (runs in address order).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DropAhead {
    /// Runs of pages (this frame's share).
    #[serde(deserialize_with = "at_most_plan_runs")]
    pub runs: Vec<GpaPages>,
    /// True on the last frame.
    pub last: bool,
}

/// Part of a destination's answer to a ShareAsk (v14): the keys of the
/// pages its host's other VMs hold (`crate::shared`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SharedOffer {
    /// The seed every key is taken with (the same in every frame).
    pub seed: u64,
    /// Keys, ascending (this frame's share).
    pub keys: Vec<u64>,
    /// True on the offer's last frame.
    pub last: bool,
}

/// Part of the destination's answer to a Resume: pages it still lacks (the
/// source sends exactly these again; its memory has not changed since the
/// switch, so nothing can be stale).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PostcopyResume {
    /// Runs of missing pages (this frame's share).
    #[serde(deserialize_with = "at_most_plan_runs")]
    pub missing: Vec<GpaPages>,
    /// True on the last frame.
    pub last: bool,
}

/// What a source tells its postcopy safety net (v11), after the switch:
/// the session to resume as, where the destination listens, and the
/// guest's memory layout; the pending pages follow as Pages frames.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StandbyPlan {
    /// The migration's session id (the destination takes a resume only
    /// from a peer that knows it).
    pub session: u64,
    /// The protocol version the source and destination agreed on.
    pub version: u16,
    /// When the migration started (Unix seconds).
    pub started_unix_s: f64,
    /// The destination, as `tcp:IP:PORT`.
    pub destination: String,
    /// Guest RAM regions: (guest physical address, bytes).
    pub layout: Vec<(u64, u64)>,
    /// The push's round number (its barrier).
    pub round: u32,
    /// Neighbours sent with each requested page.
    pub prefetch: u32,
    /// Bulk streams to push on.
    pub streams: u16,
    /// Pages the destination lacked at the switch.
    pub pending_pages: u64,
    /// The page hashes follow the pages (a Verify frame), for the
    /// destination to check what the standby sends.
    pub verify: bool,
}

/// Most runs in one PostcopyPlan, PostcopyResume or DropAhead frame (well
/// under MAX_BODY), checked as a frame is read.
pub const PLAN_RUNS_PER_FRAME: usize = 1 << 20;

/// Reads a frame's runs, refusing the frame once it holds more than
/// [`PLAN_RUNS_PER_FRAME`]: a peer's count is not trusted, and a frame of
/// tiny runs could otherwise grow to a quarter of a GiB before a check
/// after decoding saw it.
fn at_most_plan_runs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<GpaPages>, D::Error> {
    struct Runs;
    impl<'de> serde::de::Visitor<'de> for Runs {
        type Value = Vec<GpaPages>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "at most {PLAN_RUNS_PER_FRAME} runs")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            if seq.size_hint().is_some_and(|n| n > PLAN_RUNS_PER_FRAME) {
                return Err(serde::de::Error::custom(format!(
                    "more than {PLAN_RUNS_PER_FRAME} runs in one frame"
                )));
            }
            let mut runs = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 12));
            while let Some(run) = seq.next_element()? {
                if runs.len() == PLAN_RUNS_PER_FRAME {
                    return Err(serde::de::Error::custom(format!(
                        "more than {PLAN_RUNS_PER_FRAME} runs in one frame"
                    )));
                }
                runs.push(run);
            }
            Ok(runs)
        }
    }
    d.deserialize_seq(Runs)
}

/// `runs` cut into the shares of a message sent as several frames
/// (PostcopyPlan, PostcopyResume), each with "is it the last": always at
/// least one share, empty when there are no runs.
pub fn run_frames(runs: &[GpaPages]) -> impl Iterator<Item = (&[GpaPages], bool)> {
    let n = runs.len().div_ceil(PLAN_RUNS_PER_FRAME).max(1);
    (0..n).map(move |i| {
        let from = (i * PLAN_RUNS_PER_FRAME).min(runs.len());
        let to = ((i + 1) * PLAN_RUNS_PER_FRAME).min(runs.len());
        (&runs[from..to], i == n - 1)
    })
}

/// Writes a message with a postcard body.
pub fn send<T: serde::Serialize>(
    w: &mut impl Write,
    kind: Kind,
    msg: &T,
) -> Result<(), ProtocolError> {
    let body = postcard::to_stdvec(msg).map_err(|e| ProtocolError::Malformed {
        kind,
        reason: e.to_string(),
    })?;
    write_frame(w, kind, &body)?;
    Ok(())
}

/// Decodes a postcard body of the expected kind.
pub fn decode<T: serde::de::DeserializeOwned>(f: &Frame, want: Kind) -> Result<T, ProtocolError> {
    if f.kind != want {
        return Err(ProtocolError::Unexpected {
            got: f.kind,
            want: kind_name(want),
        });
    }
    postcard::from_bytes(&f.body).map_err(|e| ProtocolError::Malformed {
        kind: f.kind,
        reason: e.to_string(),
    })
}

/// Reads the next frame and decodes it as `want`.
pub fn recv<T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
    want: Kind,
) -> Result<T, ProtocolError> {
    decode(&read_frame(r)?, want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_frame_over_the_runs_cap_is_refused_as_it_is_read() {
        // Found by a hostile source: 16.7 M runs in one PostcopyPlan were
        // decoded whole (+290 MiB) before anything counted them.
        let run = GpaPages::new(0, 1);
        let plan = |n: usize| PostcopyPlan {
            pending: vec![run; n],
            last: true,
            prefetch: 0,
            verify: false,
            guest_apf_base: None,
        };
        let frame = |kind: Kind, body: Vec<u8>| Frame { kind, body };
        let at_cap = postcard::to_stdvec(&plan(PLAN_RUNS_PER_FRAME)).unwrap();
        let read: PostcopyPlan =
            decode(&frame(Kind::PostcopyPlan, at_cap), Kind::PostcopyPlan).unwrap();
        assert_eq!(read.pending.len(), PLAN_RUNS_PER_FRAME);
        let over = postcard::to_stdvec(&plan(PLAN_RUNS_PER_FRAME + 1)).unwrap();
        let e = decode::<PostcopyPlan>(&frame(Kind::PostcopyPlan, over), Kind::PostcopyPlan)
            .unwrap_err();
        // (postcard keeps no text of a custom error: the kind says it.)
        assert!(
            matches!(
                e,
                ProtocolError::Malformed {
                    kind: Kind::PostcopyPlan,
                    ..
                }
            ),
            "{e}"
        );
        // The other run-carrying messages too.
        let resume = PostcopyResume {
            missing: vec![run; PLAN_RUNS_PER_FRAME + 1],
            last: true,
        };
        let body = postcard::to_stdvec(&resume).unwrap();
        assert!(
            decode::<PostcopyResume>(&frame(Kind::PostcopyResume, body), Kind::PostcopyResume)
                .is_err()
        );
        let drop = DropAhead {
            runs: vec![run; PLAN_RUNS_PER_FRAME + 1],
            last: true,
        };
        let body = postcard::to_stdvec(&drop).unwrap();
        assert!(decode::<DropAhead>(&frame(Kind::DropAhead, body), Kind::DropAhead).is_err());
    }
    use crate::protocol::{decode_pages, encode_pages, PAGE};

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        let hello = Hello {
            version_min: 1,
            version_max: 1,
            role: Role::Bulk(2),
            session: 9,
            streams: 0,
        };
        send(&mut buf, Kind::Hello, &hello).unwrap();
        let gpas = [0x1000u64, 0x5000];
        let data = vec![7u8; 2 * PAGE];
        write_frame(&mut buf, Kind::Pages, &encode_pages(&gpas, &data)).unwrap();
        let mut r = &buf[..];
        assert_eq!(recv::<Hello>(&mut r, Kind::Hello).unwrap(), hello);
        let f = read_frame(&mut r).unwrap();
        let (g, d) = decode_pages(&f.body).unwrap();
        assert_eq!((g.as_slice(), d), (&gpas[..], &data[..]));
        assert!(matches!(read_frame(&mut r), Err(ProtocolError::Closed)));
    }

    #[test]
    fn every_message_reads_back_as_sent() {
        let runs = vec![GpaPages::new(0x1000, 3), GpaPages::new(0x10_0000, 1)];
        let layout = Layout {
            regions: vec![(0, 1 << 30), (1 << 32, 1 << 20)],
            vcpus: 4,
        };
        let done = RoundDone {
            round: 3,
            frames: vec![10, 0, 7],
        };
        let plan = PostcopyPlan {
            pending: runs.clone(),
            last: true,
            prefetch: 8,
            verify: true,
            guest_apf_base: Some(42),
        };
        let resume = PostcopyResume {
            missing: runs,
            last: false,
        };
        let mut buf = Vec::new();
        send(&mut buf, Kind::Layout, &layout).unwrap();
        send(&mut buf, Kind::RoundDone, &done).unwrap();
        send(&mut buf, Kind::PostcopyPlan, &plan).unwrap();
        send(&mut buf, Kind::PostcopyResume, &resume).unwrap();
        let mut r = &buf[..];
        assert_eq!(recv::<Layout>(&mut r, Kind::Layout).unwrap(), layout);
        assert_eq!(recv::<RoundDone>(&mut r, Kind::RoundDone).unwrap(), done);
        assert_eq!(
            recv::<PostcopyPlan>(&mut r, Kind::PostcopyPlan).unwrap(),
            plan
        );
        assert_eq!(
            recv::<PostcopyResume>(&mut r, Kind::PostcopyResume).unwrap(),
            resume
        );
    }

    #[test]
    fn hello_and_roles_keep_their_wire_bytes() {
        // docs/protocol.md: roles are postcard variants Control 0, Bulk 1,
        // Demand 2, Fds 3, Resume 4, Store 5; Hello's fields are varints in
        // order. Older and newer peers depend on these bytes.
        let roles = [
            (Role::Control, vec![0]),
            (Role::Bulk(3), vec![1, 3]),
            (Role::Demand, vec![2]),
            (Role::Fds, vec![3]),
            (Role::Resume, vec![4]),
            (Role::Store, vec![5]),
            (Role::Standby, vec![6]),
        ];
        for (role, bytes) in roles {
            assert_eq!(postcard::to_stdvec(&role).unwrap(), bytes, "{role:?}");
        }
        let hello = Hello {
            version_min: 1,
            version_max: 8,
            role: Role::Control,
            session: 9,
            streams: 2,
        };
        assert_eq!(postcard::to_stdvec(&hello).unwrap(), [1, 8, 0, 9, 2]);
    }

    #[test]
    fn a_message_of_another_kind_is_unexpected() {
        let mut buf = Vec::new();
        send(
            &mut buf,
            Kind::Layout,
            &Layout {
                regions: vec![(0, 4096)],
                vcpus: 1,
            },
        )
        .unwrap();
        let e = recv::<Hello>(&mut &buf[..], Kind::Hello).unwrap_err();
        assert!(
            matches!(
                e,
                ProtocolError::Unexpected {
                    got: Kind::Layout,
                    want: "Hello"
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "unexpected Layout message while waiting for Hello"
        );
    }

    #[test]
    fn a_body_that_does_not_decode_is_malformed() {
        let mut buf = Vec::new();
        // A Hello cut after its first field.
        write_frame(&mut buf, Kind::Hello, &[1]).unwrap();
        assert!(matches!(
            recv::<Hello>(&mut &buf[..], Kind::Hello),
            Err(ProtocolError::Malformed {
                kind: Kind::Hello,
                ..
            })
        ));
    }

    #[test]
    fn an_abort_while_waiting_is_the_peers_reason() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Abort, b"no room").unwrap();
        assert!(matches!(
            recv::<Hello>(&mut &buf[..], Kind::HelloAck),
            Err(ProtocolError::Aborted(m)) if m == "no room"
        ));
    }

    #[test]
    fn runs_go_out_in_marked_frames() {
        let runs: Vec<GpaPages> = (0..PLAN_RUNS_PER_FRAME as u64 + 1)
            .map(|i| GpaPages::new(i * 8192, 1))
            .collect();
        let shares: Vec<(usize, bool)> = run_frames(&runs).map(|(r, l)| (r.len(), l)).collect();
        assert_eq!(shares, [(PLAN_RUNS_PER_FRAME, false), (1, true)]);
        let shares: Vec<(usize, bool)> =
            run_frames(&runs[..3]).map(|(r, l)| (r.len(), l)).collect();
        assert_eq!(shares, [(3, true)]);
        assert_eq!(
            run_frames(&[])
                .map(|(r, l)| (r.len(), l))
                .collect::<Vec<_>>(),
            [(0, true)]
        );
    }

    #[test]
    fn link_names_fold_a_resumed_control_into_control() {
        assert_eq!(Role::Resume.link_name(), Role::Control.link_name());
        assert_eq!(Role::Bulk(3).link_name(), "bulk3");
        assert_eq!(Role::Demand.link_name(), "demand");
    }
}
