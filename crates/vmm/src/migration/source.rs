//! Migrating a VM away: the engine's [`MigratableVm`] on a [`Vm`], and the
//! call the control socket makes.

use std::sync::Mutex;

use ferry_migration::{
    AccessHistory, Backend, BackendKind, ClientsAnswer, ClientsPlan, Endpoint, GpaBytes,
    MigratableVm, MigrateOptions, MigrationError, MigrationStats, OffsetBytes, Outcome, Progress,
    RegionView, VmOpError,
};

use crate::vm::Vm;
use crate::vstate::dirty::Consumer;

/// How long a pause waits for the disks' requests in flight: a backend
/// stalled longer (an NBD server reconnecting) fails the migration, and
/// the VM runs on here.
const DISK_SETTLE: std::time::Duration = std::time::Duration::from_secs(5);

impl MigratableVm for Vm {
    fn fence(&self) -> Option<std::sync::Arc<dyn ferry_migration::OwnerFence>> {
        self.owner()
            .map(|o| o.clone() as std::sync::Arc<dyn ferry_migration::OwnerFence>)
    }
    fn regions(&self) -> Vec<RegionView> {
        super::views(self)
    }

    fn pager(&self) -> Option<std::sync::Arc<ferry_migration::RemotePager>> {
        Vm::pager(self)
    }

    fn vcpus(&self) -> u32 {
        self.config().vcpus
    }

    // Through the arbiter: access tracking may read the same log.
    fn start_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(self.dirty_log().start(Consumer::Migration)?)
    }

    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError> {
        Ok(self.dirty_log().take(Consumer::Migration)?)
    }

    fn stop_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(self.dirty_log().stop(Consumer::Migration)?)
    }

    fn access_history(&self) -> Option<AccessHistory> {
        self.access().snapshot().map(|s| AccessHistory {
            clock: s.clock,
            aging: s.aging,
            periods: s.periods,
        })
    }

    /// When the clients move with the VM, the readers stop between frames
    /// and requests in the ring travel with it (their connections are
    /// restored under the same ids there). When they stay (forwarded),
    /// requests in the ring travel too if the destination holds their
    /// answers for this host to collect (v16); else they are answered here
    /// first, so every answer the destination's guest writes is for a
    /// request it got.
    fn pause(&self) -> Result<(), VmOpError> {
        let timeout = std::time::Duration::from_secs(2);
        let paused = match self.service() {
            Some(s) if s.clients_move() => s
                .freeze(timeout)
                .map_err(VmOpError::from)
                .and_then(|_| Vm::pause(self).map_err(VmOpError::from))
                .and_then(|_| s.flush_answers(timeout).map_err(VmOpError::from)),
            Some(s) => s
                .hold_for_pause(timeout)
                .map_err(VmOpError::from)
                .and_then(|_| Vm::pause(self).map_err(VmOpError::from))
                .map(|_| s.pause_in_flight()),
            None => Vm::pause(self).map_err(VmOpError::from),
        };
        // The disks: with the vCPUs stopped, the requests in flight finish
        // (writing guest RAM and the used ring, all in the dirty log) and
        // the backend flushes, before the last dirty pages and the state
        // are taken. The disk itself stays where it is (shared storage).
        let paused = paused.and_then(|_| {
            self.disks()
                .iter()
                .try_for_each(|d| d.settle(DISK_SETTLE).map_err(VmOpError::from))
        });
        if paused.is_err() {
            let _ = Vm::resume(self);
            // The engine resumes only a VM it paused: undo the hold here.
            if let Some(s) = self.service() {
                s.release();
            }
        }
        paused
    }

    /// The service first: clients that were checkpointed must leave
    /// repair mode before the guest can answer them again.
    fn resume(&self) -> Result<(), VmOpError> {
        if let Some(s) = self.service() {
            s.release();
        }
        Vm::resume(self).map_err(VmOpError::from)
    }

    fn save_state(&self) -> Result<Vec<u8>, VmOpError> {
        Ok(Vm::save_state(self)?.encode()?)
    }

    fn data_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        super::data_ranges(self, index)
    }

    fn data_ranges_in(&self, index: usize, window: OffsetBytes) -> Vec<OffsetBytes> {
        self.memory().regions().get(index).map_or(Vec::new(), |r| {
            r.data_ranges_in(window.offset, window.bytes)
                .into_iter()
                .map(|(o, l)| OffsetBytes::new(o, l))
                .collect()
        })
    }

    fn throttle(&self, pct: u32) -> Result<(), VmOpError> {
        self.set_throttle(pct);
        Ok(())
    }

    fn host_written_ranges(&self) -> Vec<GpaBytes> {
        super::service_ring(self)
    }

    fn guest_apf_count(&self) -> Option<u64> {
        super::guest_apf_count(self)
    }

    fn telemetry(&self) -> Option<std::sync::Arc<ferry_migration::Telemetry>> {
        self.watch().current().map(|r| r.telemetry().clone())
    }

    fn peer_timeline(&self, lines: Vec<u8>) {
        if let Some(r) = self.watch().current() {
            r.set_peer_lines(lines);
        }
    }

    fn clients_plan(&self) -> Option<ClientsPlan> {
        let (ip, port, connections) = self.service()?.clients_plan()?;
        Some(ClientsPlan {
            ip,
            port,
            connections,
        })
    }

    fn clients_decided(&self, answer: &ClientsAnswer) {
        if let Some(s) = self.service() {
            s.clients_decided(*answer == ClientsAnswer::Move);
        }
    }

    fn answers_may_follow(&self) -> bool {
        self.service().is_some_and(|s| !s.clients_move())
    }

    fn answers_follow(&self, token: [u8; 16]) {
        if let Some(s) = self.service() {
            s.answers_follow(token);
        }
    }

    fn save_clients(&self) -> Result<Vec<u8>, VmOpError> {
        let s = self
            .service()
            .ok_or_else(|| VmOpError::from("the VM has no service device".to_string()))?;
        Ok(s.move_out()?)
    }
}

/// The codec backend the options name.
fn backend(kind: BackendKind) -> Backend {
    match kind {
        BackendKind::Cpu => Backend::cpu(),
        BackendKind::Cuda => crate::codec_backend::cuda(),
    }
}

/// Migrates `vm` to `to`. Done: the VM runs there, and this VM's service
/// clients either moved with it or are forwarded to it (the caller releases
/// the VM here). Paused: a postcopy lost its link; the caller keeps it for
/// a resume.
pub fn migrate(
    vm: &Vm,
    to: &Endpoint,
    opts: &MigrateOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Outcome, MigrationError> {
    let state = vm.reported_state();
    if state != crate::ReportedState::Running {
        return Err(MigrationError::Unsupported(format!(
            "the VM is {}: only a running VM migrates",
            state.name()
        )));
    }
    if let Some(why) = crate::devices::block::why_not_migrate(vm.disks()) {
        return Err(MigrationError::Unsupported(format!(
            "cannot migrate: {why}"
        )));
    }
    if let Some(s) = vm.service() {
        s.forget_follow(); // an earlier attempt's agreement is not this one's
    }
    let progress = Mutex::new(progress);
    // The migration reads all of guest memory: access tracking steps
    // aside (its faults would stall the reads and count them as accesses).
    let tracking = vm.access().pause();
    let result = ferry_migration::migrate(vm, to, opts, &backend(opts.compression.backend), &|p| {
        // Postcopy: the VM serves from the destination before the
        // migration ends; forward clients from then on (unless they
        // moved with it).
        if let Some(addr) = &p.destination_service {
            redirect_service(vm, to, addr);
        }
        (progress.lock().unwrap_or_else(|e| e.into_inner()))(p)
    });
    let mut stats = match result {
        Ok(Outcome::Done(stats)) => stats,
        Ok(paused) => return Ok(paused),
        Err(e) => {
            if tracking && runs_here_after(&e) {
                vm.access().resume();
            }
            return Err(e);
        }
    };
    settle_clients(vm, to, &mut stats);
    // Every disk stayed on its shared storage (a local one was refused
    // above): the destination attached the same export.
    stats.disks = vm
        .disks()
        .iter()
        .map(|d| {
            let i = d.info();
            ferry_migration::DiskMove {
                index: i.index,
                backend: i.backend,
                path: i.path,
                how: "shared".into(),
                bytes: 0,
            }
        })
        .collect();
    stats.disk_bytes = stats.disks.iter().map(|d| d.bytes).sum();
    Ok(Outcome::Done(stats))
}

/// Whether the VM goes on running here after a migration failed this way
/// (not after a postcopy switch, nor when the outcome is unknown, nor when
/// verification failed once the destination had started it).
fn runs_here_after(e: &MigrationError) -> bool {
    !matches!(
        e,
        MigrationError::InDoubt(_)
            | MigrationError::PostcopyBroken { .. }
            | MigrationError::VerifyAfterSwitch { .. }
    )
}

/// After a migration that succeeded: clients that moved are let go here,
/// others are forwarded to the destination's service.
fn settle_clients(vm: &Vm, to: &Endpoint, stats: &mut MigrationStats) {
    let Some(svc) = vm.service() else { return };
    match stats.clients.as_mut() {
        Some(c) if c.moved => {
            c.connections = svc
                .stats
                .moved_out
                .load(std::sync::atomic::Ordering::Relaxed);
            svc.moved_away();
        }
        _ => {
            if let Some(addr) = stats.destination_service.clone() {
                redirect_service(vm, to, &addr);
            }
            let unreachable = match (&stats.destination_service, to) {
                (Some(a), Endpoint::Tcp(t)) => a
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_loopback() && !t.ip().is_loopback()),
                _ => false,
            };
            let in_flight = match svc.answers_in_flight() {
                0 => String::new(),
                n => format!(
                    "; {n} request{} in flight at the pause answered there",
                    if n == 1 { "" } else { "s" }
                ),
            };
            let how = format!(
                "forwarded by this host to the destination's service{}{in_flight}",
                match (&stats.destination_service, unreachable) {
                    (Some(a), true) => format!(
                        " ({a}: a loopback address on another host, which this host cannot reach; give the destination --serve on its own address)"
                    ),
                    (Some(a), false) => format!(" ({a})"),
                    (None, _) => String::new(),
                }
            );
            match stats.clients.as_mut() {
                Some(c) => c.detail = format!("{how}: {}", c.detail),
                None => {
                    stats.clients = Some(ferry_migration::ClientsOutcome {
                        moved: false,
                        connections: 0,
                        detail: format!("{how}: the VM has no address of its own (--vm-address)"),
                    })
                }
            }
        }
    }
}

/// Continues a postcopy migration that paused on a broken link.
pub fn resume(
    vm: &Vm,
    paused: ferry_migration::PausedPostcopy,
    to: Option<Endpoint>,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Outcome, MigrationError> {
    let dest = to.clone().unwrap_or_else(|| paused.to.clone());
    let progress = Mutex::new(progress);
    let outcome = ferry_migration::resume(vm, paused, to, &|p| {
        (progress.lock().unwrap_or_else(|e| e.into_inner()))(p)
    })?;
    let Outcome::Done(mut stats) = outcome else {
        return Ok(outcome);
    };
    settle_clients(vm, &dest, &mut stats);
    Ok(Outcome::Done(stats))
}

/// Clients keep using this host's port; their requests now go to the
/// destination's service at `addr` (an unspecified address there means the
/// host we migrated to).
fn redirect_service(vm: &Vm, to: &Endpoint, addr: &str) {
    let Some(svc) = vm.service() else { return };
    if svc.clients_move() {
        return; // the connections moved with the VM
    }
    if let Ok(mut a) = addr.parse::<std::net::SocketAddr>() {
        if a.ip().is_unspecified() {
            if let Endpoint::Tcp(t) = to {
                a.set_ip(t.ip());
            }
        }
        svc.redirect(a);
    }
}
