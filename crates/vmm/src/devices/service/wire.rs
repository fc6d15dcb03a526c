//! The service device's wire format, shared by the device and its clients
//! (`ferry load`). Documented in docs/service.md.
//!
//! ```text
//! frame    = len:u32 | body            (len = body bytes, at most MAX_BODY)
//! request  = op:u8 flags:u8 rsvd:u16 value_len:u32 id:u64 key:u64 seed:u64 | value
//! response = status:u8 op:u8 rsvd:u16 value_len:u32 id:u64 key:u64 seed:u64 checksum:u64 | value
//! ```
//! All integers little-endian. The bodies are exactly what the guest reads and
//! writes in its ring slots (`struct ferry_svc_request/response`).

use std::io::{self, Read, Write};

use crate::guest_abi::SVC_MAX_BODY;

/// Bytes of request header.
pub const REQUEST_HEADER: usize = 32;
/// Bytes of response header.
pub const RESPONSE_HEADER: usize = 40;
/// Largest body in either direction.
pub const MAX_BODY: usize = SVC_MAX_BODY as usize;

/// Request operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[repr(u8)]
pub enum Op {
    /// Read a value.
    Get = 1,
    /// Write a value.
    Set = 2,
    /// Answered by the device itself (device-only latency).
    Echo = 3,
    /// Table size and value size.
    Info = 4,
    /// Answered by a guest worker doing nothing.
    Nop = 5,
    /// Answered by a guest worker after `seed` milliseconds of spinning
    /// (at most 10 s): a request that is surely in flight when a migration
    /// pauses the VM.
    Slow = 6,
    /// Never reaches the guest: a migration's source collecting the
    /// answers to requests that were in flight at its pause (key and seed
    /// are the 16-byte token it agreed with the destination). The device
    /// answers with collected frames, `tag:u64 | response` each.
    Collect = 7,
}

impl Op {
    /// Decodes an op byte.
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Get,
            2 => Op::Set,
            3 => Op::Echo,
            4 => Op::Info,
            5 => Op::Nop,
            6 => Op::Slow,
            7 => Op::Collect,
            _ => return None,
        })
    }
}

/// Response status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[repr(u8)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// Key out of range.
    BadKey = 1,
    /// Malformed request (text in the value).
    BadRequest = 2,
    /// Frame longer than MAX_BODY (text in the value).
    TooLarge = 3,
    /// The guest is not serving yet.
    NotReady = 4,
    /// SET value of the wrong size.
    BadValue = 5,
}

impl Status {
    /// Decodes a status byte (unknown codes are BadRequest).
    pub fn from_u8(v: u8) -> Status {
        match v {
            0 => Status::Ok,
            1 => Status::BadKey,
            3 => Status::TooLarge,
            4 => Status::NotReady,
            5 => Status::BadValue,
            _ => Status::BadRequest,
        }
    }
}

/// Why a frame could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The length prefix exceeds the limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// The body is shorter than its header.
    #[error("frame body of {len} bytes is shorter than the {need}-byte header")]
    TooShort {
        /// Body length.
        len: usize,
        /// Header length.
        need: usize,
    },
    /// value_len disagrees with the body length.
    #[error("value_len {value_len} disagrees with the {body} bytes of body after the header")]
    BadLength {
        /// Announced.
        value_len: u32,
        /// Actual.
        body: usize,
    },
    /// Unknown op code.
    #[error("unknown op {0}")]
    BadOp(u8),
    /// The stream ended inside a frame.
    #[error("connection closed in the middle of a frame")]
    Truncated,
    /// Socket error.
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
}

/// A client request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Operation.
    pub op: Op,
    /// Client's request id, echoed in the response.
    pub id: u64,
    /// Key.
    pub key: u64,
    /// Seed naming a SET value's content.
    pub seed: u64,
    /// SET value.
    pub value: Vec<u8>,
}

/// A response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// Outcome.
    pub status: Status,
    /// Operation answered (0 if unknown).
    pub op: u8,
    /// Request id.
    pub id: u64,
    /// Key (INFO: number of keys).
    pub key: u64,
    /// Seed of the value's content (INFO: value size).
    pub seed: u64,
    /// ferry_csum of the value (GET) or of the stored value (SET).
    pub checksum: u64,
    /// GET value, or error text.
    pub value: Vec<u8>,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default())
}

impl Request {
    /// A request without a value.
    pub fn new(op: Op, id: u64, key: u64, seed: u64) -> Self {
        Request {
            op,
            id,
            key,
            seed,
            value: Vec::new(),
        }
    }

    /// The frame: length prefix and body.
    pub fn encode(&self) -> Vec<u8> {
        let body = REQUEST_HEADER + self.value.len();
        let mut f = Vec::with_capacity(4 + body);
        f.extend_from_slice(&(body as u32).to_le_bytes());
        f.extend_from_slice(&[self.op as u8, 0, 0, 0]);
        f.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        f.extend_from_slice(&self.id.to_le_bytes());
        f.extend_from_slice(&self.key.to_le_bytes());
        f.extend_from_slice(&self.seed.to_le_bytes());
        f.extend_from_slice(&self.value);
        f
    }

    /// Parses a body (the frame without its length).
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < REQUEST_HEADER {
            return Err(WireError::TooShort {
                len: body.len(),
                need: REQUEST_HEADER,
            });
        }
        let op = Op::from_u8(body[0]).ok_or(WireError::BadOp(body[0]))?;
        let value_len = u32_at(body, 4);
        if value_len as usize != body.len() - REQUEST_HEADER {
            return Err(WireError::BadLength {
                value_len,
                body: body.len() - REQUEST_HEADER,
            });
        }
        Ok(Request {
            op,
            id: u64_at(body, 8),
            key: u64_at(body, 16),
            seed: u64_at(body, 24),
            value: body[REQUEST_HEADER..].to_vec(),
        })
    }
}

impl Response {
    /// An error response carrying a message.
    pub fn error(status: Status, op: u8, id: u64, message: &str) -> Self {
        Response {
            status,
            op,
            id,
            key: 0,
            seed: 0,
            checksum: 0,
            value: message.as_bytes().to_vec(),
        }
    }

    /// The frame: length prefix and body.
    pub fn encode(&self) -> Vec<u8> {
        let body = RESPONSE_HEADER + self.value.len();
        let mut f = Vec::with_capacity(4 + body);
        f.extend_from_slice(&(body as u32).to_le_bytes());
        f.extend_from_slice(&[self.status as u8, self.op, 0, 0]);
        f.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        for v in [self.id, self.key, self.seed, self.checksum] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        f.extend_from_slice(&self.value);
        f
    }

    /// Parses a body.
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        if body.len() < RESPONSE_HEADER {
            return Err(WireError::TooShort {
                len: body.len(),
                need: RESPONSE_HEADER,
            });
        }
        let value_len = u32_at(body, 4);
        if value_len as usize != body.len() - RESPONSE_HEADER {
            return Err(WireError::BadLength {
                value_len,
                body: body.len() - RESPONSE_HEADER,
            });
        }
        Ok(Response {
            status: Status::from_u8(body[0]),
            op: body[1],
            id: u64_at(body, 8),
            key: u64_at(body, 16),
            seed: u64_at(body, 24),
            checksum: u64_at(body, 32),
            value: body[RESPONSE_HEADER..].to_vec(),
        })
    }

    /// The error text of a failed response.
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.value).into_owned()
    }
}

/// Reads one frame body of at most `max` bytes. `Ok(None)` is a clean end of
/// stream between frames.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Option<Vec<u8>>, WireError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(WireError::TooLarge {
            len: len as u64,
            max,
        });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => WireError::Truncated,
        _ => WireError::Io(e),
    })?;
    Ok(Some(body))
}

/// The body length of the frame at the start of `buf` if all of it is
/// there (its 4-byte prefix then `len` bytes), `None` if more must be read.
/// A reader that keeps its own buffer can stop between frames without
/// losing a partial one (the service device does, to hand a connection to
/// another process).
pub fn complete_frame(buf: &[u8], max: usize) -> Result<Option<usize>, WireError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(prefix.try_into().unwrap_or_default()) as usize;
    if len > max {
        return Err(WireError::TooLarge {
            len: len as u64,
            max,
        });
    }
    Ok((buf.len() >= 4 + len).then_some(len))
}

/// The frame of `body`: its length prefix, then the body.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + body.len());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// Writes a whole frame.
pub fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)
}

/// `ferry_csum`: the checksum guest, device and clients agree on.
pub fn csum(data: &[u8]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ data.len() as u64;
    for chunk in data.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x0000_0100_0000_01B3);
        h ^= h >> 29;
    }
    h
}

/// `ferry_value`: the content of `key`'s value written with `seed`.
pub fn value_into(out: &mut [u8], key: u64, seed: u64) {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(key.wrapping_add(1));
    if s == 0 {
        s = 1;
    }
    for chunk in out.chunks_mut(8) {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let w = s.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// A new buffer holding `ferry_value(len, key, seed)`.
pub fn value(len: usize, key: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    value_into(&mut v, key, seed);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_frame_waits_for_the_whole_body() {
        let mut f = 3u32.to_le_bytes().to_vec();
        assert_eq!(complete_frame(&f[..2], 16).unwrap(), None);
        assert_eq!(complete_frame(&f, 16).unwrap(), None);
        f.extend_from_slice(b"abc");
        assert_eq!(complete_frame(&f, 16).unwrap(), Some(3));
        f.extend_from_slice(b"next");
        assert_eq!(complete_frame(&f, 16).unwrap(), Some(3));
        assert!(matches!(
            complete_frame(&100u32.to_le_bytes(), 16),
            Err(WireError::TooLarge { len: 100, .. })
        ));
    }

    #[test]
    fn request_and_response_round_trip() {
        let r = Request {
            op: Op::Set,
            id: 9,
            key: 3,
            seed: 77,
            value: value(100, 3, 77),
        };
        let f = r.encode();
        assert_eq!(
            u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
            f.len() - 4
        );
        assert_eq!(Request::decode(&f[4..]).unwrap(), r);
        let s = Response {
            status: Status::Ok,
            op: 1,
            id: 9,
            key: 3,
            seed: 77,
            checksum: csum(&r.value),
            value: r.value.clone(),
        };
        let f = s.encode();
        assert_eq!(Response::decode(&f[4..]).unwrap(), s);
        let mut rd = &f[..];
        assert_eq!(read_frame(&mut rd, MAX_BODY).unwrap().unwrap(), &f[4..]);
        assert!(
            read_frame(&mut rd, MAX_BODY).unwrap().is_none(),
            "clean EOF between frames"
        );
    }

    #[test]
    fn hostile_frames_are_refused() {
        assert!(matches!(
            Request::decode(&[1, 0, 0]),
            Err(WireError::TooShort { .. })
        ));
        let mut b = Request::new(Op::Get, 1, 2, 3).encode()[4..].to_vec();
        b[0] = 99;
        assert!(matches!(Request::decode(&b), Err(WireError::BadOp(99))));
        // 1..=7 are ops (6 SLOW, 7 COLLECT); 0 and 8 are not.
        for op in 1..=7u8 {
            b[0] = op;
            assert_eq!(Request::decode(&b).unwrap().op as u8, op);
        }
        for op in [0u8, 8] {
            b[0] = op;
            assert!(matches!(Request::decode(&b), Err(WireError::BadOp(o)) if o == op));
        }
        b[0] = 1;
        b[4] = 5; // value_len 5, no value bytes
        assert!(matches!(
            Request::decode(&b),
            Err(WireError::BadLength { .. })
        ));
        let mut huge = &[0xffu8, 0xff, 0xff, 0xff][..];
        assert!(matches!(
            read_frame(&mut huge, MAX_BODY),
            Err(WireError::TooLarge { .. })
        ));
        let mut cut = &[10u8, 0, 0, 0, 1, 2][..];
        assert!(matches!(
            read_frame(&mut cut, MAX_BODY),
            Err(WireError::Truncated)
        ));
        let mut half = &[10u8, 0][..];
        assert!(matches!(
            read_frame(&mut half, MAX_BODY),
            Err(WireError::Truncated)
        ));
    }

    #[test]
    fn values_depend_on_key_and_seed() {
        assert_ne!(value(64, 1, 0), value(64, 2, 0));
        assert_ne!(value(64, 1, 0), value(64, 1, 1));
        assert_eq!(value(13, 4, 4), value(13, 4, 4));
        assert_ne!(csum(&[0; 8]), csum(&[0; 16]), "length is mixed in");
    }
}
