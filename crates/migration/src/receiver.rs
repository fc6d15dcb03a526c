//! The destination's bulk streams: one thread per stream reads frames and
//! lands their pages through the [`PageSink`]; a compressed stream gets a
//! decode thread (caches mirrored from the source's encoders). Every frame
//! is checked (magic, length, checksum, addresses) before it lands.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use ferry_codec::StreamDecoder;

use crate::error::MigrationError;
use crate::memory::{range_inside, RegionView};
use crate::protocol::{self, Kind, ProtocolError, PAGE};
use crate::ranges::GpaPages;
use crate::sink::PageSink;
use crate::stats::{thread_cpu_secs, CpuMeter};
use crate::transport::{Closer, ConnReader};

/// What the bulk threads share with the control thread.
pub(crate) struct Received {
    frames: Vec<AtomicU64>,
    failed: Mutex<Option<(u16, MigrationError)>>,
    changed: Condvar,
    lock: Mutex<()>,
    stop: AtomicBool,
    /// Pages landed, and zero pages.
    pub(crate) pages: AtomicU64,
    pub(crate) zero_pages: AtomicU64,
    /// CPU seconds of the bulk threads.
    pub(crate) cpu: CpuMeter,
    /// The streams' sockets, to cut them when the link broke.
    socks: Mutex<Vec<Closer>>,
    /// This host's other VMs' pages that references name (v14), until the
    /// copy rounds end.
    shared: Mutex<Option<std::sync::Arc<crate::shared::SiblingIndex>>>,
    /// Pages landed by reference, and references that missed (v14).
    pub(crate) shared_landed: AtomicU64,
    pub(crate) shared_missed: AtomicU64,
    /// Pages referenced that did not resolve, since the last round.
    pub(crate) missed: Mutex<Vec<u64>>,
}

impl Received {
    pub(crate) fn new(streams: usize) -> Self {
        Received {
            frames: (0..streams).map(|_| AtomicU64::new(0)).collect(),
            failed: Mutex::new(None),
            changed: Condvar::new(),
            lock: Mutex::new(()),
            stop: AtomicBool::new(false),
            pages: AtomicU64::new(0),
            zero_pages: AtomicU64::new(0),
            cpu: CpuMeter::default(),
            socks: Mutex::new(Vec::new()),
            shared: Mutex::new(None),
            shared_landed: AtomicU64::new(0),
            shared_missed: AtomicU64::new(0),
            missed: Mutex::new(Vec::new()),
        }
    }

    /// Resolves SharedPages references against `index` (v14).
    pub(crate) fn sharing(
        mut self,
        index: Option<std::sync::Arc<crate::shared::SiblingIndex>>,
    ) -> Self {
        self.shared = Mutex::new(index);
        self
    }

    /// The copy rounds are over (no reference may come any more): lets go
    /// of the other VMs' memory, which a VM that exited meanwhile would
    /// otherwise keep allocated through a postcopy phase.
    pub(crate) fn stop_sharing(&self) {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// The pages referenced that did not resolve since the last call, as
    /// runs (after a round's barrier: the source sends them again).
    pub(crate) fn take_missed(&self) -> Vec<GpaPages> {
        let mut gpas = std::mem::take(&mut *self.missed.lock().unwrap_or_else(|e| e.into_inner()));
        gpas.sort_unstable();
        gpas.dedup();
        let mut runs = Vec::new();
        for gpa in gpas {
            crate::ranges::push_page(&mut runs, gpa);
        }
        runs
    }

    /// Keeps a handle on a stream's socket for [`Received::cut`].
    pub(crate) fn hold(&self, s: Closer) {
        self.socks.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }

    /// Shuts every held stream down: a thread blocked reading a silent
    /// peer ends now instead of at its timeout.
    pub(crate) fn cut(&self) {
        self.stop();
        for s in self.socks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            s.shutdown();
        }
    }

    pub(crate) fn streams(&self) -> usize {
        self.frames.len()
    }

    fn wake(&self) {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }

    /// Records a stream's failure (the first one wins) and wakes the barrier.
    pub(crate) fn fail(&self, stream: usize, e: MigrationError) {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some((stream as u16, e));
        }
        drop(f);
        self.wake();
    }

    /// The failure of a stream, if one failed: the real cause of most
    /// errors the control connection sees.
    pub(crate) fn take_failure(&self) -> Option<MigrationError> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|(stream, e)| MigrationError::Stream {
                stream,
                source: Box::new(e),
            })
    }

    /// Tells the bulk threads to end.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// A count that grows while any bulk stream applies frames: while it
    /// does, the source is sending, even if the control connection says
    /// nothing for a long round.
    pub(crate) fn progress(&self) -> u64 {
        self.pages.load(Ordering::Relaxed)
            + self.zero_pages.load(Ordering::Relaxed)
            + self
                .frames
                .iter()
                .map(|f| f.load(Ordering::Relaxed))
                .sum::<u64>()
    }

    /// Counts a frame as applied and wakes the control thread's barrier.
    fn applied(&self, idx: usize, cpu_mark: &mut f64) {
        // CPU is counted per frame: the Started report goes out before these
        // threads end.
        let now = thread_cpu_secs();
        self.cpu.add(now - *cpu_mark);
        *cpu_mark = now;
        self.frames[idx].fetch_add(1, Ordering::Release);
        self.wake();
    }

    /// Waits until every stream has applied `want[i]` frames of this round,
    /// then starts counting the next one.
    pub(crate) fn barrier(&self, want: &[u64], timeout: Duration) -> Result<(), MigrationError> {
        let deadline = Instant::now() + timeout;
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = self.take_failure() {
                return Err(e);
            }
            let done = self
                .frames
                .iter()
                .zip(want)
                .all(|(a, w)| a.load(Ordering::Acquire) >= *w);
            if done {
                break;
            }
            if Instant::now() >= deadline {
                return Err(ProtocolError::Io(std::io::ErrorKind::TimedOut.into()).into());
            }
            g = self
                .changed
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(g);
        for f in &self.frames {
            f.store(0, Ordering::Release);
        }
        Ok(())
    }
}

pub(crate) fn zero_ranges(
    regions: &[RegionView],
    sink: &dyn PageSink,
    body: &[u8],
    rx: &Received,
) -> Result<(), MigrationError> {
    let ranges: Vec<GpaPages> =
        postcard::from_bytes(body).map_err(|e| ProtocolError::Malformed {
            kind: Kind::ZeroRanges,
            reason: e.to_string(),
        })?;
    for run in ranges {
        if !range_inside(regions, run.gpa, run.pages) {
            return Err(ProtocolError::Malformed {
                kind: Kind::ZeroRanges,
                reason: format!(
                    "range {:#x}+{} pages is not in guest RAM",
                    run.gpa, run.pages
                ),
            }
            .into());
        }
        sink.zero(run)?;
        rx.zero_pages.fetch_add(run.pages, Ordering::Relaxed);
    }
    Ok(())
}

/// The decode stage of a compressed stream: decodes each Encoded body with
/// its shard's decoder and lands the pages; buffers go back to the reader.
pub(crate) fn decode_loop(
    regions: &[RegionView],
    sink: &dyn PageSink,
    bodies: Receiver<Vec<u8>>,
    back: Sender<Vec<u8>>,
    mut decoders: Vec<StreamDecoder>,
    idx: usize,
    rx: &Received,
) -> Result<(), MigrationError> {
    let mut cpu_mark = thread_cpu_secs();
    let mut out = Vec::new();
    let bad = |reason: String| ProtocolError::Malformed {
        kind: Kind::Encoded,
        reason,
    };
    for body in bodies {
        let f = crate::encoded::parse_encoded(&body)?;
        let shards = decoders.len();
        let dec = decoders
            .get_mut(f.shard as usize)
            .ok_or_else(|| bad(format!("shard {} of {shards}", f.shard)))?;
        let mut pages = Vec::with_capacity(f.gpas.len());
        for &gpa in &f.gpas {
            if gpa % PAGE as u64 != 0 || !regions.iter().any(|r| r.contains(gpa)) {
                return Err(bad(format!("page address {gpa:#x} is not in guest RAM")).into());
            }
            pages.push(gpa / PAGE as u64);
        }
        out.resize(pages.len() * PAGE, 0);
        dec.decode(f.method, &pages, &f.codecs, &f.lens, f.payload, &mut out)
            .map_err(|e| bad(e.to_string()))?;
        let mut i = 0;
        while i < f.gpas.len() {
            let mut n = 1;
            while i + n < f.gpas.len() && f.gpas[i + n] == f.gpas[i] + (n * PAGE) as u64 {
                n += 1;
            }
            sink.write(
                GpaPages::new(f.gpas[i], n as u64),
                &out[i * PAGE..(i + n) * PAGE],
            )?;
            i += n;
        }
        rx.pages.fetch_add(f.gpas.len() as u64, Ordering::Relaxed);
        rx.applied(idx, &mut cpu_mark);
        let _ = back.send(body);
    }
    Ok(())
}

/// Receives one bulk stream until it closes or the session stops.
pub(crate) fn bulk_loop(
    regions: &[RegionView],
    sink: &dyn PageSink,
    mut r: ConnReader,
    idx: usize,
    rx: &Received,
) -> Result<(), MigrationError> {
    let (mut body, mut data) = (Vec::new(), Vec::new());
    let mut cpu_mark = thread_cpu_secs();
    // Compressed streams get a decode thread; Encoded bodies travel to it
    // through three buffers and come back empty.
    let (back_tx, back_rx) = channel::<Vec<u8>>();
    std::thread::scope(|sc| {
        let mut decode: Option<(SyncSender<Vec<u8>>, _)> = None;
        let mut first = true;
        let result = loop {
            if rx.stop.load(Ordering::Acquire) {
                break Ok(());
            }
            let h = match protocol::read_header(&mut r) {
                Err(ProtocolError::Closed) => break Ok(()),
                Err(ProtocolError::Io(_)) if rx.stop.load(Ordering::Acquire) => break Ok(()),
                Err(e) => break Err(e.into()),
                Ok(h) => h,
            };
            let step = (|| -> Result<bool, MigrationError> {
                match h.kind {
                    Kind::Pages => {
                        let n = crate::pagein::read_pages(
                            &mut r, &h, regions, sink, &mut body, &mut data,
                        )?;
                        rx.pages.fetch_add(n, Ordering::Relaxed);
                    }
                    Kind::ZeroRanges => {
                        protocol::read_body_into(&mut r, &h, &mut body)?;
                        zero_ranges(regions, sink, &body, rx)?;
                    }
                    Kind::SharedPages => {
                        protocol::read_body_into(&mut r, &h, &mut body)?;
                        let index = rx.shared.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        let (n, misses) = crate::shared::land_refs(
                            regions,
                            sink,
                            &body,
                            index.as_deref(),
                            &rx.missed,
                        )?;
                        rx.pages.fetch_add(n, Ordering::Relaxed);
                        rx.shared_landed.fetch_add(n, Ordering::Relaxed);
                        rx.shared_missed.fetch_add(misses, Ordering::Relaxed);
                    }
                    Kind::Codec if first => {
                        protocol::read_body_into(&mut r, &h, &mut body)?;
                        let setup: crate::encoded::CodecSetup = postcard::from_bytes(&body)
                            .map_err(|e| ProtocolError::Malformed {
                                kind: Kind::Codec,
                                reason: e.to_string(),
                            })?;
                        let caches = setup.check()?;
                        let decoders = (0..setup.shards)
                            .map(|_| StreamDecoder::new(caches))
                            .collect();
                        let (tx, bodies) = sync_channel::<Vec<u8>>(3);
                        let back = back_tx.clone();
                        let handle = sc.spawn(move || {
                            let res = decode_loop(regions, sink, bodies, back, decoders, idx, rx);
                            if let Err(e) = res {
                                // Tell the control thread now: the reading
                                // thread may be waiting for a frame that the
                                // source will not send before its RoundAck.
                                rx.fail(idx, e);
                            }
                        });
                        decode = Some((tx, handle));
                        return Ok(false);
                    }
                    Kind::Encoded => {
                        let Some((tx, _)) = &decode else {
                            return Err(ProtocolError::Unexpected {
                                got: Kind::Encoded,
                                want: "a Codec frame first",
                            }
                            .into());
                        };
                        let mut buf = back_rx.try_recv().unwrap_or_default();
                        protocol::read_body_into(&mut r, &h, &mut buf)?;
                        if tx.send(buf).is_err() {
                            // The decoder stopped: its error is already recorded.
                            return Err(ProtocolError::Closed.into());
                        }
                        return Ok(false);
                    }
                    k => {
                        return Err(ProtocolError::Unexpected {
                            got: k,
                            want: "Pages, ZeroRanges, SharedPages or Encoded on a bulk stream",
                        }
                        .into())
                    }
                }
                Ok(true)
            })();
            first = false;
            match step {
                Ok(true) => rx.applied(idx, &mut cpu_mark),
                Ok(false) => {}
                Err(e) => break Err(e),
            }
        };
        if let Some((tx, handle)) = decode {
            drop(tx);
            let _ = handle.join();
        }
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_ranges_from_the_wire_must_lie_inside_one_region() {
        let p = PAGE as u64;
        // SAFETY: only the views' address ranges are used, never their memory.
        let regions = unsafe {
            [
                RegionView::new(0, 16 * p, std::ptr::null_mut()),
                RegionView::new(0x1_0000_0000, 4 * p, std::ptr::null_mut()),
            ]
        };
        assert!(range_inside(&regions, 0, 16));
        assert!(range_inside(&regions, 0x1_0000_0000 + p, 3));
        assert!(!range_inside(&regions, 0, 17), "past the end");
        assert!(
            !range_inside(&regions, 15 * p, 2),
            "into the next region's gap"
        );
        assert!(!range_inside(&regions, 8, 1), "unaligned");
        assert!(!range_inside(&regions, 16 * p, 1), "in the gap");
        assert!(!range_inside(&regions, p, (1 << 52) - 1), "wraps around");
        assert!(!range_inside(&regions, p, u64::MAX), "overflows");
    }
}
