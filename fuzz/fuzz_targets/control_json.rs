//! The control socket's request lines (`control::protocol::parse_request`,
//! the server's reading of one line from a client: the length cap, then
//! serde_json into a `Request` with the migration's options).
//!
//! Checks: a line over the cap is refused and closes the connection; any
//! other refusal keeps it open and says why as a JSON error reply; an
//! accepted request written back as JSON reads back as the same request.
#![no_main]

use ferry_vmm::control::protocol::{fuzz_parse_request, MAX_LINE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    match fuzz_parse_request(data) {
        Ok(req) => {
            assert!(data.len() <= MAX_LINE);
            let line = serde_json::to_vec(&req).expect("a request writes as JSON");
            let again = fuzz_parse_request(&line).expect("its JSON reads back");
            assert_eq!(again, req, "a request changed through JSON");
        }
        Err((reply, close)) => {
            assert_eq!(close, data.len() > MAX_LINE);
            assert_eq!(reply["ok"], false);
            assert!(reply["error"].as_str().is_some_and(|e| !e.is_empty()));
        }
    }
});
