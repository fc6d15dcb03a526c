//! Pages written into guest memory no vCPU runs on yet (a precopy
//! destination before its start): into the region's file where the region
//! names one, else through the guest mapping.
//!
//! Writing the file allocates a fresh page without mapping it. Through the
//! mapping, a fresh page is allocated *and* mapped on first touch (or by
//! populating it ahead), and on this machine (a PVM guest, where page
//! tables cost) the mapping was half of it: 1 GiB of shmem populated and
//! copied into at 2.3 µs a page, written with pwrite(2) at 1.3 µs a page
//! (scratch probe, 256 KiB calls). The guest maps each page on its own
//! first touch later, as it does every page a migration did not send.
//!
//! The kernel writes a file under its inode lock, so two receivers' writes
//! take turns. Where the host's first touch of memory is slow, they spent a
//! fifth of the time waiting; a receiver that finds the other one writing
//! copies through the mapping instead (populated first). 1 GiB of random
//! pages over mutual TLS, 8 runs each alternated with the build before:
//! 1392 against 1238 MiB/s (medians), destination CPU 0.85-0.93 against
//! ~1.05 s; plaintext was unchanged (1437 against 1457).

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::FileExt;

use super::PageStore;
use super::{InPlace, MaybeNonZero, PageSink, SinkError};
use crate::memory::RegionView;
use crate::ranges::GpaPages;

/// Lands pages in a [`PageStore`]'s memory by plain copies (or read(2) in
/// place) and clears only the pages that may hold data.
pub struct DirectSink<'a> {
    store: &'a dyn PageStore,
    regions: Vec<RegionView>,
    maybe: MaybeNonZero,
    /// Held while a receiver writes into a region's file.
    file_writer: std::sync::Mutex<()>,
}

impl<'a> DirectSink<'a> {
    /// A sink over `store`'s regions, knowing what its VMM wrote already.
    pub fn new(store: &'a dyn PageStore) -> Self {
        let regions = store.regions();
        let nonzero: Vec<_> = (0..regions.len())
            .map(|i| store.nonzero_ranges(i))
            .collect();
        let maybe = MaybeNonZero::new(&regions, &nonzero, &store.device_written_ranges());
        DirectSink {
            store,
            regions,
            maybe,
            file_writer: std::sync::Mutex::new(()),
        }
    }

    fn host(&self, run: GpaPages) -> Result<*mut u8, SinkError> {
        super::host_of(&self.regions, run)
    }

    /// The file and offset `run` lies at, where its region names a file.
    fn file_of(&self, run: GpaPages) -> Option<(RawFd, u64)> {
        let r = self.regions.iter().find(|r| r.contains(run.gpa))?;
        Some((r.file()?, run.gpa - r.gpa()))
    }
}

/// Writes all of `data` at `offset` of the open file `fd`.
fn write_file(fd: RawFd, data: &[u8], offset: u64) -> io::Result<()> {
    // SAFETY: `fd` is open for as long as the sink's regions are used (the
    // promise of `RegionView::with_file`); ManuallyDrop leaves it open.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    file.write_all_at(data, offset)
}

impl PageSink for DirectSink<'_> {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        if data.len() as u64 != run.bytes() {
            return Err(SinkError::Shape {
                pages: run.pages,
                bytes: data.len(),
            });
        }
        let dst = self.host(run)?;
        // Marked before it lands: "may hold data" errs on the safe side.
        self.maybe.mark(run);
        if let Some((fd, offset)) = self.file_of(run) {
            // The kernel writes a file under its inode lock: while another
            // receiver holds it, copy through the mapping instead of waiting.
            if let Ok(_writing) = self.file_writer.try_lock() {
                // A full host fails here, not with SIGBUS in a copy.
                return write_file(fd, data, offset).map_err(|source| SinkError::Write {
                    gpa: run.gpa,
                    pages: run.pages,
                    source,
                });
            }
            if data.len() >= super::POPULATE_MIN_BYTES {
                super::populate(dst, data.len());
            }
        }
        // SAFETY: `dst .. dst + len` lies inside one live region (checked
        // by `host`); `data` is the receiver's buffer, not guest RAM.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.host(run)?;
        // Pages that already read as zeros are left alone.
        for part in self.maybe.take(run) {
            self.store
                .discard(part)
                .map_err(|source| SinkError::Discard {
                    gpa: part.gpa,
                    pages: part.pages,
                    source,
                })?;
        }
        Ok(())
    }

    fn in_place(&self, run: GpaPages) -> Option<InPlace<'_>> {
        // Pages for a file land by write(): the receiver reads them into
        // its own buffer, hot for the checksum or the TLS open, and the
        // write allocates them unmapped.
        if self.file_of(run).is_some() {
            return None;
        }
        let dst = self.host(run).ok()?;
        self.maybe.mark(run);
        // SAFETY: inside one live region (checked); nothing reads the
        // destination's memory until the migration starts the VM, and within
        // a round each page arrives on one stream only.
        Some(unsafe { InPlace::new(dst, run.bytes() as usize) })
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::*;
    use crate::ranges::PAGE;
    use crate::vm_error::VmOpError;

    const PAGES: u64 = 16;
    const GPA: u64 = 0x10_0000;

    /// A memfd of PAGES pages mapped shared; a sealed one refuses writes
    /// (F_SEAL_WRITE) and is mapped read-only.
    struct Memfd {
        fd: OwnedFd,
        host: *mut u8,
    }

    impl Memfd {
        fn new(sealed: bool) -> Memfd {
            let len = (PAGES * PAGE) as usize;
            // SAFETY: plain syscalls on a fresh memfd; results checked.
            unsafe {
                let raw = libc::memfd_create(c"direct-sink-test".as_ptr(), libc::MFD_ALLOW_SEALING);
                assert!(raw >= 0);
                let fd = OwnedFd::from_raw_fd(raw);
                assert_eq!(libc::ftruncate(raw, len as libc::off_t), 0);
                if sealed {
                    let r = libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_WRITE);
                    assert_eq!(r, 0, "{}", io::Error::last_os_error());
                }
                let prot = libc::PROT_READ | if sealed { 0 } else { libc::PROT_WRITE };
                let host = libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, raw, 0);
                assert_ne!(host, libc::MAP_FAILED);
                Memfd {
                    fd,
                    host: host.cast(),
                }
            }
        }

        fn view(&self, with_file: bool) -> RegionView {
            // SAFETY: the mapping and the fd live as long as `self`, which
            // outlives every sink in these tests.
            unsafe {
                if with_file {
                    RegionView::with_file(GPA, PAGES * PAGE, self.host, self.fd.as_raw_fd())
                } else {
                    RegionView::new(GPA, PAGES * PAGE, self.host)
                }
            }
        }

        /// True if page `i` of the mapping has a page table entry
        /// (/proc/self/pagemap's "present" bit).
        fn mapped(&self, i: u64) -> bool {
            let pagemap = File::open("/proc/self/pagemap").unwrap();
            let mut entry = [0u8; 8];
            let vpage = self.host as u64 / PAGE + i;
            pagemap.read_exact_at(&mut entry, vpage * 8).unwrap();
            u64::from_le_bytes(entry) >> 63 == 1
        }

        fn page(&self, i: u64) -> Vec<u8> {
            // SAFETY: page `i` lies inside the live mapping.
            unsafe { std::slice::from_raw_parts(self.host.add((i * PAGE) as usize), PAGE as usize) }
                .to_vec()
        }
    }

    impl Drop for Memfd {
        fn drop(&mut self) {
            // SAFETY: unmaps what `new` mapped.
            unsafe { libc::munmap(self.host.cast(), (PAGES * PAGE) as usize) };
        }
    }

    struct Store(RegionView);

    impl PageStore for Store {
        fn regions(&self) -> Vec<RegionView> {
            vec![self.0]
        }
        fn discard(&self, _run: GpaPages) -> Result<(), VmOpError> {
            Ok(())
        }
    }

    fn pages(n: u64, seed: u8) -> Vec<u8> {
        (0..n * PAGE)
            .map(|i| (i as u8).wrapping_mul(7) ^ seed)
            .collect()
    }

    #[test]
    fn pages_for_a_file_land_in_it_without_being_mapped() {
        let m = Memfd::new(false);
        let store = Store(m.view(true));
        let sink = DirectSink::new(&store);
        let run = GpaPages::new(GPA + 4 * PAGE, 3);
        assert!(
            sink.in_place(run).is_none(),
            "file pages must land by write"
        );
        let data = pages(3, 0x5a);
        sink.write(run, &data).unwrap();
        // Landed in the file, not through the mapping.
        assert!((4..7).all(|i| !m.mapped(i)));
        let landed: Vec<u8> = (4..7).flat_map(|i| m.page(i)).collect();
        assert_eq!(landed, data);
        assert!(m.page(3).iter().chain(&m.page(7)).all(|&b| b == 0));
    }

    #[test]
    fn pages_without_a_file_land_through_the_mapping() {
        let m = Memfd::new(false);
        let store = Store(m.view(false));
        let sink = DirectSink::new(&store);
        let run = GpaPages::new(GPA, 2);
        assert!(sink.in_place(run).is_some());
        let data = pages(2, 3);
        sink.write(run, &data).unwrap();
        assert!(m.mapped(0) && m.mapped(1));
        assert_eq!([m.page(0), m.page(1)].concat(), data);
    }

    #[test]
    fn a_receiver_finding_the_file_busy_copies_through_the_mapping() {
        let m = Memfd::new(false);
        let store = Store(m.view(true));
        let sink = DirectSink::new(&store);
        let data = pages(8, 9);
        {
            let _other_receiver = sink.file_writer.lock().unwrap();
            sink.write(GpaPages::new(GPA, 8), &data).unwrap();
        }
        assert!((0..8).all(|i| m.mapped(i)), "landed through the mapping");
        assert_eq!((0..8).flat_map(|i| m.page(i)).collect::<Vec<_>>(), data);
        // Free again: the next write goes to the file.
        sink.write(GpaPages::new(GPA + 8 * PAGE, 1), &pages(1, 2))
            .unwrap();
        assert!(!m.mapped(8));
        assert_eq!(m.page(8), pages(1, 2));
    }

    #[test]
    fn a_file_that_refuses_writes_is_an_error_not_a_signal() {
        // Read-only mapping, file sealed against writes: a copy through the
        // mapping would fault (SIGSEGV); the write must fail cleanly.
        let m = Memfd::new(true);
        let store = Store(m.view(true));
        let sink = DirectSink::new(&store);
        let err = sink.write(GpaPages::new(GPA, 1), &pages(1, 1)).unwrap_err();
        assert!(
            matches!(
                err,
                SinkError::Write {
                    gpa: GPA,
                    pages: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(m.page(0).iter().all(|&b| b == 0));
    }
}
