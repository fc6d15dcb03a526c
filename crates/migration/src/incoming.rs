//! The receiving side: accepts one migration session on a listener, writes
//! pages into the waiting VM, restores its state and starts it.
//!
//! The incoming stream is treated as hostile: every frame is checked (magic,
//! length limit, checksum), every page address must lie in guest RAM, and the
//! VM is started only after Complete. Any failure before that returns an
//! error with the VM never started.

use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex};

use ferry_codec::StreamDecoder;
use std::time::{Duration, Instant};

use crate::protocol::{self, Hello, Kind, Layout, ProtocolError, Role, RoundDone, PAGE};
use crate::vm::{IncomingVm, RegionView};
use crate::MigrationError;

/// What the destination saw.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct IncomingStats {
    /// Pages written.
    pub pages: u64,
    /// Zero pages.
    pub zero_pages: u64,
    /// Rounds.
    pub rounds: u32,
    /// Pages verified (0 without verification).
    pub verified_pages: u64,
    /// Complete received to vCPUs started (ms).
    pub restore_ms: f64,
}

fn accept(
    listener: &TcpListener,
    timeout: Duration,
) -> Result<(BufReader<TcpStream>, TcpStream), MigrationError> {
    listener.set_nonblocking(true).map_err(ProtocolError::Io)?;
    let deadline = Instant::now() + timeout;
    let s = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(ProtocolError::Io(e).into()),
        }
    };
    s.set_nonblocking(false).map_err(ProtocolError::Io)?;
    s.set_nodelay(true).map_err(ProtocolError::Io)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ProtocolError::Io)?;
    let w = s.try_clone().map_err(ProtocolError::Io)?;
    Ok((BufReader::with_capacity(64 << 10, s), w))
}

struct Progress {
    frames: Vec<AtomicU64>,
    failed: Mutex<Option<String>>,
    changed: Condvar,
    lock: Mutex<()>,
    stop: AtomicBool,
    pages: AtomicU64,
    zero_pages: AtomicU64,
    /// Pages that may hold data: zero ranges only clear these.
    maybe: crate::written::MaybeNonZero,
    /// CPU seconds of the bulk threads, and the control thread's start value.
    cpu: crate::stats::CpuMeter,
    ctl_cpu0: f64,
}

/// Counts a frame as applied and wakes the control thread's barrier.
fn applied(p: &Progress, idx: usize, cpu_mark: &mut f64) {
    // CPU is counted per frame: the Started report goes out before these
    // threads end.
    let now = crate::stats::thread_cpu_secs();
    p.cpu.add(now - *cpu_mark);
    *cpu_mark = now;
    p.frames[idx].fetch_add(1, Ordering::Release);
    let _g = p.lock.lock().unwrap_or_else(|e| e.into_inner());
    p.changed.notify_all();
}

/// True if `n` pages from `gpa` are whole pages inside one region (checked
/// arithmetic: the range comes from the wire).
fn zero_range_inside(regions: &[RegionView], gpa: u64, n: u64) -> bool {
    gpa.is_multiple_of(PAGE as u64)
        && n.checked_mul(PAGE as u64).is_some_and(|l| {
            regions.iter().any(|r| {
                r.contains(gpa) && (gpa - r.gpa).checked_add(l).is_some_and(|e| e <= r.size)
            })
        })
}

fn zero_ranges(
    vm: &dyn IncomingVm,
    regions: &[RegionView],
    body: &[u8],
    p: &Progress,
) -> Result<(), MigrationError> {
    let ranges: Vec<(u64, u64)> =
        postcard::from_bytes(body).map_err(|e| ProtocolError::Malformed {
            kind: Kind::ZeroRanges,
            reason: e.to_string(),
        })?;
    for (gpa, n) in ranges {
        if !zero_range_inside(regions, gpa, n) {
            return Err(ProtocolError::Malformed {
                kind: Kind::ZeroRanges,
                reason: format!("range {gpa:#x}+{n} pages is not in guest RAM"),
            }
            .into());
        }
        // Pages that already read as zeros are left alone.
        for (at, k) in p.maybe.take(gpa, n) {
            vm.zero(at, k * PAGE as u64)
                .map_err(MigrationError::vm("zero pages"))?;
        }
        p.zero_pages.fetch_add(n, Ordering::Relaxed);
    }
    Ok(())
}

/// The decode stage of a compressed stream: decodes each Encoded body with
/// its shard's decoder (caches mirrored from the source) and writes the
/// pages; buffers go back to the receiving thread.
fn decode_loop(
    vm: &dyn IncomingVm,
    regions: &[RegionView],
    rx: Receiver<Vec<u8>>,
    back: Sender<Vec<u8>>,
    mut decoders: Vec<StreamDecoder>,
    idx: usize,
    p: &Progress,
) -> Result<(), MigrationError> {
    let mut cpu_mark = crate::stats::thread_cpu_secs();
    let mut out = Vec::new();
    let bad = |reason: String| ProtocolError::Malformed {
        kind: Kind::Encoded,
        reason,
    };
    for body in rx {
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
            vm.write_pages(f.gpas[i], &out[i * PAGE..(i + n) * PAGE])
                .map_err(bad)?;
            p.maybe.mark(f.gpas[i], n as u64);
            i += n;
        }
        p.pages.fetch_add(f.gpas.len() as u64, Ordering::Relaxed);
        applied(p, idx, &mut cpu_mark);
        let _ = back.send(body);
    }
    Ok(())
}

fn bulk_loop(
    vm: &dyn IncomingVm,
    regions: &[RegionView],
    mut r: BufReader<TcpStream>,
    idx: usize,
    p: &Progress,
) -> Result<(), MigrationError> {
    let mut body = Vec::new();
    let mut cpu_mark = crate::stats::thread_cpu_secs();
    // Compressed streams get a decode thread; Encoded bodies travel to it
    // through three buffers and come back empty.
    let (back_tx, back_rx) = channel::<Vec<u8>>();
    std::thread::scope(|sc| {
        let mut decode: Option<(SyncSender<Vec<u8>>, _)> = None;
        let mut first = true;
        let result = loop {
            if p.stop.load(Ordering::Acquire) {
                break Ok(());
            }
            let h = match protocol::read_header(&mut r) {
                Err(ProtocolError::Closed) => break Ok(()),
                Err(ProtocolError::Io(_)) if p.stop.load(Ordering::Acquire) => break Ok(()),
                Err(e) => break Err(e.into()),
                Ok(h) => h,
            };
            let step = (|| -> Result<bool, MigrationError> {
                match h.kind {
                    Kind::Pages => {
                        let n =
                            crate::pagein::read_pages(&mut r, &h, regions, &p.maybe, &mut body)?;
                        p.pages.fetch_add(n, Ordering::Relaxed);
                    }
                    Kind::ZeroRanges => {
                        protocol::read_body_into(&mut r, &h, &mut body)?;
                        zero_ranges(vm, regions, &body, p)?;
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
                        let (tx, rx) = sync_channel::<Vec<u8>>(3);
                        let back = back_tx.clone();
                        let handle = sc.spawn(move || {
                            let r = decode_loop(vm, regions, rx, back, decoders, idx, p);
                            if let Err(e) = &r {
                                // Tell the control thread now: the receiving
                                // thread may be waiting for a frame that the
                                // source will not send before its RoundAck.
                                *p.failed.lock().unwrap_or_else(|e| e.into_inner()) =
                                    Some(e.to_string());
                                let _g = p.lock.lock().unwrap_or_else(|e| e.into_inner());
                                p.changed.notify_all();
                            }
                            r
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
                            // The decoder stopped: its error is collected below.
                            return Err(ProtocolError::Closed.into());
                        }
                        return Ok(false);
                    }
                    k => {
                        return Err(ProtocolError::Unexpected {
                            got: k,
                            want: "Pages, ZeroRanges or Encoded on a bulk stream",
                        }
                        .into())
                    }
                }
                Ok(true)
            })();
            first = false;
            match step {
                Ok(true) => applied(p, idx, &mut cpu_mark),
                Ok(false) => {}
                Err(e) => break Err(e),
            }
        };
        // The decoder's own error says more than "closed".
        let decoded = match decode {
            Some((tx, handle)) => {
                drop(tx);
                handle.join().unwrap_or(Ok(()))
            }
            None => Ok(()),
        };
        match (result, decoded) {
            (_, Err(e)) => Err(e),
            (r, Ok(())) => r,
        }
    })
}

/// Receives one migration into `vm` through `listener`. Returns once the VM
/// has been started (and the source told so).
pub fn receive(
    vm: &dyn IncomingVm,
    listener: &TcpListener,
    timeout: Duration,
) -> Result<IncomingStats, MigrationError> {
    // Wait for a control connection. Connections that close without a word
    // (port probes, health checks) are ignored; anything else that is not a
    // control Hello gets an Abort and is dropped. The VM is untouched so far.
    let (mut ctl_r, mut ctl_w, hello) = loop {
        let (mut r, w) = accept(listener, Duration::from_secs(24 * 3600))?;
        let mut w = BufWriter::new(w);
        match protocol::recv::<Hello>(&mut r, Kind::Hello) {
            Ok(h) if h.role == Role::Control => break (r, w, h),
            Err(ProtocolError::Closed) => continue,
            Ok(_) | Err(_) => {
                let _ = protocol::write_frame(
                    &mut w,
                    Kind::Abort,
                    b"expected a ferry migration control Hello",
                );
                let _ = w.flush();
            }
        }
    };
    let result = receive_on(vm, listener, timeout, hello, &mut ctl_r, &mut ctl_w);
    if let Err(e) = &result {
        if !matches!(e, MigrationError::Protocol(ProtocolError::Aborted(_))) {
            let _ = protocol::write_frame(&mut ctl_w, Kind::Abort, e.to_string().as_bytes());
            let _ = ctl_w.flush();
            // Close the control connection gracefully: unread bytes at close
            // would turn into a reset, and the source would lose the reason.
            let _ = ctl_w.get_ref().shutdown(std::net::Shutdown::Write);
            let _ = ctl_r
                .get_ref()
                .set_read_timeout(Some(Duration::from_secs(1)));
            let mut sink = [0u8; 65536];
            while matches!(std::io::Read::read(&mut ctl_r, &mut sink), Ok(n) if n > 0) {}
        }
    }
    result
}

fn receive_on(
    vm: &dyn IncomingVm,
    listener: &TcpListener,
    timeout: Duration,
    hello: Hello,
    ctl_r: &mut BufReader<TcpStream>,
    ctl_w: &mut BufWriter<TcpStream>,
) -> Result<IncomingStats, MigrationError> {
    let version = protocol::negotiate(&hello)?;
    protocol::send(ctl_w, Kind::HelloAck, &version)?;
    ctl_w.flush().map_err(ProtocolError::Io)?;
    let layout: Layout = protocol::recv(ctl_r, Kind::Layout)?;
    let regions = vm.regions();
    let mine: Vec<(u64, u64)> = regions.iter().map(|r| (r.gpa, r.size)).collect();
    if layout.regions != mine || layout.vcpus != vm.vcpus() {
        return Err(MigrationError::Mismatch(format!(
            "source has memory {:?} and {} vCPUs, this VM {:?} and {} vCPUs",
            layout.regions,
            layout.vcpus,
            mine,
            vm.vcpus()
        )));
    }
    let n = hello.streams.clamp(1, 64) as usize;
    let mut streams: Vec<Option<BufReader<TcpStream>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (mut r, _w) = accept(listener, timeout)?;
        let h: Hello = protocol::recv(&mut r, Kind::Hello)?;
        match h.role {
            Role::Bulk(i)
                if h.session == hello.session
                    && (i as usize) < n
                    && streams[i as usize].is_none() =>
            {
                streams[i as usize] = Some(r)
            }
            _ => {
                return Err(ProtocolError::Unexpected {
                    got: Kind::Hello,
                    want: "a bulk Hello of this session",
                }
                .into())
            }
        }
    }
    let p = Progress {
        frames: (0..n).map(|_| AtomicU64::new(0)).collect(),
        failed: Mutex::new(None),
        changed: Condvar::new(),
        lock: Mutex::new(()),
        stop: AtomicBool::new(false),
        pages: AtomicU64::new(0),
        zero_pages: AtomicU64::new(0),
        maybe: crate::written::MaybeNonZero::new(
            &regions,
            &(0..regions.len())
                .map(|i| vm.nonzero_ranges(i))
                .collect::<Vec<_>>(),
            &vm.device_written_ranges(),
        ),
        cpu: crate::stats::CpuMeter::default(),
        ctl_cpu0: crate::stats::thread_cpu_secs(),
    };
    let p = Arc::new(p);
    let mut stats = IncomingStats::default();
    std::thread::scope(|s| -> Result<(), MigrationError> {
        for (i, r) in streams.into_iter().enumerate() {
            let (p, regions) = (p.clone(), &regions);
            let r = r.ok_or(ProtocolError::Closed)?;
            s.spawn(move || {
                if let Err(e) = bulk_loop(vm, regions, r, i, &p) {
                    *p.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                    let _g = p.lock.lock().unwrap_or_else(|e| e.into_inner());
                    p.changed.notify_all();
                }
            });
        }
        let r = control_loop(vm, &regions, ctl_r, ctl_w, timeout, &p, &mut stats);
        p.stop.store(true, Ordering::Release);
        // A bulk stream that failed (corrupt frame, bad address) is the real
        // cause even when the control connection saw something else first.
        match (
            r,
            p.failed.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        ) {
            (Err(_), Some(bulk)) => Err(MigrationError::Vm {
                op: "receive pages",
                reason: bulk,
            }),
            (r, _) => r,
        }
    })?;
    stats.pages = p.pages.load(Ordering::Relaxed);
    stats.zero_pages = p.zero_pages.load(Ordering::Relaxed);
    Ok(stats)
}

fn control_loop(
    vm: &dyn IncomingVm,
    regions: &[RegionView],
    ctl_r: &mut BufReader<TcpStream>,
    ctl_w: &mut BufWriter<TcpStream>,
    timeout: Duration,
    p: &Progress,
    stats: &mut IncomingStats,
) -> Result<(), MigrationError> {
    let mut state: Option<Vec<u8>> = None;
    loop {
        let f = protocol::read_frame(ctl_r)?;
        match f.kind {
            Kind::RoundDone => {
                let rd: RoundDone = protocol::decode(&f, Kind::RoundDone)?;
                if rd.frames.len() != p.frames.len() {
                    return Err(ProtocolError::Malformed {
                        kind: Kind::RoundDone,
                        reason: "wrong stream count".into(),
                    }
                    .into());
                }
                // Wait until every bulk stream has applied its share of the round.
                let deadline = Instant::now() + timeout;
                let mut g = p.lock.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(e) = p.failed.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                        return Err(MigrationError::Vm {
                            op: "receive pages",
                            reason: e,
                        });
                    }
                    let done = p
                        .frames
                        .iter()
                        .zip(&rd.frames)
                        .all(|(a, want)| a.load(Ordering::Acquire) >= *want);
                    if done {
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err(ProtocolError::Io(std::io::ErrorKind::TimedOut.into()).into());
                    }
                    g = p
                        .changed
                        .wait_timeout(g, Duration::from_millis(50))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                drop(g);
                for f in &p.frames {
                    f.store(0, Ordering::Release);
                }
                stats.rounds = rd.round + 1;
                protocol::send(ctl_w, Kind::RoundAck, &rd.round)?;
                ctl_w.flush().map_err(ProtocolError::Io)?;
            }
            Kind::State => state = Some(f.body),
            Kind::Verify => {
                let (mut bad, mut first, mut total) = (0u64, 0u64, 0u64);
                let mut words = f.body.chunks_exact(8);
                for (ri, r) in regions.iter().enumerate() {
                    let mine = crate::vm::region_hashes(r, &vm.data_ranges(ri));
                    for (i, h) in (0u64..).zip(mine) {
                        let theirs = words
                            .next()
                            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()));
                        total += 1;
                        if theirs != Some(h) {
                            if bad == 0 {
                                first = r.gpa + i * PAGE as u64;
                            }
                            bad += 1;
                        }
                    }
                }
                if bad > 0 || words.next().is_some() {
                    return Err(MigrationError::Verify { bad, total, first });
                }
                stats.verified_pages = total;
            }
            Kind::Complete => {
                let t = Instant::now();
                let state = state.ok_or(ProtocolError::Unexpected {
                    got: Kind::Complete,
                    want: "State before Complete",
                })?;
                vm.restore_state(&state)
                    .map_err(MigrationError::vm("restore state"))?;
                vm.start().map_err(MigrationError::vm("start"))?;
                stats.restore_ms = t.elapsed().as_secs_f64() * 1e3;
                let report = crate::stats::StartedReport {
                    service: vm.service_addr(),
                    cpu_s: p.cpu.secs() + crate::stats::thread_cpu_secs() - p.ctl_cpu0,
                };
                protocol::send(ctl_w, Kind::Started, &report)?;
                ctl_w.flush().map_err(ProtocolError::Io)?;
                return Ok(());
            }
            k => {
                return Err(ProtocolError::Unexpected {
                    got: k,
                    want: "RoundDone, State, Verify or Complete",
                }
                .into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_ranges_from_the_wire_must_lie_inside_one_region() {
        let p = PAGE as u64;
        let regions = [
            RegionView {
                gpa: 0,
                size: 16 * p,
                host: std::ptr::null_mut(),
            },
            RegionView {
                gpa: 0x1_0000_0000,
                size: 4 * p,
                host: std::ptr::null_mut(),
            },
        ];
        assert!(zero_range_inside(&regions, 0, 16));
        assert!(zero_range_inside(&regions, 0x1_0000_0000 + p, 3));
        assert!(!zero_range_inside(&regions, 0, 17), "past the end");
        assert!(
            !zero_range_inside(&regions, 15 * p, 2),
            "into the next region's gap"
        );
        assert!(!zero_range_inside(&regions, 8, 1), "unaligned");
        assert!(!zero_range_inside(&regions, 16 * p, 1), "in the gap");
        assert!(
            !zero_range_inside(&regions, p, (1 << 52) - 1),
            "wraps around"
        );
        assert!(!zero_range_inside(&regions, p, u64::MAX), "overflows");
    }
}
