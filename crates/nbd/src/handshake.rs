//! The negotiation, from the server's greeting to the export's size and
//! flags: fixed newstyle only, STARTTLS first when TLS is asked for, then
//! GO with the export's name. Each step reads only what its header
//! announces, within the limits in [`wire`].

use std::io::{Read, Write};

use crate::error::NbdError;
use crate::wire::{self, ExportInfo};

/// Reads exactly `buf.len()` bytes; a closed or broken link is `Io`.
pub(crate) fn read_exact(r: &mut impl Read, buf: &mut [u8], addr: &str) -> Result<(), NbdError> {
    r.read_exact(buf).map_err(|source| NbdError::Io {
        addr: addr.into(),
        source,
    })
}

/// Writes all of `buf` and flushes.
pub(crate) fn write_all(w: &mut impl Write, buf: &[u8], addr: &str) -> Result<(), NbdError> {
    w.write_all(buf)
        .and_then(|_| w.flush())
        .map_err(|source| NbdError::Io {
            addr: addr.into(),
            source,
        })
}

/// The greeting: the server's magic and flags, answered with the
/// client's flags.
pub fn greet(s: &mut (impl Read + Write), addr: &str) -> Result<(), NbdError> {
    let mut b = [0u8; 18];
    read_exact(s, &mut b[..16], addr)?;
    let magic = u64::from_be_bytes(b[0..8].try_into().unwrap_or_default());
    if magic != wire::NBDMAGIC {
        return Err(NbdError::NotNbd(format!(
            "{addr} does not speak NBD (its first bytes: {:02x?})",
            &b[..8]
        )));
    }
    match u64::from_be_bytes(b[8..16].try_into().unwrap_or_default()) {
        wire::IHAVEOPT => {}
        wire::OLDSTYLE_MAGIC => {
            return Err(NbdError::NotNbd(format!(
                "{addr} speaks the oldstyle NBD protocol (no export names, no TLS): run the server in newstyle mode (qemu-nbd and nbdkit do by default)"
            )))
        }
        m => return Err(NbdError::NotNbd(format!("{addr}: NBD magic then {m:#018x}"))),
    }
    read_exact(s, &mut b[16..18], addr)?;
    let flags = u16::from_be_bytes([b[16], b[17]]);
    if flags & wire::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::NotNbd(format!(
            "{addr} does not speak fixed-newstyle NBD (handshake flags {flags:#06x})"
        )));
    }
    let mut mine = wire::FLAG_C_FIXED_NEWSTYLE;
    if flags & wire::FLAG_NO_ZEROES != 0 {
        mine |= wire::FLAG_C_NO_ZEROES;
    }
    write_all(s, &mine.to_be_bytes(), addr)
}

/// One option reply: (its type, its data).
fn option_reply(s: &mut impl Read, opt: u32, addr: &str) -> Result<(u32, Vec<u8>), NbdError> {
    let mut h = [0u8; 20];
    read_exact(s, &mut h, addr)?;
    let (got, kind, len) = wire::option_reply(&h)?;
    if got != opt {
        return Err(NbdError::Protocol(format!(
            "a reply to option {got} while option {opt} was asked"
        )));
    }
    // `len` is capped by wire::option_reply.
    let mut data = vec![0u8; len as usize];
    read_exact(s, &mut data, addr)?;
    Ok((kind, data))
}

/// An error reply, in words.
fn refusal(kind: u32, data: &[u8]) -> String {
    let name = match kind & !wire::REP_FLAG_ERROR {
        1 => "not supported",
        2 => "forbidden by the server's policy",
        3 => "invalid",
        4 => "not available on this platform",
        5 => "TLS is required",
        6 => "no such export",
        7 => "the server is shutting down",
        8 => "block size constraints are required",
        9 => "too big",
        n => return format!("error {n}"),
    };
    let text: String = String::from_utf8_lossy(&data[..data.len().min(200)])
        .chars()
        .filter(|c| !c.is_control())
        .collect();
    if text.is_empty() {
        name.into()
    } else {
        format!("{name} ({text})")
    }
}

/// STARTTLS: the server agrees (the caller then runs the TLS handshake on
/// the same connection) or says why not.
pub fn starttls(s: &mut (impl Read + Write), addr: &str) -> Result<(), NbdError> {
    write_all(s, &wire::option(wire::OPT_STARTTLS, &[]), addr)?;
    let (kind, data) = option_reply(s, wire::OPT_STARTTLS, addr)?;
    match kind {
        wire::REP_ACK => Ok(()),
        k if k & wire::REP_FLAG_ERROR != 0 => Err(NbdError::Tls(format!(
            "{addr} does not take TLS: {} (use nbd:// for a plaintext server)",
            refusal(k, &data)
        ))),
        k => Err(NbdError::Protocol(format!("reply {k} to STARTTLS"))),
    }
}

/// GO: chooses `export` and enters transmission; what the export is.
pub fn go(
    s: &mut (impl Read + Write),
    export: &str,
    tls: bool,
    addr: &str,
) -> Result<ExportInfo, NbdError> {
    write_all(s, &wire::option(wire::OPT_GO, &wire::go_data(export)), addr)?;
    let mut info = ExportInfo::default();
    let mut seen_export = false;
    for _ in 0..wire::MAX_OPTION_REPLIES {
        let (kind, data) = option_reply(s, wire::OPT_GO, addr)?;
        match kind {
            wire::REP_INFO => wire::take_info(&data, &mut info, &mut seen_export)?,
            wire::REP_ACK if seen_export => return Ok(info),
            wire::REP_ACK => {
                return Err(NbdError::Protocol(
                    "GO ended without the export's size".into(),
                ))
            }
            k if k & wire::REP_FLAG_ERROR != 0 => {
                if k & !wire::REP_FLAG_ERROR == 5 && !tls {
                    return Err(NbdError::Tls(format!("{addr} requires TLS: use nbds://")));
                }
                return Err(NbdError::Refused {
                    option: "export",
                    reason: format!("{export:?}: {}", refusal(k, &data)),
                });
            }
            k => return Err(NbdError::Protocol(format!("reply {k} to GO"))),
        }
    }
    Err(NbdError::Protocol(format!(
        "more than {} replies to GO",
        wire::MAX_OPTION_REPLIES
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A scripted server: what it says, and what the client wrote.
    struct Script {
        said: Cursor<Vec<u8>>,
        heard: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.said.read(b)
        }
    }
    impl Write for Script {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.heard.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn script(said: Vec<u8>) -> Script {
        Script {
            said: Cursor::new(said),
            heard: Vec::new(),
        }
    }

    fn greeting(flags: u16) -> Vec<u8> {
        let mut b = wire::NBDMAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b
    }

    use crate::wire::server_option_reply as reply;

    fn export_info(size: u64, flags: u16) -> Vec<u8> {
        let mut d = vec![0, 0];
        d.extend_from_slice(&size.to_be_bytes());
        d.extend_from_slice(&flags.to_be_bytes());
        d
    }

    #[test]
    fn a_fixed_newstyle_server_is_greeted_and_gives_its_export() {
        let mut said = greeting(wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES);
        said.extend(reply(
            wire::OPT_GO,
            wire::REP_INFO,
            &export_info(1 << 20, 5),
        ));
        said.extend(reply(wire::OPT_GO, wire::REP_ACK, &[]));
        let mut s = script(said);
        greet(&mut s, "t").unwrap();
        let info = go(&mut s, "disk", false, "t").unwrap();
        assert_eq!((info.size, info.flags), (1 << 20, 5));
        // Client flags, then IHAVEOPT GO with the name and one info ask.
        assert_eq!(&s.heard[..4], &3u32.to_be_bytes());
        assert_eq!(&s.heard[4..12], &wire::IHAVEOPT.to_be_bytes());
        assert_eq!(&s.heard[12..16], &wire::OPT_GO.to_be_bytes());
        assert_eq!(&s.heard[20..24], &4u32.to_be_bytes());
        assert_eq!(&s.heard[24..28], b"disk");
    }

    #[test]
    fn servers_that_are_not_fixed_newstyle_nbd_are_refused() {
        let mut old = wire::NBDMAGIC.to_be_bytes().to_vec();
        old.extend_from_slice(&wire::OLDSTYLE_MAGIC.to_be_bytes());
        old.extend_from_slice(&[0; 8]);
        for said in [
            b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
            old,
            greeting(0),
            greeting(1)[..10].to_vec(),
        ] {
            let e = greet(&mut script(said), "t").unwrap_err();
            assert!(
                matches!(e, NbdError::NotNbd(_) | NbdError::Io { .. }),
                "{e}"
            );
        }
    }

    #[test]
    fn refusals_and_broken_replies_are_errors_in_words() {
        let go_with = |replies: Vec<u8>, tls| go(&mut script(replies), "d", tls, "t");
        let e = go_with(
            reply(wire::OPT_GO, wire::REP_FLAG_ERROR | 6, b"no d"),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("no such export (no d)"), "{e}");
        let e = go_with(reply(wire::OPT_GO, wire::REP_FLAG_ERROR | 5, &[]), false).unwrap_err();
        assert!(e.to_string().contains("use nbds://"), "{e}");
        let e = go_with(reply(wire::OPT_GO, wire::REP_ACK, &[]), false).unwrap_err();
        assert!(e.to_string().contains("without the export's size"), "{e}");
        let e = go_with(reply(wire::OPT_STARTTLS, wire::REP_ACK, &[]), false).unwrap_err();
        assert!(matches!(e, NbdError::Protocol(_)), "{e}");
        // A server that never ACKs is cut off.
        let many: Vec<u8> = (0..100)
            .flat_map(|_| reply(wire::OPT_GO, wire::REP_INFO, &[0, 99]))
            .collect();
        assert!(matches!(go_with(many, false), Err(NbdError::Protocol(_))));
        // A reply announcing more than its limit is not read.
        let mut big = reply(wire::OPT_GO, wire::REP_INFO, &[]);
        big[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(go_with(big, false), Err(NbdError::Protocol(_))));
        let e = starttls(
            &mut script(reply(wire::OPT_STARTTLS, wire::REP_FLAG_ERROR | 2, &[])),
            "t",
        )
        .unwrap_err();
        assert!(matches!(e, NbdError::Tls(_)), "{e}");
    }
}
