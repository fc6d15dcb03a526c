//! Where a destination or memory server waits: one listener per endpoint,
//! and its gate.
//!
//! The gate is a thread that accepts every connection at once and hands
//! each to a short-lived admission thread: the TLS handshake (the peer's
//! certificate must chain to the fleet CA), the `--from` check (it must
//! name the one host allowed), and the Hello (the role it plays), all
//! within [`ADMISSION_TIMEOUT`]. Only connections that pass reach the
//! session, through [`Listener::accept_hello`]. A silent, trickling or
//! foreign connection costs a thread for a few seconds and never holds up
//! the real source: the first admitted peer is served first.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ferry_tls::PeerIdentity;

use super::security::{installed, Security};
use super::stream::poll_in;
use super::{Conn, Endpoint, Stream};
use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, ProtocolError};

/// How long a connection has for its TLS handshake and its Hello.
pub const ADMISSION_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections being admitted at once; more are closed at the door (each
/// costs a thread and a descriptor for at most [`ADMISSION_TIMEOUT`]).
const MAX_ADMITTING: usize = 512;

/// Admitted connections waiting for the session to take them.
const QUEUE: usize = 64;

/// The largest Hello body read (a real one is about 20 bytes).
const MAX_HELLO: u32 = 1024;

/// Who may come in: the rules a waiting destination was started with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Only a peer whose certificate names this host, or one of these
    /// comma-separated hosts (`--from NAME[,NAME…]`).
    pub from: Option<String>,
    /// The one-time migration token a source must present (`--token`);
    /// checked by the session on the control connection.
    pub token: Option<String>,
}

/// A connection that passed the gate.
type Admitted = (Conn, Hello);

/// How long an admitted connection nobody asked for yet is kept for a
/// later ask (a demand link that arrived before the bulk streams were all
/// taken, say).
const HOLD: Duration = Duration::from_secs(60);

/// Admitted connections: the gate's queue, and those passed over by an
/// ask for another role, in arrival order.
struct Inbox {
    rx: Receiver<Admitted>,
    held: std::collections::VecDeque<(Instant, Conn, Hello)>,
}

impl Inbox {
    /// Holds `c` for a later ask (the oldest held goes if there are many).
    fn keep(&mut self, c: Conn, h: Hello) {
        if self.held.len() >= QUEUE {
            if let Some((_, mut old, _)) = self.held.pop_front() {
                old.abort("busy: too many connections wait to be served");
            }
        }
        let _ = c.set_timeouts(Some(HOLD));
        self.held.push_back((Instant::now(), c, h));
    }
}

/// Listens for migration connections.
pub struct Listener {
    endpoint: Endpoint,
    admission: Arc<RwLock<Admission>>,
    admitted: Mutex<Inbox>,
    stop: Arc<AtomicBool>,
    socket: Arc<Socket>,
    gate: Option<std::thread::JoinHandle<()>>,
}

enum Socket {
    Tcp(TcpListener, Security),
    /// Removed when the listener is dropped.
    Unix(UnixListener, PathBuf),
}

impl Socket {
    fn fd(&self) -> RawFd {
        match self {
            Socket::Tcp(l, _) => l.as_raw_fd(),
            Socket::Unix(l, _) => l.as_raw_fd(),
        }
    }
}

impl Listener {
    /// Listens on `at` (port 0 picks a free port) and opens the gate. A
    /// Unix socket is owner-only (0600, whatever the umask: it is not
    /// wrapped in TLS, so its mode is what guards it); a stale one left by
    /// a dead process is replaced, any other file at its path is not. Over
    /// TCP, the process's security must be chosen (TLS credentials, or
    /// `--insecure`).
    pub fn bind(at: &Endpoint) -> Result<Listener, MigrationError> {
        let err = |source| MigrationError::Listen {
            addr: at.to_string(),
            source,
        };
        let socket = match at {
            Endpoint::Tcp(a) => {
                let security = installed().map_err(|e| err(io::Error::other(e)))?;
                Socket::Tcp(TcpListener::bind(a).map_err(err)?, security)
            }
            Endpoint::Unix(p) => {
                if UnixStream::connect(p).is_err()
                    && std::fs::symlink_metadata(p).is_ok_and(|m| {
                        use std::os::unix::fs::FileTypeExt;
                        m.file_type().is_socket()
                    })
                {
                    let _ = std::fs::remove_file(p);
                }
                Socket::Unix(super::bind_owner_only(p).map_err(err)?, p.clone())
            }
        };
        let endpoint = match &socket {
            Socket::Tcp(l, _) => l
                .local_addr()
                .map(Endpoint::Tcp)
                .unwrap_or(Endpoint::Tcp(SocketAddr::from(([0, 0, 0, 0], 0)))),
            Socket::Unix(_, p) => Endpoint::Unix(p.clone()),
        };
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let socket = Arc::new(socket);
        let stop = Arc::new(AtomicBool::new(false));
        let admission = Arc::new(RwLock::new(Admission::default()));
        let gate = {
            let gate = Gate {
                socket: socket.clone(),
                stop: stop.clone(),
                admission: admission.clone(),
                tx,
                admitting: Arc::new(AtomicUsize::new(0)),
            };
            std::thread::Builder::new()
                .name("ferry-gate".into())
                .spawn(move || gate.run())
                .map_err(err)?
        };
        Ok(Listener {
            endpoint,
            admission,
            admitted: Mutex::new(Inbox {
                rx,
                held: Default::default(),
            }),
            stop,
            socket,
            gate: Some(gate),
        })
    }

    /// Where it listens (with the port the kernel picked).
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    /// Sets who may come in from now on.
    pub fn admit(&self, rules: Admission) {
        *self.admission.write().unwrap_or_else(|p| p.into_inner()) = rules;
    }

    /// Who may come in.
    pub fn admission(&self) -> Admission {
        self.admission
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The next admitted connection and its Hello, within `timeout`.
    pub fn accept_hello(&self, timeout: Duration) -> Result<(Conn, Hello), MigrationError> {
        self.accept_matching(timeout, |_| true)
    }

    /// The first admitted connection whose Hello `wanted` takes, within
    /// `timeout`. The gate admits connections in parallel, so they may
    /// arrive out of the order they were opened: those passed over are
    /// held for a later ask (for a minute) rather than refused.
    pub fn accept_matching(
        &self,
        timeout: Duration,
        wanted: impl Fn(&Hello) -> bool,
    ) -> Result<(Conn, Hello), MigrationError> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut inbox = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
                inbox.held.retain_mut(|(at, c, _)| {
                    let keep = at.elapsed() < HOLD;
                    if !keep {
                        c.abort("nobody here asked for this connection");
                    }
                    keep
                });
                if let Some(i) = inbox.held.iter().position(|(_, _, h)| wanted(h)) {
                    let (_, c, h) = inbox.held.remove(i).expect("an index inside");
                    return self.taken(c, h, timeout);
                }
                // Short waits, the lock let go in between: another thread
                // may be asking for another role.
                let left = deadline.saturating_duration_since(Instant::now());
                match inbox.rx.recv_timeout(left.min(Duration::from_millis(50))) {
                    Ok((c, h)) if wanted(&h) => return self.taken(c, h, timeout),
                    Ok((c, h)) => inbox.keep(c, h),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(MigrationError::Listen {
                            addr: self.endpoint.to_string(),
                            source: io::Error::other("the listener's gate stopped"),
                        })
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(MigrationError::Listen {
                    addr: self.endpoint.to_string(),
                    source: io::ErrorKind::TimedOut.into(),
                });
            }
        }
    }

    /// Keeps an admitted connection that its taker cannot use yet for a
    /// later ask, as one passed over by
    /// [`accept_matching`](Self::accept_matching) is.
    pub(crate) fn hold(&self, c: Conn, h: Hello) {
        self.admitted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keep(c, h);
    }

    fn taken(&self, c: Conn, h: Hello, timeout: Duration) -> Result<(Conn, Hello), MigrationError> {
        c.set_timeouts(Some(timeout)).map_err(ProtocolError::Io)?;
        Ok((c, h))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the gate's poll at once, so the port is free on return.
        // SAFETY: shutdown on a listening socket we own; no memory involved.
        unsafe { libc::shutdown(self.socket.fd(), libc::SHUT_RDWR) };
        if let Some(g) = self.gate.take() {
            let _ = g.join();
        }
        if let Socket::Unix(_, p) = &*self.socket {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The gate's thread: accepts, and admits each connection on its own.
struct Gate {
    socket: Arc<Socket>,
    stop: Arc<AtomicBool>,
    admission: Arc<RwLock<Admission>>,
    tx: SyncSender<Admitted>,
    admitting: Arc<AtomicUsize>,
}

impl Gate {
    fn run(self) {
        let mut backoff = Duration::from_millis(10);
        while !self.stop.load(Ordering::Relaxed) {
            match poll_in(self.socket.fd(), Duration::from_millis(200)) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!("migration listener: poll failed: {e}");
                    std::thread::sleep(backoff);
                    continue;
                }
            }
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let accepted = match &*self.socket {
                Socket::Tcp(l, _) => l.accept().map(|(s, a)| (Incoming::Tcp(s), a.to_string())),
                Socket::Unix(l, _) => l.accept().map(|(s, _)| (Incoming::Unix(s), "local".into())),
            };
            let (incoming, from) = match accepted {
                Ok(a) => {
                    backoff = Duration::from_millis(10);
                    a
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    // Out of descriptors, say: wait and go on; never stop
                    // listening because of what peers did.
                    tracing::warn!("migration listener: accept failed: {e}; retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            if self.admitting.fetch_add(1, Ordering::AcqRel) >= MAX_ADMITTING {
                self.admitting.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(
                    peer = %from,
                    "migration listener: {MAX_ADMITTING} connections are being admitted already; closed this one"
                );
                continue;
            }
            let job = Admit {
                incoming,
                from,
                security: match &*self.socket {
                    Socket::Tcp(_, s) => Some(s.clone()),
                    Socket::Unix(..) => None,
                },
                rules: self
                    .admission
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
                tx: self.tx.clone(),
                _slot: Slot(self.admitting.clone()),
            };
            if let Err(e) = std::thread::Builder::new()
                .name("ferry-admit".into())
                .spawn(move || job.run())
            {
                tracing::warn!("migration listener: cannot start an admission thread: {e}");
            }
        }
    }
}

enum Incoming {
    Tcp(std::net::TcpStream),
    Unix(UnixStream),
}

/// One of the gate's admission slots, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection's way through the gate.
struct Admit {
    incoming: Incoming,
    from: String,
    security: Option<Security>,
    rules: Admission,
    tx: SyncSender<Admitted>,
    /// Given back when the admission ends however it ends (a panic, or a
    /// thread that could not start, included): a slot lost each time would
    /// close the gate after MAX_ADMITTING of them.
    _slot: Slot,
}

impl Admit {
    fn run(self) {
        let from = self.from.clone();
        let tx = self.tx.clone();
        match self.admit() {
            Ok(Some(admitted)) => match tx.try_send(admitted) {
                Ok(()) => {}
                Err(TrySendError::Full((mut c, _))) => {
                    tracing::warn!(peer = %from, "migration listener: {QUEUE} admitted connections wait already; refused this one");
                    c.abort("busy: too many connections wait to be served");
                }
                // The listener is gone.
                Err(TrySendError::Disconnected(_)) => {}
            },
            // Closed without a word: a port probe or a health check.
            Ok(None) => {}
            Err(why) => {
                tracing::warn!(peer = %from, "migration listener: refused a connection: {why}")
            }
        }
    }

    /// The handshake, the host check and the Hello, within the deadline.
    fn admit(self) -> Result<Option<Admitted>, String> {
        let deadline = Instant::now() + ADMISSION_TIMEOUT;
        let stream = match self.incoming {
            Incoming::Tcp(s) => {
                let security = self.security.unwrap_or(Security::Insecure);
                match Stream::accepted_tcp(s, &security) {
                    Ok(s) => s,
                    // Closed without a word: a port probe or a health check.
                    Err(e) if ferry_tls::TlsError::is_silent(&e) => return Ok(None),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Incoming::Unix(s) => Stream::unix(s),
        };
        let peer: Option<PeerIdentity> = stream.peer().cloned();
        let mut conn = Conn::new(stream, Some(ADMISSION_TIMEOUT)).map_err(|e| e.to_string())?;
        if let (Some(want), Some(p)) = (&self.rules.from, &peer) {
            // One host, or several comma-separated (a source and its
            // postcopy standby).
            if !want.split(',').any(|w| p.is(w.trim())) {
                let why = format!(
                    "this destination accepts migrations only from {want}; this host's \
                     certificate names {}",
                    p.names.join(", ")
                );
                conn.abort(&why);
                return Err(why);
            }
        }
        let hello = match read_hello(&mut conn, deadline) {
            Ok(h) => h,
            Err(ProtocolError::Closed) => return Ok(None),
            Err(e) => {
                let why = format!("no ferry Hello within {ADMISSION_TIMEOUT:?}: {e}");
                conn.abort(&why);
                return Err(why);
            }
        };
        if let Some(p) = &peer {
            tracing::debug!(peer = %p, role = ?hello.role, "admitted");
        }
        Ok(Some((conn, hello)))
    }
}

/// Reads a Hello frame by `deadline` whatever the peer's pace, and no
/// bigger than a Hello can be.
fn read_hello(conn: &mut Conn, deadline: Instant) -> Result<Hello, ProtocolError> {
    let mut r = conn.reader().until(deadline);
    let h = protocol::read_header(&mut r)?;
    if h.kind != Kind::Hello && h.kind != Kind::Abort {
        return Err(ProtocolError::Unexpected {
            got: h.kind,
            want: "Hello",
        });
    }
    if h.len > MAX_HELLO {
        return Err(ProtocolError::TooLarge(h.len));
    }
    let mut body = Vec::new();
    protocol::read_body_into(&mut r, &h, &mut body)?;
    protocol::decode(&protocol::Frame { kind: h.kind, body }, Kind::Hello)
}
