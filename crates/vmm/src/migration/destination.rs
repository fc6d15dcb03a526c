//! Receiving a VM: the engine's [`PageStore`] and [`DestinationVm`] on a
//! [`Vm`] that waits for its migration, and the listener it waits on.

use std::time::Duration;

use ferry_migration::{
    ClientsPlan, DestinationStats, DestinationVm, Endpoint, GpaBytes, GpaPages, Listener,
    MigrationError, OffsetBytes, PageStore, RegionView, VmOpError,
};

use crate::vm::{Vm, VmState};

impl PageStore for Vm {
    fn regions(&self) -> Vec<RegionView> {
        super::views(self)
    }

    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        super::data_ranges(self, index)
    }

    /// Its data ranges, or what they were before `--prealloc` populated the
    /// rest with zeros.
    fn nonzero_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        match self.data_before_prealloc(index) {
            Some(r) => r.into_iter().map(|(o, l)| OffsetBytes::new(o, l)).collect(),
            None => super::data_ranges(self, index),
        }
    }

    /// The service ring: the device may write it from the host (it is held
    /// until the VM starts, so this is the safe side).
    fn device_written_ranges(&self) -> Vec<GpaBytes> {
        super::service_ring(self)
    }

    fn discard(&self, run: GpaPages) -> Result<(), VmOpError> {
        let r = self.memory().region_for(run.gpa, run.bytes())?;
        Ok(r.punch_hole(run.gpa - r.gpa(), run.bytes())?)
    }
}

impl DestinationVm for Vm {
    fn fence(&self) -> Option<std::sync::Arc<dyn ferry_migration::OwnerFence>> {
        self.owner()
            .map(|o| o.clone() as std::sync::Arc<dyn ferry_migration::OwnerFence>)
    }
    fn vcpus(&self) -> u32 {
        self.config().vcpus
    }

    /// Guest memory is the migration's now: the background preallocation
    /// stops (a postcopy discards pages it must not see populated again).
    fn admitted(&self) {
        let t = std::time::Instant::now();
        let bytes = self.stop_prealloc();
        tracing::info!(
            bytes,
            stop_ms = t.elapsed().as_millis() as u64,
            "a source was admitted; preallocated while waiting"
        );
        // The vCPU threads, made now and parked, so the switch only lets
        // them go. If they cannot be made now, start makes them as before.
        if let Err(e) = self.prepare_incoming() {
            tracing::warn!(error = %e, "vCPU threads not made ahead of the switch");
        }
    }

    fn sibling_memory(&self) -> Option<Vec<ferry_memory::PeerRegion>> {
        Vm::sibling_memory(self)
    }

    fn release_prealloc(&self) -> Result<u64, VmOpError> {
        let t = std::time::Instant::now();
        // The service ring is the device's to write, populated or not.
        let ring: Vec<(u64, u64)> = super::service_ring(self)
            .iter()
            .map(|g| (g.gpa, g.bytes))
            .collect();
        let bytes = Vm::release_prealloc(self, &ring)?;
        tracing::info!(
            bytes,
            ms = t.elapsed().as_millis() as u64,
            "gave back memory populated ahead"
        );
        Ok(bytes)
    }

    /// Restores the state, then counts this migration on the guest's host
    /// info page, so the guest can tell it runs here from its first
    /// instruction here on.
    fn restore_state(&self, state: &[u8]) -> Result<(), VmOpError> {
        let state = VmState::decode(state)?;
        Vm::restore_state(self, &state)?;
        let n = self.count_incoming_migration()?;
        tracing::debug!(migrations = n, "guest told it was moved");
        Ok(())
    }

    fn start(&self) -> Result<(), VmOpError> {
        Ok(Vm::start(self)?)
    }

    fn memory_fds(&self) -> Option<Vec<std::os::fd::OwnedFd>> {
        self.memory()
            .regions()
            .iter()
            .map(|r| r.fd().try_clone_to_owned().ok())
            .collect()
    }

    fn adopt_pager(&self, pager: ferry_migration::RemotePager) -> Result<(), VmOpError> {
        self.keep_pager(pager);
        Ok(())
    }

    fn service_addr(&self) -> Option<String> {
        self.service().map(|s| s.local_addr().to_string())
    }

    fn vcpu_tids(&self) -> Vec<u32> {
        Vm::vcpu_tids(self)
    }

    fn guest_apf_count(&self) -> Option<u64> {
        super::guest_apf_count(self)
    }

    fn telemetry(&self) -> Option<std::sync::Arc<ferry_migration::Telemetry>> {
        self.watch().current().map(|r| r.telemetry().clone())
    }

    fn timeline(&self) -> Vec<u8> {
        self.watch().current().map_or_else(Vec::new, |r| r.lines())
    }

    fn hold_answers(&self, token: [u8; 16]) -> bool {
        self.service().map(|s| s.hold_answers(token)).is_some()
    }

    fn prepare_clients(&self, plan: &ClientsPlan) -> Result<(), String> {
        match self.service() {
            Some(s) => s.prepare_clients(plan.ip, plan.port, plan.connections),
            None => Err(
                "the destination VM has no service device (give it a kv workload or --serve)"
                    .into(),
            ),
        }
    }

    fn restore_clients(&self, clients: &[u8]) -> Result<String, VmOpError> {
        let s = self
            .service()
            .ok_or_else(|| VmOpError::from("the VM has no service device".to_string()))?;
        Ok(s.restore_clients(clients)?)
    }
}

/// Where a VM waits for its incoming migration.
pub struct WaitingDestination {
    listener: Listener,
}

impl WaitingDestination {
    /// Listens on `at` (`tcp:HOST:PORT`, port 0 picks one; or `unix:PATH`).
    pub fn listen(at: &Endpoint) -> Result<WaitingDestination, MigrationError> {
        Ok(WaitingDestination {
            listener: Listener::bind(at)?,
        })
    }

    /// Where it listens.
    pub fn endpoint(&self) -> Endpoint {
        self.listener.endpoint()
    }

    /// Who may bring the VM: only the host named (`--from`), only with
    /// the token (`--token`).
    pub fn admit(&self, rules: ferry_migration::transport::Admission) {
        self.listener.admit(rules)
    }

    /// Waits for a source and receives the migration into `vm`, which runs
    /// once this returns Ok; `timeout` bounds each step after the source
    /// connected. On failure the VM was never started.
    pub fn receive(&self, vm: &Vm, timeout: Duration) -> Result<DestinationStats, MigrationError> {
        let rec = crate::timeline::Recorder::new("destination");
        vm.watch().record(vm, &rec, || {
            ferry_migration::receive(vm, &self.listener, timeout)
        })
    }

    /// [`WaitingDestination::receive`], where a postcopy whose link broke waits
    /// `reconnect_timeout` for the source to come back.
    pub fn receive_with_reconnect(
        &self,
        vm: &Vm,
        timeout: Duration,
        reconnect_timeout: Duration,
    ) -> Result<DestinationStats, MigrationError> {
        let rec = crate::timeline::Recorder::new("destination");
        vm.watch().record(vm, &rec, || {
            ferry_migration::receive_with_reconnect(vm, &self.listener, timeout, reconnect_timeout)
        })
    }
}
