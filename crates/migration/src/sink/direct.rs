//! Pages written straight through the guest mapping: for memory no vCPU
//! runs on yet (a precopy destination before its start).

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
        }
    }

    fn host(&self, run: GpaPages) -> Result<*mut u8, SinkError> {
        super::host_of(&self.regions, run)
    }
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
        let dst = self.host(run).ok()?;
        self.maybe.mark(run);
        // SAFETY: inside one live region (checked); nothing reads the
        // destination's memory until the migration starts the VM, and within
        // a round each page arrives on one stream only.
        Some(unsafe { InPlace::new(dst, run.bytes() as usize) })
    }
}
