//! The fault thread: reads the guest's page faults from userfaultfd and
//! settles each one (a page the source never had data in is zero-filled
//! here, one already here is woken, a pending one is asked for on the
//! demand connection), and sends those page requests. Apart from the
//! connections in `epoch` because it lives across them: a broken link only
//! takes its request writer away, and the faults wait in the account.

use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry_memory::{Event, UffdError};

use super::super::fault_account::Action;
use super::Shared;
use crate::error::MigrationError;
use crate::protocol::{self, Kind, ProtocolError};
use crate::ranges::{GpaPages, PAGE};
use crate::transport::ConnWriter;

impl Shared {
    /// Sends page requests on the current demand connection from now on
    /// (none: paused, requests wait in the tracker).
    pub(super) fn requests_to(&self, w: Option<ConnWriter>) {
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()) = w;
    }

    /// Asks the source for pages; a failed send drops the connection (the
    /// control thread pauses the phase) and the faults stay waiting.
    pub(super) fn request(&self, gpas: &[u64]) {
        if gpas.is_empty() {
            return;
        }
        let mut w = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let Some(writer) = w.as_mut() else { return };
        let sent = protocol::send(writer, Kind::PageRequest, &gpas)
            .and_then(|_| std::io::Write::flush(writer).map_err(ProtocolError::Io));
        if let Err(e) = sent {
            *w = None;
            drop(w);
            self.fail(e.into());
        }
    }

    /// The fault thread: turns faults into requests, zero fills and wakes.
    pub(super) fn serve_faults(&self) -> Result<(), MigrationError> {
        crate::priority::fault_path();
        let mut events = Vec::new();
        let mut ask: Vec<u64> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            if !self
                .uffd
                .poll(Duration::from_millis(50))
                .map_err(uffd_err)?
            {
                continue;
            }
            events.clear();
            self.uffd.read_events(&mut events).map_err(uffd_err)?;
            ask.clear();
            for ev in &events {
                let Event::PageFault { addr, tid, .. } = *ev else {
                    continue;
                };
                let Some(gpa) = self.regions.iter().find_map(|r| r.gpa_of_host(addr)) else {
                    continue;
                };
                let gpa = gpa & !(PAGE - 1);
                let Some(n) = self.tracker.index().page_of(gpa) else {
                    continue;
                };
                let page = GpaPages::new(gpa, 1);
                if !self.tracker.planned(n) {
                    // Never had data at the source: zeros, here and now.
                    self.sink.placer().zero_missing(page)?;
                    self.tracker.zero_fault(tid);
                    continue;
                }
                match self.tracker.fault(n, tid, self.sink.is_present(gpa)) {
                    Action::Request => ask.push(gpa),
                    Action::Wait => {}
                    Action::Wake => self.sink.placer().wake(page),
                }
            }
            self.request(&ask);
        }
        Ok(())
    }
}

fn uffd_err(e: UffdError) -> MigrationError {
    MigrationError::Sink(e.into())
}
