//! The destination's account of postcopy: which pages are still missing,
//! every fault on them and how long it waited, and (with verification) the
//! hash of each page as it landed.
//!
//! A fault is read from userfaultfd with the faulting thread's id; it stays
//! "outstanding" until its page lands, whichever connection brings it. The
//! thread id says who waited: a vCPU thread (the vCPU blocked), a KVM
//! async-page-fault worker (a kernel thread: the guest parked one task and
//! ran another) or one of the VMM's own threads. Who is who is decided at the
//! end, when the vCPU threads are known.
//!
//! This is the account only: the fault thread that reads the faults and
//! acts on them is `destination/fault_thread.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::pages::{PageIndex, PageSet};
use crate::ranges::GpaPages;
use crate::sink::LandObserver;
use crate::stats::{FaultBin, FaultReport, Latency};

/// How a fault was resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// Waited for a page from the source.
    Major,
    /// Its page had already landed.
    Minor,
    /// Memory the source has no data in: zeros, filled here.
    Zero,
    /// Another fault on a page already waited for.
    Duplicate,
}

/// One fault.
#[derive(Clone, Copy, Debug)]
struct Record {
    /// Microseconds after the VM started.
    at_us: u64,
    tid: u32,
    kind: FaultKind,
    /// Fault read to page landed (0 for minor and zero faults).
    service_us: u64,
}

struct Waiting {
    at: Instant,
    tid: u32,
    kind: FaultKind,
}

#[derive(Default)]
struct Book {
    /// Faults waiting for their page, by page number.
    outstanding: HashMap<u64, Vec<Waiting>>,
    records: Vec<Record>,
}

/// What the fault thread should do after [`Tracker::fault`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Ask the source for the page.
    Request,
    /// Nothing: the page is on its way (or was asked for already).
    Wait,
    /// Wake the thread: the page is here.
    Wake,
}

/// Shared by the fault thread and every landing path.
pub(crate) struct Tracker {
    t0: Instant,
    index: PageIndex,
    /// Pages the plan said would come (static).
    planned: PageSet,
    /// Planned pages not landed yet.
    missing: PageSet,
    /// Planned pages already asked for.
    requested: PageSet,
    book: Mutex<Book>,
    /// Per page, the hash of what landed (verification only).
    hashes: Option<Vec<AtomicU64>>,
    /// The hash of a zero page (what a zero range lands as).
    zero_hash: u64,
}

impl Tracker {
    /// Tracks `planned` pages; with `hashes`, starts from those of the
    /// memory already here (each planned page's entry is replaced when it lands).
    pub(crate) fn new(index: PageIndex, planned: &[GpaPages], hashes: Option<Vec<u64>>) -> Self {
        Tracker {
            t0: Instant::now(),
            planned: PageSet::of_runs(&index, planned),
            missing: PageSet::of_runs(&index, planned),
            requested: PageSet::new(index.total()),
            index,
            book: Mutex::new(Book::default()),
            hashes: hashes.map(|h| h.into_iter().map(AtomicU64::new).collect()),
            zero_hash: crate::protocol::page_hash(&[0u8; crate::protocol::PAGE]),
        }
    }

    pub(crate) fn index(&self) -> &PageIndex {
        &self.index
    }

    /// Planned pages that have not landed.
    pub(crate) fn missing(&self) -> u64 {
        self.missing.count()
    }

    /// The missing pages as runs (for an error report).
    pub(crate) fn missing_runs(&self) -> Vec<GpaPages> {
        self.missing.runs(&self.index)
    }

    /// Guest addresses of the pages faults wait for (asked for again after
    /// a broken link: the answer may have been lost with it).
    pub(crate) fn waiting_pages(&self) -> Vec<u64> {
        let book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<u64> = book
            .outstanding
            .keys()
            .map(|&n| self.index.gpa_of(n))
            .collect();
        v.sort_unstable();
        v
    }

    /// True if page `n` was planned (will come from the source).
    pub(crate) fn planned(&self, n: u64) -> bool {
        self.planned.contains(n)
    }

    /// Records a fault by thread `tid` on planned page `n`; `claimed` says
    /// whether a landing of it has begun. Says what to do.
    pub(crate) fn fault(&self, n: u64, tid: u32, claimed: bool) -> Action {
        let now = Instant::now();
        let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        if !self.missing.contains(n) {
            book.records.push(Record {
                at_us: self.us(now),
                tid,
                kind: FaultKind::Minor,
                service_us: 0,
            });
            return Action::Wake;
        }
        let waiting = book.outstanding.entry(n).or_default();
        let kind = if waiting.is_empty() {
            FaultKind::Major
        } else {
            FaultKind::Duplicate
        };
        waiting.push(Waiting { at: now, tid, kind });
        drop(book);
        if !claimed && !self.requested.contains(n) {
            self.requested.insert(n);
            return Action::Request;
        }
        Action::Wait
    }

    /// Records a fault on memory the source has no data in (filled here).
    pub(crate) fn zero_fault(&self, tid: u32) {
        let at_us = self.us(Instant::now());
        let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        book.records.push(Record {
            at_us,
            tid,
            kind: FaultKind::Zero,
            service_us: 0,
        });
    }

    fn us(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.t0).as_micros() as u64
    }

    /// Pages landed: they are no longer missing, and whoever waited for
    /// them was woken now.
    fn landed(&self, run: GpaPages, data: Option<&[u8]>) {
        let now = Instant::now();
        let first = self.index.page_of(run.gpa);
        let Some(first) = first else { return };
        if let Some(h) = &self.hashes {
            for k in 0..run.pages {
                let v = match data {
                    Some(d) => crate::protocol::page_hash(
                        &d[k as usize * crate::protocol::PAGE..][..crate::protocol::PAGE],
                    ),
                    None => self.zero_hash,
                };
                if let Some(slot) = h.get((first + k) as usize) {
                    slot.store(v, Ordering::Relaxed);
                }
            }
        }
        let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        for n in first..first + run.pages {
            self.missing.claim(n);
            if let Some(waiting) = book.outstanding.remove(&n) {
                for w in waiting {
                    let at_us = self.us(w.at);
                    book.records.push(Record {
                        at_us,
                        tid: w.tid,
                        kind: w.kind,
                        service_us: now.saturating_duration_since(w.at).as_micros() as u64,
                    });
                }
            }
        }
    }

    /// The landed memory's hashes (verification).
    pub(crate) fn hashes(&self) -> Option<Vec<u64>> {
        self.hashes
            .as_ref()
            .map(|h| h.iter().map(|a| a.load(Ordering::Relaxed)).collect())
    }

    /// The report: faults by kind and by who took them, latencies, and the
    /// 100 ms series. `vcpu_tids[i]` is vCPU i's thread; `own` tells the
    /// VMM's other threads.
    /// `absorbed`: the guest's count of faults it absorbed over the phase.
    pub(crate) fn report(
        &self,
        vcpu_tids: &[u32],
        own: &dyn Fn(u32) -> bool,
        absorbed: Option<u64>,
    ) -> FaultReport {
        let book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        let mut r = FaultReport::default();
        const BIN_US: u64 = 100_000;
        let end_us = self.us(Instant::now());
        let bins = (end_us / BIN_US + 1) as usize;
        let vcpus = vcpu_tids.len().max(1);
        let mut series: Vec<FaultBin> = (0..bins)
            .map(|i| FaultBin {
                t_ms: i as u64 * 100,
                blocked_ms: vec![0.0; vcpu_tids.len()],
                ..Default::default()
            })
            .collect();
        let mut lat = Vec::new();
        for rec in &book.records {
            r.faults += 1;
            let bin = &mut series[((rec.at_us / BIN_US) as usize).min(bins - 1)];
            match rec.kind {
                FaultKind::Major => {
                    r.major += 1;
                    bin.major += 1;
                    lat.push(rec.service_us as f64);
                }
                FaultKind::Minor => {
                    r.minor += 1;
                    bin.minor += 1;
                }
                FaultKind::Zero => {
                    r.zero += 1;
                    bin.zero += 1;
                }
                FaultKind::Duplicate => r.duplicate += 1,
            }
            if let Some(v) = vcpu_tids.iter().position(|&t| t == rec.tid) {
                r.vcpu_thread += 1;
                // Spread the wait over the bins it covers.
                let (mut at, end) = (rec.at_us, rec.at_us + rec.service_us);
                while at < end {
                    let b = ((at / BIN_US) as usize).min(bins - 1);
                    let bin_end = (at / BIN_US + 1) * BIN_US;
                    let part = end.min(bin_end) - at;
                    series[b].blocked_ms[v] += part as f64 / 1e3;
                    at = end.min(bin_end);
                    if b == bins - 1 {
                        break;
                    }
                }
            } else if own(rec.tid) {
                r.host += 1;
            } else {
                r.async_worker += 1;
                bin.async_worker += 1;
            }
        }
        for bin in &mut series {
            let blocked: f64 = bin.blocked_ms.iter().map(|m| m.min(100.0)).sum();
            bin.exec_ratio = 1.0 - blocked / (100.0 * vcpus as f64);
        }
        r.apf_absorbed = absorbed.map(|a| a.min(r.async_worker));
        r.blocked = r.vcpu_thread + r.async_worker - r.apf_absorbed.unwrap_or(0);
        r.histogram = histogram(&lat);
        r.latency_us = Latency::of(lat);
        r.series = series;
        r
    }
}

/// Power-of-two buckets: (upper bound µs, count), up to the largest used.
fn histogram(samples: &[f64]) -> Vec<(u64, u64)> {
    let mut counts: Vec<(u64, u64)> = Vec::new();
    for &s in samples {
        let mut upper = 1u64;
        while (upper as f64) < s {
            upper *= 2;
        }
        match counts.iter_mut().find(|(u, _)| *u == upper) {
            Some(c) => c.1 += 1,
            None => counts.push((upper, 1)),
        }
    }
    counts.sort_unstable();
    counts
}

impl LandObserver for Tracker {
    fn supplied(&self, run: GpaPages, data: Option<&[u8]>) {
        self.landed(run, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionView;
    use crate::ranges::PAGE;

    #[test]
    fn faults_wait_until_their_page_lands_and_are_told_apart_by_thread() {
        // SAFETY: only the view's address range is used, never its memory.
        let regions = [unsafe { RegionView::new(0, 64 * PAGE, std::ptr::null_mut()) }];
        let t = Tracker::new(
            PageIndex::new(&regions),
            &[GpaPages::new(0, 32)],
            Some(vec![0; 64]),
        );
        assert_eq!(t.missing(), 32);
        // vCPU thread 100 faults on page 3: ask for it.
        assert_eq!(t.fault(3, 100, false), Action::Request);
        // An APF worker (tid 7) faults on the same page: already asked.
        assert_eq!(t.fault(3, 7, false), Action::Wait);
        // A fault on a page whose landing began: nothing to ask.
        assert_eq!(t.fault(5, 100, true), Action::Wait);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.supplied(
            GpaPages::new(3 * PAGE, 3),
            Some(&vec![1u8; 3 * PAGE as usize]),
        );
        assert_eq!(t.missing(), 29);
        // Landed already: a minor fault.
        assert_eq!(t.fault(4, 100, true), Action::Wake);
        t.zero_fault(100);
        let r = t.report(&[100], &|tid| tid == 55, Some(1));
        assert_eq!(
            (r.faults, r.major, r.duplicate, r.minor, r.zero),
            (5, 2, 1, 1, 1)
        );
        assert_eq!((r.vcpu_thread, r.async_worker, r.host), (4, 1, 0));
        assert_eq!((r.apf_absorbed, r.blocked), (Some(1), 4));
        let r2 = t.report(&[100], &|_| false, Some(0));
        assert_eq!(r2.blocked, 5, "an unabsorbed async fault halted its vCPU");
        assert_eq!(r.latency_us.count, 2);
        assert!(r.latency_us.p50 >= 2000.0, "{:?}", r.latency_us);
        assert!(r.series[0].exec_ratio < 1.0 && r.series[0].blocked_ms[0] >= 4.0);
        let h = t.hashes().unwrap();
        assert_eq!(h[3], crate::protocol::page_hash(&[1u8; 4096]));
        assert_eq!(h[0], 0, "not landed: the starting value");
        assert_eq!(
            histogram(&[3.0, 4.0, 5.0, 1000.0]),
            vec![(4, 2), (8, 1), (1024, 1)]
        );
    }
}
