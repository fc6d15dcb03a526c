//! ferry's virtual machine monitor: one KVM VM with its vCPU threads, the test
//! guest it boots, the guest's devices and metrics, and the control socket.
//!
//! Layout: [`vstate`] holds the KVM objects, [`boot`] what the guest finds at
//! entry, [`devices`] the port-I/O devices, [`guest_abi`] the contract with the
//! guest, [`workload`] the workload specs, [`metrics`] the guest's counters,
//! [`vm`] the VM handle and its lifecycle, [`access`] its access tracking and
//! [`control`] its control socket.

pub mod access;
pub mod boot;
pub mod codec_backend;
pub mod control;
pub mod devices;
pub mod exporter;
pub mod guest_abi;
pub mod handover;
pub mod hostnet;
pub mod metrics;
pub mod migration;
pub mod owner;
pub mod share;
pub mod timeline;
pub mod vm;
pub mod vstate;
pub mod workload;

/// The VM module's old path (`ferry_vmm::vmm::Vm` and so on).
pub use vm as vmm;
pub use vm::{ReportedState, RunState, Vm, VmConfig, VmError, VmExit, VmState, Waiting};
pub use workload::{Workload, WorkloadSet};

pub use boot::GUEST_KERNEL;
