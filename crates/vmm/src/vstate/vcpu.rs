//! vCPUs: configuration (CPUID, long-mode registers) and the run loop on
//! its own thread. What the loop obeys and reports lives beside it: the
//! run control it shares with the VM handle ([`super::run_control`]), the
//! kick that gets it out of KVM_RUN ([`super::kick`]) and why it stopped
//! ([`super::exit`]).

use std::sync::Arc;

use kvm_bindings::{kvm_mp_state, kvm_run, CpuId, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuExit, VcpuFd};

pub use super::exit::RegsReport;
use super::exit::VmExit;
use super::kick::set_thread_run;
pub use super::kick::{install_kick_handler, kick_signal};
use super::kvm::KvmError;
use super::run_control::{RunState, VmShared};
use crate::boot::setup;
use crate::devices::PioAction;

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
    set_thread_run(vcpu.get_kvm_run() as *mut kvm_run);
    shared.set_vcpu_tid(id);
    loop {
        vcpu.set_kvm_immediate_exit(0);
        match shared.requested() {
            RunState::Running => {
                // Auto-converge: the throttle thread kicks us every period;
                // sit out our share of it.
                if shared.throttle_due(id) {
                    shared.sit_out(shared.throttle_sleep());
                }
            }
            RunState::Paused => {
                vcpu = shared.park(id, vcpu);
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
            Ok(VcpuExit::MmioRead(addr, data)) => {
                shared.devices.mmio_read(addr, data);
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
    set_thread_run(std::ptr::null_mut());
    shared.clear_vcpu_tid(id);
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

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn a_panic_report_starts_at_the_last_panic_line() {
        let lines: Vec<String> = ["boot", "PANIC old", "more", "PANIC: bad", "  at x"]
            .map(String::from)
            .to_vec();
        assert_eq!(panic_message(&lines), "PANIC: bad\n  at x");
        let lines = vec!["a".to_string(), "last words".to_string()];
        assert_eq!(panic_message(&lines), "last words");
        assert_eq!(panic_message(&[]), "");
    }
}
