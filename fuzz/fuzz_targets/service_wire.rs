//! The service port's wire (what the VM's clients send over TCP, and what
//! they read back): length-prefixed frames read by `wire::read_frame` and
//! `wire::complete_frame` (the buffered reader a handed-over connection
//! uses), requests by `Request::decode`, responses by `Response::decode`.
//!
//! Checks: both frame readers agree on where each frame ends and on a
//! frame too large; a decoded request or response re-encodes to its frame
//! (the reserved header bytes aside).
#![no_main]

use ferry_vmm::devices::service::wire::{
    complete_frame, read_frame, Request, Response, MAX_BODY, REQUEST_HEADER, RESPONSE_HEADER,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ferry_fuzz::init();
    let mut r = data;
    let mut at = 0usize;
    loop {
        let buffered = complete_frame(&data[at..], MAX_BODY);
        match read_frame(&mut r, MAX_BODY) {
            Ok(Some(body)) => {
                assert_eq!(
                    buffered.ok().flatten(),
                    Some(body.len()),
                    "readers disagree"
                );
                if let Ok(req) = Request::decode(&body) {
                    let mut frame = req.encode();
                    assert_eq!(frame[4..].len(), body.len());
                    frame[5..8].copy_from_slice(&body[1..4]);
                    assert_eq!(&frame[4..], &body[..], "a request re-encodes differently");
                    assert!(body.len() >= REQUEST_HEADER);
                }
                if let Ok(resp) = Response::decode(&body) {
                    let mut frame = resp.encode();
                    frame[6..8].copy_from_slice(&body[2..4]);
                    // Unknown status bytes read as BadRequest.
                    frame[4] = body[0];
                    assert_eq!(&frame[4..], &body[..], "a response re-encodes differently");
                    assert!(body.len() >= RESPONSE_HEADER);
                }
                at += 4 + body.len();
            }
            Ok(None) => {
                assert_eq!(at, data.len());
                assert!(matches!(buffered, Ok(None)));
                break;
            }
            Err(e) => {
                // Too large for both, or cut short (the buffered reader
                // then waits for more).
                match buffered {
                    Err(_) => {}
                    Ok(None) => assert!(!e.to_string().is_empty()),
                    Ok(Some(n)) => panic!("read_frame refused a frame of {n} bytes: {e}"),
                }
                break;
            }
        }
    }
});
