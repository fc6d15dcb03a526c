//! Hosts and VMs as their agents would describe them, for the unit tests
//! of planning and room.

use crate::api::{HostInfo, VmInfo, VmSpec};

/// A running VM of `mib` MiB and `vcpus` vCPUs.
pub(crate) fn vm(name: &str, mib: u64, vcpus: u32) -> VmInfo {
    VmInfo {
        spec: VmSpec {
            name: name.into(),
            mem_bytes: mib << 20,
            vcpus,
            workload: "idle".into(),
            vm_address: None,
            serve: None,
        },
        state: "running".into(),
        pid: 1,
        socket: "/x".into(),
        uptime_s: 1.0,
        came_by: "started".into(),
        progress: None,
        dirty_bytes_per_s: None,
    }
}

/// A host of 4 GiB and 8 vCPUs with `free_mib` and `free_vcpus` free,
/// running `vms`, with no memory servers.
pub(crate) fn host(name: &str, free_mib: u64, free_vcpus: u32, vms: Vec<VmInfo>) -> HostInfo {
    HostInfo {
        name: name.into(),
        addr: "10.0.0.1:7000".into(),
        mem_bytes: 4096 << 20,
        free_mem: free_mib << 20,
        vcpus: 8,
        free_vcpus,
        link_bps: 0,
        vms,
        stores: Vec::new(),
        sent: Vec::new(),
    }
}
