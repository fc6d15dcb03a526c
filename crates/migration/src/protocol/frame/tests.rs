//! Frames written and read back, and every way a header or body is refused:
//! magic (or a TLS record in its place), kind, flags, length, checksum,
//! truncation, socket errors.

use super::*;
use crate::protocol::{encode_pages, PAGE};

fn frame(kind: Kind, body: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    write_frame(&mut buf, kind, body).unwrap();
    buf
}

#[test]
fn a_good_frame_round_trips() {
    let pattern: Vec<u8> = (0..3 * PAGE).map(|i| (i * 7 % 251) as u8).collect();
    for body in [&b""[..], b"x", &pattern] {
        let wire = frame(Kind::Layout, body);
        assert_eq!(wire.len(), HEADER + body.len());
        assert_eq!(&wire[0..4], b"FRYM");
        assert_eq!(&wire[6..8], [0, 0], "flags");
        let h = read_header(&mut &wire[..]).unwrap();
        assert_eq!(
            h,
            Header {
                kind: Kind::Layout,
                len: body.len() as u32,
                crc: crate::checksum::crc32c(body),
                sealed: false,
            }
        );
        let mut r = &wire[..];
        let f = read_frame(&mut r).unwrap();
        assert_eq!((f.kind, &f.body[..]), (Kind::Layout, body));
        assert!(r.is_empty(), "read exactly one frame");
    }
}

#[test]
fn a_body_of_exactly_the_limit_is_accepted() {
    let body = vec![0x5a; MAX_BODY];
    let f = read_frame(&mut &frame(Kind::Pages, &body)[..]).unwrap();
    assert_eq!(f.body.len(), MAX_BODY);
}

#[test]
fn frames_follow_each_other_and_a_clean_end_is_closed() {
    let mut wire = frame(Kind::Complete, b"");
    wire.extend(frame(Kind::State, b"state"));
    let mut r = &wire[..];
    assert_eq!(read_frame(&mut r).unwrap().kind, Kind::Complete);
    assert_eq!(read_frame(&mut r).unwrap().body, b"state");
    assert!(matches!(read_frame(&mut r), Err(ProtocolError::Closed)));
}

#[test]
fn bad_magic_is_refused_with_what_came() {
    assert!(matches!(
        read_frame(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]),
        Err(ProtocolError::BadMagic(0x2054_4547))
    ));
    let mut wire = frame(Kind::Hello, b"hi");
    wire[3] = b'N';
    let e = read_frame(&mut &wire[..]).unwrap_err();
    assert!(matches!(e, ProtocolError::BadMagic(0x4e59_5246)), "{e:?}");
    assert!(e.to_string().contains("0x4e595246"), "{e}");
}

#[test]
fn a_tls_record_where_a_frame_starts_says_the_peer_speaks_tls() {
    // What a TLS server answers a plaintext Hello with (an alert, then
    // it closes), and a TLS client's first bytes.
    let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32];
    let mut hello = vec![0x16, 0x03, 0x01, 0x00, 0xc0, 0x01];
    hello.resize(HEADER + 8, 0);
    for wire in [&alert[..], &hello[..]] {
        let e = read_header(&mut &wire[..]).unwrap_err();
        assert!(matches!(e, ProtocolError::SpeaksTls), "{e:?}");
        assert!(e.to_string().contains("--insecure"), "{e}");
    }
    // Two bytes are not enough to tell: a plain truncation.
    assert!(matches!(
        read_header(&mut &alert[..2]),
        Err(ProtocolError::Truncated)
    ));
}

#[test]
fn an_unknown_kind_is_refused() {
    for raw in [0u16, 53, 99, u16::MAX] {
        let mut wire = frame(Kind::Hello, b"hi");
        wire[4..6].copy_from_slice(&raw.to_le_bytes());
        assert!(
            matches!(read_frame(&mut &wire[..]), Err(ProtocolError::BadKind(k)) if k == raw),
            "kind {raw}"
        );
    }
}

#[test]
fn a_length_over_the_limit_is_refused_from_the_header_alone() {
    for len in [MAX_BODY as u32 + 1, u32::MAX] {
        let mut wire = frame(Kind::Pages, b"");
        wire[8..12].copy_from_slice(&len.to_le_bytes());
        // No body follows: the header alone must be refused, before
        // anything is allocated or read for the body.
        assert!(
            matches!(read_frame(&mut &wire[..]), Err(ProtocolError::TooLarge(l)) if l == len),
            "len {len}"
        );
    }
}

#[test]
fn a_truncated_header_is_truncated_and_an_empty_stream_closed() {
    let wire = frame(Kind::Hello, b"hi");
    assert!(matches!(
        read_header(&mut &wire[..0]),
        Err(ProtocolError::Closed)
    ));
    for cut in 1..HEADER {
        assert!(
            matches!(
                read_header(&mut &wire[..cut]),
                Err(ProtocolError::Truncated)
            ),
            "cut at {cut}"
        );
    }
}

#[test]
fn a_truncated_body_is_truncated() {
    let wire = frame(Kind::State, b"some vm state");
    for cut in HEADER..wire.len() {
        assert!(
            matches!(read_frame(&mut &wire[..cut]), Err(ProtocolError::Truncated)),
            "cut at {cut}"
        );
    }
}

#[test]
fn a_bad_checksum_is_refused() {
    let wire = frame(Kind::State, b"some vm state");
    // A flipped bit in the body, and one in the checksum itself.
    for at in [HEADER, wire.len() - 1, 12, 15] {
        let mut bad = wire.clone();
        bad[at] ^= 0x10;
        assert!(
            matches!(
                read_frame(&mut &bad[..]),
                Err(ProtocolError::Checksum {
                    kind: Kind::State,
                    len: 13
                })
            ),
            "bit flipped at {at}"
        );
    }
}

#[test]
fn an_abort_frame_is_the_peers_reason_once_its_checksum_holds() {
    let wire = frame(Kind::Abort, b"disk full");
    assert!(
        matches!(read_frame(&mut &wire[..]), Err(ProtocolError::Aborted(m)) if m == "disk full")
    );
    let mut bad = wire.clone();
    bad[HEADER] ^= 1;
    assert!(matches!(
        read_frame(&mut &bad[..]),
        Err(ProtocolError::Checksum {
            kind: Kind::Abort,
            ..
        })
    ));
    let odd = frame(Kind::Abort, b"no \xff utf-8");
    assert!(
        matches!(read_frame(&mut &odd[..]), Err(ProtocolError::Aborted(m)) if m == "no \u{fffd} utf-8")
    );
}

/// A reader that hands out one byte per call, with an interrupted call
/// before each, then fails with `end` once its bytes are gone.
struct Trickle<'a> {
    bytes: &'a [u8],
    interrupt: bool,
    end: Option<io::ErrorKind>,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.interrupt = !self.interrupt;
        if self.interrupt {
            return Err(io::ErrorKind::Interrupted.into());
        }
        match (self.bytes.split_first(), self.end) {
            (Some((b, rest)), _) => {
                buf[0] = *b;
                self.bytes = rest;
                Ok(1)
            }
            (None, Some(kind)) => Err(kind.into()),
            (None, None) => Ok(0),
        }
    }
}

#[test]
fn short_and_interrupted_reads_make_up_a_frame() {
    let wire = frame(Kind::RoundDone, b"round");
    let mut r = Trickle {
        bytes: &wire,
        interrupt: false,
        end: None,
    };
    assert_eq!(read_frame(&mut r).unwrap().body, b"round");
    assert!(matches!(read_frame(&mut r), Err(ProtocolError::Closed)));
}

#[test]
fn a_socket_error_is_an_io_error_not_a_truncation() {
    let wire = frame(Kind::RoundDone, b"round");
    for cut in [0, 5, HEADER + 2] {
        let mut r = Trickle {
            bytes: &wire[..cut],
            interrupt: false,
            end: Some(io::ErrorKind::ConnectionReset),
        };
        assert!(
            matches!(read_frame(&mut r), Err(ProtocolError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset),
            "cut at {cut}"
        );
    }
}

#[test]
fn a_reused_body_buffer_takes_each_frames_length() {
    let mut wire = frame(Kind::Pages, &[1; 100]);
    wire.extend(frame(Kind::ZeroRanges, &[2; 3]));
    let mut r = &wire[..];
    let mut body = Vec::new();
    assert_eq!(read_frame_into(&mut r, &mut body).unwrap(), Kind::Pages);
    assert_eq!(body, [1; 100]);
    assert_eq!(
        read_frame_into(&mut r, &mut body).unwrap(),
        Kind::ZeroRanges
    );
    assert_eq!(body, [2; 3]);
}

/// A reader that announces a body and then sends `sent` bytes of it,
/// recording the largest buffer it was asked to fill.
struct Stingy {
    header: Vec<u8>,
    sent: usize,
    largest: usize,
}

impl Read for Stingy {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.header.is_empty() {
            let n = buf.len().min(self.header.len());
            buf[..n].copy_from_slice(&self.header[..n]);
            self.header.drain(..n);
            return Ok(n);
        }
        self.largest = self.largest.max(buf.len());
        let n = buf.len().min(self.sent);
        buf[..n].fill(7);
        self.sent -= n;
        Ok(n)
    }
}

#[test]
fn a_body_announced_but_not_sent_costs_only_what_arrived() {
    let mut header = frame(Kind::State, b"");
    header[8..12].copy_from_slice(&(MAX_BODY as u32).to_le_bytes());
    let mut r = Stingy {
        header,
        sent: 100_000,
        largest: 0,
    };
    let mut body = Vec::new();
    let e = read_frame_into(&mut r, &mut body).unwrap_err();
    assert!(matches!(e, ProtocolError::Truncated), "{e:?}");
    // 100 000 bytes arrived: the buffer grew to 128 KiB, not 32 MiB.
    assert!(body.capacity() <= 256 << 10, "{}", body.capacity());
    assert!(r.largest <= 128 << 10, "{}", r.largest);
    // A whole body still reads back, and a reused large buffer takes a
    // smaller one in one read.
    let big: Vec<u8> = (0..(3 << 20)).map(|i| (i % 253) as u8).collect();
    let mut body = Vec::new();
    read_frame_into(&mut &frame(Kind::State, &big)[..], &mut body).unwrap();
    assert_eq!(body, big);
    read_frame_into(&mut &frame(Kind::State, &big[..5000])[..], &mut body).unwrap();
    assert_eq!(body, &big[..5000]);
}

#[test]
fn a_frame_with_a_flag_it_may_not_carry_is_refused_from_its_header() {
    for flags in [SEALED, 2, 0x8000, 0xffff] {
        let mut wire = frame(Kind::Complete, b"");
        wire[6..8].copy_from_slice(&flags.to_le_bytes());
        let e = read_frame(&mut &wire[..]).unwrap_err();
        assert!(
            matches!(e, ProtocolError::BadFlags { kind: Kind::Complete, flags: f } if f == flags),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("not flags this ferry defines"),
            "{e}"
        );
    }
    // On a Pages frame only SEALED, and only with a zero checksum field;
    // the header alone is refused: no body is read.
    for (flags, crc) in [(2u16, 0u32), (0x8000, 0), (0xffff, 0), (SEALED, 7)] {
        let mut wire = frame(Kind::Pages, b"");
        wire[6..8].copy_from_slice(&flags.to_le_bytes());
        wire[8..12].copy_from_slice(&(MAX_BODY as u32).to_le_bytes());
        wire[12..16].copy_from_slice(&crc.to_le_bytes());
        assert!(
            matches!(
                read_header(&mut &wire[..]),
                Err(ProtocolError::BadFlags { .. })
            ),
            "flags {flags:#x} crc {crc}"
        );
    }
}

#[test]
fn a_sealed_pages_frame_reads_as_sealed_and_no_generic_reader_takes_it() {
    let wire = one_sealed_page(9);
    let h = read_header(&mut &wire[..]).unwrap();
    assert!(h.sealed);
    assert_eq!(
        (h.kind, h.crc, h.len as usize),
        (Kind::Pages, 0, 4 + 8 + PAGE)
    );
    // The generic body reader checks every frame: it takes no sealed one.
    let e = read_frame(&mut &wire[..]).unwrap_err();
    assert!(
        matches!(e, ProtocolError::Unsealed { kind: Kind::Pages }),
        "{e:?}"
    );
}

#[test]
fn a_frame_written_in_parts_reads_back_whole() {
    let mut a = Vec::new();
    write_frame_parts(&mut a, Kind::Pages, &[b"ab", b"", b"cde"]).unwrap();
    assert_eq!(a, frame(Kind::Pages, b"abcde"));
}

#[test]
fn a_pages_frame_with_a_precomputed_data_crc_reads_back() {
    let data: Vec<u8> = (0..2 * PAGE).map(|i| (i * 7) as u8).collect();
    let addrs = [0x1000u64.to_le_bytes(), 0x5000u64.to_le_bytes()].concat();
    let crc = data.chunks(PAGE).fold(0, crate::checksum::append);
    let mut buf = Vec::new();
    write_pages_frame(&mut buf, &2u32.to_le_bytes(), &addrs, &data, crc).unwrap();
    let f = read_frame(&mut &buf[..]).unwrap();
    assert_eq!(f.kind, Kind::Pages);
    assert_eq!(f.body, encode_pages(&[0x1000, 0x5000], &data));
}
