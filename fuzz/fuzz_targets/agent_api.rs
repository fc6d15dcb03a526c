//! The fleet agent's API (`crates/fleet`): what an agent reads from a peer
//! (a request line, `api::parse_request`: JSON, then names, sizes and
//! lengths checked) and what a client reads from an agent (a reply line: a
//! progress line, an error, or a host's account of itself). The first byte
//! picks which (`Q` a request, anything else a reply).
//!
//! Checks: an accepted request has a VM name that is a file name of its
//! own, sizes ferry runs and bounded fields, and reads back the same
//! through JSON; a reply that parses as a host keeps its VMs' names as
//! they came (a client never trusts them as paths: it only prints them).
#![no_main]

use ferry_fleet::{check_name, parse_request, HostInfo, Request, MAX_FIELD, MAX_STORES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let Some((&which, line)) = data.split_first() else {
        return;
    };
    if which == b'Q' {
        let Ok(req) = parse_request(line) else {
            return;
        };
        match &req {
            Request::Start { vm } => vm.check().expect("an accepted spec passes its check"),
            Request::Receive {
                vm,
                from,
                token,
                budget,
                ..
            } => {
                vm.check().expect("an accepted spec passes its check");
                assert!(!from.is_empty() && from.len() <= MAX_FIELD);
                assert!(!token.is_empty() && token.len() <= MAX_FIELD);
                assert!(budget.is_none_or(|b| b > 0 && b <= vm.mem_bytes));
            }
            Request::Store { vm, bytes } | Request::Standby { vm, bytes } => {
                check_name(vm).expect("an accepted name passes its check");
                assert!(*bytes > 0 && *bytes <= 1 << 40);
            }
            Request::Stop { name } | Request::Upgrade { name, .. } => {
                check_name(name).expect("an accepted name passes its check")
            }
            Request::Send {
                name,
                token,
                split,
                safety_net,
                ..
            } => {
                check_name(name).expect("an accepted name passes its check");
                assert!(token.len() <= MAX_FIELD);
                assert!(safety_net.as_ref().is_none_or(|n| n.len() <= MAX_FIELD));
                if let Some(sp) = split {
                    assert!(!sp.subs.is_empty() && sp.subs.len() <= MAX_STORES);
                }
            }
            Request::Info | Request::DirtyRates => {}
        }
        let again = serde_json::to_vec(&req).expect("a request writes as JSON");
        assert_eq!(parse_request(&again).expect("its JSON reads back"), req);
        return;
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else {
        return;
    };
    if let Ok(h) = serde_json::from_value::<HostInfo>(v["host"].clone()) {
        let again = serde_json::to_value(&h).expect("a host writes as JSON");
        assert_eq!(
            serde_json::from_value::<HostInfo>(again).expect("reads back"),
            h
        );
    }
});
