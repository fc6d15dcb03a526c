//! The VMM side of migration: a [`Vm`] as the engine sees it, through the
//! `ferry-migration` traits. KVM specifics (dirty log, state) stay here.

use ferry_migration::{IncomingVm, MigratableVm, RegionView};

use crate::guest_abi::{SVC_GPA, SVC_HEADER_SIZE, SVC_SLOTS, SVC_SLOT_SIZE};
use crate::vmm::{Vm, VmState};
use crate::vstate::{persist, vm};

fn views(vm: &Vm) -> Vec<RegionView> {
    vm.memory()
        .regions()
        .iter()
        .map(|r| RegionView {
            gpa: r.gpa(),
            size: r.size(),
            host: r.host_addr(),
        })
        .collect()
}

fn data_ranges(vm: &Vm, index: usize) -> Vec<(u64, u64)> {
    vm.memory()
        .regions()
        .get(index)
        .map_or(Vec::new(), |r| r.data_ranges())
}

impl MigratableVm for Vm {
    fn regions(&self) -> Vec<RegionView> {
        views(self)
    }

    fn vcpus(&self) -> u32 {
        self.config().vcpus
    }

    fn start_dirty_log(&self) -> Result<(), String> {
        vm::register_memory(self.vm_fd(), self.memory(), true).map_err(|e| e.to_string())?;
        vm::take_dirty_log(self.vm_fd(), self.memory())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, String> {
        vm::take_dirty_log(self.vm_fd(), self.memory()).map_err(|e| e.to_string())
    }

    fn stop_dirty_log(&self) -> Result<(), String> {
        vm::register_memory(self.vm_fd(), self.memory(), false).map_err(|e| e.to_string())
    }

    /// Requests in the service ring are answered here before the pause, so
    /// every answer the destination's guest writes is for a request it got.
    fn pause(&self) -> Result<(), String> {
        let drained = match self.service() {
            Some(s) => s.hold_and_drain(std::time::Duration::from_secs(2)),
            None => Ok(()),
        };
        let paused = drained.and_then(|_| Vm::pause(self).map_err(|e| e.to_string()));
        if paused.is_err() {
            // The engine resumes only a VM it paused: undo the hold here.
            if let Some(s) = self.service() {
                s.release();
            }
        }
        paused
    }

    fn resume(&self) -> Result<(), String> {
        let r = Vm::resume(self).map_err(|e| e.to_string());
        if let Some(s) = self.service() {
            s.release();
        }
        r
    }

    fn save_state(&self) -> Result<Vec<u8>, String> {
        let state = Vm::save_state(self).map_err(|e| e.to_string())?;
        persist::encode(&state).map_err(|e| e.to_string())
    }

    fn data_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        data_ranges(self, index)
    }

    fn throttle(&self, pct: u32) -> Result<(), String> {
        self.set_throttle(pct);
        Ok(())
    }

    /// The service ring: the device writes requests into it from the host,
    /// which KVM's dirty log does not see.
    fn host_written_ranges(&self) -> Vec<(u64, u64)> {
        match self.service() {
            Some(_) => vec![(SVC_GPA, SVC_HEADER_SIZE + SVC_SLOTS as u64 * SVC_SLOT_SIZE)],
            None => Vec::new(),
        }
    }
}

impl IncomingVm for Vm {
    fn regions(&self) -> Vec<RegionView> {
        views(self)
    }

    fn vcpus(&self) -> u32 {
        self.config().vcpus
    }

    fn data_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        data_ranges(self, index)
    }

    /// Its data ranges, or what they were before `--prealloc` populated the
    /// rest with zeros.
    fn nonzero_ranges(&self, index: usize) -> Vec<(u64, u64)> {
        self.data_before_prealloc(index)
            .unwrap_or_else(|| data_ranges(self, index))
    }

    /// The service ring: the device writes requests there from the host,
    /// even into a VM that waits for its migration.
    fn device_written_ranges(&self) -> Vec<(u64, u64)> {
        MigratableVm::host_written_ranges(self)
    }

    fn zero(&self, gpa: u64, len: u64) -> Result<(), String> {
        let r = self
            .memory()
            .region_for(gpa, len)
            .map_err(|e| e.to_string())?;
        r.punch_hole(gpa - r.gpa(), len).map_err(|e| e.to_string())
    }

    fn restore_state(&self, state: &[u8]) -> Result<(), String> {
        let state: VmState = persist::decode(state).map_err(|e| e.to_string())?;
        Vm::restore_state(self, &state).map_err(|e| e.to_string())
    }

    fn start(&self) -> Result<(), String> {
        Vm::start(self).map_err(|e| e.to_string())
    }

    fn service_addr(&self) -> Option<String> {
        self.service().map(|s| s.local_addr().to_string())
    }
}
