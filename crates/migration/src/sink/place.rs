//! Userfaultfd placement in guest-physical terms: the one place where a page
//! enters memory that a vCPU may be faulting on. [`UffdSink`] lands the
//! streams' pages through it, postcopy's fault thread zero-fills never-sent
//! pages and wakes waiters through it, and the split pager pages chunks in
//! through it. A run that lies in one region goes in one ioctl (a page at a
//! time costs an ioctl each); where the kernel already holds some page of
//! it, the run goes page by page and the pages already there are left.
//!
//! [`UffdSink`]: super::UffdSink

use std::sync::Arc;

use ferry_memory::{UffdError, Userfaultfd};

use super::SinkError;
use crate::memory::RegionView;
use crate::ranges::{GpaPages, PAGE};

/// Places pages into the userfaultfd-registered memory of `regions`.
#[derive(Clone)]
pub struct UffdPlacer {
    uffd: Arc<Userfaultfd>,
    regions: Vec<RegionView>,
}

/// What one placement did, in pages. Where the kernel stopped a run after
/// a prefix went in (EAGAIN does not say how many), that prefix counts as
/// present.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    /// Pages this call put in.
    pub new: u64,
    /// Pages the kernel held already (left as they were).
    pub present: u64,
}

impl UffdPlacer {
    /// A placer for `regions`, registered with `uffd`.
    pub fn new(uffd: Arc<Userfaultfd>, regions: Vec<RegionView>) -> Self {
        UffdPlacer { uffd, regions }
    }

    /// The regions placed into.
    pub fn regions(&self) -> &[RegionView] {
        &self.regions
    }

    /// The host address of `run`, which must lie wholly in one region.
    pub fn host(&self, run: GpaPages) -> Result<u64, SinkError> {
        let out = SinkError::OutOfRange {
            gpa: run.gpa,
            pages: run.pages,
        };
        if !run.gpa.is_multiple_of(PAGE) {
            return Err(out);
        }
        let (_, r) = crate::memory::region_of(&self.regions, run.gpa).ok_or(out)?;
        r.host_range(run.gpa, run.bytes().max(PAGE))
            .map(|p| p as u64)
            .ok_or(SinkError::OutOfRange {
                gpa: run.gpa,
                pages: run.pages,
            })
    }

    /// UFFDIO_COPY of `data` (exactly `run`'s pages) in one ioctl; `wake`
    /// wakes the threads waiting on them. Fails with the kernel's error,
    /// [`UffdError::AlreadyMapped`] included: the caller decides what a page
    /// already there means.
    pub fn copy(&self, run: GpaPages, data: &[u8], wake: bool) -> Result<(), SinkError> {
        self.copy_as(run, data, wake, false)
    }

    fn copy_as(
        &self,
        run: GpaPages,
        data: &[u8],
        wake: bool,
        protect: bool,
    ) -> Result<(), SinkError> {
        shape(run, data)?;
        let host = self.host(run)?;
        if protect {
            self.uffd.copy_protected(host, data, wake)?;
        } else {
            self.uffd.copy(host, data, wake)?;
        }
        Ok(())
    }

    /// UFFDIO_ZEROPAGE over `run` in one ioctl (wakes its waiters); fails
    /// like [`UffdPlacer::copy`].
    pub fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        let host = self.host(run)?;
        self.uffd.zeropage(host, run.bytes())?;
        Ok(())
    }

    /// Copies `data` to the pages at `gpas` (in any order: runs of
    /// consecutive pages inside one region go in one ioctl); pages the
    /// kernel already holds are left as they are.
    pub fn copy_pages(&self, gpas: &[u64], data: &[u8], wake: bool) -> Result<Placed, SinkError> {
        self.copy_pages_as(gpas, data, wake, false)
    }

    /// Like [`copy_pages`](Self::copy_pages), but the pages land
    /// write-protected, each in the ioctl that places it (the regions must
    /// be registered for WP): the first write to any of them faults.
    pub fn copy_pages_protected(
        &self,
        gpas: &[u64],
        data: &[u8],
        wake: bool,
    ) -> Result<Placed, SinkError> {
        self.copy_pages_as(gpas, data, wake, true)
    }

    fn copy_pages_as(
        &self,
        gpas: &[u64],
        data: &[u8],
        wake: bool,
        protect: bool,
    ) -> Result<Placed, SinkError> {
        if data.len() as u64 != gpas.len() as u64 * PAGE {
            return Err(SinkError::Shape {
                pages: gpas.len() as u64,
                bytes: data.len(),
            });
        }
        let mut placed = Placed::default();
        let mut j = 0;
        while j < gpas.len() {
            let mut n = 1;
            while j + n < gpas.len() && gpas[j + n] == gpas[j] + n as u64 * PAGE {
                n += 1;
            }
            let run = GpaPages::new(gpas[j], n as u64);
            let bytes = &data[j * PAGE as usize..][..n * PAGE as usize];
            let whole = self.in_one_region(run);
            match whole.then(|| self.copy_as(run, bytes, wake, protect)) {
                Some(Ok(())) => placed.new += run.pages,
                Some(Err(e)) if !stopped_at_present(&e) => return Err(e),
                // Some page is there already (a prefix may have gone in
                // before it), or the run spans two regions.
                _ => {
                    for (k, gpa) in run.page_addrs().enumerate() {
                        let page = &bytes[k * PAGE as usize..][..PAGE as usize];
                        match self.copy_as(GpaPages::new(gpa, 1), page, wake, protect) {
                            Ok(()) => placed.new += 1,
                            Err(e) if already_mapped(&e) => placed.present += 1,
                            Err(e) => return Err(e),
                        }
                    }
                }
            }
            j += n;
        }
        Ok(placed)
    }

    /// Maps zero pages over `run` where the kernel holds none (waking
    /// whoever waits on them); pages already there are left.
    pub fn zero_missing(&self, run: GpaPages) -> Result<Placed, SinkError> {
        if self.in_one_region(run) {
            match self.zero(run) {
                Ok(()) => {
                    return Ok(Placed {
                        new: run.pages,
                        present: 0,
                    })
                }
                Err(e) if !stopped_at_present(&e) => return Err(e),
                Err(_) => {}
            }
        }
        let mut placed = Placed::default();
        for gpa in run.page_addrs() {
            match self.zero(GpaPages::new(gpa, 1)) {
                Ok(()) => placed.new += 1,
                Err(e) if already_mapped(&e) => placed.present += 1,
                Err(e) => return Err(e),
            }
        }
        Ok(placed)
    }

    /// UFFDIO_CONTINUE over `run`: maps pages the memfd holds back into the
    /// guest mapping (after MADV_DONTNEED dropped their entries); pages
    /// mapped already are left.
    pub fn map_back(&self, run: GpaPages) -> Result<(), SinkError> {
        self.map_back_as(run, false)
    }

    /// Zero pages, write-protected, over `run` where the kernel holds none
    /// (copied from zeros: UFFDIO_ZEROPAGE has no WP mode); wakes nobody.
    pub fn zero_missing_protected(&self, run: GpaPages) -> Result<Placed, SinkError> {
        let zeros = vec![0u8; run.bytes() as usize];
        let gpas: Vec<u64> = run.page_addrs().collect();
        self.copy_pages_as(&gpas, &zeros, false, true)
    }

    /// Like [`map_back`](Self::map_back), but the pages are mapped
    /// write-protected. Fails where the kernel refuses the mode (before
    /// 6.4): the caller then maps back unprotected and stops relying on
    /// the protection.
    pub fn map_back_protected(&self, run: GpaPages) -> Result<(), SinkError> {
        self.map_back_as(run, true)
    }

    /// The whole run in one UFFDIO_CONTINUE, or, where some page is mapped
    /// already, page by page. Unprotected, a page that cannot be mapped is
    /// left (it faults MINOR again); protected, that is an error (the
    /// caller must know the protection did not hold).
    fn map_back_as(&self, run: GpaPages, protect: bool) -> Result<(), SinkError> {
        let host = self.host(run)?;
        let map = |addr, len| {
            if protect {
                self.uffd.continue_protected(addr, len)
            } else {
                self.uffd.continue_range(addr, len)
            }
        };
        match map(host, run.bytes()) {
            Ok(_) => Ok(()),
            Err(UffdError::AlreadyMapped { .. }) => {
                for p in 0..run.pages {
                    match map(host + p * PAGE, PAGE) {
                        Ok(_) | Err(UffdError::AlreadyMapped { .. }) => {}
                        Err(e) if protect => return Err(e.into()),
                        Err(_) => {}
                    }
                }
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Wakes the threads faulting on `run` (its pages are there now).
    pub fn wake(&self, run: GpaPages) {
        if let Ok(host) = self.host(run) {
            let _ = self.uffd.wake(host, run.bytes());
        }
    }

    fn in_one_region(&self, run: GpaPages) -> bool {
        crate::memory::region_of(&self.regions, run.gpa)
            .is_some_and(|(_, r)| r.contains_range(run.gpa, run.bytes()))
    }
}

fn shape(run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
    if data.len() as u64 != run.bytes() {
        return Err(SinkError::Shape {
            pages: run.pages,
            bytes: data.len(),
        });
    }
    Ok(())
}

/// True if the kernel refused because some page of the range is there.
pub fn already_mapped(e: &SinkError) -> bool {
    matches!(e, SinkError::Uffd(UffdError::AlreadyMapped { .. }))
}

/// True if a run stopped at a page that is there: refused at its first page
/// (EEXIST), or after a prefix went in (EAGAIN, the rest not placed).
fn stopped_at_present(e: &SinkError) -> bool {
    already_mapped(e)
        || matches!(e, SinkError::Uffd(UffdError::Ioctl { source, .. })
            if source.raw_os_error() == Some(libc::EAGAIN))
}
