//! The NBD protocol's numbers and frames (the NBD project's proto.md),
//! encoded and decoded without I/O. Decoding takes the bytes a server sent
//! and checks them: a magic, a length within its limit, a known kind.

use crate::error::NbdError;

/// The server's first eight bytes: "NBDMAGIC".
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// Newstyle negotiation follows: "IHAVEOPT" (also the client's option
/// prefix).
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The oldstyle protocol's second magic (refused: it has no export names
/// and no TLS).
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// An option reply's magic.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// A request's magic.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// A simple reply's magic.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// A structured reply's magic (never asked for, so refused).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server): fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flags (server): no 124 zero bytes after the export.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flags: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_ABORT: u32 = 2;
/// STARTTLS.
pub const OPT_STARTTLS: u32 = 5;
/// GO: choose the export and enter transmission.
pub const OPT_GO: u32 = 7;

/// Option replies.
pub const REP_ACK: u32 = 1;
/// An information item (GO).
pub const REP_INFO: u32 = 3;
/// An error reply has this bit.
pub const REP_FLAG_ERROR: u32 = 1 << 31;

/// Information items.
pub const INFO_EXPORT: u16 = 0;
/// The block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// FLUSH is understood.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// FUA is understood.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// TRIM is understood.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// WRITE_ZEROES is understood.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Several connections see each other's writes, and a flush on one
/// covers all.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// The longest option reply ferry reads (an INFO, an error's text).
pub const MAX_OPTION_REPLY: u32 = 64 << 10;
/// The most option replies to one GO (a server that never ACKs).
pub const MAX_OPTION_REPLIES: usize = 64;
/// The largest request the protocol lets a client send without the
/// server's block size constraints (and ferry's cap with them).
pub const MAX_REQUEST: u32 = 32 << 20;

/// Commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    /// Read.
    Read = 0,
    /// Write.
    Write = 1,
    /// Disconnect (no reply).
    Disc = 2,
    /// Flush.
    Flush = 3,
    /// Trim (discard).
    Trim = 4,
    /// Write zeroes.
    WriteZeroes = 6,
}

impl Command {
    /// Its name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disconnect",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::WriteZeroes => "write-zeroes",
        }
    }
}

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;

/// A request's 28-byte header.
pub fn request(cmd: Command, flags: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&(cmd as u16).to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b
}

/// A simple reply's 16-byte header: its error and cookie.
pub fn simple_reply(b: &[u8; 16]) -> Result<(u32, u64), NbdError> {
    let magic = u32::from_be_bytes(b[0..4].try_into().unwrap_or_default());
    match magic {
        SIMPLE_REPLY_MAGIC => {}
        STRUCTURED_REPLY_MAGIC => {
            return Err(NbdError::Protocol(
                "a structured reply, which was not negotiated".into(),
            ))
        }
        m => return Err(NbdError::Protocol(format!("reply magic {m:#010x}"))),
    }
    let error = u32::from_be_bytes(b[4..8].try_into().unwrap_or_default());
    let cookie = u64::from_be_bytes(b[8..16].try_into().unwrap_or_default());
    Ok((error, cookie))
}

/// An option request: IHAVEOPT, the option, its data's length and data.
pub fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// GO's data: the export's name, and the one information item asked for
/// (the block size: saying so lets the server state its constraints).
pub fn go_data(export: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + export.len());
    b.extend_from_slice(&(export.len() as u32).to_be_bytes());
    b.extend_from_slice(export.as_bytes());
    b.extend_from_slice(&1u16.to_be_bytes());
    b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b
}

/// An option reply's 20-byte header: (the option it answers, its type,
/// its data's length), the length within [`MAX_OPTION_REPLY`].
pub fn option_reply(b: &[u8; 20]) -> Result<(u32, u32, u32), NbdError> {
    let magic = u64::from_be_bytes(b[0..8].try_into().unwrap_or_default());
    if magic != OPTION_REPLY_MAGIC {
        return Err(NbdError::Protocol(format!(
            "option reply magic {magic:#018x}"
        )));
    }
    let opt = u32::from_be_bytes(b[8..12].try_into().unwrap_or_default());
    let kind = u32::from_be_bytes(b[12..16].try_into().unwrap_or_default());
    let len = u32::from_be_bytes(b[16..20].try_into().unwrap_or_default());
    if len > MAX_OPTION_REPLY {
        return Err(NbdError::Protocol(format!(
            "an option reply of {len} bytes (the limit is {MAX_OPTION_REPLY})"
        )));
    }
    Ok((opt, kind, len))
}

/// An option reply as a server writes it (for tests and fuzz seeds that
/// play the server).
pub fn server_option_reply(opt: u32, kind: u32, data: &[u8]) -> Vec<u8> {
    let mut b = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// What an export is, from GO's INFO replies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportInfo {
    /// Its size, bytes.
    pub size: u64,
    /// Its transmission flags.
    pub flags: u16,
    /// Block size constraints (min, preferred, max), if the server gave
    /// them.
    pub block: Option<(u32, u32, u32)>,
}

/// Takes one INFO reply's data into `info` (unknown items are skipped, as
/// the protocol asks).
pub fn take_info(
    data: &[u8],
    info: &mut ExportInfo,
    seen_export: &mut bool,
) -> Result<(), NbdError> {
    let bad = |what: &str| NbdError::Protocol(format!("{what}: {} bytes", data.len()));
    let Some(kind) = data.get(0..2) else {
        return Err(bad("an INFO reply without its type"));
    };
    match u16::from_be_bytes([kind[0], kind[1]]) {
        INFO_EXPORT => {
            if data.len() != 12 {
                return Err(bad("an INFO_EXPORT reply"));
            }
            info.size = u64::from_be_bytes(data[2..10].try_into().unwrap_or_default());
            info.flags = u16::from_be_bytes([data[10], data[11]]);
            if info.size > i64::MAX as u64 {
                return Err(NbdError::Protocol(format!(
                    "an export of {} bytes (over 2^63)",
                    info.size
                )));
            }
            *seen_export = true;
        }
        INFO_BLOCK_SIZE => {
            if data.len() != 14 {
                return Err(bad("an INFO_BLOCK_SIZE reply"));
            }
            let word = |i: usize| u32::from_be_bytes(data[i..i + 4].try_into().unwrap_or_default());
            let (min, pref, max) = (word(2), word(6), word(10));
            // The protocol's rules: powers of two, min at most 64 KiB,
            // preferred at least min, max a multiple of min (or "none").
            let ok = min.is_power_of_two()
                && min <= 64 << 10
                && pref.is_power_of_two()
                && pref >= min
                && (max == u32::MAX || (max >= min && max % min == 0));
            if !ok {
                return Err(NbdError::Protocol(format!(
                    "block size constraints min {min}, preferred {pref}, max {max}"
                )));
            }
            info.block = Some((min, pref, max));
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_laid_out_as_the_protocol_says() {
        let b = request(Command::Write, CMD_FLAG_FUA, 7, 4096, 512);
        assert_eq!(&b[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&b[4..6], &[0, 1]);
        assert_eq!(&b[6..8], &[0, 1]);
        assert_eq!(u64::from_be_bytes(b[8..16].try_into().unwrap()), 7);
        assert_eq!(u64::from_be_bytes(b[16..24].try_into().unwrap()), 4096);
        assert_eq!(u32::from_be_bytes(b[24..28].try_into().unwrap()), 512);
    }

    #[test]
    fn replies_are_checked() {
        let mut r = [0u8; 16];
        r[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        r[4..8].copy_from_slice(&5u32.to_be_bytes());
        r[8..16].copy_from_slice(&9u64.to_be_bytes());
        assert_eq!(simple_reply(&r).unwrap(), (5, 9));
        r[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert!(simple_reply(&r).is_err());
        r[0] ^= 0xff;
        assert!(simple_reply(&r).is_err());

        let mut o = [0u8; 20];
        o[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        o[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        o[12..16].copy_from_slice(&REP_INFO.to_be_bytes());
        o[16..20].copy_from_slice(&12u32.to_be_bytes());
        assert_eq!(option_reply(&o).unwrap(), (OPT_GO, REP_INFO, 12));
        o[16..20].copy_from_slice(&(MAX_OPTION_REPLY + 1).to_be_bytes());
        assert!(option_reply(&o).is_err(), "over its limit");
        o[16..20].copy_from_slice(&0u32.to_be_bytes());
        o[1] ^= 0xff;
        assert!(option_reply(&o).is_err(), "wrong magic");
    }

    #[test]
    fn information_items_are_checked() {
        let mut info = ExportInfo::default();
        let mut seen = false;
        let mut e = vec![0, 0];
        e.extend_from_slice(&(1u64 << 30).to_be_bytes());
        e.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
        take_info(&e, &mut info, &mut seen).unwrap();
        assert!(seen);
        assert_eq!(info.size, 1 << 30);
        assert_eq!(info.flags, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH);
        assert!(take_info(&e[..11], &mut info, &mut seen).is_err());
        let mut huge = e.clone();
        huge[2..10].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(take_info(&huge, &mut info, &mut seen).is_err());

        let block = |min: u32, pref: u32, max: u32| {
            let mut b = vec![0, 3];
            for w in [min, pref, max] {
                b.extend_from_slice(&w.to_be_bytes());
            }
            b
        };
        take_info(&block(512, 4096, 32 << 20), &mut info, &mut seen).unwrap();
        assert_eq!(info.block, Some((512, 4096, 32 << 20)));
        for (min, pref, max) in [
            (0, 4096, 1 << 20),
            (3, 4096, 1 << 20),
            (1 << 20, 1 << 20, 1 << 20),
            (512, 256, 1 << 20),
        ] {
            assert!(
                take_info(&block(min, pref, max), &mut info, &mut seen).is_err(),
                "{min} {pref} {max}"
            );
        }
        // Unknown items are skipped; an empty one is not an item.
        take_info(&[0, 99, 1, 2, 3], &mut info, &mut seen).unwrap();
        assert!(take_info(&[0], &mut info, &mut seen).is_err());
    }
}
