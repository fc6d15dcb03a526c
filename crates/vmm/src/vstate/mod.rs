//! KVM state: the system fd, the VM and its vCPUs, and what a vCPU thread
//! shares with the VM handle (run control, the kick, why the VM stopped).
//! Nothing here imports the VM module above it (`crate::vm`).

pub mod dirty;
pub mod exit;
pub mod kick;
pub mod kvm;
pub mod persist;
pub mod run_control;
pub mod vcpu;
pub mod vm;
