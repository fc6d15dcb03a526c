//! The destination's one landing seam: every page a destination receives,
//! whatever the mode or codec, lands through a [`PageSink`].
//!
//! - [`DirectSink`]: writes through the guest mapping, reads page data from
//!   the socket straight into place, and clears only pages that may hold
//!   data. For memory no vCPU touches yet (precopy).
//! - [`UffdSink`]: memory registered with userfaultfd (MISSING): missing
//!   pages land by UFFDIO_COPY / UFFDIO_ZEROPAGE, which also wakes a vCPU
//!   waiting on them; a receiver writing through the mapping would fault on
//!   its own write. For postcopy and remote paging.
//! - [`UffdPlacer`]: the userfaultfd calls under [`UffdSink`], in guest
//!   addresses, for pages that land outside a stream: postcopy's zeros for
//!   never-sent pages, the split pager's page-ins, wakes.

mod direct;
mod place;
mod store;
mod switch;
mod uffd;
pub(crate) mod written;

use std::io;
use std::marker::PhantomData;

pub use direct::DirectSink;
pub use place::{already_mapped, Placed, UffdPlacer};
pub use store::PageStore;
pub use switch::SwitchSink;
pub use uffd::{LandObserver, LandPolicy, UffdSink, UffdSinkStats};
pub use written::MaybeNonZero;

use crate::ranges::GpaPages;
use crate::transport::ConnReader;
use crate::vm_error::VmOpError;

/// Why pages could not land.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The pages are not (wholly) inside one region of guest RAM.
    #[error("{pages} pages at {gpa:#x} are not in guest RAM")]
    OutOfRange {
        /// First page.
        gpa: u64,
        /// Pages.
        pages: u64,
    },
    /// The data is not a whole number of pages matching the run.
    #[error("{bytes} bytes do not fill {pages} pages")]
    Shape {
        /// Pages in the run.
        pages: u64,
        /// Bytes given.
        bytes: usize,
    },
    /// The memory's owner could not discard pages.
    #[error("discarding {pages} pages at {gpa:#x} failed: {source}")]
    Discard {
        /// First page.
        gpa: u64,
        /// Pages.
        pages: u64,
        /// The owner's error.
        source: VmOpError,
    },
    /// A memory server has no room for more pages.
    #[error("the memory server is full: {pages} more pages asked, {free} free")]
    Full {
        /// Pages asked for.
        pages: u64,
        /// Pages free.
        free: u64,
    },
    /// A userfaultfd call failed.
    #[error(transparent)]
    Uffd(#[from] ferry_memory::UffdError),
}

/// Where `run` lies in one of `regions`, if it lies wholly inside one and
/// starts on a page.
pub(crate) fn host_of(
    regions: &[crate::memory::RegionView],
    run: GpaPages,
) -> Result<*mut u8, SinkError> {
    regions
        .iter()
        .find_map(|r| r.host_range(run.gpa, run.bytes()))
        .filter(|_| run.gpa.is_multiple_of(crate::ranges::PAGE))
        .ok_or(SinkError::OutOfRange {
            gpa: run.gpa,
            pages: run.pages,
        })
}

/// Where received pages land.
pub trait PageSink: Send + Sync {
    /// Lands whole pages: `data` holds `run.pages` pages for `run`.
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError>;
    /// Makes `run` read as zeros.
    fn zero(&self, run: GpaPages) -> Result<(), SinkError>;
    /// Memory where `run` may be written in place by read(2), if this sink
    /// can take pages that way (memory no one reads until the migration
    /// ends); the pages count as written. `None`: use [`PageSink::write`].
    fn in_place(&self, _run: GpaPages) -> Option<InPlace<'_>> {
        None
    }
    /// Pages that landed in place ([`PageSink::in_place`]) at `run`, as
    /// they landed (a verified migration hashes them here).
    fn landed(&self, _run: GpaPages, _data: &[u8]) {}
}

/// Stretches at least this long are populated in one call before a copy
/// fills them (see [`ConnReader::lands_by_copy`]).
const POPULATE_MIN_BYTES: usize = 8 * crate::ranges::PAGE as usize;

/// Allocates and maps `len` bytes at `at`, best effort (where the kernel
/// cannot, the copy faults the pages in as before). Fresh guest memory
/// faults page by page on first touch; a fault taken in this process's
/// copies and in-place opening of TLS records costs more than one the
/// kernel takes inside read(2), and populating the stretch first costs one
/// call (1 GiB of random pages over TLS, 5 runs each, session 39: 1.49 s
/// median populated, 1.62 s not; plaintext is not helped: 1.38 s against
/// 1.28 s).
fn populate(at: *mut u8, len: usize) {
    // SAFETY: `at .. at + len` is a page-aligned stretch of live guest
    // memory that is ours to write (InPlace's promise), landed by copies,
    // so not under a userfaultfd.
    let _ = unsafe { ferry_memory::mapping::populate_write(at as u64, len as u64) };
}

/// A checked stretch of guest memory to read page data into, in place.
pub struct InPlace<'a> {
    ptr: *mut u8,
    len: usize,
    _memory: PhantomData<&'a ()>,
}

impl<'a> InPlace<'a> {
    /// # Safety
    /// `ptr .. ptr + len` must be writable memory that nothing else reads or
    /// writes while the returned value lives.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        InPlace {
            ptr,
            len,
            _memory: PhantomData,
        }
    }

    /// Fills the stretch from `r`: what it has buffered, then straight
    /// from the socket, no copy in between.
    pub fn fill_from(&mut self, r: &mut ConnReader) -> io::Result<()> {
        if r.lands_by_copy() && self.len >= POPULATE_MIN_BYTES {
            populate(self.ptr, self.len);
        }
        // SAFETY: `ptr .. ptr + len` is writable and ours alone while `self`
        // lives (the constructor's promise); it is guest RAM, never the
        // reader's buffer.
        unsafe { r.read_exact_raw(self.ptr, self.len) }
    }

    /// Allocates and maps the whole stretch now, in one call, ahead of
    /// copies that fill it page by page (each would fault its page in).
    pub fn populate(&self) {
        populate(self.ptr, self.len);
    }

    /// CRC-32C of the stretch appended to `crc` (after [`InPlace::fill_from`]).
    pub fn crc(&self, crc: u32) -> u32 {
        crate::checksum::append(crc, self.landed())
    }

    /// What the stretch holds (after [`InPlace::fill_from`]: what landed).
    pub fn landed(&self) -> &[u8] {
        // SAFETY: the stretch is ours alone while `self` lives (the
        // constructor's promise), so a shared view of it cannot race.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
