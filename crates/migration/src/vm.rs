//! What the engine needs from a VM, as traits the VMM implements (and tests
//! implement on plain memory). Errors come back whole ([`VmOpError`]).
//!
//! - [`MigratableVm`]: a running VM that can be migrated away (the source).
//! - [`PageStore`]: memory that receives pages, and nothing else: the page
//!   part of a destination (defined with the landing seam, `sink/store.rs`;
//!   a memory server lands pages through a `PageSink` of its own instead).
//! - [`DestinationVm`]: a destination VM: a page store plus vCPUs to restore
//!   and start.

pub use crate::memory::RegionView;
use crate::ranges::{GpaBytes, OffsetBytes};
pub use crate::sink::PageStore;
pub use crate::vm_error::VmOpError;

/// What a VM's access tracker has seen, per region and page: the input of
/// split migration's ranking (hot chunks go to the main host).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessHistory {
    /// Per region, per page: 1 if the page was accessed in the last
    /// period (the clock algorithm's reference bit), else 0.
    pub clock: Vec<Vec<u8>>,
    /// Per region, per page: the aging algorithm's 8-bit history (each
    /// period shifts right and puts that period's access in the top bit).
    pub aging: Vec<Vec<u8>>,
    /// Periods observed so far.
    pub periods: u64,
}

/// The VM's clients can move with it: the VM has its own IP address on
/// the hosts' network, where its request service listens.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClientsPlan {
    /// The VM's address.
    pub ip: std::net::Ipv4Addr,
    /// The service's port there.
    pub port: u16,
    /// Client connections now (the destination gets ready for about as many).
    pub connections: u32,
}

/// The destination's answer to a [`ClientsPlan`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ClientsAnswer {
    /// It takes the address and the connections over.
    Move,
    /// It cannot; the source forwards its clients instead. Why.
    Stay(String),
}

/// The VM's owner fence (docs/safety.md): the one process the registry
/// says holds the VM may run it. The VMM implements it over the registry;
/// the engine calls it at the switch and when a switch fails.
pub trait OwnerFence: Send + Sync {
    /// The claim this process holds, encoded for the destination (≤ 4 KiB);
    /// None if it holds none (then it must not run the VM).
    fn claim(&self) -> Option<Vec<u8>>;
    /// Destination, at the opening: may the VM come from the source's
    /// `claim` (Err: why not, and nothing moves)? What it reads makes the
    /// take-over at the switch one compare-and-swap.
    fn expect(&self, _claim: &[u8]) -> Result<(), String> {
        Ok(())
    }
    /// Destination: takes the VM from the source's `claim` before the
    /// guest's first instruction here; waits while the registry does not
    /// answer. Err: why it may not run the VM (the switch is refused).
    fn take_over(&self, claim: &[u8]) -> Result<String, String>;
    /// Source: Complete goes out; from now on the VM runs here only after a
    /// take-back says it never left.
    fn completing(&self);
    /// Source: the destination said it started the VM.
    fn handed(&self);
    /// Source, after Complete went out and the switch failed: may the VM
    /// run here again?
    fn take_back(&self) -> TakeBackAnswer;
    /// Source, after handing the VM: Some(who and what it means) once the
    /// process that holds it has stopped renewing its claim past the
    /// registry's TTL (it seems dead, and the VM's newest state with it).
    fn holder_gone(&self) -> Option<String> {
        None
    }
}

/// A source's take-back after a failed switch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TakeBackAnswer {
    /// The destination never took the VM: it may run here again (why).
    Back(String),
    /// Another process holds it: it never runs here again (who).
    Gone(String),
    /// The registry did not answer: it stays paused here; the VMM resumes
    /// it by itself if the registry later says it never left (why).
    Unknown(String),
}

/// A running VM that can be migrated away.
pub trait MigratableVm: Send + Sync {
    /// Its owner fence, if the VM is fenced through a registry.
    fn fence(&self) -> Option<std::sync::Arc<dyn OwnerFence>> {
        None
    }
    /// Guest RAM regions.
    fn regions(&self) -> Vec<RegionView>;
    /// Number of vCPUs.
    fn vcpus(&self) -> u32;
    /// Starts tracking guest writes (and clears what was tracked).
    fn start_dirty_log(&self) -> Result<(), VmOpError>;
    /// Per region, a bitmap of pages written since the last call (bit i of
    /// word i/64 = page i), clearing it.
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError>;
    /// Stops tracking.
    fn stop_dirty_log(&self) -> Result<(), VmOpError>;
    /// Stops the vCPUs.
    fn pause(&self) -> Result<(), VmOpError>;
    /// Runs them again (after a failed migration).
    fn resume(&self) -> Result<(), VmOpError>;
    /// The VM's state besides memory (vCPUs, devices), encoded.
    fn save_state(&self) -> Result<Vec<u8>, VmOpError>;
    /// The parts of region `index` that may hold data; the rest is known to
    /// read as zeros and need not be read at all.
    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        crate::memory::whole_region(&self.regions(), index)
    }
    /// [`data_ranges`](Self::data_ranges) clipped to `window` of region
    /// `index`. A VM that can ask its memory about a window alone (a few
    /// lseeks, in the pause) overrides it.
    fn data_ranges_in(&self, index: usize, window: OffsetBytes) -> Vec<OffsetBytes> {
        self.data_ranges(index)
            .into_iter()
            .filter_map(|r| {
                let (start, end) = (r.offset.max(window.offset), r.end().min(window.end()));
                (start < end).then(|| OffsetBytes::new(start, end - start))
            })
            .collect()
    }
    /// Auto-converge: slow the guest so it dirties memory more slowly
    /// (percent of vCPU time taken away, 0 = off). VMs that cannot throttle
    /// keep the default, which does nothing.
    fn throttle(&self, _pct: u32) -> Result<(), VmOpError> {
        Ok(())
    }
    /// Guest ranges the VMM itself writes (not seen by the dirty log): sent
    /// again in the final round.
    fn host_written_ranges(&self) -> Vec<GpaBytes>;
    /// Per-page hashes of all memory known without reading it (a postcopy
    /// standby holds only the pages the destination lacked, and the hashes
    /// its source sent); None: hash the memory.
    fn page_hashes(&self) -> Option<Vec<u64>> {
        None
    }
    /// The guest's own count of async page faults it absorbed ('page not
    /// present' events), if it keeps one.
    fn guest_apf_count(&self) -> Option<u64> {
        None
    }
    /// Where the engine reports live figures of this migration (the VMM's
    /// timeline and metrics read them); None: nobody watches.
    fn telemetry(&self) -> Option<std::sync::Arc<crate::telemetry::Telemetry>> {
        None
    }
    /// What the VM's access tracker has seen so far (split migration ranks
    /// chunks by it); None: the VM tracks no accesses.
    fn access_history(&self) -> Option<AccessHistory> {
        None
    }
    /// A split VM's pager on its main host (gather reads from it); None
    /// for a VM that is not split.
    fn pager(&self) -> Option<std::sync::Arc<crate::pager::RemotePager>> {
        None
    }
    /// The destination's timeline arrived (JSON lines, as its
    /// [`DestinationVm::timeline`] gave them); the default drops it.
    fn peer_timeline(&self, _lines: Vec<u8>) {}
    /// Whether the VM's clients can move with it (asked once per
    /// migration, before any page is sent).
    fn clients_plan(&self) -> Option<ClientsPlan> {
        None
    }
    /// What the destination answered (or the engine, for a destination
    /// too old to move clients). With [`ClientsAnswer::Move`] the pause
    /// need not drain the VM's requests: the connections travel.
    fn clients_decided(&self, _answer: &ClientsAnswer) {}
    /// Whether requests may be in the VM's ring at the pause whose answers
    /// it can collect from the destination once the VM runs there (its
    /// clients stay here and are forwarded).
    fn answers_may_follow(&self) -> bool {
        false
    }
    /// The destination holds the answers to requests in flight at the
    /// pause under `token`: the pause need not wait for the guest to
    /// answer them here (only after [`answers_may_follow`](Self::answers_may_follow)).
    fn answers_follow(&self, _token: [u8; 16]) {}
    /// The VM is paused and everything else is sent: take the clients off
    /// this host and checkpoint their connections (only after
    /// [`ClientsAnswer::Move`]). A later [`resume`](Self::resume) brings
    /// them back here.
    fn save_clients(&self) -> Result<Vec<u8>, VmOpError> {
        Err(VmOpError::from(
            "this VM cannot move its clients".to_string(),
        ))
    }
}

/// A VM waiting to receive a migration: its memory, and vCPUs to start.
pub trait DestinationVm: PageStore {
    /// Number of vCPUs.
    fn vcpus(&self) -> u32;
    /// Its owner fence, if this VMM fences its VM through a registry: then
    /// it takes the VM only from a source's claim.
    fn fence(&self) -> Option<std::sync::Arc<dyn OwnerFence>> {
        None
    }
    /// A source was admitted: from now on guest memory is the migration's
    /// (whatever else touched it while the VM waited must stop now).
    fn admitted(&self) {}
    /// The source may switch to postcopy or split, which need the pages
    /// still to come missing: memory populated ahead of the stream (and
    /// holding no data) is given back now, before any page lands. Returns
    /// the bytes given back.
    fn release_prealloc(&self) -> Result<u64, VmOpError> {
        Ok(0)
    }
    /// The RAM of this host's other VMs that pages may be shared from
    /// (`crate::shared`, read-only, by pread), or None when this VM does
    /// not share (the default: a source asking is offered nothing).
    fn sibling_memory(&self) -> Option<Vec<ferry_memory::PeerRegion>> {
        None
    }
    /// Restores the state `save_state` produced.
    fn restore_state(&self, state: &[u8]) -> Result<(), VmOpError>;
    /// Starts the vCPUs.
    fn start(&self) -> Result<(), VmOpError>;
    /// Where this VM's request service listens, told to the source so it
    /// can forward its clients here.
    fn service_addr(&self) -> Option<String> {
        None
    }
    /// The vCPU threads' ids once started (postcopy tells a vCPU that
    /// blocked on a fault from the VMM's other threads).
    fn vcpu_tids(&self) -> Vec<u32> {
        Vec::new()
    }
    /// As [`MigratableVm::guest_apf_count`] (read once every page is here).
    fn guest_apf_count(&self) -> Option<u64> {
        None
    }
    /// As [`MigratableVm::telemetry`].
    fn telemetry(&self) -> Option<std::sync::Arc<crate::telemetry::Telemetry>> {
        None
    }
    /// This side's timeline so far, as JSON lines (sent to the source at
    /// the end; empty when it keeps none).
    fn timeline(&self) -> Vec<u8> {
        Vec::new()
    }
    /// The memfd behind each region, in order (duplicates), for a split
    /// VM's pager, which reads what it pages out through them rather than
    /// through the guest mapping its own userfaultfd watches; None: this
    /// VMM cannot run a split VM.
    fn memory_fds(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        None
    }
    /// The VM started on the main host of a split migration: keep its
    /// pager (dropping it would strand the VM's remote memory). A VMM that
    /// cannot says why (the pager is then dropped).
    fn adopt_pager(&self, _pager: crate::pager::RemotePager) -> Result<(), VmOpError> {
        Err(VmOpError::from(
            "this VMM cannot keep a split VM's pager".to_string(),
        ))
    }
    /// Holds the answers the guest gives to requests that were in flight
    /// at the source's pause, for the source to collect with `token`
    /// (its clients stay there); false: this VMM cannot, and the source
    /// waits for them in its pause instead.
    fn hold_answers(&self, _token: [u8; 16]) -> bool {
        false
    }
    /// Gets ready to take the source's clients over (before any page
    /// arrives); Err says why it cannot, and the source forwards instead.
    fn prepare_clients(&self, _plan: &ClientsPlan) -> Result<(), String> {
        Err("this VMM cannot take a VM's clients over".into())
    }
    /// Restores the clients [`MigratableVm::save_clients`] checkpointed,
    /// after the state and before [`start`](Self::start), which puts them
    /// on the network; returns what it did, for the source's report.
    fn restore_clients(&self, _clients: &[u8]) -> Result<String, VmOpError> {
        Err(VmOpError::from(
            "this VMM cannot take a VM's clients over".to_string(),
        ))
    }
}
