//! One VM: the handle that owns the KVM VM, its vCPU threads, devices and
//! guest memory, and what the rest of the VMM asks of it.
//!
//! The handle's work is split by what it does: [`config`] (what to build,
//! checked without KVM) and [`error`], `build.rs` (the KVM VM around guest
//! memory, and the boot image), [`state`] (saving and restoring everything
//! but memory), `lifecycle.rs` (start, stop, why it ended) and
//! `run_control.rs` (pause, resume, throttle). What the vCPU threads share
//! with the handle sits below, in [`crate::vstate`], so that nothing there
//! imports this module: run control ([`VmShared`], [`RunState`]) and why
//! the VM stopped ([`VmExit`]). This file keeps the handle itself, its
//! accessors, its memory and paging, and access tracking.

mod build;
pub mod config;
pub mod error;
mod lifecycle;
mod prealloc;
mod run_control;
pub mod state;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ferry_memory::{GuestMemory, MemoryError};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use crate::access::{AccessConfig, AccessSlot};
use crate::boot::layout::MemoryLayout;
use crate::devices::host_info::HostInfoPage;
use crate::devices::service::ServiceDevice;
use crate::metrics::MetricsSnapshot;
use crate::timeline::{Sampled, Watch};
use crate::vstate::dirty::DirtyLog;

pub use crate::vstate::exit::VmExit;
pub use crate::vstate::run_control::{ReportedState, RunState, VmShared};
pub use config::VmConfig;
pub use error::VmError;
pub use state::VmState;

/// (offset, length) runs of one memory region that hold data.
type DataRanges = Vec<(u64, u64)>;

/// A VM and its vCPU threads.
pub struct Vm {
    config: VmConfig,
    layout: MemoryLayout,
    shared: Arc<VmShared>,
    vcpus: Mutex<Vec<VcpuFd>>,
    handles: Mutex<Vec<JoinHandle<VcpuFd>>>,
    tsc_khz: u64,
    /// The vCPUs have something to run: a boot image or a restored state.
    loaded: AtomicBool,
    started: Mutex<Option<Instant>>,
    /// Per region, what held data when `prealloc` populated the rest.
    data_before_prealloc: Mutex<Option<Vec<DataRanges>>>,
    /// Guest RAM being populated in the background while the VM waits for
    /// its migration (`prealloc.rs`).
    background_prealloc: prealloc::Slot,
    /// The migration being recorded, if any (timeline and metrics).
    watch: Watch,
    /// A split VM's remote paging (on its main host), kept while it runs.
    pager: Mutex<Option<Arc<ferry_migration::RemotePager>>>,
    /// Its last figures, once the VM stopped and the pager went.
    pager_final: Mutex<Option<ferry_migration::PagerStats>>,
    /// KVM's dirty log, shared by a migration and access tracking.
    dirty: Arc<DirtyLog>,
    /// Access tracking, when on.
    access: AccessSlot,
    /// While this VM waits for an incoming migration: where, and who may
    /// bring it (shown by `status`).
    waiting: Mutex<Option<Waiting>>,
    /// Where this VM shares its RAM with the host's other VMs, and finds
    /// theirs (`--share-pages`, `crate::share`).
    sharing: Mutex<Option<crate::share::Published>>,
    /// The owner fence, when the VM is fenced through a registry
    /// (`crate::owner`): the vCPUs run only while it holds the VM.
    owner: std::sync::OnceLock<Arc<crate::owner::Owner>>,
    // Fields drop in order: vCPU fds above, then the VM, then the memory it maps.
    vm_fd: Arc<VmFd>,
    _kvm: Kvm,
    host_info: HostInfoPage,
    memory: Arc<GuestMemory>,
}

/// Where a VM waits for its incoming migration and who may bring it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Waiting {
    /// The endpoint it listens on.
    pub endpoint: String,
    /// Only this host may (`--from`).
    pub from: Option<String>,
    /// The one-time token a source must present (`--token`).
    pub token: Option<String>,
    /// True if the link is mutual TLS.
    pub tls: bool,
}

impl Vm {
    /// Fences this VM through a registry from now on (once).
    pub fn set_owner(&self, owner: Arc<crate::owner::Owner>) {
        let _ = self.owner.set(owner);
    }

    /// Its owner fence, if it is fenced.
    pub fn owner(&self) -> Option<&Arc<crate::owner::Owner>> {
        self.owner.get()
    }

    /// Why the vCPUs may not run now, by the owner fence (None: they may,
    /// or the VM is not fenced).
    pub fn fence_forbids(&self) -> Option<String> {
        self.owner.get().and_then(|o| o.why_not_run())
    }

    /// Says where and how this VM waits for its migration (None: it does
    /// not wait any more).
    pub fn set_waiting(&self, w: Option<Waiting>) {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = w;
    }

    /// Where and how this VM waits for its migration, if it does.
    pub fn waiting(&self) -> Option<Waiting> {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Shares this VM's RAM with the host's other sharing VMs through
    /// `dir`, and lets an incoming migration take pages from theirs
    /// (`--share-pages`).
    pub fn share_pages(&self, dir: &std::path::Path) -> std::io::Result<()> {
        let published = crate::share::publish(dir, &self.memory)?;
        *self.sharing.lock().unwrap_or_else(|e| e.into_inner()) = Some(published);
        Ok(())
    }

    /// The other sharing VMs' RAM, opened read-only (None when this VM
    /// does not share).
    pub fn sibling_memory(&self) -> Option<Vec<ferry_memory::PeerRegion>> {
        let sharing = self.sharing.lock().unwrap_or_else(|e| e.into_inner());
        sharing.as_ref().map(|p| crate::share::siblings(p.dir()))
    }

    /// Starts access tracking on this running VM (a failure is logged and
    /// shown in its status; the VM runs on without it).
    pub fn start_access(&self, config: AccessConfig) {
        let shared = self.shared.clone();
        self.access.start(
            &self.memory,
            self.dirty.clone(),
            config,
            Box::new(move || {
                shared
                    .tids
                    .iter()
                    .map(|t| t.load(Ordering::Acquire))
                    .collect()
            }),
        );
    }

    /// Access tracking (pause it before reading all of guest memory).
    pub fn access(&self) -> &AccessSlot {
        &self.access
    }

    /// KVM's dirty log and its consumers.
    pub fn dirty_log(&self) -> &Arc<DirtyLog> {
        &self.dirty
    }

    /// How fast the guest writes memory now: the distinct pages it wrote
    /// during `window` (the dirty log on for that long, as a consumer of
    /// its own beside any migration or access tracking), and the seconds
    /// the window really lasted.
    pub fn dirty_rate(&self, window: std::time::Duration) -> Result<(u64, f64), VmError> {
        use crate::vstate::dirty::Consumer;
        self.dirty.start(Consumer::Probe)?;
        // Logging may start with every page set (KVM's "initially set"):
        // a first read clears the slate and protects the pages.
        if let Err(e) = self.dirty.take(Consumer::Probe) {
            let _ = self.dirty.stop(Consumer::Probe);
            return Err(e.into());
        }
        let t = std::time::Instant::now();
        std::thread::sleep(window);
        let taken = self.dirty.take(Consumer::Probe);
        let secs = t.elapsed().as_secs_f64();
        let stopped = self.dirty.stop(Consumer::Probe);
        let pages = taken?
            .iter()
            .flatten()
            .map(|w| u64::from(w.count_ones()))
            .sum();
        stopped?;
        Ok((pages, secs))
    }

    /// Keeps a split VM's pager for as long as the VM lives.
    /// If paging fails for good (a memory server died with the only copy
    /// of some pages), the vCPUs stop: the VM cannot run on without them,
    /// and `ferry status` says which server (the pager's failure).
    pub fn keep_pager(&self, pager: ferry_migration::RemotePager) {
        let shared = self.shared.clone();
        pager.on_failure(move |why| {
            tracing::error!(%why, "the VM stops: part of its memory is out of reach");
            // Only asked, not waited for: a vCPU may be blocked on the
            // very page that cannot come.
            shared.set_requested(RunState::Paused);
            shared.kick_all();
        });
        *self.pager.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(pager));
    }

    /// A split VM's pager (gather reads from it).
    pub fn pager(&self) -> Option<Arc<ferry_migration::RemotePager>> {
        self.pager.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What remote paging did, for a split VM on its main host.
    pub fn pager_stats(&self) -> Option<ferry_migration::PagerStats> {
        let live = self
            .pager
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|p| p.stats());
        live.or_else(|| {
            self.pager_final
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }

    /// Guest memory.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }

    /// The RAM layout.
    pub fn layout(&self) -> &MemoryLayout {
        &self.layout
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Guest TSC frequency.
    pub fn tsc_khz(&self) -> u64 {
        self.tsc_khz
    }

    /// Reads the guest's metrics page now.
    pub fn metrics(&self) -> Result<MetricsSnapshot, MemoryError> {
        MetricsSnapshot::read(&self.memory)
    }

    /// The migration being recorded, if any.
    pub fn watch(&self) -> &Watch {
        &self.watch
    }

    /// The service device, if the VM has one.
    pub fn service(&self) -> Option<&Arc<ServiceDevice>> {
        self.shared.devices.service.as_ref()
    }

    /// The VM's virtio-blk disks.
    pub fn disks(&self) -> &[Arc<crate::devices::block::BlockDevice>] {
        &self.shared.devices.disks
    }

    /// The KVM VM.
    pub fn vm_fd(&self) -> &Arc<VmFd> {
        &self.vm_fd
    }

    /// The guest's most recent console lines.
    pub fn console_lines(&self) -> Vec<String> {
        self.shared.devices.serial.lines()
    }
}

/// The owner fence acts on the VM through this (`crate::owner`).
impl crate::owner::Guarded for Vm {
    fn halt(&self, why: &str) {
        tracing::error!("{why}: the vCPUs stop here");
        if let Err(e) = self.pause() {
            tracing::error!("cannot pause the VM that lost its claim: {e}");
        }
    }

    fn run_again(&self) -> Result<(), String> {
        self.resume().map_err(|e| e.to_string())
    }
}

/// What the timeline reads (it knows no [`Vm`]).
impl Sampled for Vm {
    fn reported_state(&self) -> ReportedState {
        Vm::reported_state(self)
    }

    fn tsc_khz(&self) -> u64 {
        Vm::tsc_khz(self)
    }

    fn metrics(&self) -> Result<MetricsSnapshot, MemoryError> {
        Vm::metrics(self)
    }

    fn workload_count(&self) -> usize {
        self.config.workloads.0.len()
    }

    fn service(&self) -> Option<&Arc<ServiceDevice>> {
        Vm::service(self)
    }

    fn watch(&self) -> &Watch {
        Vm::watch(self)
    }

    fn disk_io(&self) -> Vec<[u64; 4]> {
        self.disks().iter().map(|d| d.io_counters()).collect()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop();
    }
}
