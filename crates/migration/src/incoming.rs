//! The destination's entry point: receives one migration into a waiting VM
//! and starts it.

use std::time::Duration;

use crate::session::DestSession;
use crate::sink::DirectSink;
use crate::stats::IncomingStats;
use crate::transport::Listener;
use crate::vm::IncomingVm;
use crate::MigrationError;

/// Receives one migration into `vm` through `listener`; `timeout` bounds
/// each step once a source has connected (waiting for one is unbounded).
/// Returns once the VM runs here and the source was told so. On failure
/// the VM was never started.
pub fn receive(
    vm: &dyn IncomingVm,
    listener: &Listener,
    timeout: Duration,
) -> Result<IncomingStats, MigrationError> {
    let mut session = DestSession::accept(listener, timeout)?;
    let result = (|| {
        session.handshake(&vm.regions(), vm.vcpus())?;
        // Every session this build speaks is precopy-shaped on the wire:
        // pages land straight in memory no vCPU runs on yet.
        let sink = DirectSink::new(vm);
        session.run(vm, &sink, &mut crate::precopy::Incoming)
    })();
    session.conclude(result)
}
