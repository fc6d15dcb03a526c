//! Saved KVM state: every vCPU (registers, special registers, XSAVE, XCRs,
//! MSRs, LAPIC, pending events, MP state, debug registers) and the VM
//! (PIC, IOAPIC, PIT, KVM clock), for migration and snapshots.
//!
//! Restore order follows what KVM needs: MSRs before special registers (EFER
//! and APIC base), LAPIC before MP state and events, as Firecracker does.
//! Encoded with postcard inside a versioned envelope:
//! `magic:u64 | version:u32 | postcard(VmState)`.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

/// Envelope magic ("FERRYVS1").
pub const STATE_MAGIC: u64 = 0x3153_5659_5252_4546;
/// Envelope version; a restore refuses any other.
pub const STATE_VERSION: u32 = 2;

/// Why state could not be saved, encoded or restored.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// A KVM get/set call failed.
    #[error("KVM {op} failed on {what}: {source}")]
    Kvm {
        /// Which call.
        op: &'static str,
        /// vCPU n or "the VM".
        what: String,
        /// KVM's error.
        source: kvm_ioctls::Error,
    },
    /// KVM took fewer MSRs than given.
    #[error(
        "KVM_SET_MSRS on vCPU {cpu} accepted {set} of {total} MSRs (first refused: {refused:#x})"
    )]
    Msrs {
        /// vCPU.
        cpu: u32,
        /// Accepted.
        set: usize,
        /// Given.
        total: usize,
        /// Index of the first refused MSR.
        refused: u32,
    },
    /// The bytes are not a ferry VM state of this version.
    #[error("not a ferry VM state (bad magic, version {found} vs {STATE_VERSION}, or truncated)")]
    Envelope {
        /// Version found (0 if unreadable).
        found: u32,
    },
    /// The state does not decode.
    #[error("corrupt VM state: {0}")]
    Decode(String),
    /// The state is for another VM shape.
    #[error("state is for {saved} vCPUs, this VM has {have}")]
    Shape {
        /// vCPUs in the state.
        saved: usize,
        /// vCPUs here.
        have: usize,
    },
}

/// One vCPU's saved state.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct VcpuState {
    /// vCPU index.
    pub id: u32,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state: the 4 KiB XSAVE region.
    pub xsave: Vec<u32>,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// MSRs KVM could read (TSC, syscall MSRs, KVM paravirt MSRs such as async PF...).
    pub msrs: Vec<kvm_msr_entry>,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// Pending exceptions, interrupts, NMIs.
    pub events: kvm_vcpu_events,
    /// Running, halted, INIT-wait...
    pub mp_state: kvm_mp_state,
}

/// The VM-wide KVM state.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct KvmVmState {
    /// PIC master, PIC slave, IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// i8254 PIT.
    pub pit: kvm_pit_state2,
    /// KVM clock.
    pub clock: kvm_clock_data,
}

fn kvm_err(
    op: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kvm_ioctls::Error) -> PersistError {
    let what = what.into();
    move |source| PersistError::Kvm { op, what, source }
}

/// The MSRs to save: every MSR KVM lists that this vCPU can actually read.
pub fn saveable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, PersistError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST", "the host"))?;
    let mut out = Vec::new();
    for &index in list.as_slice() {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|_| PersistError::Decode("MSR list".into()))?;
        if vcpu.get_msrs(&mut one).unwrap_or(0) == 1 {
            out.push(index);
        }
    }
    Ok(out)
}

/// Saves vCPU `id` (which must not be running).
pub fn save_vcpu(vcpu: &VcpuFd, id: u32, msr_indices: &[u32]) -> Result<VcpuState, PersistError> {
    let who = format!("vCPU {id}");
    let entries: Vec<kvm_msr_entry> = msr_indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs =
        Msrs::from_entries(&entries).map_err(|_| PersistError::Decode("too many MSRs".into()))?;
    let n = vcpu
        .get_msrs(&mut msrs)
        .map_err(kvm_err("KVM_GET_MSRS", who.clone()))?;
    Ok(VcpuState {
        id,
        regs: vcpu
            .get_regs()
            .map_err(kvm_err("KVM_GET_REGS", who.clone()))?,
        sregs: vcpu
            .get_sregs()
            .map_err(kvm_err("KVM_GET_SREGS", who.clone()))?,
        xsave: vcpu
            .get_xsave()
            .map_err(kvm_err("KVM_GET_XSAVE", who.clone()))?
            .region
            .to_vec(),
        xcrs: vcpu
            .get_xcrs()
            .map_err(kvm_err("KVM_GET_XCRS", who.clone()))?,
        debugregs: vcpu
            .get_debug_regs()
            .map_err(kvm_err("KVM_GET_DEBUGREGS", who.clone()))?,
        msrs: msrs.as_slice()[..n].to_vec(),
        lapic: vcpu
            .get_lapic()
            .map_err(kvm_err("KVM_GET_LAPIC", who.clone()))?,
        events: vcpu
            .get_vcpu_events()
            .map_err(kvm_err("KVM_GET_VCPU_EVENTS", who.clone()))?,
        mp_state: vcpu
            .get_mp_state()
            .map_err(kvm_err("KVM_GET_MP_STATE", who))?,
    })
}

/// KVM's async page fault enable MSR (its paravirtual MSR range).
pub const MSR_KVM_ASYNC_PF_EN: u32 = 0x4b56_4d02;

/// The parts of a saved vCPU that KVM takes as built structures, checked
/// before any KVM call: its MSR list and its XSAVE region.
pub fn restore_parts(s: &VcpuState) -> Result<(Msrs, kvm_xsave), PersistError> {
    let msrs =
        Msrs::from_entries(&s.msrs).map_err(|_| PersistError::Decode("too many MSRs".into()))?;
    let mut xsave = kvm_xsave::default();
    if s.xsave.len() != xsave.region.len() {
        return Err(PersistError::Decode(format!(
            "XSAVE region of {} words",
            s.xsave.len()
        )));
    }
    xsave.region.copy_from_slice(&s.xsave);
    Ok((msrs, xsave))
}

/// Restores a vCPU (created and given its CPUID, not running).
pub fn restore_vcpu(vcpu: &VcpuFd, s: &VcpuState) -> Result<(), PersistError> {
    let who = format!("vCPU {}", s.id);
    let (msrs, xsave) = restore_parts(s)?;
    let set = vcpu
        .set_msrs(&msrs)
        .map_err(kvm_err("KVM_SET_MSRS", who.clone()))?;
    if set != s.msrs.len() {
        return Err(PersistError::Msrs {
            cpu: s.id,
            set,
            total: s.msrs.len(),
            refused: s.msrs[set].index,
        });
    }
    vcpu.set_sregs(&s.sregs)
        .map_err(kvm_err("KVM_SET_SREGS", who.clone()))?;
    vcpu.set_regs(&s.regs)
        .map_err(kvm_err("KVM_SET_REGS", who.clone()))?;
    // SAFETY: a plain kvm_xsave (no extra area), as KVM_GET_XSAVE returns it.
    unsafe { vcpu.set_xsave(&xsave) }.map_err(kvm_err("KVM_SET_XSAVE", who.clone()))?;
    vcpu.set_xcrs(&s.xcrs)
        .map_err(kvm_err("KVM_SET_XCRS", who.clone()))?;
    vcpu.set_debug_regs(&s.debugregs)
        .map_err(kvm_err("KVM_SET_DEBUGREGS", who.clone()))?;
    vcpu.set_lapic(&s.lapic)
        .map_err(kvm_err("KVM_SET_LAPIC", who.clone()))?;
    vcpu.set_mp_state(s.mp_state)
        .map_err(kvm_err("KVM_SET_MP_STATE", who.clone()))?;
    vcpu.set_vcpu_events(&s.events)
        .map_err(kvm_err("KVM_SET_VCPU_EVENTS", who))?;
    Ok(())
}

/// Saves the VM-wide state (vCPUs must not be running).
pub fn save_vm(vm: &VmFd) -> Result<KvmVmState, PersistError> {
    let mut irqchips = Vec::new();
    for chip_id in [
        KVM_IRQCHIP_PIC_MASTER,
        KVM_IRQCHIP_PIC_SLAVE,
        KVM_IRQCHIP_IOAPIC,
    ] {
        let mut chip = kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        vm.get_irqchip(&mut chip)
            .map_err(kvm_err("KVM_GET_IRQCHIP", "the VM"))?;
        irqchips.push(chip);
    }
    Ok(KvmVmState {
        irqchips,
        pit: vm.get_pit2().map_err(kvm_err("KVM_GET_PIT2", "the VM"))?,
        clock: vm.get_clock().map_err(kvm_err("KVM_GET_CLOCK", "the VM"))?,
    })
}

/// Restores the VM-wide state.
pub fn restore_vm(vm: &VmFd, s: &KvmVmState) -> Result<(), PersistError> {
    for chip in &s.irqchips {
        vm.set_irqchip(chip)
            .map_err(kvm_err("KVM_SET_IRQCHIP", "the VM"))?;
    }
    vm.set_pit2(&s.pit)
        .map_err(kvm_err("KVM_SET_PIT2", "the VM"))?;
    // Only the clock value: its flags describe the source host.
    let clock = kvm_clock_data {
        clock: s.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock)
        .map_err(kvm_err("KVM_SET_CLOCK", "the VM"))?;
    Ok(())
}

/// Encodes any serialisable state in the versioned envelope.
pub fn encode<T: serde::Serialize>(state: &T) -> Result<Vec<u8>, PersistError> {
    let mut out = STATE_MAGIC.to_le_bytes().to_vec();
    out.extend_from_slice(&STATE_VERSION.to_le_bytes());
    let body = postcard::to_stdvec(state).map_err(|e| PersistError::Decode(e.to_string()))?;
    out.extend_from_slice(&body);
    Ok(out)
}

/// [`encode`], with `tail` after the state when there is one: a state
/// with no tail is byte for byte what `encode` writes, so builds that
/// know no tail still take it (and refuse one with a tail, as trailing
/// bytes, rather than drop what it carries).
pub fn encode_with_tail<T: serde::Serialize, U: serde::Serialize>(
    state: &T,
    tail: Option<&U>,
) -> Result<Vec<u8>, PersistError> {
    let mut out = encode(state)?;
    if let Some(tail) = tail {
        let body = postcard::to_stdvec(tail).map_err(|e| PersistError::Decode(e.to_string()))?;
        out.extend_from_slice(&body);
    }
    Ok(out)
}

/// Decodes what [`encode_with_tail`] wrote.
pub fn decode_with_tail<T: serde::de::DeserializeOwned, U: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<(T, Option<U>), PersistError> {
    let rest = envelope(bytes)?;
    let (value, rest) =
        postcard::take_from_bytes(rest).map_err(|e| PersistError::Decode(e.to_string()))?;
    if rest.is_empty() {
        return Ok((value, None));
    }
    let (tail, rest) =
        postcard::take_from_bytes(rest).map_err(|e| PersistError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(PersistError::Decode(format!(
            "{} trailing bytes",
            rest.len()
        )));
    }
    Ok((value, Some(tail)))
}

/// The body of an envelope of this version.
fn envelope(bytes: &[u8]) -> Result<&[u8], PersistError> {
    if bytes.len() < 12 || bytes[..8] != STATE_MAGIC.to_le_bytes() {
        return Err(PersistError::Envelope { found: 0 });
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version != STATE_VERSION {
        return Err(PersistError::Envelope { found: version });
    }
    Ok(&bytes[12..])
}

/// Decodes what [`encode`] wrote; refuses other magic, versions or garbage.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, PersistError> {
    let (value, rest) = postcard::take_from_bytes(envelope(bytes)?)
        .map_err(|e| PersistError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(PersistError::Decode(format!(
            "{} trailing bytes",
            rest.len()
        )));
    }
    Ok(value)
}
