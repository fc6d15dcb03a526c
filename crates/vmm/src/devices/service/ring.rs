//! Where a request frame goes: posted into the request ring in guest
//! memory (waking a parked guest worker with an MSI) or forwarded to the
//! VM's new host; the guest's doorbell once it answered; draining the ring
//! before a migration pauses the VM; and the ring's part of the saved
//! state ([`ServiceState`]). Everything here touches the ring itself.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use ferry_memory::MemoryError;
use kvm_bindings::kvm_msi;

use super::conn::Outbox;
use super::wire::{self, MAX_BODY};
use super::{lock, Route, ServiceDevice, ServiceError, ServiceState};
use crate::guest_abi::{self, slot_state, svc_off, svc_slot_gpa, SVC_GPA, SVC_SLOTS};

impl ServiceDevice {
    /// Migration is about to pause the VM: stop posting new requests and wait
    /// until the guest has answered every request in the ring, so nothing in
    /// flight belongs to a connection the destination does not know.
    pub fn hold_and_drain(&self, timeout: Duration) -> Result<(), String> {
        self.held.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + timeout;
        let mut ring = lock(&self.ring);
        while ring.free.len() < SVC_SLOTS {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the guest did not answer {} in-flight service requests within {timeout:?}",
                    SVC_SLOTS - ring.free.len()
                ));
            }
            ring = self
                .slot_freed
                .wait_timeout(ring, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Puts a request body into a free slot and tells the guest, or says
    /// where it must go instead.
    pub(super) fn post(&self, body: &[u8], conn: u64) -> Result<Route, MemoryError> {
        let mut ring = lock(&self.ring);
        let slot = loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(Route::Closed);
            }
            if let Some(to) = *lock(&self.redirect) {
                return Ok(Route::Forward(to));
            }
            if self.gate.is_frozen() {
                return Ok(Route::Frozen);
            }
            if !self.held.load(Ordering::SeqCst) {
                if let Some(i) = ring.free.pop() {
                    break i;
                }
            }
            ring = self
                .slot_freed
                .wait_timeout(ring, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        let gpa = svc_slot_gpa(slot);
        let m = &self.memory;
        m.write_bytes(gpa + guest_abi::SVC_SLOT_HEADER, body)?;
        m.write_u32_volatile(gpa + svc_off::SLOT_LEN, body.len() as u32)?;
        m.write_u64_volatile(gpa + svc_off::SLOT_TAG, conn)?;
        m.write_u64_volatile(gpa + svc_off::SLOT_POST_TSC, rdtsc())?;
        fence(Ordering::Release);
        m.write_u32_volatile(gpa + svc_off::SLOT_STATE, slot_state::POSTED)?;
        let posted = m.read_u64_volatile(SVC_GPA + svc_off::POSTED)? + 1;
        m.write_u64_volatile(SVC_GPA + svc_off::POSTED, posted)?;
        self.stats.posted.fetch_add(1, Ordering::Relaxed);
        // Posted before reading `spinner` and the sleepers; the guest clears
        // `spinner` / raises its sleeper count before checking `posted`: one
        // of us sees the other, so a request is never left unseen.
        fence(Ordering::SeqCst);
        if m.read_u64_volatile(SVC_GPA + svc_off::SPINNER)? != 0 {
            return Ok(Route::Posted); // a worker is polling the ring: no interrupt needed
        }
        for n in 0..self.vcpus {
            let cpu = (ring.next_irq_cpu + n) % self.vcpus;
            if m.read_u64_volatile(SVC_GPA + svc_off::SLEEPERS + 8 * cpu as u64)? > 0 {
                ring.next_irq_cpu = cpu + 1;
                self.interrupt(cpu);
                break;
            }
        }
        Ok(Route::Posted)
    }

    fn interrupt(&self, cpu: usize) {
        let msi = kvm_msi {
            address_lo: 0xfee0_0000 | ((cpu as u32) << 12),
            data: guest_abi::VEC_SVC,
            ..Default::default()
        };
        let _ = self.vm.signal_msi(msi);
    }

    /// A guest worker finished the request in `slot` (called on the vCPU thread).
    pub fn doorbell(&self, slot: u32) {
        let slot = slot as usize;
        if slot >= SVC_SLOTS {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let gpa = svc_slot_gpa(slot);
        let m = &self.memory;
        if m.read_u32_volatile(gpa + svc_off::SLOT_STATE).ok() != Some(slot_state::DONE) {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        fence(Ordering::Acquire);
        let len = m.read_u32_volatile(gpa + svc_off::SLOT_LEN).unwrap_or(0) as usize;
        let conn = self.slot_tag(slot).unwrap_or(0);
        let posted_tsc = m
            .read_u64_volatile(gpa + svc_off::SLOT_POST_TSC)
            .unwrap_or(0);
        let mut frame = vec![0u8; 4 + len.min(MAX_BODY)];
        frame[..4].copy_from_slice(&(len.min(MAX_BODY) as u32).to_le_bytes());
        let ok = len <= MAX_BODY
            && m.read_bytes(gpa + guest_abi::SVC_SLOT_HEADER, &mut frame[4..])
                .is_ok();
        let _ = m.write_u32_volatile(gpa + svc_off::SLOT_STATE, slot_state::FREE);
        lock(&self.ring).free.push(slot);
        self.slot_freed.notify_all();
        if !ok {
            self.stats.guest_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Another host's TSC (a move between machines) reads as nonsense:
        // a negative or over-a-minute time is not counted.
        let ticks = rdtsc().wrapping_sub(posted_tsc);
        if ticks < 60 * 4_000_000_000 {
            self.stats.latency_ticks.fetch_add(ticks, Ordering::Relaxed);
            self.stats
                .latency_max_ticks
                .fetch_max(ticks, Ordering::Relaxed);
        }
        self.stats.responses.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = lock(&self.conns).get(&conn) {
            let _ = c.tx.frame(frame);
        } else {
            // In flight at a migration's pause: the source's client.
            self.answer_orphan(slot, conn, &frame);
        }
    }

    /// The connection a slot's request came from (its tag in the ring).
    pub(super) fn slot_tag(&self, slot: usize) -> Result<u64, MemoryError> {
        self.memory
            .read_u64_volatile(svc_slot_gpa(slot) + svc_off::SLOT_TAG)
    }

    /// Sends a request frame to the VM's new host on this connection's own
    /// upstream connection; a thread copies the answers back to the client.
    pub(super) fn forward(
        &self,
        upstream: &mut Option<TcpStream>,
        to: SocketAddr,
        body: &[u8],
        tx: &Outbox,
    ) -> std::io::Result<()> {
        if upstream.is_none() {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            let mut r = BufReader::new(s.try_clone()?);
            let tx = tx.clone();
            std::thread::Builder::new()
                .name("svc-fwd".into())
                .spawn(move || {
                    while let Ok(Some(b)) = wire::read_frame(&mut r, MAX_BODY) {
                        if !tx.frame(wire::frame(&b)) {
                            break;
                        }
                    }
                })?;
            *upstream = Some(s);
        }
        let s = upstream.as_mut().ok_or(std::io::ErrorKind::NotConnected)?;
        s.write_all(&wire::frame(body))?;
        self.stats.forwarded.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Takes over a saved device state (the ring itself is in guest memory
    /// and travels with it): the slots the saved device owned and its next
    /// connection id, so requests already in the ring are finished exactly as
    /// there. Refused once this device has posted requests of its own.
    ///
    /// `state.port` is left alone: this device listens on its own address
    /// (on the same host the source still holds the old port until it
    /// redirects), and the source's device forwards its clients here.
    pub fn restore(&self, state: &ServiceState) -> Result<(), ServiceError> {
        state.check()?;
        // Under the ring lock: a reader takes a slot and counts the post
        // under it, so no post slips between this check and the update.
        let mut ring = lock(&self.ring);
        let posted = self.stats.posted.load(Ordering::Relaxed);
        if posted > 0 {
            return Err(ServiceError::AlreadyPosting { posted });
        }
        ring.free = state.free_slots.iter().map(|&i| i as usize).collect();
        self.note_orphans(&ring.free);
        // Slots in flight carry the saved connections' ids as tags; new
        // connections here must never reuse one (their answers would go to
        // the wrong client), nor an id this device already gave out.
        self.next_conn.fetch_max(state.next_conn, Ordering::Relaxed);
        drop(ring);
        self.slot_freed.notify_all();
        Ok(())
    }

    /// The device state besides guest memory.
    pub fn state(&self) -> ServiceState {
        ServiceState {
            port: self.local_addr().port(),
            next_conn: self.next_conn.load(Ordering::Relaxed),
            free_slots: lock(&self.ring).free.iter().map(|&i| i as u16).collect(),
        }
    }
}

impl ServiceState {
    /// Checks a saved state from a peer before anything takes it: every
    /// free slot inside the ring and listed once, connection ids from 1.
    pub fn check(&self) -> Result<(), ServiceError> {
        let mut owned = [false; SVC_SLOTS];
        for &slot in &self.free_slots {
            let i = slot as usize;
            if i >= SVC_SLOTS {
                return Err(ServiceError::BadState(format!(
                    "free slot {i} is outside the ring of {SVC_SLOTS}"
                )));
            }
            if std::mem::replace(&mut owned[i], true) {
                return Err(ServiceError::BadState(format!(
                    "free slot {i} is listed twice"
                )));
            }
        }
        if self.next_conn == 0 {
            return Err(ServiceError::BadState(
                "next connection id 0 (ids start at 1)".into(),
            ));
        }
        Ok(())
    }
}

fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86-64.
    unsafe { core::arch::x86_64::_rdtsc() }
}
