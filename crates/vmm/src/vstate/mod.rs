//! KVM state: the system fd, the VM and its vCPUs.

pub mod dirty;
pub mod kvm;
pub mod persist;
pub mod vcpu;
pub mod vm;
