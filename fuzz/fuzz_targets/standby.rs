//! A postcopy standby's intake (`standby::intake`): what a source sends
//! before the standby stands by. The Hello (a standby's role or another,
//! any version range), a StandbyPlan (mostly well-formed from the input's
//! pieces: a layout of up to three regions, aligned or not, in order or
//! not, empty or huge, a destination that parses or not, the Hello's
//! session or another; else raw bytes), then frames of every kind: pages
//! inside and outside the layout, zero runs, hashes, Complete, others.
//!
//! Checks: never a panic or a hang; the standby answers only HelloAck and
//! StandbyHeld; an intake that succeeds came from a standby's Hello, with
//! a layout that holds memory, and says in StandbyHeld what it holds.
#![no_main]

use ferry_fuzz::{frame, init, kind_of, Input, Peer};
use ferry_migration::protocol::{self, Hello, Kind, Role, StandbyPlan, VERSION_MAX};
use libfuzzer_sys::fuzz_target;

const PAGE: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    init();
    let mut input = Input::new(data);
    let sel = input.u8();
    let hello = Hello {
        version_min: if sel % 16 == 15 { 1 } else { 11 },
        version_max: if sel % 32 == 31 { input.u16() } else { VERSION_MAX },
        role: if sel % 8 == 7 { Role::Store } else { Role::Standby },
        session: 7,
        streams: 1,
    };
    let mut wire = Vec::new();
    let mut layout: Vec<(u64, u64)> = Vec::new();
    if input.u8() % 8 != 0 {
        let mut end = 0u64;
        for _ in 0..1 + input.u8() % 3 {
            let (a, b) = (input.u8(), input.u8());
            let gpa = match a {
                255 => end.saturating_sub(PAGE),
                254 => end + 1,
                _ => end + u64::from(a % 4) * PAGE,
            };
            let size = match b {
                255 => 2 << 40,
                254 => 0,
                _ => u64::from(1 + b % 16) * PAGE,
            };
            layout.push((gpa, size));
            end = gpa.saturating_add(size);
        }
        let plan = StandbyPlan {
            session: if input.u8() % 16 == 0 { 8 } else { 7 },
            version: 11,
            started_unix_s: 0.0,
            destination: if input.u8() % 8 == 0 {
                String::from_utf8_lossy(input.chunk()).into_owned()
            } else {
                "tcp:127.0.0.1:9".into()
            },
            layout: layout.clone(),
            round: 0,
            prefetch: u32::from(input.u8()),
            streams: u16::from(input.u8()),
            pending_pages: input.u64(),
            verify: input.bool(),
        };
        wire.extend(frame(Kind::StandbyPlan, &postcard::to_stdvec(&plan).expect("encodes")));
    } else {
        wire.extend(frame(Kind::StandbyPlan, input.chunk()));
    }
    let total_pages: u64 = layout.iter().map(|r| r.1 / PAGE).sum();
    while !input.is_empty() {
        match input.u8() % 8 {
            0..=3 => {
                let n = usize::from(input.u8() % 4);
                let gpas: Vec<u64> = (0..n)
                    .map(|_| {
                        let r = layout
                            .get(usize::from(input.u8()) % layout.len().max(1))
                            .copied()
                            .unwrap_or((0, PAGE));
                        r.0 + u64::from(input.u8() % 20) * PAGE
                    })
                    .collect();
                let mut pages = Vec::new();
                for _ in &gpas {
                    pages.extend(input.page());
                }
                wire.extend(frame(Kind::Pages, &protocol::encode_pages(&gpas, &pages)));
            }
            4 => wire.extend(frame(Kind::ZeroRanges, input.chunk())),
            5 => {
                let n = usize::from(input.u8()) * 8 + usize::from(input.u8() % 2);
                wire.extend(frame(Kind::Verify, &vec![0x11; n]));
            }
            6 => wire.extend(frame(Kind::Complete, &[])),
            _ => {
                let k = kind_of(input.u8());
                wire.extend(frame(k, input.chunk()));
            }
        }
    }

    let (mut conn, peer) = Peer::connect(wire);
    let held = ferry_migration::fuzzing::standby_intake(&mut conn, &hello);
    drop(conn);
    let answers = peer.answers();
    let mut r = &answers[..];
    let mut said_held = None;
    loop {
        match protocol::read_frame(&mut r) {
            Ok(f) => match f.kind {
                Kind::HelloAck => {}
                Kind::StandbyHeld => said_held = postcard::from_bytes::<u64>(&f.body).ok(),
                k => panic!("the standby answered with {k:?}"),
            },
            Err(protocol::ProtocolError::Closed) => break,
            Err(e) => panic!("the standby's answers do not read back: {e}"),
        }
    }
    if let Ok(pages) = held {
        assert_eq!(hello.role, Role::Standby, "a {:?} connection was held", hello.role);
        assert_eq!(said_held, Some(pages), "StandbyHeld does not say what is held");
        assert!(total_pages > 0, "held pages of an empty layout");
    }
});
