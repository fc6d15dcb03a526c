//! A Pages frame from a bulk stream into a [`PageSink`].
//!
//! The destination's bulk streams carry most of a migration's bytes. Where
//! the sink takes pages in place (memory no vCPU runs on yet), the addresses
//! are read and checked first, then the page data goes from the kernel
//! straight to its place in the guest, and the checksum is computed over the
//! landed pages afterwards: a mismatch fails the migration before the VM
//! could ever start. Other sinks (userfaultfd) get the frame only after its
//! checksum held, so a running guest never sees a corrupt page. A sealed
//! frame has no checksum: it is taken only from a link that seals every
//! byte (TLS), whose records were each checked before a byte was read out.

use std::io::Read;

use crate::error::MigrationError;
use crate::protocol::{eof_is_truncated, Header, Kind, ProtocolError, MAX_BATCH, PAGE};
use crate::ranges::GpaPages;
use crate::sink::PageSink;
use crate::transport::ConnReader;

fn malformed(reason: String) -> ProtocolError {
    ProtocolError::Malformed {
        kind: Kind::Pages,
        reason,
    }
}

/// Reads the body of the Pages frame `h` and lands its pages in `sink`.
/// Returns the number of pages. `scratch` and `data` are buffers kept
/// between calls.
pub fn read_pages(
    r: &mut ConnReader,
    h: &Header,
    regions: &[crate::memory::RegionView],
    sink: &dyn PageSink,
    scratch: &mut Vec<u8>,
    data: &mut Vec<u8>,
) -> Result<u64, MigrationError> {
    if h.sealed && !r.seals() {
        return Err(ProtocolError::Unsealed { kind: h.kind }.into());
    }
    let checked = !h.sealed;
    let len = h.len as usize;
    let mut count = [0u8; 4];
    if len < 4 {
        return Err(malformed("shorter than its count".into()).into());
    }
    r.read_exact(&mut count).map_err(eof_is_truncated)?;
    let n = u32::from_le_bytes(count) as usize;
    if n > MAX_BATCH || len != 4 + n * (8 + PAGE) {
        return Err(malformed(format!("{n} pages do not match {len} bytes")).into());
    }
    scratch.resize(8 * n, 0);
    r.read_exact(scratch).map_err(eof_is_truncated)?;
    let mut crc = if checked {
        crate::checksum::append(crate::checksum::crc32c(&count), scratch)
    } else {
        0
    };
    // Check every address before a byte lands, and group them into runs of
    // consecutive pages inside one region.
    let mut runs: Vec<(usize, GpaPages)> = Vec::new(); // (region, run)
    for c in scratch.chunks_exact(8) {
        let gpa = u64::from_le_bytes(c.try_into().unwrap_or_default());
        let region = crate::memory::region_of(regions, gpa)
            .map(|(i, _)| i)
            .filter(|_| gpa % PAGE as u64 == 0)
            .ok_or_else(|| malformed(format!("page address {gpa:#x} is not in guest RAM")))?;
        match runs.last_mut() {
            Some((ri, run)) if *ri == region && run.end() == gpa => run.pages += 1,
            _ => runs.push((region, GpaPages::new(gpa, 1))),
        }
    }
    // Runs the sink cannot take in place are read into `data` and land
    // once the whole frame's checksum held.
    data.clear();
    let mut deferred: Vec<GpaPages> = Vec::new();
    for &(_, run) in &runs {
        match sink.in_place(run) {
            // The whole run in one request: each read(2) that returns frees
            // receive buffer and may send a window update, whose processing
            // (on loopback, the sender's next segments too) costs more than
            // the checksum gains from reading small pieces hot. Measured with
            // 2 streams: 128 KiB pieces 0.25-0.51, whole runs 0.12-0.19
            // destination CPU s per GiB.
            Some(mut place) => {
                place.fill_from(r).map_err(eof_is_truncated)?;
                if checked {
                    crc = place.crc(crc);
                }
                sink.landed(run, place.landed());
            }
            None => {
                let (at, len) = (data.len(), run.bytes() as usize);
                // Read into spare capacity: zeroing it first would write
                // every byte once more.
                data.reserve(len);
                // SAFETY: `reserve` made `len` writable bytes after `at`,
                // in our own vector (not the reader's buffer); `set_len`
                // exposes them only once the read filled them all.
                unsafe {
                    r.read_exact_raw(data.as_mut_ptr().add(at), len)
                        .map_err(eof_is_truncated)?;
                    data.set_len(at + len);
                }
                if checked {
                    crc = crate::checksum::append(crc, &data[at..]);
                }
                deferred.push(run);
            }
        }
    }
    if checked && crc != h.crc {
        return Err(ProtocolError::Checksum {
            kind: h.kind,
            len: h.len,
        }
        .into());
    }
    let mut at = 0usize;
    for run in deferred {
        let end = at + run.bytes() as usize;
        sink.write(run, &data[at..end])?;
        at = end;
    }
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;

    use super::*;
    use crate::memory::RegionView;
    use crate::protocol::frame::one_sealed_page;
    use crate::protocol::read_header;
    use crate::transport::{Conn, Stream};

    /// Pages that land by copies into a buffer standing for guest RAM.
    struct Landed(Mutex<Vec<u8>>);

    impl PageSink for Landed {
        fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), crate::sink::SinkError> {
            let at = run.gpa as usize;
            self.0.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn zero(&self, _run: GpaPages) -> Result<(), crate::sink::SinkError> {
            Ok(())
        }
    }

    /// Sends `wire` on `a` and lands the frame that arrives on `b`.
    fn land(a: Stream, b: Stream, wire: &[u8], sink: &Landed) -> Result<u64, MigrationError> {
        let mut a = Conn::new(a, Some(std::time::Duration::from_secs(5))).unwrap();
        let mut b = Conn::new(b, Some(std::time::Duration::from_secs(5))).unwrap();
        a.writer().write_all(wire).unwrap();
        a.flush().unwrap();
        // SAFETY: only the view's address range is used (the sink copies).
        let regions = [unsafe { RegionView::new(0, 4 * PAGE as u64, std::ptr::null_mut()) }];
        let h = read_header(b.reader()).unwrap();
        read_pages(
            b.reader(),
            &h,
            &regions,
            sink,
            &mut Vec::new(),
            &mut Vec::new(),
        )
    }

    #[test]
    fn a_sealed_frame_is_refused_from_a_link_that_does_not_seal_and_lands_from_one_that_does() {
        let sink = Landed(Mutex::new(vec![0; 4 * PAGE]));
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = land(Stream::unix(a), Stream::unix(b), &one_sealed_page(7), &sink).unwrap_err();
        assert!(
            matches!(
                e,
                MigrationError::Protocol(ProtocolError::Unsealed { kind: Kind::Pages })
            ),
            "{e:?}"
        );
        assert!(
            sink.0.lock().unwrap().iter().all(|&b| b == 0),
            "nothing landed"
        );

        let dir = std::env::temp_dir().join(format!("ferry-pagein-{}", std::process::id()));
        let (a, b) = crate::transport::tls_pair(&dir);
        assert_eq!(land(a, b, &one_sealed_page(7), &sink).unwrap(), 1);
        let mem = sink.0.lock().unwrap();
        assert!(
            mem[PAGE..2 * PAGE].iter().all(|&b| b == 7),
            "the page landed"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
