//! The device's clients move with the VM (docs/service.md, "Clients that
//! follow their VM"): the VM has its own IP address on the hosts' network,
//! and at a migration the address goes to the destination host and every
//! client connection is checkpointed here and restored there with
//! TCP_REPAIR, so clients see a pause and nothing else.
//!
//! Source, in order:
//! 1. [`ServiceDevice::clients_decided`]: the destination agreed.
//! 2. The pause freezes the readers between frames (requests already in
//!    the ring stay there: they travel with guest memory) and flushes the
//!    answers given so far into the sockets.
//! 3. [`ServiceDevice::move_out`], last before Complete: the address goes
//!    down (from here packets for it are dropped, and the clients
//!    retransmit them to the destination), then every connection is
//!    checkpointed in repair mode, with what its reader had not handled.
//! 4. Success: [`ServiceDevice::moved_away`] drops the sockets silently.
//!    Failure: [`ServiceDevice::release`] takes repair mode off and brings
//!    the address back, and the clients go on here.
//!
//! Destination: [`ServiceDevice::prepare_clients`] (before any page: the
//! listener on the VM's address and port), [`ServiceDevice::restore_clients`]
//! (at Complete: sockets restored in repair mode, connections registered
//! under their ids, so answers to requests in the ring find them), and
//! [`ServiceDevice::release`] when the vCPUs run: the address goes up here,
//! the sockets go live, a gratuitous ARP tells the peers.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::conn::{FrozenConn, Inbox, Outbox};
use super::{lock, ServiceDevice, ServiceError};
use crate::hostnet::tcp_repair::{self, ParkedConn, TcpCheckpoint};
use crate::hostnet::{NetError, VmAddress};

/// One client connection on its way to another host.
#[derive(serde::Serialize, serde::Deserialize)]
struct MovedConn {
    /// Its id: the tag of its requests in the ring.
    id: u64,
    /// Bytes its reader had read and not handled.
    pending: Vec<u8>,
    /// The socket.
    tcp: TcpCheckpoint,
}

/// The connections of a Clients body (from the source: untrusted). Each
/// id must be one a device can have given: unique, and with room after it
/// for this device's next connection (ids are never reused).
fn decode_moved(bytes: &[u8]) -> Result<Vec<MovedConn>, ServiceError> {
    let conns: Vec<MovedConn> =
        postcard::from_bytes(bytes).map_err(|e| ServiceError::BadState(e.to_string()))?;
    let mut seen = HashSet::with_capacity(conns.len());
    for c in &conns {
        next_id_after(c.id)?;
        if !seen.insert(c.id) {
            return Err(ServiceError::BadState(format!(
                "moved clients name connection {} twice",
                c.id
            )));
        }
    }
    Ok(conns)
}

/// The id this device gives next once connection `id` is its own: `id + 1`,
/// refused where that does not exist.
pub(super) fn next_id_after(id: u64) -> Result<u64, ServiceError> {
    id.checked_add(1).ok_or_else(|| {
        ServiceError::BadState(format!(
            "connection id {id} leaves no id for the next connection"
        ))
    })
}

impl ServiceDevice {
    /// A Clients body decoded as [`ServiceDevice::restore_clients`] decodes
    /// it, for the fuzz targets (fuzz/, docs/fuzzing.md): per connection
    /// its id, its unread bytes and its socket's checkpoint.
    #[doc(hidden)]
    pub fn fuzz_decode_clients(
        bytes: &[u8],
    ) -> Result<Vec<(u64, Vec<u8>, TcpCheckpoint)>, ServiceError> {
        Ok(decode_moved(bytes)?
            .into_iter()
            .map(|c| (c.id, c.pending, c.tcp))
            .collect())
    }
}

/// Where a move of the clients is.
#[derive(Default)]
pub(super) enum Moving {
    /// No move.
    #[default]
    Idle,
    /// Source: the destination takes the clients; not checkpointed yet.
    Agreed,
    /// Source: the address is down and these sockets are in repair mode
    /// (plus connections accepted from the listen queue at the last
    /// moment, not served yet).
    Out {
        checkpointed: HashSet<u64>,
        queued: Vec<FrozenConn>,
    },
    /// Destination: connections restored in repair mode, registered, to go
    /// live when the VM runs.
    In(Vec<Restored>),
}

pub(super) struct Restored {
    id: u64,
    parked: ParkedConn,
    pending: Vec<u8>,
    tx: Outbox,
    rx: Inbox,
}

fn move_err(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Move(e.to_string())
}

/// Tests make a step fail on purpose: FERRY_TEST_FAIL_CLIENTS=prepare
/// (the destination refuses the clients, so the source forwards them) or
/// =restore (the restore fails after the sockets were rebuilt, so the
/// migration fails and the source must bring its clients back).
fn test_hook(step: &str) -> bool {
    std::env::var("FERRY_TEST_FAIL_CLIENTS").is_ok_and(|v| v == step)
}

impl ServiceDevice {
    /// A device on the VM's own address `ip` (added to this host's
    /// interface for that subnet now): its clients can move with the VM.
    pub fn start_on_address(
        ip: Ipv4Addr,
        port: u16,
        memory: Arc<ferry_memory::GuestMemory>,
        vm: Arc<kvm_ioctls::VmFd>,
        vcpus: u32,
    ) -> Result<Arc<Self>, ServiceError> {
        let addr = SocketAddr::from((ip, port));
        let address = VmAddress::on_this_host(ip).map_err(ServiceError::Address)?;
        address.bring_up().map_err(ServiceError::Address)?;
        let address = Arc::new(address);
        address.announce_in_background();
        let device = TcpListener::bind(addr)
            .map_err(|source| ServiceError::Listen { addr, source })
            .and_then(|l| Self::adopt(l, memory, vm, vcpus));
        match device {
            Ok(d) => {
                *lock(&d.address) = Some(address);
                Ok(d)
            }
            Err(e) => {
                let _ = address.take_down();
                Err(e)
            }
        }
    }

    /// A handed-over device whose VM has its own address, already up on
    /// this host (the old process added it).
    pub fn keep_address(&self, ip: Ipv4Addr) -> Result<(), ServiceError> {
        let dev = crate::hostnet::address::device_holding(ip)
            .ok_or(ServiceError::Address(NetError::NoInterface(ip)))?;
        let a = VmAddress::on_device(ip, &dev).map_err(ServiceError::Address)?;
        a.mark_up();
        *lock(&self.address) = Some(Arc::new(a));
        Ok(())
    }

    /// The VM's own address, if it has one.
    pub fn vm_address(&self) -> Option<Ipv4Addr> {
        lock(&self.address).as_ref().map(|a| a.ip())
    }

    /// Whether the clients can move: the VM's address and service port,
    /// while the address is up here.
    pub fn clients_plan(&self) -> Option<(Ipv4Addr, u16, u32)> {
        let a = lock(&self.address);
        let a = a.as_ref().filter(|a| a.is_up())?;
        let conns = lock(&self.conns).len() as u32;
        Some((a.ip(), self.local_addr().port(), conns))
    }

    /// The destination takes the clients over (true), or they stay and are
    /// forwarded (false).
    pub fn clients_decided(&self, moving: bool) {
        *lock(&self.moving) = if moving { Moving::Agreed } else { Moving::Idle };
    }

    /// Destination: connections restored here wait to go live.
    pub fn clients_moving_in(&self) -> bool {
        matches!(*lock(&self.moving), Moving::In(_))
    }

    /// True once the destination agreed to take the clients.
    pub fn clients_move(&self) -> bool {
        !matches!(*lock(&self.moving), Moving::Idle)
    }

    /// Source, the VM paused and its readers frozen: takes the address
    /// down, then checkpoints every connection (the ones waiting in the
    /// listen queue too). Returns them encoded.
    pub fn move_out(&self) -> Result<Vec<u8>, ServiceError> {
        let address = lock(&self.address)
            .clone()
            .ok_or_else(|| move_err("the VM has no address of its own to move"))?;
        let mut moving = lock(&self.moving);
        if !matches!(*moving, Moving::Agreed) {
            return Err(move_err("the clients were not agreed to move"));
        }
        let t = std::time::Instant::now();
        address.take_down().map_err(ServiceError::Address)?;
        // Clients whose handshake completed after the readers froze wait in
        // the listen queue: they move too (as new connections).
        let mut queued = Vec::new();
        {
            let l = lock(&self.listener);
            while let Ok((s, _)) = l.accept() {
                let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
                self.stats.connections.fetch_add(1, Ordering::Relaxed);
                queued.push(FrozenConn {
                    id,
                    stream: s,
                    pending: Vec::new(),
                });
            }
        }
        let mut pending = self.gate.pending();
        let conns = lock(&self.conns);
        let socks = conns
            .iter()
            .map(|(&id, c)| (id, &c.stream, pending.remove(&id).unwrap_or_default()))
            .chain(queued.iter().map(|q| (q.id, &q.stream, Vec::new())));
        let mut out = Vec::new();
        let mut checkpointed = HashSet::new();
        let mut failed = None;
        // (No duplicate descriptors here: growing the descriptor table of a
        // process with many threads waits an RCU grace period.)
        for (id, s, pending) in socks {
            match tcp_repair::checkpoint(s) {
                Ok(tcp) => {
                    out.push(MovedConn { id, pending, tcp });
                    checkpointed.insert(id);
                }
                // A client that closed its side: it stays and is closed here.
                Err(NetError::NotEstablished { .. }) => {
                    let _ = tcp_repair::resume(s);
                }
                Err(e) => {
                    let _ = tcp_repair::resume(s);
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(conns);
        let n = out.len();
        tracing::debug!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            n,
            "clients checkpointed"
        );
        self.stats.moved_out.store(n as u64, Ordering::Relaxed);
        *moving = Moving::Out {
            checkpointed,
            queued,
        };
        drop(moving);
        if let Some(e) = failed {
            return Err(ServiceError::Address(e));
        }
        postcard::to_stdvec(&out).map_err(move_err)
    }

    /// Undoes [`move_out`](Self::move_out) (the migration failed): the
    /// sockets leave repair mode and the address comes back, so the clients
    /// go on here. Called by [`release`](Self::release).
    pub(super) fn move_back(self: &Arc<Self>, moving: Moving) {
        let Moving::Out {
            checkpointed,
            queued,
        } = moving
        else {
            return;
        };
        if let Some(a) = lock(&self.address).clone() {
            match a.bring_up() {
                Ok(()) => a.announce_in_background(),
                Err(e) => {
                    tracing::error!(error = %e, "the VM's address could not come back: its clients are cut off")
                }
            }
        }
        {
            let conns = lock(&self.conns);
            let streams = conns
                .iter()
                .map(|(&id, c)| (id, &c.stream))
                .chain(queued.iter().map(|q| (q.id, &q.stream)));
            for (_, s) in streams.filter(|(id, _)| checkpointed.contains(id)) {
                if let Err(e) = tcp_repair::resume(s) {
                    tracing::warn!(error = %e, "a client connection could not leave repair mode");
                }
            }
        }
        self.stats.moved_out.store(0, Ordering::Relaxed);
        for c in queued {
            let (tx, rx) = Outbox::new();
            if let Ok(shut) = c.stream.try_clone() {
                self.register(c.id, tx.clone(), shut);
                self.spawn_connection(c.id, c.stream, c.pending, tx, rx);
            }
        }
    }

    /// Source, the migration succeeded: the clients are served at the
    /// destination. Readers and writers leave; the sockets, in repair
    /// mode, close without a word to the clients.
    pub fn moved_away(&self) {
        let moving = std::mem::take(&mut *lock(&self.moving));
        self.hand_off();
        drop(moving);
    }

    /// Destination, before any page arrives: ready to take the clients of
    /// a VM whose address is `ip` and service port `port`, with about
    /// `connections` clients (a reader and a writer thread each are started
    /// now, outside the downtime). Err says why not (the source then
    /// forwards them).
    pub fn prepare_clients(&self, ip: Ipv4Addr, port: u16, connections: u32) -> Result<(), String> {
        if test_hook("prepare") {
            return Err("FERRY_TEST_FAIL_CLIENTS=prepare (a test hook) refuses the clients".into());
        }
        if self.accepting.load(Ordering::Acquire) || !lock(&self.conns).is_empty() {
            return Err("this VM's service already serves clients".into());
        }
        tcp_repair::allowed()
            .map_err(|e| format!("TCP_REPAIR is not allowed here ({e}); it needs CAP_NET_ADMIN"))?;
        let address = VmAddress::on_this_host(ip).map_err(|e| e.to_string())?;
        let addr = SocketAddr::from((ip, port));
        let listener = crate::hostnet::listen_anywhere(addr)
            .and_then(|l| l.set_nonblocking(true).map(|_| l))
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        *lock(&self.listener) = listener;
        *lock(&self.addr) = addr;
        *lock(&self.address) = Some(Arc::new(address));
        // Some room for clients that connect during the migration: their
        // threads, and descriptor table slots (growing the table later, in
        // the downtime, would wait an RCU grace period).
        let room = (connections as usize + 8).min(4096);
        self.spares.add(2 * room);
        crate::hostnet::reserve_fds(3 * room);
        Ok(())
    }

    /// Destination, after the VM's state: restores the connections in
    /// repair mode and registers each under its id. They go live when the
    /// VM runs ([`release`](Self::release)).
    pub fn restore_clients(&self, bytes: &[u8]) -> Result<String, ServiceError> {
        let address = lock(&self.address).clone().ok_or_else(|| {
            ServiceError::BadState(
                "clients arrived for a device that did not prepare for them".into(),
            )
        })?;
        let t = std::time::Instant::now();
        let conns = decode_moved(bytes)?;
        let mut restored = Vec::with_capacity(conns.len());
        let rebuilt = (|| {
            for c in conns {
                let parked = tcp_repair::restore_parked(&c.tcp).map_err(ServiceError::Address)?;
                let shut = parked.stream().try_clone().map_err(move_err)?;
                let (tx, rx) = Outbox::new();
                let next = next_id_after(c.id)?;
                self.register(c.id, tx.clone(), shut);
                self.next_conn.fetch_max(next, Ordering::Relaxed);
                restored.push(Restored {
                    id: c.id,
                    parked,
                    pending: c.pending,
                    tx,
                    rx,
                });
            }
            if test_hook("restore") {
                return Err(ServiceError::BadState(
                    "FERRY_TEST_FAIL_CLIENTS=restore (a test hook) fails the restore".into(),
                ));
            }
            Ok(())
        })();
        if let Err(e) = rebuilt {
            // Unregistered, the parked sockets close silently: the source
            // takes its clients back.
            let mut conns = lock(&self.conns);
            for r in &restored {
                conns.remove(&r.id);
            }
            return Err(e);
        }
        let n = restored.len();
        tracing::debug!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            n,
            "clients restored (parked)"
        );
        self.stats.moved_in.store(n as u64, Ordering::Relaxed);
        *lock(&self.moving) = Moving::In(restored);
        Ok(format!(
            "{n} connections restored by TCP_REPAIR; {} moved to {}",
            address.ip(),
            address.device()
        ))
    }

    /// Destination, the VM runs: the address goes up here, the restored
    /// sockets go live and are served, and the peers are told. Called by
    /// [`release`](Self::release).
    pub(super) fn go_live(self: &Arc<Self>, restored: Vec<Restored>) {
        let t = std::time::Instant::now();
        let address = lock(&self.address).clone();
        if let Some(Err(e)) = address.as_ref().map(|a| a.bring_up()) {
            tracing::error!(error = %e, "the VM's address cannot go up here: its clients are cut off");
        }
        // Every socket first, then the readers: a reader woken between two
        // sockets takes the core from this loop (on 2 cores, 128 wake-ups
        // inside it doubled its 1.2 ms).
        let mut live = Vec::with_capacity(restored.len());
        for r in restored {
            match r.parked.go_live() {
                Ok(s) => live.push((r.id, s, r.pending, r.tx, r.rx)),
                Err(e) => {
                    tracing::warn!(error = %e, id = r.id, "a client connection could not go live");
                    lock(&self.conns).remove(&r.id);
                }
            }
        }
        for (id, stream, pending, tx, rx) in live {
            self.spawn_connection(id, stream, pending, tx, rx);
        }
        if let Some(a) = address {
            a.announce_in_background();
        }
        tracing::debug!(ms = t.elapsed().as_secs_f64() * 1e3, "clients live");
    }

    /// The device's side of a release: undoes a move out, or finishes a
    /// move in.
    pub(super) fn settle_move(self: &Arc<Self>) {
        let moving = std::mem::take(&mut *lock(&self.moving));
        match moving {
            Moving::Out { .. } => self.move_back(moving),
            Moving::In(restored) => self.go_live(restored),
            Moving::Idle | Moving::Agreed => {}
        }
    }

    /// Takes the VM's address off this host if this process holds it (the
    /// VM stops here).
    pub(super) fn drop_address(&self) {
        if let Some(a) = lock(&self.address).as_ref() {
            if a.is_up() {
                if let Err(e) = a.take_down() {
                    tracing::warn!(error = %e, "the VM's address stays on this host");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostnet::tcp_repair::TcpCheckpoint;

    fn moved(id: u64) -> MovedConn {
        MovedConn {
            id,
            pending: b"GET".to_vec(),
            tcp: TcpCheckpoint {
                local: "10.0.0.2:80".parse().unwrap(),
                peer: "10.0.0.9:40000".parse().unwrap(),
                snd_seq: 1,
                rcv_seq: 2,
                send_queue: vec![],
                unsent: 0,
                recv_queue: vec![],
                mss: 1460,
                wscale: None,
                sack: false,
                timestamp: None,
                window: None,
            },
        }
    }

    fn body(ids: &[u64]) -> Vec<u8> {
        postcard::to_allocvec(&ids.iter().map(|&i| moved(i)).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn a_peer_chosen_connection_id_without_a_successor_or_twice_is_refused() {
        let ok = decode_moved(&body(&[1, 7, u64::MAX - 1])).unwrap();
        assert_eq!(
            ok.iter().map(|c| c.id).collect::<Vec<_>>(),
            [1, 7, u64::MAX - 1]
        );
        let e = decode_moved(&body(&[3, u64::MAX]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("leaves no id for the next connection"), "{e}");
        let e = decode_moved(&body(&[5, 9, 5])).err().unwrap().to_string();
        assert!(e.contains("connection 5 twice"), "{e}");
        assert_eq!(next_id_after(41).unwrap(), 42);
        assert!(next_id_after(u64::MAX).is_err());
    }
}
