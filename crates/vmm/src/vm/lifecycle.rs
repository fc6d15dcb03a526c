//! A VM's life after it is built: starting its vCPU threads (running or
//! paused), stopping them and saying why the VM ended, waiting for that,
//! and releasing a VM that now runs elsewhere.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvm_ioctls::VcpuFd;
use vmm_sys_util::signal::Killable;

use super::{RunState, Vm, VmError, VmExit};
use crate::vstate::vcpu;

impl Vm {
    /// Starts one thread per vCPU. When clients moved here with the VM,
    /// the service device is released (they go live) between the threads'
    /// start, parked, and their run: the vCPUs would take the cores from
    /// that work, and once the threads exist nothing can fail after it.
    /// Otherwise the threads run at once (parking them first costs a
    /// wake-up each, which an idle VM's downtime feels). An incoming VM's
    /// threads may have been started parked already
    /// ([`prepare_incoming`](Self::prepare_incoming)): they are only let go.
    pub fn start(&self) -> Result<(), VmError> {
        if let Some(why) = self.fence_forbids() {
            return Err(VmError::Fenced(why));
        }
        let t = Instant::now();
        let prepared = self.prepared();
        let staged = prepared || self.service().is_some_and(|s| s.clients_moving_in());
        if prepared {
            self.check_loaded()?;
            self.mark_started();
        } else if staged {
            self.start_paused()?;
        } else {
            self.start_threads()?;
        }
        let threads_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Some(s) = self.service() {
            s.release();
        }
        if staged {
            self.resume()?;
        }
        if let Some(access) = self.config.access {
            self.start_access(access);
        }
        tracing::debug!(
            threads_ms,
            prepared,
            release_ms = t.elapsed().as_secs_f64() * 1e3 - threads_ms,
            "VM started"
        );
        Ok(())
    }

    /// Starts the vCPU threads paused (a handover: everything is ready
    /// before the commit point, and [`resume`](Self::resume) is then all
    /// that runs the guest). The service device stays held.
    pub fn start_paused(&self) -> Result<(), VmError> {
        self.shared.set_requested(RunState::Paused);
        self.start_threads()
    }

    /// An incoming VM: starts its vCPU threads parked before its state has
    /// arrived, so the switch does not wait for threads to be made (60-100
    /// µs here, downtime). Parked, they lend their fds, and the state is
    /// restored through them ([`Vm::restore_state`]). The VM still reports
    /// itself waiting, not started, until [`start`](Self::start). Does
    /// nothing if its threads exist already.
    pub fn prepare_incoming(&self) -> Result<(), VmError> {
        if self.prepared() {
            return Ok(());
        }
        {
            // Under the lock: a stop that came first stays a stop.
            let _c = self.shared.lock();
            if self.shared.requested() == RunState::Stopped {
                return Err(VmError::WrongState("stopped"));
            }
            self.shared.set_requested(RunState::Paused);
        }
        self.spawn_threads()
    }

    /// Threads started parked by `prepare_incoming`, not yet let go.
    pub(super) fn prepared(&self) -> bool {
        !self.has_started()
            && !self
                .handles
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
    }

    fn check_loaded(&self) -> Result<(), VmError> {
        if self.loaded.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(VmError::WrongState(
                "empty: install a boot image or restore a saved state before start",
            ))
        }
    }

    fn mark_started(&self) {
        *self.started.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    fn start_threads(&self) -> Result<(), VmError> {
        // (A started VM was loaded: spawn_threads says "already started".)
        self.check_loaded()?;
        self.spawn_threads()?;
        self.mark_started();
        Ok(())
    }

    fn spawn_threads(&self) -> Result<(), VmError> {
        vcpu::install_kick_handler().map_err(VmError::Thread)?;
        let vcpus: Vec<VcpuFd> =
            std::mem::take(&mut *self.vcpus.lock().unwrap_or_else(|e| e.into_inner()));
        if vcpus.is_empty() {
            return Err(VmError::WrongState("already started"));
        }
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        let mut threads = self
            .shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (id, fd) in vcpus.into_iter().enumerate() {
            let shared = self.shared.clone();
            // Counted before the thread can leave (it counts itself out).
            self.shared.lock().running_threads += 1;
            let spawned = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || vcpu::run_loop(fd, id as u32, shared));
            match spawned {
                Ok(h) => {
                    threads.push(h.pthread_handle());
                    handles.push(h);
                }
                Err(e) => {
                    // The VM cannot run without every vCPU: the threads
                    // made already leave, and stop() can join them.
                    self.shared.lock().running_threads -= 1;
                    // (finish kicks the threads: it takes their list.)
                    drop(threads);
                    drop(handles);
                    self.shared.finish(VmExit::Stopped);
                    return Err(VmError::Thread(e));
                }
            }
        }
        Ok(())
    }

    /// Releases a VM that now runs elsewhere (it is paused here).
    pub fn finish_migrated(&self, to: String) {
        self.shared.finish(VmExit::Migrated { to });
    }

    /// Releases a VM another process on this host runs now (it is paused
    /// here, and its memory is that process's as well: nothing here
    /// touches it again).
    pub fn finish_handed_over(&self, pid: u32) {
        self.shared.finish(VmExit::HandedOver { pid });
    }

    /// Asks the VM to stop without waiting (used by `quit`).
    pub fn request_stop(&self) {
        self.shared.finish(VmExit::Stopped);
    }

    /// Waits up to `timeout` for the VM to stop by itself or on request.
    pub fn wait_exit(&self, timeout: Duration) -> Option<VmExit> {
        let c = self.shared.lock();
        match self.shared.wait_until(c, timeout, |c| c.exit.is_some()) {
            Ok(c) => c.exit.clone(),
            Err(_) => None,
        }
    }

    /// Stops the VM, joins the vCPU threads and says why it stopped.
    pub fn stop(&self) -> VmExit {
        // Tracking and remote paging first: no vCPU may be left waiting on
        // their faults (a split VM's page on a dead server never comes; with
        // the pager gone the vCPU's access completes and it can leave).
        self.access.stop();
        if let Some(pager) = self.pager.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // What it did stays readable (the run summary comes after).
            *self.pager_final.lock().unwrap_or_else(|e| e.into_inner()) = Some(pager.stats());
        }
        self.shared.finish(VmExit::Stopped);
        if let Some(s) = &self.shared.devices.service {
            s.shutdown();
        }
        let handles: Vec<_> =
            std::mem::take(&mut *self.handles.lock().unwrap_or_else(|e| e.into_inner()));
        // Keep kicking until every thread is out: a kick can race a thread that
        // is between checking its state and entering KVM_RUN. Less and less
        // often: the kick is a real-time signal, and they queue, so a thread
        // that cannot take them (stopped by a debugger) must not fill the
        // user's whole signal queue.
        let mut c = self.shared.lock();
        let mut pause = Duration::from_millis(1);
        while c.running_threads > 0 {
            drop(c);
            self.shared.kick_all();
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
            c = self.shared.lock();
        }
        let exit = c.exit.clone().unwrap_or(VmExit::Stopped);
        drop(c);
        self.shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let mut vcpus = self.vcpus.lock().unwrap_or_else(|e| e.into_inner());
        for h in handles {
            if let Ok(fd) = h.join() {
                vcpus.push(fd);
            }
        }
        exit
    }

    /// True once the vCPUs were started (an incoming VM: the migration
    /// got that far).
    pub fn has_started(&self) -> bool {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map_or(Duration::ZERO, |s| s.elapsed())
    }
}
