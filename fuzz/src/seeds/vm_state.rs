//! A VM's state as a source sends it, for the targets that decode one.

/// A VM state as the source sends it: a real one from KVM when this host
/// can make a VM, else one made of the state's default parts.
pub(super) fn vm_state_bytes() -> Vec<u8> {
    use ferry_vmm::vstate::persist;
    let real = (|| -> Option<Vec<u8>> {
        let vm = ferry_vmm::Vm::create(ferry_vmm::VmConfig::new(
            16 << 20,
            2,
            "compute:tasks=1".parse().ok()?,
        ))
        .ok()?;
        persist::encode(&vm.save_state().ok()?).ok()
    })();
    real.unwrap_or_else(|| {
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
        };
        persist::encode(&state).expect("encodes")
    })
}

fn kvm_msr(index: u32, data: u64) -> kvm_bindings::kvm_msr_entry {
    kvm_bindings::kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}
