//! Why a VM could not be built or driven ([`VmError`]): one error type for
//! every VM operation, wrapping the lower layers' own.

use std::time::Duration;

use ferry_memory::MemoryError;

use crate::boot::layout::LayoutError;
use crate::boot::loader::KernelError;
use crate::devices::host_info::HostInfoError;
use crate::devices::service::ServiceError;
use crate::guest_abi;
use crate::vstate::kvm::KvmError;
use crate::vstate::persist::PersistError;
use crate::workload::SpecError;

/// Why a VM could not be built or driven.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// Bad RAM size.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Bad workload.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Bad guest image.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// KVM refused.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// The dirty log could not be read.
    #[error("dirty log: {0}")]
    DirtyLog(#[from] crate::vstate::dirty::DirtyLogError),
    /// Guest memory could not be set up.
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
    /// The memory handed to [`Vm::build`](super::Vm::build) is not laid out as the config's RAM size needs.
    #[error("guest memory regions {found:#x?} (gpa, size) do not match the layout of a {mem_bytes}-byte VM: {expected:#x?}")]
    MemoryMismatch {
        /// The config's RAM size.
        mem_bytes: u64,
        /// (gpa, size) of each region the layout needs.
        expected: Vec<(u64, u64)>,
        /// (gpa, size) of each region handed over.
        found: Vec<(u64, u64)>,
    },
    /// vCPU count out of range.
    #[error("--vcpus {0} is out of range: the guest supports 1 to {max}", max = guest_abi::MAX_CPUS)]
    VcpuCount(u32),
    /// Tick rate out of range.
    #[error("tick rate {0} Hz is out of range (1 to 1000)")]
    TickRate(u32),
    /// APF asked for but not available.
    #[error(
        "KVM on this host lacks KVM_CAP_ASYNC_PF_INT (asynchronous page faults): run with --no-apf"
    )]
    NoAsyncPf,
    /// A thread or signal handler could not be set up.
    #[error("cannot start vCPU threads: {0}")]
    Thread(std::io::Error),
    /// The vCPUs did not stop in time.
    #[error("vCPUs did not pause within {0:?}")]
    PauseTimeout(Duration),
    /// The operation needs a VM in another state.
    #[error("the VM is {0}")]
    WrongState(&'static str),
    /// The owner fence forbids running the VM here (docs/safety.md).
    #[error("this VMM may not run the VM: {0}")]
    Fenced(String),
    /// Saving or restoring state failed.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// The service device could not start or take over a saved state.
    #[error(transparent)]
    Service(#[from] ServiceError),
    /// The saved state has a service device and this VM has none.
    #[error("the saved state has a service device and this VM has none (give it a serve address or a kv workload)")]
    ServiceMissing,
    /// A migrated disk's state does not fit this VM's disks.
    #[error(transparent)]
    DiskState(#[from] crate::devices::block::DiskStateError),
    /// This VM has a service device and the saved state has none.
    #[error("this VM has a service device and the saved state has none")]
    ServiceUnexpected,
    /// The host info page could not be set up.
    #[error(transparent)]
    HostInfo(#[from] HostInfoError),
    /// A disk could not be attached.
    #[error(transparent)]
    Disk(#[from] crate::devices::block::BlockError),
    /// The disk workload names a disk the VM does not have.
    #[error("the disk workload uses disk {index} but the VM has {disks} disk(s): add --disk PATH")]
    NoDisk {
        /// The disk it names.
        index: u32,
        /// Disks the VM has.
        disks: usize,
    },
    /// The disk workload needs more of its disk than there is.
    #[error("the disk workload uses {need} bytes of disk {index}, which holds only {have}")]
    DiskTooSmall {
        /// The disk.
        index: u32,
        /// Bytes it uses.
        need: u64,
        /// Bytes the disk holds.
        have: u64,
    },
}
