//! The kick that pulls a vCPU out of KVM_RUN: a real-time signal another
//! thread sends the vCPU thread. Apart from the run loop because the VM's
//! run control sends it too, and neither should import the other.
//!
//! The signal's handler sets `immediate_exit` in that vCPU's `kvm_run`.
//! Setting it in the handler (not before sending) closes the race where the
//! signal lands just before the thread enters KVM_RUN: KVM then returns
//! EINTR at once.

use std::cell::Cell;

use kvm_bindings::kvm_run;

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

/// Registers the calling thread's `kvm_run` mapping for the kick handler
/// (null: none). The vCPU loop registers its own before it first enters
/// KVM_RUN and clears it before its VcpuFd can be dropped.
pub(super) fn set_thread_run(run: *mut kvm_run) {
    KVM_RUN.with(|p| p.set(run));
}
