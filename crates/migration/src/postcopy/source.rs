//! The source after the switch: the VM is paused here for good (its memory
//! frozen), and every page the destination lacks goes out exactly once
//! unless a vCPU asks for it first:
//!
//! - the demand thread answers each requested page at once on its own
//!   connection, with its ±N neighbours that have not gone out yet, so a
//!   fault never queues behind bulk data;
//! - one pusher per bulk stream sends the rest in address order, jumping to
//!   just past the latest requested window (locality: the guest is likely
//!   to touch what follows), at lower CPU priority than the demand thread,
//!   backing off while the path queues (the governor of `--share-link`:
//!   a demand answer behind a full bottleneck queue waited ~4.4 ms on a
//!   1 Gbit link, ~0.2 ms with it);
//!   pages the VM's access tracker saw used lately go first (a service
//!   touching its data at random gets its working set before the cold
//!   rest, instead of faulting on it page by page).
//!
//! Pages are claimed in one shared set, so a page goes out by push or by
//! prefetch, never both; a requested page is always sent (it may be in a
//! bulk stream's queue, and the vCPU must not wait for that).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::pages::{PageIndex, PageSet};
use crate::batch::{Fill, PageBatch};
use crate::error::MigrationError;
use crate::governor::Governor;
use crate::memory::RegionView;
use crate::pacer::Pacer;
use crate::protocol::{self, Kind, ProtocolError, MAX_BATCH};
use crate::ranges::GpaPages;
use crate::stats::CpuMeter;
use crate::transport::Conn;
use crate::vm::AccessHistory;

/// Pages per pushed frame: small enough that a new fault redirects the
/// pusher soon, large enough to keep per-frame costs low.
const PUSH_BATCH: usize = 128;
/// "No fault yet" in the hint.
const NO_HINT: u64 = u64::MAX;
/// A recent request: its page in the low bits, and above them how many
/// requests before it each followed the one before (its scan's streak).
const RECENT_STREAK_SHIFT: u32 = 56;
const RECENT_PAGE: u64 = (1 << RECENT_STREAK_SHIFT) - 1;
const RECENT_MAX_STREAK: u64 = 0x7f;

/// What the demand and push threads share.
pub(crate) struct SourcePages {
    regions: Vec<RegionView>,
    index: PageIndex,
    /// Pending pages not sent yet.
    unsent: PageSet,
    /// Of those, the ones the guest used lately: pushed first.
    hot: PageSet,
    /// The hot set is empty (the pushers stop looking in it).
    hot_done: AtomicBool,
    /// Pages pushed from the hot set.
    pub(crate) hot_pages: AtomicU64,
    prefetch: u64,
    /// Where the pushers continue: just past the latest requested window.
    hint: AtomicU64,
    /// (next page to push, hint last followed).
    cursor: Mutex<(u64, u64)>,
    pub(crate) pushed_pages: AtomicU64,
    pub(crate) pushed_zero_pages: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) demand_pages: AtomicU64,
    pub(crate) prefetched_pages: AtomicU64,
    /// Bytes written, all connections.
    pub(crate) bytes: AtomicU64,
    /// The demand thread stops when this is set (or its connection closes).
    pub(crate) done: AtomicBool,
    /// The push does not start before this (`--push-delay`): until then
    /// only requested windows go out.
    push_from: Instant,
    /// Set when the link broke: a pusher still held stops at once.
    pub(crate) halt: AtomicBool,
    /// Set while a safety net that finishes the move copies every page
    /// (`--net-finishes`): the push waits.
    pub(crate) net_copies: AtomicBool,
    /// The last requested pages (a ring): while the push's governor holds
    /// it back (the link is full), neighbours go with a requested page
    /// only when it follows one of them (a scan). Random access rarely
    /// wants them then, and they cost the link: a kv VM's answers of 12
    /// pages a fault took most of the lab's 1 Gbit link, outside the
    /// governor, and its faults waited 0.9 ms at the median, not 0.05.
    /// With room on the link they are pages the push would send anyway.
    recent: [AtomicU64; 8],
    recent_at: std::sync::atomic::AtomicUsize,
    pub(crate) cpu: CpuMeter,
    /// `--bandwidth` for the push (demand answers are never held back, but
    /// count against it).
    pacer: Pacer,
    /// The destination reads sealed Pages frames: over a link that seals,
    /// pushed pages go without a checksum, sealed where they lie.
    may_seal: bool,
    /// The push's streams back off while the path queues, so demand
    /// answers do not wait behind them ([`crate::governor`]).
    governor: Option<Governor>,
    /// Each push stream's share of `--bandwidth` (the governor's cap never
    /// lifts it).
    fixed_share: Option<u64>,
}

impl SourcePages {
    pub(crate) fn new(
        regions: Vec<RegionView>,
        pending: &[GpaPages],
        prefetch: u32,
        bandwidth: Option<f64>,
        push_from: Instant,
    ) -> Self {
        let index = PageIndex::new(&regions);
        let unsent = PageSet::of_runs(&index, pending);
        SourcePages {
            hot: PageSet::new(0),
            hot_done: AtomicBool::new(true),
            hot_pages: AtomicU64::new(0),
            regions,
            unsent,
            index,
            prefetch: u64::from(prefetch),
            hint: AtomicU64::new(NO_HINT),
            cursor: Mutex::new((0, NO_HINT)),
            pushed_pages: AtomicU64::new(0),
            pushed_zero_pages: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            demand_pages: AtomicU64::new(0),
            prefetched_pages: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            done: AtomicBool::new(false),
            push_from,
            halt: AtomicBool::new(false),
            net_copies: AtomicBool::new(false),
            recent: std::array::from_fn(|_| AtomicU64::new(NO_HINT)),
            recent_at: std::sync::atomic::AtomicUsize::new(0),
            cpu: CpuMeter::default(),
            pacer: Pacer::new(bandwidth),
            may_seal: false,
            governor: None,
            fixed_share: None,
        }
    }

    /// Has the push's `streams` streams yield the link to demand answers
    /// (always: a fault that waits behind the push costs the guest more than
    /// a slower push), within their share of `bandwidth`.
    pub(crate) fn yielding(mut self, streams: usize, bandwidth: Option<f64>) -> Self {
        self.governor = Some(Governor::for_push(streams));
        self.fixed_share = crate::pacer::stream_share(bandwidth, streams);
        self
    }

    /// Lets the pushers send sealed Pages frames over a link that seals
    /// (`peer_reads_them`: the destination speaks protocol v10 or later).
    pub(crate) fn sealing(mut self, peer_reads_them: bool) -> Self {
        self.may_seal = peer_reads_them;
        self
    }

    /// Pushes first the pending pages that `history` saw used in any of
    /// its recent periods (a history whose shape differs from the regions'
    /// is ignored).
    pub(crate) fn hot_first(mut self, history: Option<&AccessHistory>) -> Self {
        let Some(h) = history else {
            return self;
        };
        if h.aging.len() != self.regions.len() {
            return self;
        }
        let hot = PageSet::new(self.index.total());
        for (r, ages) in self.regions.iter().zip(&h.aging) {
            for (i, &age) in ages.iter().enumerate() {
                let gpa = r.gpa() + i as u64 * crate::ranges::PAGE;
                match self.index.page_of(gpa) {
                    Some(n) if age != 0 && self.unsent.contains(n) => hot.insert(n),
                    _ => {}
                }
            }
        }
        self.hot_done = AtomicBool::new(hot.count() == 0);
        self.hot = hot;
        self
    }

    /// Pending pages not sent yet.
    pub(crate) fn unsent(&self) -> u64 {
        self.unsent.count()
    }

    /// The next batch to push (claimed), empty when everything went out.
    fn next_batch(&self, out: &mut Vec<u64>) {
        out.clear();
        let mut c = self.cursor.lock().unwrap_or_else(|e| e.into_inner());
        let hint = self.hint.load(Ordering::Acquire);
        if hint != c.1 {
            c.1 = hint;
            c.0 = hint;
        }
        while out.len() < PUSH_BATCH {
            // Hot pages first, from where the pusher is (so a scan's next
            // pages still come first), then the rest.
            let hot = if self.hot_done.load(Ordering::Relaxed) {
                None
            } else {
                let h = self.hot.next_from(c.0);
                match h {
                    Some(h) => {
                        self.hot.claim(h);
                    }
                    None => self.hot_done.store(true, Ordering::Relaxed),
                }
                h
            };
            let Some(n) = hot.or_else(|| self.unsent.next_from(c.0)) else {
                break;
            };
            c.0 = n + 1;
            if self.unsent.claim(n) {
                out.push(n);
                if hot.is_some() {
                    self.hot_pages.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// True if a request for page `n` continues a scan: it follows one of
    /// the last few requests (each vCPU may scan on its own), within a
    /// window's width of it as a forward or backward scan's next fault is,
    /// and that one followed another. One page after another alone is a
    /// value that spans two pages, as often as not. Notes `n` as requested.
    fn follows_recent_requests(&self, n: u64) -> bool {
        let reach = 2 * self.prefetch + 1;
        let streak = self
            .recent
            .iter()
            .filter_map(|r| {
                let r = r.load(Ordering::Relaxed);
                let (page, streak) = (r & RECENT_PAGE, r >> RECENT_STREAK_SHIFT);
                (r != NO_HINT && n.abs_diff(page) <= reach).then_some(streak + 1)
            })
            .max()
            .unwrap_or(0)
            .min(RECENT_MAX_STREAK);
        let at = self.recent_at.fetch_add(1, Ordering::Relaxed) % self.recent.len();
        self.recent[at].store(
            (n & RECENT_PAGE) | (streak << RECENT_STREAK_SHIFT),
            Ordering::Relaxed,
        );
        streak >= 2
    }

    /// No safety net copies the pages, and the push's governor does not
    /// hold it back: neighbours sent now are pages the push would send.
    fn link_has_room(&self) -> bool {
        !self.net_copies.load(Ordering::Acquire)
            && !self.governor.as_ref().is_some_and(Governor::capped)
    }

    /// The pages that answer a request for page `n`: `n` itself, then its
    /// unsent neighbours after it and before it (inside its region), if it
    /// continues a scan or the link has room (no safety net copies, the
    /// push not held back).
    fn window(&self, n: u64, out: &mut Vec<u64>) {
        // (A scan needs no look at the governor, whose lock the pushers take.)
        let scan = self.follows_recent_requests(n);
        let prefetch = if scan || self.link_has_room() {
            self.prefetch
        } else {
            0
        };
        out.push(n);
        self.unsent.claim(n);
        let span = self.index.region_span(n);
        for k in 1..=prefetch {
            if n + k < span.end && self.unsent.claim(n + k) {
                out.push(n + k);
            }
        }
        for k in 1..=prefetch {
            if n >= span.start + k && self.unsent.claim(n - k) {
                out.push(n - k);
            }
        }
        self.hint
            .store((n + self.prefetch + 1).min(span.end), Ordering::Release);
    }

    /// Reads pages `pages` (numbers) into `b`, as `how` says.
    fn fill(&self, b: &mut PageBatch, pages: &[u64], how: Fill) {
        b.fill(
            &self.regions,
            pages.iter().map(|&n| self.index.gpa_of(n)),
            how,
        );
        debug_assert_eq!(
            b.pages() + b.zero_pages(),
            pages.len() as u64,
            "page numbers map into guest RAM"
        );
    }

    /// Writes a batch's pages with data as one Pages frame (if any);
    /// returns the frames written.
    fn write_pages(
        &self,
        w: &mut impl protocol::SpendingWrite,
        b: &mut PageBatch,
        sealed: bool,
    ) -> Result<(u64, u64), ProtocolError> {
        let bytes = b.write_pages_spending(w, sealed)?;
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok((u64::from(bytes > 0), bytes))
    }

    /// Pushes pages on one bulk stream until none is left; returns the
    /// frames sent.
    pub(crate) fn push(&self, conn: &mut Conn) -> Result<u64, MigrationError> {
        crate::priority::background();
        // The kernel paces the push's packets at the stream's share of
        // `--bandwidth` (so demand answers, on their own connection, do not
        // queue behind push bursts at the bottleneck) until the governor
        // steers it. Set either way: a hybrid's rounds may have left a
        // `--share-link` cap on this connection.
        conn.writer().pace_packets(self.fixed_share);
        while Instant::now() < self.push_from || self.net_copies.load(Ordering::Acquire) {
            if self.halt.load(Ordering::Acquire) {
                // The demand connection ended first: like a pusher whose
                // socket was shut, this epoch fails (never a barrier
                // for pages no one will send).
                return Err(ProtocolError::Closed.into());
            }
            if self.unsent() == 0 {
                return Ok(0);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(g) = &self.governor {
            // A slow start's first cap, before the first batch; and the
            // governor's first rate window opens now, as the push starts
            // sending. Opened before a hold (`--push-delay`, a net that
            // copies first), it took the hold for time spent sending: a
            // 512 KiB first batch after a 5 s hold read as ~100 KB/s, the
            // cap fell to 89 KB/s, and the rest of the push crawled (a
            // 64 MiB VM's move did not end once its standby failed).
            conn.writer().steer(g, 0, self.fixed_share);
        }
        let cpu0 = crate::stats::thread_cpu_secs();
        let (mut batch, mut b) = (Vec::new(), PageBatch::default());
        let mut frames = 0u64;
        let sealed = self.may_seal && conn.writer_seals();
        let how = if sealed { Fill::SEALED } else { Fill::RAW };
        loop {
            self.next_batch(&mut batch);
            if batch.is_empty() {
                break;
            }
            self.fill(&mut b, &batch, how);
            // Pages first, then the zero runs.
            let (f, mut sent) = self.write_pages(conn.writer(), &mut b, sealed)?;
            frames += f;
            if b.zero_pages() > 0 {
                let bytes = b.write_zeros(conn.writer())?;
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
                sent += bytes;
                frames += 1;
            }
            self.pushed_pages.fetch_add(b.pages(), Ordering::Relaxed);
            self.pushed_zero_pages
                .fetch_add(b.zero_pages(), Ordering::Relaxed);
            self.pacer
                .pace(self.bytes.load(Ordering::Relaxed), conn.writer())
                .map_err(ProtocolError::Io)?;
            if let Some(g) = &self.governor {
                conn.writer().steer(g, sent, self.fixed_share);
            }
        }
        conn.flush()?;
        self.cpu.add(crate::stats::thread_cpu_secs() - cpu0);
        Ok(frames)
    }

    /// Answers page requests on the demand connection until the migration
    /// is done or the destination closes it.
    pub(crate) fn serve_demand(&self, conn: &mut Conn) -> Result<(), MigrationError> {
        crate::priority::fault_path();
        let cpu0 = crate::stats::thread_cpu_secs();
        let (mut window, mut b) = (Vec::new(), PageBatch::default());
        let result = loop {
            let f = match protocol::read_frame(conn.reader()) {
                Ok(f) => f,
                Err(_) if self.done.load(Ordering::Acquire) => break Ok(()),
                Err(ProtocolError::Closed) => break Ok(()),
                Err(e) => break Err(e.into()),
            };
            let gpas: Vec<u64> = protocol::decode(&f, Kind::PageRequest)?;
            for gpa in gpas {
                let n = self.index.page_of(gpa).ok_or(ProtocolError::Malformed {
                    kind: Kind::PageRequest,
                    reason: format!("page {gpa:#x} is not in guest RAM"),
                })?;
                window.clear();
                self.window(n, &mut window);
                // Every page asked for as data, zero or not.
                for part in window.chunks(MAX_BATCH) {
                    self.fill(&mut b, part, Fill::EVERY_PAGE);
                    self.write_pages(conn.writer(), &mut b, false)?;
                }
                self.requests.fetch_add(1, Ordering::Relaxed);
                self.demand_pages
                    .fetch_add(window.len() as u64, Ordering::Relaxed);
                self.prefetched_pages
                    .fetch_add(window.len() as u64 - 1, Ordering::Relaxed);
            }
            conn.flush()?;
        };
        self.cpu.add(crate::stats::thread_cpu_secs() - cpu0);
        result
    }
}

#[cfg(test)]
mod tests;
