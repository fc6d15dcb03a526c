//! Pages frames read straight from the socket into guest memory.
//!
//! The destination's bulk streams carry most of a migration's bytes. Reading
//! a frame into a buffer and copying it into guest RAM would cost a second
//! copy of every page; here the addresses are read and checked first, then
//! the page data goes from the kernel straight to its place in the guest.
//! The checksum is computed over guest memory afterwards (the VM is not
//! running yet, so nothing changes it), and a mismatch fails the migration
//! before the VM could ever start.

use std::io::{self, BufRead, BufReader, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::protocol::{eof_is_truncated, Header, Kind, ProtocolError, MAX_BATCH, PAGE};
use crate::vm::RegionView;
use crate::written::MaybeNonZero;

/// Reads exactly `len` bytes to `dst`: first what `r` has buffered, then
/// straight from the socket.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes.
unsafe fn read_exact_raw(r: &mut BufReader<TcpStream>, dst: *mut u8, len: usize) -> io::Result<()> {
    let buffered = r.buffer();
    let k = buffered.len().min(len);
    // SAFETY: `dst` is valid for `len >= k` bytes (the caller's promise);
    // the source is BufReader's own buffer, which cannot overlap guest RAM.
    unsafe { std::ptr::copy_nonoverlapping(buffered.as_ptr(), dst, k) };
    r.consume(k);
    let fd = r.get_ref().as_raw_fd();
    let mut done = k;
    while done < len {
        // SAFETY: `dst + done .. dst + len` is inside the range the caller
        // vouched for; read(2) writes at most `len - done` bytes there.
        let n = unsafe { libc::read(fd, dst.add(done).cast(), len - done) };
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

fn malformed(reason: String) -> ProtocolError {
    ProtocolError::Malformed {
        kind: Kind::Pages,
        reason,
    }
}

/// Reads the body of the Pages frame `h` into guest memory, recording the
/// pages in `written`. Returns the number of pages written. `scratch` holds
/// the addresses between calls.
pub fn read_pages(
    r: &mut BufReader<TcpStream>,
    h: &Header,
    regions: &[RegionView],
    written: &MaybeNonZero,
    scratch: &mut Vec<u8>,
) -> Result<u64, ProtocolError> {
    let len = h.len as usize;
    let mut count = [0u8; 4];
    if len < 4 {
        return Err(malformed("shorter than its count".into()));
    }
    r.read_exact(&mut count).map_err(eof_is_truncated)?;
    let n = u32::from_le_bytes(count) as usize;
    if n > MAX_BATCH || len != 4 + n * (8 + PAGE) {
        return Err(malformed(format!("{n} pages do not match {len} bytes")));
    }
    scratch.resize(8 * n, 0);
    r.read_exact(scratch).map_err(eof_is_truncated)?;
    let mut crc = crate::checksum::append(crate::checksum::crc32c(&count), scratch);
    // Check every address before a byte lands in guest memory, and group
    // them into runs of consecutive pages inside one region.
    let mut runs: Vec<(usize, u64, usize)> = Vec::new(); // (region, offset, pages)
    for c in scratch.chunks_exact(8) {
        let gpa = u64::from_le_bytes(c.try_into().unwrap_or_default());
        let region = regions
            .iter()
            .position(|r| r.contains(gpa))
            .filter(|_| gpa % PAGE as u64 == 0)
            .ok_or_else(|| malformed(format!("page address {gpa:#x} is not in guest RAM")))?;
        let off = gpa - regions[region].gpa;
        match runs.last_mut() {
            Some((ri, o, k)) if *ri == region && *o + (*k * PAGE) as u64 == off => *k += 1,
            _ => runs.push((region, off, 1)),
        }
    }
    for (ri, off, k) in runs {
        let rv = &regions[ri];
        let bytes = k * PAGE;
        // SAFETY: `off` is page aligned inside region `ri` and the run only
        // grew while its pages stayed in that region, so `off + bytes` is
        // within the live mapping of `rv.size` bytes.
        let dst = unsafe { rv.host.add(off as usize) };
        // Marked before it lands: "may hold data" errs on the safe side.
        written.mark(rv.gpa + off, k as u64);
        // The whole run in one request: each read(2) that returns frees
        // receive buffer and may send a window update, whose processing
        // (on loopback, the sender's next segments too) costs more than the
        // checksum gains from reading small pieces hot. Measured with 2
        // streams: 128 KiB pieces 0.25-0.51, whole runs 0.12-0.19
        // destination CPU s per GiB.
        // SAFETY: `dst .. dst + bytes` lies inside the run checked above.
        unsafe { read_exact_raw(r, dst, bytes) }.map_err(eof_is_truncated)?;
        // SAFETY: the same range, now written; the VM is not running.
        let landed = unsafe { std::slice::from_raw_parts(dst, bytes) };
        crc = crate::checksum::append(crc, landed);
    }
    if crc != h.crc {
        return Err(ProtocolError::Checksum {
            kind: h.kind,
            len: h.len,
        });
    }
    Ok(n as u64)
}
