//! A connection to a memory server, as the engine uses it: put pages,
//! make sure they landed, fetch them back, forget them. It opens with the
//! store's owner secret (v9), cuts long requests to the server's limits,
//! and reopens by itself when the server closed it for being idle.

use std::time::{Duration, Instant};

use crate::batch::{self, PageBatch};
use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, Role, MAX_BATCH, PAGE};
use crate::ranges::GpaPages;
use crate::transport::{Conn, Endpoint};

use super::limits::{list_len, MAX_LIST_BODY, MAX_RUNS};
use super::{StoreAck, StoreFetch, StoreHeld, StoreOpen};

/// One connection to one memory server, for one VM.
pub struct StoreClient {
    conn: Conn,
    to: Endpoint,
    addr: String,
    timeout: Duration,
    open: StoreOpen,
    token: u64,
    /// How long the server keeps a silent connection (from its StoreAck).
    idle: Option<Duration>,
    /// When the last request went out.
    last: Instant,
    /// The body of the last Pages frame read: reused, so a chunk fetched
    /// costs no allocation (fresh memory costs a fault and a clear a page).
    body: Vec<u8>,
}

impl StoreClient {
    /// Connects and opens (or joins) the VM's store there.
    pub fn open(
        to: &Endpoint,
        timeout: Duration,
        open: &StoreOpen,
    ) -> Result<(Self, StoreAck), MigrationError> {
        let (conn, ack) = Self::connect(to, timeout, open)?;
        Ok((
            StoreClient {
                conn,
                to: to.clone(),
                addr: to.to_string(),
                timeout,
                open: open.clone(),
                token: 0,
                idle: (ack.idle_secs > 0).then(|| Duration::from_secs(ack.idle_secs.into())),
                last: Instant::now(),
                body: Vec::new(),
            },
            ack,
        ))
    }

    fn connect(
        to: &Endpoint,
        timeout: Duration,
        open: &StoreOpen,
    ) -> Result<(Conn, StoreAck), MigrationError> {
        let hello = Hello {
            version_min: protocol::VERSION_TRUST,
            version_max: protocol::VERSION_MAX,
            role: Role::Store,
            session: 0,
            streams: 0,
        };
        let mut conn = Conn::open(to, timeout, &hello)?;
        conn.flush()?;
        let _version: u16 = conn.recv(Kind::HelloAck)?;
        conn.send(Kind::StoreOpen, open)?;
        let ack: StoreAck = conn.recv(Kind::StoreAck)?;
        Ok((conn, ack))
    }

    /// Before each request: a connection silent for half the server's idle
    /// limit or more is asked for a StoreSync first, and opened again if
    /// the server closed it (nothing is lost: the server closes only a
    /// connection that sent nothing, and every request here flushes or
    /// syncs before it goes quiet).
    fn fresh(&mut self) -> Result<(), MigrationError> {
        let stale = self
            .idle
            .is_some_and(|idle| self.last.elapsed() >= idle / 2);
        self.last = Instant::now();
        if !stale || self.sync_now().is_ok() {
            return Ok(());
        }
        tracing::info!(server = %self.addr, "memory server connection went idle: reopening it");
        let (conn, _) = Self::connect(&self.to, self.timeout, &self.open)?;
        self.conn = conn;
        Ok(())
    }

    /// Opens the connection again after one broke (the store and what it
    /// holds outlive a connection: the same StoreOpen joins it), trying
    /// for at most `within`; requests then go on as before.
    pub fn reopen(&mut self, within: Duration) -> Result<(), MigrationError> {
        let (conn, _) = Self::connect(&self.to, within.min(self.timeout), &self.open)?;
        conn.set_timeouts(Some(self.timeout))
            .map_err(protocol::ProtocolError::Io)?;
        self.conn = conn;
        self.last = Instant::now();
        Ok(())
    }

    /// The server's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sends pages (`gpas[i]` is page `i` of `data`); not flushed.
    pub fn put(&mut self, gpas: &[u64], data: &[u8]) -> Result<(), MigrationError> {
        self.fresh()?;
        let mut addrs = Vec::new();
        for (i, chunk) in gpas.chunks(MAX_BATCH).enumerate() {
            let at = i * MAX_BATCH * PAGE;
            addrs.clear();
            addrs.extend(chunk.iter().flat_map(|g| g.to_le_bytes()));
            batch::write_pages_frame(
                self.conn.writer(),
                &addrs,
                &data[at..at + chunk.len() * PAGE],
                batch::PageCheck::Compute,
            )
            .map_err(protocol::ProtocolError::Io)?;
        }
        Ok(())
    }

    /// Sends a batch's pages with data (its zero runs are the caller's:
    /// absent means zero here, see [`Self::drop_runs`]); not flushed.
    /// Returns the bytes written.
    pub(crate) fn put_batch(&mut self, b: &PageBatch) -> Result<u64, MigrationError> {
        self.fresh()?;
        // Checked even over TLS: a memory server reads every frame the
        // same way (read_body_into), and takes no sealed ones.
        Ok(b.write_pages(self.conn.writer(), false)
            .map_err(protocol::ProtocolError::Io)?)
    }

    /// Waits until everything sent so far has landed.
    pub fn sync(&mut self) -> Result<StoreAck, MigrationError> {
        self.fresh()?;
        self.sync_now()
    }

    fn sync_now(&mut self) -> Result<StoreAck, MigrationError> {
        self.token += 1;
        self.conn.send(Kind::StoreSync, &self.token)?;
        Ok(self.conn.recv(Kind::StoreAck)?)
    }

    /// Fetches pages, in the order asked, into `out` (4096 bytes each).
    pub fn fetch(&mut self, gpas: &[u64], out: &mut Vec<u8>) -> Result<(), MigrationError> {
        self.fresh()?;
        out.clear();
        for part in gpas.chunks(MAX_RUNS) {
            self.fetch_part(part, out)?;
        }
        Ok(())
    }

    fn fetch_part(&mut self, gpas: &[u64], out: &mut Vec<u8>) -> Result<(), MigrationError> {
        self.conn.send(Kind::PageRequest, &gpas)?;
        let mut got = 0;
        while got < gpas.len() {
            let f = protocol::read_frame(self.conn.reader())?;
            if f.kind != Kind::Pages {
                return Err(protocol::ProtocolError::Unexpected {
                    got: f.kind,
                    want: "Pages",
                }
                .into());
            }
            let (addrs, data) = protocol::decode_pages(&f.body)?;
            if got + addrs.len() > gpas.len() || addrs.as_slice() != &gpas[got..got + addrs.len()] {
                return Err(MigrationError::Mismatch(format!(
                    "memory server {} answered other pages than asked",
                    self.addr
                )));
            }
            got += addrs.len();
            out.extend_from_slice(data);
        }
        Ok(())
    }

    /// Fetches the held pages of `runs` (v8), run by run: `got(run, gpas,
    /// data)` sees each frame as it arrives (a page of a run that no frame
    /// names is a zero page). With `drop` the server forgets them.
    pub fn fetch_runs(
        &mut self,
        runs: &[GpaPages],
        drop: bool,
        mut got: impl FnMut(usize, &[u64], &[u8]) -> Result<(), MigrationError>,
    ) -> Result<(), MigrationError> {
        self.fresh()?;
        for (k, part) in runs.chunks(MAX_RUNS).enumerate() {
            self.fetch_runs_part(part, drop, k * MAX_RUNS, &mut got)?;
        }
        Ok(())
    }

    /// One StoreFetch of at most MAX_RUNS runs, the first being run
    /// `base` of the caller's.
    fn fetch_runs_part(
        &mut self,
        runs: &[GpaPages],
        drop: bool,
        base: usize,
        got: &mut impl FnMut(usize, &[u64], &[u8]) -> Result<(), MigrationError>,
    ) -> Result<(), MigrationError> {
        let ask = StoreFetch {
            runs: runs.to_vec(),
            drop,
        };
        self.conn.send(Kind::StoreFetch, &ask)?;
        for (i, run) in runs.iter().enumerate() {
            let frames = (run.pages as usize).div_ceil(MAX_BATCH);
            for f in 0..frames {
                let kind = protocol::read_frame_into(self.conn.reader(), &mut self.body)?;
                if kind != Kind::Pages {
                    return Err(protocol::ProtocolError::Unexpected {
                        got: kind,
                        want: "Pages",
                    }
                    .into());
                }
                let (addrs, data) = protocol::decode_pages(&self.body)?;
                let lo = run.gpa + (f * MAX_BATCH * PAGE) as u64;
                let hi = (lo + (MAX_BATCH * PAGE) as u64).min(run.end());
                if addrs
                    .iter()
                    .any(|&g| g < lo || g >= hi || g % PAGE as u64 != 0)
                {
                    return Err(MigrationError::Mismatch(format!(
                        "memory server {} answered pages outside the runs asked",
                        self.addr
                    )));
                }
                got(base + i, &addrs, data)?;
            }
        }
        Ok(())
    }

    /// Tells the server to forget pages (not flushed).
    pub fn drop_runs(&mut self, runs: &[GpaPages]) -> Result<(), MigrationError> {
        self.fresh()?;
        for part in runs.chunks(MAX_RUNS) {
            protocol::send(self.conn.writer(), Kind::StoreDrop, &part)?;
        }
        Ok(())
    }

    /// Sends what is buffered (drops) now.
    pub fn flush(&mut self) -> Result<(), MigrationError> {
        Ok(self.conn.flush()?)
    }

    /// Everything the server holds for the VM. The answer is checked as it
    /// arrives, as any peer's: each frame at most a list of [`MAX_RUNS`]
    /// runs (its size and count read before anything is allocated for it),
    /// and each run inside the VM's layout and past the one before (in the
    /// layout's order), so the whole answer is bounded by the layout and
    /// ends.
    pub fn list(&mut self) -> Result<Vec<GpaPages>, MigrationError> {
        self.fresh()?;
        self.conn.send(Kind::StoreList, &())?;
        let bad = |reason: String| protocol::ProtocolError::Malformed {
            kind: Kind::StoreHeld,
            reason: format!("memory server {}: {reason}", self.addr),
        };
        let mut runs: Vec<GpaPages> = Vec::new();
        // Where the next run may start: (region index, address).
        let mut after = (0usize, 0u64);
        let mut body = Vec::new();
        loop {
            let h = protocol::read_header(self.conn.reader())?;
            if h.len > MAX_LIST_BODY && h.kind != Kind::Abort {
                return Err(bad(format!(
                    "a frame of {} bytes, over the {MAX_LIST_BODY}-byte limit of a list",
                    h.len
                ))
                .into());
            }
            protocol::read_body_into(self.conn.reader(), &h, &mut body)?;
            match list_len(&body) {
                Some(n) if n > MAX_RUNS as u64 => {
                    return Err(bad(format!("{n} runs in one frame, over {MAX_RUNS}")).into())
                }
                _ => {}
            }
            let frame = protocol::Frame {
                kind: h.kind,
                body: std::mem::take(&mut body),
            };
            let held: StoreHeld = protocol::decode(&frame, Kind::StoreHeld)?;
            if held.runs.is_empty() && !held.last {
                return Err(bad("an empty frame that is not the last".into()).into());
            }
            for r in &held.runs {
                // The server walks the layout region by region, each in
                // address order.
                match region_of(&self.open.regions, *r) {
                    Some(i) if (i, r.gpa) >= after => after = (i, r.end()),
                    _ => {
                        return Err(bad(format!(
                            "{} pages at {:#x}: not inside the VM's memory, or not after the \
                             run before",
                            r.pages, r.gpa
                        ))
                        .into())
                    }
                }
                runs.push(*r);
            }
            if held.last {
                return Ok(runs);
            }
        }
    }

    /// Frees the VM's store on the server.
    pub fn close(mut self) -> Result<StoreAck, MigrationError> {
        self.fresh()?;
        self.conn.send(Kind::StoreClose, &())?;
        Ok(self.conn.recv(Kind::StoreAck)?)
    }
}

/// The index of the region of `regions` ((gpa, bytes) each) that holds
/// `run` whole, if `run` is a non-empty run of whole pages.
fn region_of(regions: &[(u64, u64)], run: GpaPages) -> Option<usize> {
    let end = run
        .pages
        .checked_mul(PAGE as u64)
        .and_then(|b| run.gpa.checked_add(b))?;
    if run.pages == 0 || !run.gpa.is_multiple_of(PAGE as u64) {
        return None;
    }
    regions
        .iter()
        .position(|&(gpa, bytes)| gpa <= run.gpa && end <= gpa.saturating_add(bytes))
}
