//! The memory server's accept loop: one thread per connection, stores
//! shared by VM id, one capacity for all of them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, ProtocolError, Role, MAX_BATCH, PAGE};
use crate::ranges::GpaPages;
use crate::transport::{Conn, Listener};

use super::store::{Capacity, VmStore};
use super::{StoreAck, StoreFetch, StoreHeld, StoreOpen};

/// Figures a running server shows (its status line, the registry).
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Pages received (migration and page-out).
    pub pages_in: AtomicU64,
    /// Pages sent (page-in and gather).
    pub pages_out: AtomicU64,
    /// Connections served.
    pub connections: AtomicU64,
}

/// A memory server.
pub struct MemServer {
    capacity: Arc<Capacity>,
    stores: Mutex<HashMap<String, Arc<VmStore>>>,
    /// Its figures.
    pub stats: ServerStats,
    stop: AtomicBool,
}

/// How long a silent client is waited for before its connection is dropped.
const IDLE: Duration = Duration::from_secs(3600);

impl MemServer {
    /// A server for at most `capacity_pages` pages.
    pub fn new(capacity_pages: u64) -> Arc<Self> {
        Arc::new(MemServer {
            capacity: Capacity::new(capacity_pages),
            stores: Mutex::new(HashMap::new()),
            stats: ServerStats::default(),
            stop: AtomicBool::new(false),
        })
    }

    /// Pages it may hold in all.
    pub fn capacity_pages(&self) -> u64 {
        self.capacity.total
    }

    /// Pages free.
    pub fn free_pages(&self) -> u64 {
        self.capacity.free()
    }

    /// (VM id, pages held) per store.
    pub fn vms(&self) -> Vec<(String, u64)> {
        let s = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(String, u64)> = s.iter().map(|(k, st)| (k.clone(), st.held())).collect();
        v.sort();
        v
    }

    /// Makes [`MemServer::serve`] return.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Accepts connections until stopped; each runs on a thread of its own.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> Result<(), MigrationError> {
        while !self.stop.load(Ordering::Relaxed) {
            let (mut c, hello) = match listener.accept_hello(Duration::from_millis(200)) {
                Ok(admitted) => admitted,
                Err(MigrationError::Listen { source, .. })
                    if source.kind() == std::io::ErrorKind::TimedOut =>
                {
                    continue
                }
                Err(e) => return Err(e),
            };
            let me = self.clone();
            self.stats.connections.fetch_add(1, Ordering::Relaxed);
            let spawned = std::thread::Builder::new()
                .name("memserver-conn".into())
                .spawn(move || {
                    if c.set_timeouts(Some(IDLE)).is_err() {
                        return;
                    }
                    match me.serve_conn(&mut c, &hello) {
                        Ok(()) | Err(MigrationError::Protocol(ProtocolError::Closed)) => {}
                        Err(e) => {
                            tracing::warn!("memory server connection: {e}");
                            c.abort(&e.to_string());
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a connection thread: {e}");
            }
        }
        Ok(())
    }

    /// The store for a StoreOpen, made on the first open. Later opens must
    /// give the same layout; a reservation needs that much room free.
    fn open(&self, o: &StoreOpen) -> Result<Arc<VmStore>, MigrationError> {
        let mut stores = self.stores.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = stores.get(&o.vm) {
            if s.layout() != o.regions {
                return Err(MigrationError::Mismatch(format!(
                    "VM {} is held here with layout {:?}, not {:?}",
                    o.vm,
                    s.layout(),
                    o.regions
                )));
            }
            return Ok(s.clone());
        }
        if o.reserve_pages > self.capacity.free() {
            return Err(MigrationError::Unsupported(format!(
                "this memory server has {} pages free, {} asked for VM {}",
                self.capacity.free(),
                o.reserve_pages,
                o.vm
            )));
        }
        let s = VmStore::new(&o.vm, &o.regions, self.capacity.clone())
            .map_err(|e| MigrationError::Mismatch(e.to_string()))?;
        let s = Arc::new(s);
        stores.insert(o.vm.clone(), s.clone());
        Ok(s)
    }

    fn ack(&self, store: &VmStore) -> StoreAck {
        StoreAck {
            held_pages: store.held(),
            free_pages: self.capacity.free(),
        }
    }

    fn serve_conn(&self, c: &mut Conn, hello: &Hello) -> Result<(), MigrationError> {
        if hello.role != Role::Store {
            return Err(MigrationError::Unsupported(format!(
                "this is a ferry memory server; a {:?} connection belongs to a VMM",
                hello.role
            )));
        }
        let version = protocol::negotiate(hello)?;
        if version < protocol::VERSION_STORE {
            return Err(ProtocolError::Version {
                min: hello.version_min,
                max: hello.version_max,
            }
            .into());
        }
        c.send(Kind::HelloAck, &version)?;
        let open: StoreOpen = c.recv(Kind::StoreOpen)?;
        let store = self.open(&open)?;
        c.send(Kind::StoreAck, &self.ack(&store))?;
        let (mut scratch, mut data, mut body) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let h = protocol::read_header(c.reader())?;
            if h.kind == Kind::Pages {
                let n = crate::pagein::read_pages(
                    c.reader(),
                    &h,
                    store.regions(),
                    store.as_ref(),
                    &mut scratch,
                    &mut data,
                )?;
                self.stats.pages_in.fetch_add(n, Ordering::Relaxed);
                continue;
            }
            protocol::read_body_into(c.reader(), &h, &mut body)?;
            let f = protocol::Frame {
                kind: h.kind,
                body: std::mem::take(&mut body),
            };
            match f.kind {
                Kind::ZeroRanges | Kind::StoreDrop => {
                    let runs: Vec<GpaPages> = protocol::decode(&f, f.kind)?;
                    for r in runs {
                        store.drop_run(r)?;
                    }
                }
                Kind::StoreSync => {
                    let _token: u64 = protocol::decode(&f, Kind::StoreSync)?;
                    c.send(Kind::StoreAck, &self.ack(&store))?;
                }
                Kind::PageRequest => {
                    let gpas: Vec<u64> = protocol::decode(&f, Kind::PageRequest)?;
                    self.send_pages(c, &store, &gpas)?;
                }
                Kind::StoreFetch => {
                    let ask: StoreFetch = protocol::decode(&f, Kind::StoreFetch)?;
                    self.send_fetched(c, &store, &ask)?;
                }
                Kind::StoreList => {
                    let runs = store.held_runs();
                    for (share, last) in protocol::run_frames(&runs) {
                        protocol::send(
                            c.writer(),
                            Kind::StoreHeld,
                            &StoreHeld {
                                runs: share.to_vec(),
                                last,
                            },
                        )?;
                    }
                    c.flush()?;
                }
                Kind::StoreClose => {
                    self.stores
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&open.vm);
                    let ack = StoreAck {
                        held_pages: 0,
                        free_pages: self.capacity.free(),
                    };
                    // The store's memory goes back once the last
                    // connection using it ends.
                    c.send(Kind::StoreAck, &ack)?;
                    return Ok(());
                }
                other => {
                    return Err(ProtocolError::Unexpected {
                        got: other,
                        want: "a memory server request",
                    }
                    .into())
                }
            }
            body = f.body;
        }
    }

    /// Answers a StoreFetch: per run, frames of its held pages (empty when
    /// it holds none), so the asker can count frames and knows the rest
    /// of each run is zero.
    fn send_fetched(
        &self,
        c: &mut Conn,
        store: &VmStore,
        ask: &StoreFetch,
    ) -> Result<(), MigrationError> {
        let mut page = vec![0u8; PAGE];
        let (mut gpas, mut data) = (Vec::new(), Vec::new());
        for run in &ask.runs {
            let pages: Vec<u64> = (0..run.pages).map(|i| run.gpa + i * PAGE as u64).collect();
            for batch in pages.chunks(MAX_BATCH) {
                gpas.clear();
                data.clear();
                for &g in batch {
                    if store.read_page(g, &mut page) {
                        gpas.push(g);
                        data.extend_from_slice(&page);
                    }
                }
                let body = protocol::encode_pages(&gpas, &data);
                protocol::write_frame(c.writer(), Kind::Pages, &body).map_err(ProtocolError::Io)?;
                self.stats
                    .pages_out
                    .fetch_add(gpas.len() as u64, Ordering::Relaxed);
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

    /// Answers a PageRequest: the pages in the order asked, in Pages frames.
    fn send_pages(
        &self,
        c: &mut Conn,
        store: &VmStore,
        gpas: &[u64],
    ) -> Result<(), MigrationError> {
        let mut page = vec![0u8; PAGE];
        for batch in gpas.chunks(MAX_BATCH) {
            let mut data = Vec::with_capacity(batch.len() * PAGE);
            for &g in batch {
                if !store.read_page(g, &mut page) {
                    return Err(MigrationError::Unsupported(format!(
                        "page {g:#x} is not held by this memory server"
                    )));
                }
                data.extend_from_slice(&page);
            }
            let body = protocol::encode_pages(batch, &data);
            protocol::write_frame(c.writer(), Kind::Pages, &body).map_err(ProtocolError::Io)?;
            self.stats
                .pages_out
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
        c.flush()?;
        Ok(())
    }
}
