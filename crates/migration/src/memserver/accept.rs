//! The memory server's accept loop: one thread per connection (at most
//! [`Limits::max_connections`](super::Limits); one more is told so and
//! closed). Nothing a peer does ends the loop: an accept that fails (out of
//! descriptors, say) is logged and retried. It ties the server (its
//! state) to a connection's work (`conn.rs`), so neither imports the other.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::MigrationError;
use crate::transport::{Conn, Listener};

use super::error::StoreError;
use super::server::MemServer;

/// Pause after a failed accept, so a server out of descriptors does not
/// spin while its connections end.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long a refused connection may take to read its Abort.
const REFUSE_DRAIN: Duration = Duration::from_millis(200);

impl MemServer {
    /// Accepts connections until stopped; each runs on a thread of its own.
    /// Returns only when stopped: a failed accept is logged and retried.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> Result<(), MigrationError> {
        let mut last_warned: Option<Instant> = None;
        while !self.stopping() {
            // The listener's gate did the TLS handshake and read the Hello
            // (within its own 5 s limit).
            let (c, hello) = match listener.accept_hello(Duration::from_millis(200)) {
                Ok(admitted) => admitted,
                Err(MigrationError::Listen { source, .. })
                    if source.kind() == std::io::ErrorKind::TimedOut =>
                {
                    continue
                }
                Err(e) => {
                    // Out of descriptors (EMFILE, ENFILE), out of memory, a
                    // connection reset before it was accepted: none of them
                    // is a reason to stop serving the VMs held here.
                    self.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                    if last_warned.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!("memory server: {e}; retrying");
                        last_warned = Some(Instant::now());
                    }
                    std::thread::sleep(ACCEPT_BACKOFF);
                    continue;
                }
            };
            let accepted = Instant::now();
            let Some(slot) = self.slots.take() else {
                self.refuse(c, &StoreError::Busy(self.limits.max_connections));
                continue;
            };
            let me = self.clone();
            self.stats.connections.fetch_add(1, Ordering::Relaxed);
            let spawned = std::thread::Builder::new()
                .name("memserver-conn".into())
                .spawn(move || {
                    let _slot = slot;
                    super::conn::run(&me, c, hello, accepted);
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a connection thread: {e}");
            }
        }
        Ok(())
    }

    /// Tells a connection there is no slot for it, and closes it: on a
    /// short-lived thread (at most [`REFUSERS`](super::server::REFUSERS) at once), so that peers
    /// that never read their refusal cannot slow the accept loop; past
    /// that, the connection is just closed.
    fn refuse(&self, mut c: Conn, why: &StoreError) {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = self.refusers.take() else {
            return;
        };
        let why = why.to_string();
        let _ = std::thread::Builder::new()
            .name("memserver-refuse".into())
            .spawn(move || {
                let _slot = slot;
                if c.set_timeouts(Some(REFUSE_DRAIN)).is_ok() {
                    c.abort(&why);
                    c.drain(REFUSE_DRAIN);
                }
            });
    }
}
