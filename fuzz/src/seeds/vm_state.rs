//! A VM's state as a source sends it, for the targets that decode one.

/// A VM state as the source sends it: a real one from KVM when this host
/// can make a VM, else one made of the state's default parts; with one
/// disk on shared storage, so its device state rides after the rest.
pub(super) fn vm_state_bytes() -> Vec<u8> {
    use ferry_vmm::vstate::persist;
    let real = (|| -> Option<ferry_vmm::VmState> {
        let vm = ferry_vmm::Vm::create(ferry_vmm::VmConfig::new(
            16 << 20,
            2,
            "compute:tasks=1".parse().ok()?,
        ))
        .ok()?;
        vm.save_state().ok()
    })();
    let mut state = real.unwrap_or_else(|| {
        let vcpu = persist::VcpuState {
            id: 0,
            regs: Default::default(),
            sregs: Default::default(),
            xsave: vec![0; 1024],
            xcrs: Default::default(),
            debugregs: Default::default(),
            msrs: vec![kvm_msr(0x10, 12345), kvm_msr(0xc000_0080, 0x500)],
            lapic: Default::default(),
            events: Default::default(),
            mp_state: Default::default(),
        };
        let state = ferry_vmm::VmState {
            vcpus: vec![vcpu],
            kvm: persist::KvmVmState {
                irqchips: vec![Default::default(); 3],
                pit: Default::default(),
                clock: Default::default(),
            },
            service: Some(ferry_vmm::devices::service::ServiceState {
                port: 7000,
                next_conn: 5,
                free_slots: (0..128).collect(),
            }),
            migrations: 1,
            disks: Vec::new(),
        };
        state
    });
    use ferry_vmm::devices::block::{mmio::TransportState, DiskState, QueueRegs};
    state.disks.push(DiskState {
        backend: "nbd".into(),
        name: "web".into(),
        size: 64 << 20,
        transport: TransportState {
            status: 15,
            driver_features: 1 << 32 | 1 << 9,
            device_features_sel: 1,
            driver_features_sel: 0,
            queue_sel: 0,
        },
        queue: QueueRegs {
            size: 256,
            ready: true,
            desc: 0x10000,
            avail: 0x11000,
            used: 0x12000,
            next_avail: 77,
            next_used: 77,
        },
        interrupt: 1,
    });
    state.encode().expect("encodes")
}

fn kvm_msr(index: u32, data: u64) -> kvm_bindings::kvm_msr_entry {
    kvm_bindings::kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}
