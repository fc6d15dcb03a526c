//! vCPUs: configuration (CPUID, long-mode registers), the run loop on its own
//! thread, and the kick that pulls a vCPU out of KVM_RUN.
//!
//! Kicking: another thread sends the vCPU thread a real-time signal whose
//! handler sets `immediate_exit` in that vCPU's `kvm_run`. Setting it in the
//! handler (not before sending) closes the race where the signal lands just
//! before the thread enters KVM_RUN: KVM then returns EINTR at once.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use kvm_bindings::{kvm_mp_state, kvm_run, CpuId, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::kvm::KvmError;
use super::persist;
use crate::boot::setup;
use crate::devices::PioAction;
use crate::vmm::{RunState, VmExit, VmShared};

thread_local! {
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// The signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN.with(|p| {
        let run = p.get();
        if !run.is_null() {
            // SAFETY: `run` is this thread's own kvm_run mapping, registered by
            // the vCPU loop and cleared before the VcpuFd (and mapping) is dropped.
            unsafe { std::ptr::write_volatile(&mut (*run).immediate_exit, 1) };
        }
    });
}

/// Installs the kick handler (idempotent).
pub fn install_kick_handler() -> Result<(), std::io::Error> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

/// A register dump for error reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RegsReport {
    /// Instruction pointer.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Flags.
    pub rflags: u64,
    /// General registers rax, rbx, rcx, rdx, rsi, rdi, rbp.
    pub gprs: [u64; 7],
    /// Control registers cr0, cr2, cr3, cr4.
    pub cr: [u64; 4],
    /// EFER.
    pub efer: u64,
    /// Code segment selector (its low bits are the privilege level).
    pub cs: u16,
}

impl RegsReport {
    /// Reads the registers of a stopped vCPU (best effort: zeros if KVM refuses).
    pub fn read(vcpu: &VcpuFd) -> Self {
        let r = vcpu.get_regs().unwrap_or_default();
        let s = vcpu.get_sregs().unwrap_or_default();
        RegsReport {
            rip: r.rip,
            rsp: r.rsp,
            rflags: r.rflags,
            gprs: [r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp],
            cr: [s.cr0, s.cr2, s.cr3, s.cr4],
            efer: s.efer,
            cs: s.cs.selector,
        }
    }
}

impl fmt::Display for RegsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.gprs;
        write!(
            f,
            "rip={:#x} rsp={:#x} rflags={:#x} cs={:#x} (CPL{}) rax={:#x} rbx={:#x} rcx={:#x} \
             rdx={:#x} rsi={:#x} rdi={:#x} rbp={:#x} cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x}",
            self.rip, self.rsp, self.rflags, self.cs, self.cs & 3, g[0], g[1], g[2], g[3], g[4],
            g[5], g[6], self.cr[0], self.cr[1], self.cr[2], self.cr[3], self.efer
        )
    }
}

/// Gives vCPU `id` its CPUID (APIC id patched in) and long-mode special
/// registers. Its general registers (the entry point) come later, from
/// [`set_entry`] or a restored state; nothing here reads guest memory.
pub fn configure(vcpu: &VcpuFd, id: u32, cpuid: &CpuId) -> Result<(), KvmError> {
    let mut cpuid = cpuid.clone();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => e.ebx = (e.ebx & 0x00ff_ffff) | (id << 24),
            0xb | 0x1f => e.edx = id,
            _ => {}
        }
    }
    let err = |op| move |source| KvmError::Ioctl { op, source };
    vcpu.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
    let sregs = vcpu.get_sregs().map_err(err("KVM_GET_SREGS"))?;
    vcpu.set_sregs(&setup::long_mode_sregs(sregs, id))
        .map_err(err("KVM_SET_SREGS"))?;
    if id > 0 {
        // Application processors start in INIT-wait; make them run at once.
        let mp = kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        };
        vcpu.set_mp_state(mp).map_err(err("KVM_SET_MP_STATE"))?;
    }
    Ok(())
}

/// Points vCPU `id` at the kernel entry, with its boot stack and id in rdi.
pub fn set_entry(vcpu: &VcpuFd, id: u32, entry: u64) -> Result<(), KvmError> {
    vcpu.set_regs(&setup::entry_regs(entry, id))
        .map_err(|source| KvmError::Ioctl {
            op: "KVM_SET_REGS",
            source,
        })
}

fn internal_error_details(vcpu: &mut VcpuFd) -> (u32, Vec<u64>) {
    let run = vcpu.get_kvm_run();
    // SAFETY: the exit reason was KVM_EXIT_INTERNAL_ERROR, so `internal` is the
    // union member the kernel filled in.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let n = (internal.ndata as usize).min(internal.data.len());
    (internal.suberror, internal.data[..n].to_vec())
}

/// Runs vCPU `id` until the VM stops. Returns the vCPU so its state can be read.
pub fn run_loop(mut vcpu: VcpuFd, id: u32, shared: Arc<VmShared>) -> VcpuFd {
    KVM_RUN.with(|p| p.set(vcpu.get_kvm_run() as *mut kvm_run));
    shared.set_vcpu_tid(id);
    loop {
        vcpu.set_kvm_immediate_exit(0);
        match shared.requested() {
            RunState::Running => {
                // Auto-converge: the throttle thread kicks us every period;
                // sit out our share of it.
                if shared.throttle_due(id) {
                    std::thread::sleep(shared.throttle_sleep());
                }
            }
            RunState::Paused => {
                let msrs = shared.msr_indices.clone();
                shared.park(id, &mut || {
                    persist::save_vcpu(&vcpu, id, &msrs).map_err(|e| e.to_string())
                });
                continue;
            }
            RunState::Stopped => break,
        }
        let exit = match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => match shared.devices.pio_write(port, data) {
                PioAction::Continue => None,
                PioAction::Exit(code) => Some(VmExit::GuestExit { cpu: id, code }),
                PioAction::Panic => Some(VmExit::GuestPanic {
                    cpu: id,
                    message: panic_message(&shared.devices.serial.lines()),
                    regs: RegsReport::read(&vcpu),
                }),
            },
            Ok(VcpuExit::IoIn(port, data)) => {
                shared.devices.pio_read(port, data);
                None
            }
            Ok(VcpuExit::MmioRead(_, data)) => {
                data.fill(0xff);
                None
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                shared.devices.mmio_write(addr, data);
                None
            }
            Ok(VcpuExit::Intr) => None,
            Ok(VcpuExit::Shutdown) => Some(VmExit::TripleFault {
                cpu: id,
                regs: RegsReport::read(&vcpu),
            }),
            Ok(VcpuExit::InternalError) => {
                let (suberror, data) = internal_error_details(&mut vcpu);
                Some(VmExit::InternalError {
                    cpu: id,
                    suberror,
                    data,
                    regs: RegsReport::read(&vcpu),
                })
            }
            Ok(VcpuExit::FailEntry(reason, _)) => Some(VmExit::FailEntry { cpu: id, reason }),
            Ok(other) => Some(VmExit::UnexpectedExit {
                cpu: id,
                exit: format!("{other:?}"),
                regs: RegsReport::read(&vcpu),
            }),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => Some(VmExit::RunFailed {
                cpu: id,
                error: e.to_string(),
            }),
        };
        if let Some(exit) = exit {
            shared.finish(exit);
            break;
        }
    }
    KVM_RUN.with(|p| p.set(std::ptr::null_mut()));
    shared.vcpu_exited();
    vcpu
}

/// The guest's panic line(s) from the end of its console output.
fn panic_message(lines: &[String]) -> String {
    match lines.iter().rposition(|l| l.starts_with("PANIC")) {
        Some(i) => lines[i..].join("\n"),
        None => lines.last().cloned().unwrap_or_default(),
    }
}
