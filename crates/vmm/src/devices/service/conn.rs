//! The device's client connections: accepting them, a reader per connection
//! that cuts frames out of its own buffer, a writer that sends answers in
//! order, and the gate that stops every reader between two frames so the
//! connections can be handed to another VMM process (docs/handover.md);
//! the gate itself is in `conn/gate.rs`.
//!
//! Why a reader keeps its own buffer rather than reading frame by frame: a
//! reader stopped for a handover must not hold bytes the next process will
//! never see. At the gate it stops at a frame boundary and leaves what it
//! has read but not handled (a partial frame, or whole frames not posted
//! yet) with the gate, and that travels with the socket.

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use super::wire::{self, Op, Request, Response, Status, MAX_BODY};
use super::{lock, Route, ServiceDevice};
use gate::Woken;

mod gate;
pub(super) use gate::Gate;

/// What a connection's writer sends.
pub(super) enum Out {
    /// An answer frame (length prefix included).
    Frame(Vec<u8>),
    /// Acknowledge once every frame before this one is written.
    Barrier(Sender<()>),
}

/// Where a connection's answers go: its writer's queue, and how many
/// frames wait there (a flush before a move skips writers with none, so
/// the pause wakes only the writers that have work).
#[derive(Clone)]
pub(super) struct Outbox {
    tx: Sender<Out>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

/// The writer's end of an [`Outbox`].
pub(super) struct Inbox {
    rx: Receiver<Out>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
}

impl Outbox {
    pub fn new() -> (Outbox, Inbox) {
        let (tx, rx) = channel();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        (
            Outbox {
                tx,
                queued: queued.clone(),
            },
            Inbox { rx, queued },
        )
    }

    /// Queues an answer frame (length prefix included); false if the
    /// writer is gone.
    pub fn frame(&self, f: Vec<u8>) -> bool {
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.tx.send(Out::Frame(f)).is_ok();
        if !sent {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }

    /// Asks the writer to acknowledge once what is queued now is written;
    /// None if nothing is queued (or the writer is gone).
    pub fn barrier(&self) -> Option<Receiver<()>> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let (tx, rx) = channel();
        self.tx.send(Out::Barrier(tx)).ok().map(|_| rx)
    }
}

/// A connection the device answers on.
pub(super) struct Conn {
    pub tx: Outbox,
    pub stream: TcpStream,
}

/// A connection stopped between frames, ready to move to another process:
/// its id (the tag of its requests in the ring), its socket, and what its
/// reader had read but not handled.
pub struct FrozenConn {
    /// Connection id.
    pub id: u64,
    /// The client's socket (a duplicate: the same connection).
    pub stream: TcpStream,
    /// Bytes read from the client and not handled yet.
    pub pending: Vec<u8>,
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Threads started ahead of time, each for one job: connections that
/// arrive with a migration are served from them, so no thread is created
/// while the VM is paused. Each spare runs exactly one job and ends; a job
/// goes to a spare only when one is counted idle, so none waits.
pub(super) struct Spares {
    tx: Mutex<Option<Sender<Job>>>,
    rx: Arc<Mutex<Receiver<Job>>>,
    idle: std::sync::atomic::AtomicUsize,
}

impl Spares {
    pub fn new() -> Self {
        let (tx, rx) = channel();
        Spares {
            tx: Mutex::new(Some(tx)),
            rx: Arc::new(Mutex::new(rx)),
            idle: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Starts `n` more spare threads.
    pub fn add(&self, n: usize) {
        for _ in 0..n {
            let rx = self.rx.clone();
            let spawned = std::thread::Builder::new()
                .name("svc-spare".into())
                .spawn(move || {
                    let job = lock(&rx).recv();
                    if let Ok(job) = job {
                        job();
                    }
                });
            if spawned.is_err() {
                break;
            }
            self.idle.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Runs `job` on a spare if one is idle, else on a new thread named
    /// `name`; None if no thread could be had.
    pub fn run(&self, name: &str, job: impl FnOnce() + Send + 'static) -> Option<()> {
        let claimed = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if claimed {
            if let Some(tx) = lock(&self.tx).as_ref() {
                if tx.send(Box::new(job)).is_ok() {
                    return Some(());
                }
            }
            return None;
        }
        std::thread::Builder::new()
            .name(name.into())
            .spawn(job)
            .ok()
            .map(|_| ())
    }

    /// Lets idle spares end.
    pub fn close(&self) {
        self.idle.store(0, Ordering::Release);
        lock(&self.tx).take();
    }
}

/// What woke a reader.
enum Ready {
    Socket,
    Gate,
    TimedOut,
}

/// Waits until `sock` is readable or the gate's eventfd fires (at most
/// `timeout_ms`, -1 for no limit).
fn wait_readable(
    sock: BorrowedFd<'_>,
    wake: &EventFd,
    timeout_ms: libc::c_int,
) -> std::io::Result<Ready> {
    let mut fds = [
        libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the call's length;
        // the socket is borrowed and the eventfd referenced, so both stay
        // open for its duration.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if n == 0 {
            return Ok(Ready::TimedOut);
        }
        if n > 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(if fds[1].revents != 0 {
        Ready::Gate
    } else {
        Ready::Socket
    })
}

/// Reads what the socket holds without waiting (MSG_DONTWAIT), leaving
/// the socket itself blocking for its writer.
fn recv_nowait(sock: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes; the socket is
    // borrowed, so open for the call.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// What became of one request frame.
enum Handled {
    /// Answered or posted: drop it from the buffer.
    Done,
    /// The gate closed before it was posted: keep it.
    Kept,
    /// The connection must close.
    Close,
}

impl ServiceDevice {
    /// Accepts clients until told to stop (freeze, handover, shutdown).
    /// Waits in poll with its own eventfd, so a stop is seen at once.
    pub(super) fn accept_loop(self: Arc<Self>, listener: std::net::TcpListener) {
        while self.accepting.load(Ordering::Acquire) && !self.stop.load(Ordering::Acquire) {
            if !matches!(
                wait_readable(listener.as_fd(), &self.accept_wake, 50),
                Ok(Ready::Socket)
            ) {
                continue;
            }
            match listener.accept() {
                Ok((stream, _)) => {
                    self.stats.connections.fetch_add(1, Ordering::Relaxed);
                    let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
                    let (tx, rx) = Outbox::new();
                    if let Ok(shut) = stream.try_clone() {
                        self.register(id, tx.clone(), shut);
                        self.spawn_connection(id, stream, Vec::new(), tx, rx);
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Makes `id` a connection answers can go to (before its threads run:
    /// an adopted connection may get answers as soon as the VM resumes).
    pub(super) fn register(&self, id: u64, tx: Outbox, stream: TcpStream) {
        lock(&self.conns).insert(id, Conn { tx, stream });
    }

    /// Starts the reader and writer threads of a registered connection;
    /// `pending` is what was read from it and not handled yet.
    pub(super) fn spawn_connection(
        self: &Arc<Self>,
        id: u64,
        stream: TcpStream,
        pending: Vec<u8>,
        tx: Outbox,
        rx: Inbox,
    ) {
        self.gate.reader_started();
        let d = self.clone();
        let spawned = self.spares.run("svc-conn", move || {
            d.serve_connection(id, stream, pending, tx, rx)
        });
        if spawned.is_none() {
            lock(&self.conns).remove(&id);
            self.gate.reader_ended();
        }
    }

    fn serve_connection(
        self: Arc<Self>,
        id: u64,
        stream: TcpStream,
        pending: Vec<u8>,
        tx: Outbox,
        rx: Inbox,
    ) {
        let (done_tx, done_rx) = channel::<()>();
        let writer = stream.try_clone().ok().and_then(|mut w| {
            let d = self.clone();
            self.spares.run("svc-write", move || {
                let _done = done_tx; // dropped when the writer ends
                for out in rx.rx {
                    match out {
                        // A client that cannot take answers is gone: stop
                        // (a barrier then finds the queue closed, fine).
                        Out::Frame(f) => {
                            let written = w.write_all(&f).is_ok();
                            rx.queued.fetch_sub(1, Ordering::AcqRel);
                            if !written {
                                break;
                            }
                        }
                        Out::Barrier(ack) => {
                            let _ = ack.send(());
                        }
                    }
                }
                // Another process serves this client now: a shutdown here
                // would end the connection for it too.
                if !d.gate.handed_off() {
                    let _ = w.shutdown(Shutdown::Write);
                }
            })
        });
        let handed_off = writer.is_some() && self.read_requests(id, &stream, pending, &tx);
        if !handed_off {
            lock(&self.conns).remove(&id);
        }
        self.collector_gone(id);
        drop(tx);
        self.gate.reader_ended();
        if writer.is_some() {
            let _ = done_rx.recv(); // Err once the writer ended
        }
    }

    /// The reader: handles every whole frame in its buffer, reads more, and
    /// parks at the gate between frames. True if it stopped because the
    /// connection was handed to another process.
    fn read_requests(&self, id: u64, stream: &TcpStream, pending: Vec<u8>, tx: &Outbox) -> bool {
        // The socket stays blocking (its writer shares it); the reader asks
        // for data without waiting and waits in poll, with the gate.
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        // buf[start..] is what has not been handled yet.
        let mut buf = pending;
        let mut start = 0;
        let mut upstream: Option<TcpStream> = None;
        let mut chunk = vec![0u8; 64 * 1024];
        let end = loop {
            if self.stop.load(Ordering::Acquire) {
                break false;
            }
            if self.gate.is_frozen() {
                buf.drain(..start);
                start = 0;
                match self.gate.park(id, std::mem::take(&mut buf)) {
                    Some(b) => {
                        buf = b;
                        continue;
                    }
                    None => break true,
                }
            }
            match wire::complete_frame(&buf[start..], MAX_BODY) {
                Ok(Some(len)) => {
                    let body = &buf[start + 4..start + 4 + len];
                    match self.handle_frame(body, id, tx, &mut upstream) {
                        Handled::Done => start += 4 + len,
                        Handled::Kept => {}
                        Handled::Close => break false,
                    }
                    continue;
                }
                Ok(None) => {
                    // Only a partial frame is left: keep it at the front.
                    buf.drain(..start);
                    start = 0;
                }
                Err(e) => {
                    // The stream cannot be resynchronised: answer, then close.
                    self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    let _ =
                        tx.frame(Response::error(Status::TooLarge, 0, 0, &e.to_string()).encode());
                    break false;
                }
            }
            match recv_nowait(stream, &mut chunk) {
                Ok(0) => break false, // closed (mid-frame or not): nothing to answer
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !self.gate.sleep(id, &buf) {
                        continue; // frozen meanwhile: park at the top
                    }
                    let waited = wait_readable(stream.as_fd(), &self.gate.wake, -1);
                    match self.gate.woke(id) {
                        Woken::Read if waited.is_ok() => {}
                        Woken::Read => break false,
                        Woken::Leave => break true,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        };
        if let Some(up) = &upstream {
            let _ = up.shutdown(Shutdown::Both);
        }
        end
    }

    fn handle_frame(
        &self,
        body: &[u8],
        id: u64,
        tx: &Outbox,
        upstream: &mut Option<TcpStream>,
    ) -> Handled {
        let reply = |frame: Vec<u8>| {
            let _ = tx.frame(frame);
        };
        match Request::decode(body) {
            Err(e) => {
                // Framing is intact: refuse this request, keep the connection.
                self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                let rid = body
                    .get(8..16)
                    .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
                let op = body.first().copied().unwrap_or(0);
                reply(Response::error(Status::BadRequest, op, rid, &e.to_string()).encode());
                Handled::Done
            }
            Ok(req) if req.op == Op::Echo => {
                self.stats.echoes.fetch_add(1, Ordering::Relaxed);
                let resp = Response {
                    status: Status::Ok,
                    op: Op::Echo as u8,
                    id: req.id,
                    key: req.key,
                    seed: req.seed,
                    checksum: wire::csum(&req.value),
                    value: req.value,
                };
                reply(resp.encode());
                Handled::Done
            }
            Ok(req) if req.op == Op::Collect => match self.adopt_collector(&req, id, tx) {
                Ok(()) => Handled::Done,
                Err(refusal) => {
                    self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    reply(refusal);
                    Handled::Close
                }
            },
            Ok(req) if !self.guest_ready() && self.redirected_to().is_none() => {
                self.stats.not_ready.fetch_add(1, Ordering::Relaxed);
                let msg = "the guest is not serving yet (is a kv workload running?)";
                reply(Response::error(Status::NotReady, req.op as u8, req.id, msg).encode());
                Handled::Done
            }
            Ok(_) => match self.post(body, id) {
                Ok(Route::Posted) => Handled::Done,
                Ok(Route::Frozen) => Handled::Kept,
                Ok(Route::Forward(to)) => {
                    if self.forward(upstream, to, body, tx).is_err() {
                        let msg =
                            format!("the VM moved to {to} and its service there does not answer");
                        reply(Response::error(Status::NotReady, body[0], 0, &msg).encode());
                        return Handled::Close;
                    }
                    Handled::Done
                }
                Ok(Route::Closed) | Err(_) => Handled::Close,
            },
        }
    }
}

#[cfg(test)]
mod tests;
