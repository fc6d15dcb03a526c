//! Opening /dev/kvm and checking that it can run ferry's guests.

use kvm_ioctls::{Cap, Kvm};

/// Why KVM cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// /dev/kvm could not be opened.
    #[error("cannot open {path}: {source}. {hint}")]
    Open {
        /// The KVM device path.
        path: String,
        /// OS error.
        source: std::io::Error,
        /// What to do about it.
        hint: &'static str,
    },
    /// KVM lacks something ferry needs.
    #[error("KVM on this host lacks {}: ferry cannot run guests here", .missing.join(", "))]
    MissingCapabilities {
        /// Names of the missing capabilities.
        missing: Vec<&'static str>,
    },
    /// Another KVM call failed.
    #[error("KVM {op} failed: {source}")]
    Ioctl {
        /// Which call.
        op: &'static str,
        /// Its error.
        source: kvm_ioctls::Error,
    },
}

/// Opens /dev/kvm (or `path`) and checks the capabilities every ferry VM needs.
pub fn open_kvm(path: &str) -> Result<Kvm, KvmError> {
    let c_path = std::ffi::CString::new(path).map_err(|_| KvmError::Open {
        path: path.into(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        hint: "the path contains a NUL byte",
    })?;
    let kvm = Kvm::new_with_path(&c_path).map_err(|e| {
        let source = std::io::Error::from_raw_os_error(e.errno());
        let hint = match e.errno() {
            libc::ENOENT => "KVM is not available: load the kvm module (kvm_intel/kvm_amd) or enable virtualization",
            libc::EACCES | libc::EPERM => "run as root or add your user to the 'kvm' group",
            _ => "check that KVM works on this host",
        };
        KvmError::Open { path: path.into(), source, hint }
    })?;
    let required = [
        (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
        (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        (Cap::Pit2, "KVM_CAP_PIT2"),
        (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    ];
    let missing: Vec<&'static str> = required
        .iter()
        .filter(|(c, _)| !kvm.check_extension(*c))
        .map(|(_, n)| *n)
        .collect();
    if !missing.is_empty() {
        return Err(KvmError::MissingCapabilities { missing });
    }
    Ok(kvm)
}

/// True if KVM can deliver asynchronous page faults as interrupts.
pub fn has_async_pf(kvm: &Kvm) -> bool {
    kvm.check_extension(Cap::AsyncPf)
        && kvm.check_extension_raw(kvm_bindings::KVM_CAP_ASYNC_PF_INT as libc::c_ulong) > 0
}
