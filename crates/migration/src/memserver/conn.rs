//! One memory-server connection, start to end: the handshake (Hello and
//! StoreOpen within [`Limits::handshake`], small frames only, owner's
//! secret checked), then requests until the peer closes, goes silent for
//! [`Limits::idle`], or sends something refused. Every request's size is
//! checked from its header, and the buffers it needs are taken from the
//! server's [`Budget`], before anything is read into them; every run it
//! names is checked against the VM's layout before anything changes. A
//! refusal ends this connection with an Abort naming the reason; the
//! server, its stores and its other connections go on.
//!
//! [`Limits::handshake`]: super::Limits::handshake
//! [`Limits::idle`]: super::Limits::idle
//! [`Budget`]: super::limits::Budget

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, ProtocolError, Role, MAX_BATCH, PAGE};
use crate::ranges::GpaPages;
use crate::transport::Conn;

use super::error::StoreError;
use super::limits::{list_len, Taken, MAX_LIST_BODY, MAX_RUNS, MAX_SMALL_BODY};
use super::server::MemServer;
use super::store::VmStore;
use super::{StoreAck, StoreFetch, StoreHeld, StoreOpen};

/// Largest Pages frame a client may send (a full batch).
const MAX_PAGES_BODY: u32 = (4 + MAX_BATCH * (8 + PAGE)) as u32;
/// Buffer bytes a connection may keep without asking the budget.
const FREE_BUFFERS: u64 = 64 << 10;
/// How often a connection waiting for a request looks at the stop flag.
const WAKE: Duration = Duration::from_millis(500);
/// How long an ended connection waits for its peer to read the Abort.
const ABORT_DRAIN: Duration = Duration::from_secs(1);

/// Serves one accepted connection until it ends.
pub(super) fn run(server: &MemServer, mut c: Conn, hello: Hello, accepted: Instant) {
    if c.set_timeouts(Some(server.limits.stall)).is_err() {
        return;
    }
    let mut me = Served {
        server,
        bufs: Buffers::default(),
        opened: None,
    };
    let r = me.serve(&mut c, &hello, accepted);
    me.bufs.release();
    match r {
        Ok(()) | Err(MigrationError::Protocol(ProtocolError::Closed)) => {}
        Err(e) => {
            server.stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("memory server connection: {e}");
            c.abort(&e.to_string());
            c.drain(ABORT_DRAIN);
        }
    }
    if let Some((store, vm)) = me.opened.take() {
        server.release(store, &vm);
    }
}

struct Served<'a> {
    server: &'a MemServer,
    bufs: Buffers,
    /// The store this connection opened, and its VM id.
    opened: Option<(Arc<VmStore>, String)>,
}

/// A connection's buffers and the budget bytes that cover them.
#[derive(Default)]
struct Buffers {
    body: Vec<u8>,
    scratch: Vec<u8>,
    data: Vec<u8>,
    addrs: Vec<u8>,
    out: Vec<u8>,
    taken: Option<Taken>,
}

impl Buffers {
    fn held(&self) -> u64 {
        [
            &self.body,
            &self.scratch,
            &self.data,
            &self.addrs,
            &self.out,
        ]
        .iter()
        .map(|b| b.capacity() as u64)
        .sum()
    }

    /// Makes sure the budget covers the buffers once `more` bytes more are
    /// in them (waiting for room up to the stall limit).
    fn fit(&mut self, server: &MemServer, more: u64) -> Result<(), StoreError> {
        let need = self.held() + more;
        let have = self
            .taken
            .as_ref()
            .map_or(FREE_BUFFERS, |t| t.bytes() + FREE_BUFFERS);
        if need <= have
            || server
                .budget
                .grow(&mut self.taken, need - have, server.limits.stall)
        {
            return Ok(());
        }
        Err(StoreError::NoBuffer { bytes: more })
    }

    /// Gives every buffer and its budget back (the connection goes idle).
    fn release(&mut self) {
        *self = Buffers::default();
    }
}

fn is_timeout(e: &ProtocolError) -> bool {
    matches!(e, ProtocolError::Io(e)
        if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
}

/// Decodes a postcard body of `kind`.
fn decode<T: serde::de::DeserializeOwned>(kind: Kind, body: &[u8]) -> Result<T, ProtocolError> {
    postcard::from_bytes(body).map_err(|e| ProtocolError::Malformed {
        kind,
        reason: e.to_string(),
    })
}

/// Refuses a list (the body's leading postcard length) longer than
/// [`MAX_RUNS`] before it is decoded.
fn check_list(kind: Kind, body: &[u8], what: &'static str) -> Result<(), MigrationError> {
    match list_len(body) {
        Some(n) if n > MAX_RUNS as u64 => Err(StoreError::TooMany {
            kind,
            what,
            count: n,
            most: MAX_RUNS as u64,
        }
        .into()),
        Some(_) => Ok(()),
        None => Err(ProtocolError::Malformed {
            kind,
            reason: "no list length".into(),
        }
        .into()),
    }
}

/// One small frame of `kind`, read by `at`.
fn small_frame<T: serde::de::DeserializeOwned>(
    c: &mut Conn,
    kind: Kind,
    at: Instant,
) -> Result<T, ProtocolError> {
    let mut r = c.reader().until(at);
    let h = protocol::read_header(&mut r)?;
    if h.len > MAX_SMALL_BODY && h.kind != Kind::Abort {
        return Err(ProtocolError::Malformed {
            kind: h.kind,
            reason: format!(
                "{} bytes, over the {MAX_SMALL_BODY}-byte limit of an opening message",
                h.len
            ),
        });
    }
    let mut body = Vec::new();
    protocol::read_body_into(&mut r, &h, &mut body)?;
    if h.kind != kind {
        return Err(ProtocolError::Unexpected {
            got: h.kind,
            want: if kind == Kind::Hello {
                "Hello"
            } else {
                "StoreOpen"
            },
        });
    }
    decode(kind, &body)
}

impl Served<'_> {
    fn limits(&self) -> &super::Limits {
        &self.server.limits
    }

    fn serve(
        &mut self,
        c: &mut Conn,
        hello: &Hello,
        accepted: Instant,
    ) -> Result<(), MigrationError> {
        let store = self.handshake(c, hello, accepted)?;
        c.set_read_timeout(Some(self.limits().stall))
            .map_err(ProtocolError::Io)?;
        loop {
            self.wait_request(c)?;
            let h = protocol::read_header(c.reader())?;
            if h.kind == Kind::Pages {
                if h.len > MAX_PAGES_BODY {
                    return Err(StoreError::TooLarge {
                        kind: h.kind,
                        len: h.len,
                        most: MAX_PAGES_BODY,
                    }
                    .into());
                }
                self.bufs.fit(self.server, u64::from(h.len))?;
                let n = crate::pagein::read_pages(
                    c.reader(),
                    &h,
                    store.regions(),
                    store.as_ref(),
                    &mut self.bufs.scratch,
                    &mut self.bufs.data,
                )?;
                self.server.stats.pages_in.fetch_add(n, Ordering::Relaxed);
                continue;
            }
            if self.request(c, &store, &h)? {
                return Ok(());
            }
        }
    }

    /// The Hello (read by the listener's gate) and StoreOpen, within the
    /// handshake limit: returns the store, found or made.
    fn handshake(
        &mut self,
        c: &mut Conn,
        hello: &Hello,
        accepted: Instant,
    ) -> Result<Arc<VmStore>, MigrationError> {
        let handshake = self.limits().handshake;
        let at = accepted + handshake;
        let silent = |e: ProtocolError| -> MigrationError {
            if is_timeout(&e) {
                StoreError::Silent {
                    what: "no Hello and StoreOpen",
                    after: handshake,
                }
                .into()
            } else {
                e.into()
            }
        };
        if hello.role != Role::Store {
            return Err(StoreError::NotStore(format!("{:?}", hello.role)).into());
        }
        let version = protocol::negotiate(hello)?;
        if !crate::protocol::Caps::of(version).trust() {
            return Err(StoreError::TooOld {
                need: protocol::VERSION_TRUST,
                min: hello.version_min,
                max: hello.version_max,
            }
            .into());
        }
        c.send(Kind::HelloAck, &version)?;
        let open: StoreOpen = small_frame(c, Kind::StoreOpen, at).map_err(silent)?;
        let store = self.server.open(&open)?;
        self.opened = Some((store.clone(), open.vm.clone()));
        c.send(Kind::StoreAck, &self.ack(&store))?;
        Ok(store)
    }

    fn ack(&self, store: &VmStore) -> StoreAck {
        StoreAck {
            held_pages: store.held(),
            free_pages: self.server.free(),
            idle_secs: self.limits().idle.as_secs().min(u64::from(u32::MAX)) as u32,
        }
    }

    /// Waits for the next request; gives the buffers back while idle.
    fn wait_request(&mut self, c: &mut Conn) -> Result<(), MigrationError> {
        if c.wait_readable(Duration::ZERO) {
            return Ok(());
        }
        self.bufs.release();
        let t0 = Instant::now();
        let idle = self.limits().idle;
        while !c.wait_readable(WAKE.min(idle)) {
            if self.server.stopping() {
                return Err(ProtocolError::Closed.into());
            }
            if t0.elapsed() >= idle {
                return Err(StoreError::Silent {
                    what: "no request",
                    after: idle,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Serves one request other than Pages; true once the store closed.
    fn request(
        &mut self,
        c: &mut Conn,
        store: &Arc<VmStore>,
        h: &protocol::Header,
    ) -> Result<bool, MigrationError> {
        let most = match h.kind {
            Kind::ZeroRanges | Kind::StoreDrop | Kind::PageRequest | Kind::StoreFetch => {
                MAX_LIST_BODY
            }
            Kind::StoreSync | Kind::StoreList | Kind::StoreClose | Kind::Abort => MAX_SMALL_BODY,
            other => {
                return Err(ProtocolError::Unexpected {
                    got: other,
                    want: "a memory server request",
                }
                .into())
            }
        };
        if h.len > most {
            return Err(StoreError::TooLarge {
                kind: h.kind,
                len: h.len,
                most,
            }
            .into());
        }
        self.bufs.fit(self.server, u64::from(h.len))?;
        protocol::read_body_into(c.reader(), h, &mut self.bufs.body)?;
        let body = std::mem::take(&mut self.bufs.body);
        let r = self.answer(c, store, h.kind, &body);
        self.bufs.body = body;
        r
    }

    fn answer(
        &mut self,
        c: &mut Conn,
        store: &Arc<VmStore>,
        kind: Kind,
        body: &[u8],
    ) -> Result<bool, MigrationError> {
        match kind {
            Kind::ZeroRanges | Kind::StoreDrop => {
                check_list(kind, body, "runs")?;
                let runs: Vec<GpaPages> = decode(kind, body)?;
                // All checked before the first is dropped.
                store.check_runs(kind, &runs)?;
                for r in runs {
                    store.drop_run(r)?;
                }
            }
            Kind::StoreSync => {
                let _token: u64 = decode(kind, body)?;
                c.send(Kind::StoreAck, &self.ack(store))?;
            }
            Kind::PageRequest => {
                check_list(kind, body, "addresses")?;
                let gpas: Vec<u64> = decode(kind, body)?;
                self.send_pages(c, store, &gpas)?;
            }
            Kind::StoreFetch => {
                check_list(kind, body, "runs")?;
                let ask: StoreFetch = decode(kind, body)?;
                store.check_runs(kind, &ask.runs)?;
                self.send_fetched(c, store, &ask)?;
            }
            Kind::StoreList => self.send_held(c, store)?,
            Kind::StoreClose => {
                if let Some((s, vm)) = &self.opened {
                    self.server.close(s, vm);
                }
                let ack = StoreAck {
                    held_pages: 0,
                    ..self.ack(store)
                };
                // The store's memory goes back once the last connection
                // using it ends.
                c.send(Kind::StoreAck, &ack)?;
                return Ok(true);
            }
            // read_body_into turns an Abort into an error; nothing else
            // gets here.
            _ => {}
        }
        Ok(false)
    }

    /// Answers a StoreFetch (runs checked): per run, frames of its held
    /// pages (empty when it holds none), so the asker can count frames and
    /// knows the rest of each run is zero.
    fn send_fetched(
        &mut self,
        c: &mut Conn,
        store: &VmStore,
        ask: &StoreFetch,
    ) -> Result<(), MigrationError> {
        self.bufs
            .fit(self.server, (MAX_BATCH * (8 + PAGE)) as u64)?;
        for run in &ask.runs {
            for f in 0..run.pages.div_ceil(MAX_BATCH as u64) {
                let first = f * MAX_BATCH as u64;
                let n = (run.pages - first).min(MAX_BATCH as u64);
                let gpas = (first..first + n).map(|i| run.gpa + i * PAGE as u64);
                self.send_held_of(c, store, gpas)?;
            }
            // The first run is the page a vCPU waits for: out now, before
            // the store lets go of what it sent.
            c.flush()?;
            if ask.drop {
                store.drop_run(*run)?;
            }
        }
        Ok(())
    }

    /// Sends one Pages frame of those of `gpas` the store holds.
    fn send_held_of(
        &mut self,
        c: &mut Conn,
        store: &VmStore,
        gpas: impl Iterator<Item = u64>,
    ) -> Result<(), MigrationError> {
        let (addrs, out) = (&mut self.bufs.addrs, &mut self.bufs.out);
        addrs.clear();
        out.clear();
        for g in gpas {
            let at = out.len();
            out.resize(at + PAGE, 0);
            if store.read_page(g, &mut out[at..]) {
                addrs.extend_from_slice(&g.to_le_bytes());
            } else {
                out.truncate(at);
            }
        }
        let count = ((addrs.len() / 8) as u32).to_le_bytes();
        protocol::write_frame_parts(c.writer(), Kind::Pages, &[&count, addrs, out])
            .map_err(ProtocolError::Io)?;
        self.server
            .stats
            .pages_out
            .fetch_add((addrs.len() / 8) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Answers a PageRequest: the pages in the order asked, in Pages
    /// frames; a page not held ends the connection.
    fn send_pages(
        &mut self,
        c: &mut Conn,
        store: &VmStore,
        gpas: &[u64],
    ) -> Result<(), MigrationError> {
        if let Some(&g) = gpas.iter().find(|&&g| !store.holds(g)) {
            return Err(MigrationError::Unsupported(format!(
                "page {g:#x} is not held by this memory server"
            )));
        }
        self.bufs
            .fit(self.server, (MAX_BATCH * (8 + PAGE)) as u64)?;
        for batch in gpas.chunks(MAX_BATCH) {
            self.send_held_of(c, store, batch.iter().copied())?;
        }
        c.flush()?;
        Ok(())
    }

    /// Answers a StoreList: the held runs, [`MAX_RUNS`] per frame, as the
    /// bitmap is walked (never all of them in memory at once).
    fn send_held(&mut self, c: &mut Conn, store: &VmStore) -> Result<(), MigrationError> {
        let mut share: Vec<GpaPages> = Vec::new();
        store.each_held_run(|r| -> Result<(), MigrationError> {
            share.push(r);
            if share.len() == MAX_RUNS {
                let runs = std::mem::take(&mut share);
                protocol::send(
                    c.writer(),
                    Kind::StoreHeld,
                    &StoreHeld { runs, last: false },
                )?;
            }
            Ok(())
        })?;
        protocol::send(
            c.writer(),
            Kind::StoreHeld,
            &StoreHeld {
                runs: share,
                last: true,
            },
        )?;
        c.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_longer_than_the_limit_is_refused_from_its_length_alone() {
        let ok = postcard::to_stdvec(&vec![GpaPages::new(0, 1); 3]).unwrap();
        assert!(check_list(Kind::StoreDrop, &ok, "runs").is_ok());
        // A length of MAX_RUNS + 1 and no elements after it.
        let long = postcard::to_stdvec(&(MAX_RUNS as u64 + 1)).unwrap();
        let e = check_list(Kind::StoreDrop, &long, "runs").unwrap_err();
        assert!(
            e.to_string()
                .contains("65537 runs, over the limit of 65536"),
            "{e}"
        );
        assert!(check_list(Kind::StoreDrop, &[], "runs").is_err());
        assert!(check_list(Kind::StoreDrop, &[0xff; 10], "runs").is_err());
    }
}
