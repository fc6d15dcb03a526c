//! The device's part of a handover to another VMM process on this host
//! (docs/handover.md): freeze the readers between frames, flush the
//! answers given so far, export every connection with what its reader had
//! not handled, and then either hand off (the other process serves them)
//! or thaw. The receiving side adopts the exported connections.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::conn::{FrozenConn, Inbox, Outbox};
use super::{lock, ServiceDevice, ServiceError};

/// Connections taken over from another process, registered and not read yet.
pub struct AdoptedConns(Vec<(FrozenConn, Outbox, Inbox)>);

impl AdoptedConns {
    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True if none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Starts serving them on `device`, each from what its reader left.
    pub fn serve(self, device: &Arc<ServiceDevice>) {
        for (c, tx, rx) in self.0 {
            device.spawn_connection(c.id, c.stream, c.pending, tx, rx);
        }
    }
}

impl ServiceDevice {
    /// Handover, first step (the VM still runs): stop accepting, and stop
    /// every reader between two frames, so no request is half-read or on
    /// its way into the ring. Requests already in the ring stay there: they
    /// travel with guest memory, and the next process answers them.
    /// Undo with [`thaw`](Self::thaw).
    pub fn freeze(&self, timeout: Duration) -> Result<(), ServiceError> {
        if let Some(to) = self.redirected_to() {
            return Err(ServiceError::Handover(format!(
                "the VM moved to {to} and this device forwards its clients there"
            )));
        }
        if self.stop.load(Ordering::Acquire) {
            return Err(ServiceError::Handover("the device is shut down".into()));
        }
        // The gate first, so no reader posts once the accept thread stopped.
        self.accepting.store(false, Ordering::Release);
        self.gate.close();
        self.stop_accepting();
        self.slot_freed.notify_all(); // readers waiting for a slot see the gate
        if let Err(busy) = self.gate.wait_parked(timeout) {
            self.thaw();
            return Err(ServiceError::Handover(format!(
                "{busy} connection readers did not stop within {timeout:?}"
            )));
        }
        Ok(())
    }

    /// Handover, second step (the VM is paused, so the guest answers
    /// nothing more): waits until every answer given so far is written to
    /// its client, so the next process starts with empty queues.
    pub fn flush_answers(&self, timeout: Duration) -> Result<(), ServiceError> {
        // Only writers with answers queued are asked (and woken).
        let acks: Vec<_> = lock(&self.conns)
            .values()
            .filter_map(|c| c.tx.barrier())
            .collect();
        let deadline = std::time::Instant::now() + timeout;
        for rx in acks {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            // A writer that ended (its client left) drops the barrier: fine.
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(left) {
                return Err(ServiceError::Handover(format!(
                    "a client did not take its answers within {timeout:?}"
                )));
            }
        }
        Ok(())
    }

    /// Handover, third step: duplicates of every connection's socket, each
    /// with what its reader had not handled. The device
    /// keeps serving nothing until [`thaw`](Self::thaw) or
    /// [`hand_off`](Self::hand_off).
    pub fn export(&self) -> Result<Vec<FrozenConn>, ServiceError> {
        let io = |e: std::io::Error| ServiceError::Handover(e.to_string());
        let mut pending = self.gate.pending();
        let conns = lock(&self.conns)
            .iter()
            .map(|(&id, c)| {
                Ok(FrozenConn {
                    id,
                    stream: c.stream.try_clone().map_err(io)?,
                    pending: pending.remove(&id).unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Ok(conns)
    }

    /// The handover failed: readers go on where they stopped (clients are
    /// accepted again at [`release`](Self::release)).
    pub fn thaw(&self) {
        self.gate.thaw();
        self.slot_freed.notify_all();
    }

    /// The handover succeeded: another process serves every connection.
    /// Readers and writers leave without a shutdown, which would end the
    /// connections for that process too; nothing is accepted here again.
    pub fn hand_off(&self) {
        self.stop.store(true, Ordering::Release);
        self.spares.close();
        // The other process holds the VM's address too: leave it up.
        if let Some(a) = lock(&self.address).as_ref() {
            a.forget();
        }
        self.gate.hand_off();
        // Dropping the senders ends the writers once they are idle.
        lock(&self.conns).clear();
        self.slot_freed.notify_all();
    }

    /// Takes over connections another process exported: each is registered
    /// at once (answers to its requests still in the ring may come as soon
    /// as the VM resumes); [`AdoptedConns::serve`] starts reading them.
    pub fn adopt_connections(&self, conns: Vec<FrozenConn>) -> Result<AdoptedConns, ServiceError> {
        // Every id is checked before any is registered.
        let mut next = 0;
        for c in &conns {
            next = next.max(super::moving::next_id_after(c.id)?);
        }
        let mut out = Vec::new();
        for c in conns {
            let shut = c
                .stream
                .try_clone()
                .map_err(|e| ServiceError::Handover(e.to_string()))?;
            let (tx, rx) = Outbox::new();
            self.register(c.id, tx.clone(), shut);
            out.push((c, tx, rx));
        }
        self.next_conn.fetch_max(next, Ordering::Relaxed);
        Ok(AdoptedConns(out))
    }
}
