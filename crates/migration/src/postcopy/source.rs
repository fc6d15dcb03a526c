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
mod tests {
    use super::*;
    use crate::protocol::PAGE;
    use crate::transport::{tls_pair, Stream};

    /// Pushes 301 pages (one of them zero) over `(a, b)`; (sealed,
    /// checksum holds) for each Pages frame read at `b`, whose pages must
    /// hold what the source had.
    fn pushed_frames(a: Stream, b: Stream, may_seal: bool) -> Vec<(bool, bool)> {
        let t = Some(Duration::from_secs(5));
        let mut conn = Conn::new(a, t).unwrap();
        let mut peer = Conn::new(b, t).unwrap();
        let byte_of = |i: usize| {
            if i / PAGE == 7 {
                0
            } else {
                (i % 241) as u8 | 1
            }
        };
        let reader = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while let Ok(h) = protocol::read_header(peer.reader()) {
                let mut body = vec![0u8; h.len as usize];
                std::io::Read::read_exact(peer.reader(), &mut body).unwrap();
                if h.kind == Kind::Pages {
                    seen.push((h.sealed, crate::checksum::crc32c(&body) == h.crc));
                    let (gpas, data) = protocol::decode_pages(&body).unwrap();
                    for (gpa, page) in gpas.iter().zip(data.chunks_exact(PAGE)) {
                        let at = *gpa as usize;
                        let want: Vec<u8> = (at..at + PAGE).map(byte_of).collect();
                        assert!(page == &want[..], "page {gpa:#x} arrived changed");
                    }
                }
            }
            seen
        });
        let n = 301u64;
        let mut mem: Vec<u8> = (0..n as usize * PAGE).map(byte_of).collect();
        // SAFETY: `mem` outlives the push and nothing else touches it.
        let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
        let out = SourcePages::new(regions, &[GpaPages::new(0, n)], 0, None, Instant::now())
            .sealing(may_seal);
        out.push(&mut conn).unwrap();
        assert_eq!(out.pushed_pages.load(Ordering::Relaxed), n - 1);
        assert_eq!(out.pushed_zero_pages.load(Ordering::Relaxed), 1);
        drop(conn);
        reader.join().unwrap()
    }

    #[test]
    fn a_held_push_measures_its_rate_from_when_it_starts_sending() {
        // A push held for a while (a net copying first, `--push-delay`)
        // sends one batch once released: its governor measures that batch
        // over the time it took to send, not over the hold (which read as
        // a crawl, and capped the rest of the push to it).
        let n = 128u64;
        let mut mem = vec![1u8; n as usize * PAGE];
        // SAFETY: `mem` outlives the push and nothing else touches it.
        let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
        let out = SourcePages::new(regions, &[GpaPages::new(0, n)], 0, None, Instant::now())
            .yielding(1, None);
        out.net_copies.store(true, Ordering::Release);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let drain = std::thread::spawn(move || {
            std::io::copy(&mut b, &mut std::io::sink()).unwrap();
        });
        let mut conn = Conn::new(Stream::tcp(a), Some(Duration::from_secs(5))).unwrap();
        let hold = Duration::from_secs(2);
        std::thread::scope(|sc| {
            let pusher = sc.spawn(|| out.push(&mut conn));
            std::thread::sleep(hold);
            out.net_copies.store(false, Ordering::Release);
            pusher.join().unwrap().unwrap();
        });
        drop(conn);
        drain.join().unwrap();
        assert_eq!(out.pushed_pages.load(Ordering::Relaxed), n);
        let best = out.governor.as_ref().unwrap().best_rate();
        let over_the_hold = (n as usize * PAGE) as f64 / hold.as_secs_f64();
        // No rate window closed yet (0), or one over the sending alone.
        assert!(
            best == 0.0 || best > 4.0 * over_the_hold,
            "{best} B/s: the hold ({over_the_hold} B/s) was taken for sending time"
        );
        drop(mem);
    }

    #[test]
    fn neighbours_go_only_with_requests_that_look_sequential() {
        let n = 4096u64;
        let mut mem = vec![0u8; n as usize * PAGE];
        // SAFETY: `mem` outlives `out` and nothing else touches it.
        let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
        let pending = [GpaPages::new(0, n)];
        // With room on the link (no governor holding the push back): every
        // request takes its ±8 unsent neighbours.
        let room = SourcePages::new(regions.clone(), &pending, 8, None, Instant::now());
        let mut w = Vec::new();
        room.window(2000, &mut w);
        w.sort_unstable();
        assert_eq!(w, (1992..=2008).collect::<Vec<_>>());
        // The link full: the push's governor caps it (a slow start does).
        let mut out = SourcePages::new(regions, &pending, 8, None, Instant::now());
        let g = Governor::for_push(1);
        let path = crate::governor::PathSample {
            srtt_us: 100,
            rttvar_us: 5,
            min_rtt_us: 100,
            receiver_limited: false,
            to_loopback: false,
        };
        g.observe(path, 0, Instant::now());
        assert!(g.capped());
        out.governor = Some(g);
        let window = |p: u64| {
            let mut w = Vec::new();
            out.window(p, &mut w);
            w.sort_unstable();
            w
        };
        // Requests far from the last few: alone.
        assert_eq!(window(2000), vec![2000]);
        assert_eq!(window(100), vec![100]);
        assert_eq!(window(3000), vec![3000]);
        // The page after one: alone still (a value across two pages).
        assert_eq!(window(101), vec![101]);
        assert_eq!(window(2999), vec![2999]);
        // The third of a scan (either way): with its unsent neighbours.
        assert_eq!(
            window(102),
            (94..=110)
                .filter(|&p| p != 100 && p != 101)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            window(2998),
            (2990..=3006)
                .filter(|&p| p != 2999 && p != 3000)
                .collect::<Vec<_>>()
        );
        // And on: the scan's next fault is past the window sent.
        assert_eq!(window(111), (111..=119).collect::<Vec<_>>());
        // Random again: alone; and next to a lone request, alone.
        assert_eq!(window(1500), vec![1500]);
        assert_eq!(window(2001), vec![2001]);
        drop((room, out));
        drop(mem);
    }

    #[test]
    fn pushed_pages_go_sealed_over_a_link_that_seals_to_a_peer_that_reads_them() {
        let dir = std::env::temp_dir().join(format!("ferry-push-{}", std::process::id()));
        let (a, b) = tls_pair(&dir);
        let tls = pushed_frames(a, b, true);
        assert!(
            !tls.is_empty() && tls.iter().all(|&(sealed, _)| sealed),
            "{tls:?}"
        );
        let (a, b) = tls_pair(&dir);
        let old_peer = pushed_frames(a, b, false);
        assert!(
            !old_peer.is_empty() && old_peer.iter().all(|&f| f == (false, true)),
            "{old_peer:?}"
        );
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let plain = pushed_frames(Stream::unix(a), Stream::unix(b), true);
        assert!(
            !plain.is_empty() && plain.iter().all(|&f| f == (false, true)),
            "{plain:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn pages_used_lately_are_pushed_before_the_rest() {
        let n = 1024u64;
        let mut mem = vec![0u8; n as usize * PAGE];
        // SAFETY: `mem` outlives `out` and nothing else touches it.
        let regions = vec![unsafe { RegionView::new(0, mem.len() as u64, mem.as_mut_ptr()) }];
        // Pages 500.. 700 seen used (one period ago or eight), 600 already
        // sent at the switch (not pending), the rest never.
        let mut aging = vec![0u8; n as usize];
        for (p, age) in aging.iter_mut().enumerate().take(700).skip(500) {
            *age = if p % 2 == 0 { 0x80 } else { 0x01 };
        }
        let history = AccessHistory {
            clock: vec![vec![0; n as usize]],
            aging: vec![aging],
            periods: 8,
        };
        let pending = [
            GpaPages::new(0, 600),
            GpaPages::new(601 * PAGE as u64, n - 601),
        ];
        let out = SourcePages::new(regions.clone(), &pending, 0, None, Instant::now())
            .hot_first(Some(&history));
        let mut order = Vec::new();
        let mut batch = Vec::new();
        loop {
            out.next_batch(&mut batch);
            if batch.is_empty() {
                break;
            }
            order.extend_from_slice(&batch);
        }
        assert_eq!(order.len() as u64, n - 1, "every pending page once");
        let hot: Vec<u64> = (500..700).filter(|&p| p != 600).collect();
        assert_eq!(order[..hot.len()], hot[..], "the hot pages first");
        assert_eq!(out.hot_pages.load(Ordering::Relaxed), hot.len() as u64);
        // A fault's hint moves the pushers, inside the hot pages too.
        let out = SourcePages::new(regions.clone(), &pending, 0, None, Instant::now())
            .hot_first(Some(&history));
        out.hint.store(650, Ordering::Release);
        out.next_batch(&mut batch);
        assert_eq!(batch[..3], [650, 651, 652]);
        // No history, or one of another shape: address order.
        let other = AccessHistory {
            aging: vec![],
            ..history.clone()
        };
        for h in [None, Some(&other)] {
            let out =
                SourcePages::new(regions.clone(), &pending, 0, None, Instant::now()).hot_first(h);
            out.next_batch(&mut batch);
            assert_eq!(batch[..3], [0, 1, 2]);
        }
        drop(mem);
    }
}
