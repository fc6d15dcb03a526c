//! Why a VM stopped ([`VmExit`]), with the registers at the exit for the
//! reports ([`RegsReport`]). Its own module because a vCPU thread decides
//! it and the VM handle reports it: both read it from here.

use std::fmt;

use kvm_ioctls::VcpuFd;

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

/// Why a VM stopped.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VmExit {
    /// The host asked it to stop.
    Stopped,
    /// It now runs on another host; this copy was released.
    Migrated {
        /// Where it went.
        to: String,
    },
    /// Another VMM process on this host runs it now (a handover).
    HandedOver {
        /// That process.
        pid: u32,
    },
    /// The guest wrote its exit port.
    GuestExit {
        /// vCPU that wrote it.
        cpu: u32,
        /// Exit code.
        code: u32,
    },
    /// The guest kernel panicked.
    GuestPanic {
        /// vCPU that panicked.
        cpu: u32,
        /// The guest's own message.
        message: String,
        /// Registers at the exit.
        regs: RegsReport,
    },
    /// Triple fault.
    TripleFault {
        /// vCPU.
        cpu: u32,
        /// Registers.
        regs: RegsReport,
    },
    /// KVM_EXIT_INTERNAL_ERROR, e.g. an instruction KVM could not emulate.
    InternalError {
        /// vCPU.
        cpu: u32,
        /// KVM's suberror (1 = emulation failure).
        suberror: u32,
        /// KVM's extra data.
        data: Vec<u64>,
        /// Registers.
        regs: RegsReport,
    },
    /// KVM_EXIT_FAIL_ENTRY.
    FailEntry {
        /// vCPU.
        cpu: u32,
        /// Hardware reason.
        reason: u64,
    },
    /// An exit ferry does not handle.
    UnexpectedExit {
        /// vCPU.
        cpu: u32,
        /// The exit.
        exit: String,
        /// Registers.
        regs: RegsReport,
    },
    /// KVM_RUN itself failed.
    RunFailed {
        /// vCPU.
        cpu: u32,
        /// The error.
        error: String,
    },
}

impl VmExit {
    /// True unless the host stopped the VM or the guest exited with code 0.
    pub fn is_error(&self) -> bool {
        !matches!(
            self,
            VmExit::Stopped
                | VmExit::Migrated { .. }
                | VmExit::HandedOver { .. }
                | VmExit::GuestExit { code: 0, .. }
        )
    }
}

impl fmt::Display for VmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmExit::Stopped => write!(f, "stopped by the host"),
            VmExit::Migrated { to } => write!(f, "migrated to {to}"),
            VmExit::HandedOver { pid } => write!(f, "handed over to VMM process {pid}"),
            VmExit::GuestExit { cpu, code } => write!(f, "guest exited with code {code} (vCPU {cpu})"),
            VmExit::GuestPanic { cpu, message, regs } => {
                write!(f, "guest panic on vCPU {cpu}: {message}\n  registers: {regs}")
            }
            VmExit::TripleFault { cpu, regs } => {
                write!(f, "triple fault (KVM_EXIT_SHUTDOWN) on vCPU {cpu}\n  registers: {regs}")
            }
            VmExit::InternalError { cpu, suberror, data, regs } => write!(
                f,
                "KVM_EXIT_INTERNAL_ERROR on vCPU {cpu}: suberror {suberror}{} data {data:x?}\n  registers: {regs}",
                if *suberror == 1 { " (instruction emulation failed)" } else { "" }
            ),
            VmExit::FailEntry { cpu, reason } => {
                write!(f, "KVM_EXIT_FAIL_ENTRY on vCPU {cpu}: hardware reason {reason:#x}")
            }
            VmExit::UnexpectedExit { cpu, exit, regs } => {
                write!(f, "unhandled exit {exit} on vCPU {cpu}\n  registers: {regs}")
            }
            VmExit::RunFailed { cpu, error } => write!(f, "KVM_RUN failed on vCPU {cpu}: {error}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_host_stops_moves_and_clean_guest_exits_are_not_errors() {
        assert!(!VmExit::Stopped.is_error());
        assert!(!VmExit::Migrated { to: "b".into() }.is_error());
        assert!(!VmExit::HandedOver { pid: 7 }.is_error());
        assert!(!VmExit::GuestExit { cpu: 0, code: 0 }.is_error());
        assert!(VmExit::GuestExit { cpu: 1, code: 3 }.is_error());
        assert!(VmExit::TripleFault {
            cpu: 0,
            regs: RegsReport::default()
        }
        .is_error());
        assert!(VmExit::RunFailed {
            cpu: 0,
            error: "x".into()
        }
        .is_error());
    }

    #[test]
    fn reports_name_the_vcpu_and_decode_what_they_can() {
        let e = VmExit::InternalError {
            cpu: 2,
            suberror: 1,
            data: vec![0x10],
            regs: RegsReport {
                cs: 0x2b,
                ..Default::default()
            },
        };
        let text = e.to_string();
        assert!(text.contains("vCPU 2"), "{text}");
        assert!(text.contains("instruction emulation failed"), "{text}");
        // The privilege level is the selector's low bits.
        assert!(text.contains("cs=0x2b (CPL3)"), "{text}");
        let other = VmExit::InternalError {
            cpu: 0,
            suberror: 3,
            data: vec![],
            regs: RegsReport::default(),
        };
        assert!(!other.to_string().contains("emulation"));
        assert_eq!(
            VmExit::GuestExit { cpu: 1, code: 4 }.to_string(),
            "guest exited with code 4 (vCPU 1)"
        );
    }

    #[test]
    fn exits_serialize_tagged_by_kind() {
        let v = serde_json::to_value(VmExit::Migrated { to: "h:1".into() }).unwrap();
        assert_eq!(v, serde_json::json!({"kind": "migrated", "to": "h:1"}));
        let v = serde_json::to_value(VmExit::GuestExit { cpu: 0, code: 0 }).unwrap();
        assert_eq!(v["kind"], "guest_exit");
    }
}
