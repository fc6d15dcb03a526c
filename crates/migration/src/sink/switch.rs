//! A destination's sink across a postcopy switch: pages land directly while
//! no vCPU runs, through userfaultfd once the VM has started with memory
//! still missing. The switch happens between frames (the source's round
//! barrier comes before it), so no landing straddles it.

use std::sync::{Arc, OnceLock};

use super::{InPlace, PageSink, SinkError, UffdSink};
use crate::ranges::GpaPages;

/// `before` until [`SwitchSink::switch`], then the userfaultfd sink.
pub struct SwitchSink<'a> {
    before: &'a dyn PageSink,
    after: OnceLock<Arc<UffdSink>>,
}

impl<'a> SwitchSink<'a> {
    /// Lands through `before` for now.
    pub fn new(before: &'a dyn PageSink) -> Self {
        SwitchSink {
            before,
            after: OnceLock::new(),
        }
    }

    /// From now on every page lands through `uffd` (a second call is ignored).
    pub fn switch(&self, uffd: Arc<UffdSink>) {
        let _ = self.after.set(uffd);
    }

    fn current(&self) -> &dyn PageSink {
        match self.after.get() {
            Some(u) => u.as_ref(),
            None => self.before,
        }
    }
}

impl PageSink for SwitchSink<'_> {
    fn write(&self, run: GpaPages, data: &[u8]) -> Result<(), SinkError> {
        self.current().write(run, data)
    }

    fn zero(&self, run: GpaPages) -> Result<(), SinkError> {
        self.current().zero(run)
    }

    fn in_place(&self, run: GpaPages) -> Option<InPlace<'_>> {
        self.current().in_place(run)
    }

    fn landed(&self, run: GpaPages, data: &[u8]) {
        self.current().landed(run, data)
    }
}
