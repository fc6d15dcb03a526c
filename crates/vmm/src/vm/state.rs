//! A VM's saved state besides guest memory ([`VmState`]): every vCPU, the
//! KVM VM's own state, the service device's and the guest's migration
//! count. Saved from a paused VM, restored into one that has not started;
//! migration and handover carry it, and guest memory travels separately.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::Duration;

use kvm_ioctls::VcpuFd;

use super::{RunState, Vm, VmError};
use crate::devices::block::{DiskState, DiskStateError};
use crate::vstate::persist::{self, KvmVmState, PersistError, VcpuState};
use crate::vstate::run_control::Control;

/// A whole VM's state besides guest memory.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct VmState {
    /// Every vCPU.
    pub vcpus: Vec<VcpuState>,
    /// irqchip, PIT, clock.
    pub kvm: KvmVmState,
    /// The service device, if any.
    pub service: Option<crate::devices::service::ServiceState>,
    /// Incoming migrations the guest had been told of (its host info page).
    pub migrations: u64,
    /// Each disk's device state, in order (carried after the rest, only
    /// when there are disks: see [`VmState::encode`]).
    #[serde(skip)]
    pub disks: Vec<DiskState>,
}

impl VmState {
    /// The state as bytes: a VM without disks encodes as builds before
    /// disks did, so they still take it.
    pub fn encode(&self) -> Result<Vec<u8>, PersistError> {
        persist::encode_with_tail(self, (!self.disks.is_empty()).then_some(&self.disks))
    }

    /// What [`encode`](Self::encode) wrote.
    pub fn decode(bytes: &[u8]) -> Result<VmState, PersistError> {
        let (mut state, disks): (VmState, Option<Vec<DiskState>>) =
            persist::decode_with_tail(bytes)?;
        state.disks = disks.unwrap_or_default();
        Ok(state)
    }
}

impl Vm {
    /// Saves the whole VM state; the VM must be paused (or not started yet).
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let n = self.config.vcpus as usize;
        let idle = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        let vcpus = if idle.len() == n {
            // Not running: the fds are here.
            self.save_vcpus(idle.iter())?
        } else {
            drop(idle);
            if self.shared.requested() != RunState::Paused {
                return Err(VmError::WrongState(
                    "not paused: pause it before saving its state",
                ));
            }
            self.save_vcpus(self.lent_fds()?.lent.iter().flatten())?
        };
        Ok(VmState {
            vcpus,
            kvm: persist::save_vm(&self.vm_fd)?,
            service: self.service().map(|s| s.state()),
            migrations: self.host_info.migrations(),
            disks: self.disks().iter().map(|d| d.state()).collect(),
        })
    }

    /// Restores a saved state into this VM, which must not have started:
    /// KVM state, every vCPU, the service device's own state (a saved
    /// service and this VM's device must both be there or both absent) and
    /// the host info page's migration count, as saved.
    /// Guest memory is restored separately (it is most of the migration);
    /// nothing here reads or writes it.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        let n = self.config.vcpus as usize;
        if state.vcpus.len() != n {
            return Err(PersistError::Shape {
                saved: state.vcpus.len(),
                have: n,
            }
            .into());
        }
        let idle = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() != n && !self.prepared() {
            return Err(VmError::WrongState("already started: restore before start"));
        }
        match (&state.service, self.service()) {
            (Some(saved), Some(device)) => device.restore(saved)?,
            (None, None) => {}
            (Some(_), None) => return Err(VmError::ServiceMissing),
            (None, Some(_)) => return Err(VmError::ServiceUnexpected),
        }
        let disks = self.disks();
        if state.disks.len() != disks.len() {
            return Err(DiskStateError::Count {
                theirs: state.disks.len(),
                ours: disks.len(),
            }
            .into());
        }
        for (d, saved) in disks.iter().zip(&state.disks) {
            d.restore(saved)?;
        }
        persist::restore_vm(&self.vm_fd, &state.kvm)?;
        if idle.len() == n {
            self.restore_vcpus(idle.iter(), state)?;
        } else {
            drop(idle);
            // Started parked for this (prepare_incoming).
            self.restore_vcpus(self.lent_fds()?.lent.iter().flatten(), state)?;
        }
        self.host_info.set_migrations(state.migrations);
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }

    /// The run control once every vCPU thread is parked and has lent its
    /// fd: the fds are read and written through it, under its lock, so no
    /// vCPU thread has to wake (see `Control::lent`) and none takes its fd
    /// back meanwhile.
    fn lent_fds(&self) -> Result<MutexGuard<'_, Control>, VmError> {
        let timeout = Duration::from_secs(5);
        self.shared
            .wait_until(self.shared.lock(), timeout, |c| {
                c.lent.iter().all(Option::is_some)
            })
            .map_err(|_| VmError::PauseTimeout(timeout))
    }

    fn save_vcpus<'a>(
        &self,
        fds: impl Iterator<Item = &'a VcpuFd>,
    ) -> Result<Vec<VcpuState>, VmError> {
        fds.enumerate()
            .map(|(id, fd)| Ok(persist::save_vcpu(fd, id as u32, &self.shared.msr_indices)?))
            .collect()
    }

    fn restore_vcpus<'a>(
        &self,
        fds: impl Iterator<Item = &'a VcpuFd>,
        state: &VmState,
    ) -> Result<(), VmError> {
        for (fd, s) in fds.zip(&state.vcpus) {
            if self.config.apf {
                persist::restore_vcpu(fd, s)?;
            } else {
                // APF off here: the guest may have enabled it where it ran
                // before; KVM then never delivers 'page not present', and
                // every host fault waits in the vCPU, as if the guest had
                // never been told of the feature.
                let mut s = s.clone();
                for m in &mut s.msrs {
                    if m.index == persist::MSR_KVM_ASYNC_PF_EN {
                        m.data = 0;
                    }
                }
                persist::restore_vcpu(fd, &s)?;
            }
        }
        Ok(())
    }

    /// Tells the guest it has been moved: adds one to the migration count
    /// on its host info page and returns the new count. A destination calls
    /// it after [`restore_state`](Self::restore_state) and before
    /// [`start`](Self::start), so the guest sees the change as soon as it
    /// runs here (memtouch `after=migrate` waits for it). The page is not
    /// guest RAM: nothing here waits for memory still at the source.
    pub fn count_incoming_migration(&self) -> Result<u64, VmError> {
        if self.has_started() {
            return Err(VmError::WrongState(
                "already started: count a migration before start",
            ));
        }
        let n = self.host_info.migrations().wrapping_add(1);
        self.host_info.set_migrations(n);
        Ok(n)
    }

    /// Incoming migrations this VM's guest has been told of.
    pub fn migrations(&self) -> u64 {
        self.host_info.migrations()
    }
}
