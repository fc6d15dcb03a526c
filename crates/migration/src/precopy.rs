//! Precopy, the sending side: copy all memory while the guest runs, then the
//! pages it dirtied, round after round, until the rest fits the downtime
//! target at the measured bandwidth; then pause, send the rest and the state.
//!
//! Safety rule (after QEMU's "the source must not be changed or destroyed by
//! an outgoing migration"): until the destination says Started, any failure
//! stops dirty tracking, resumes the VM if it was paused, tells the peer to
//! abort, and returns the error. The VM keeps running here with nothing lost.
//! Once Complete has gone out, only an Abort proves the destination did not
//! start the VM; any other failure is `InDoubt` and the VM stays paused here
//! (never two running copies; the operator resumes it if the destination
//! did not start).

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::protocol::{self, Hello, Kind, Layout, Role, RoundDone, MAX_BATCH, PAGE};
use crate::stats::{secs, MigrationStats, Progress, RoundStats};
use crate::vm::{MigratableVm, RegionView};
use crate::{MigrationError, ProtocolError};

/// How to migrate.
#[derive(Clone, Debug)]
pub struct PrecopyOptions {
    /// Parallel bulk connections.
    pub streams: u16,
    /// Stop iterating when the rest would take at most this long (ms).
    pub downtime_ms: f64,
    /// Stop iterating after this many dirty rounds regardless.
    pub max_rounds: u32,
    /// Compare per-page hashes at the end.
    pub verify: bool,
    /// Throttle the vCPUs step by step when the guest dirties memory faster
    /// than the link carries it.
    pub auto_converge: bool,
    /// Most bytes per second on the wire, all streams together.
    pub bandwidth: Option<f64>,
    /// How long to wait for the destination at each step.
    pub timeout: Duration,
    /// Compression and the pipelined data path.
    pub compression: crate::compress::CompressOptions,
}

impl Default for PrecopyOptions {
    fn default() -> Self {
        PrecopyOptions {
            streams: default_streams(),
            downtime_ms: 10.0,
            max_rounds: 30,
            verify: false,
            auto_converge: true,
            bandwidth: None,
            timeout: Duration::from_secs(30),
            compression: Default::default(),
        }
    }
}

/// Bulk streams by default: two, unless there is a single core. One sending
/// thread saturates its core with the kernel's socket work while the
/// receiver idles; a second stream fills the other core even where both ends
/// share two cores (round 0 +35-40% here, bench/results/throughput.md).
pub fn default_streams() -> u16 {
    match std::thread::available_parallelism().map(|n| n.get()) {
        Ok(1) => 1,
        _ => 2,
    }
}

/// A page set to send: (gpa of first page, number of pages) runs.
type Runs = Vec<(u64, u64)>;

pub(crate) struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

fn connect(addr: SocketAddr, timeout: Duration) -> Result<Conn, MigrationError> {
    let s =
        TcpStream::connect_timeout(&addr, timeout).map_err(|source| MigrationError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    s.set_nodelay(true).map_err(crate::ProtocolError::Io)?;
    s.set_read_timeout(Some(timeout))
        .map_err(crate::ProtocolError::Io)?;
    s.set_write_timeout(Some(timeout))
        .map_err(crate::ProtocolError::Io)?;
    let w = s.try_clone().map_err(crate::ProtocolError::Io)?;
    Ok(Conn {
        reader: BufReader::new(s),
        writer: BufWriter::with_capacity(1 << 20, w),
    })
}

pub(crate) fn is_zero(page: &[u8]) -> bool {
    page.chunks_exact(8).all(|c| c == [0u8; 8])
}

/// Round 0: the pages that may hold data, and the holes (known zeros).
fn first_round(vm: &dyn MigratableVm, regions: &[RegionView]) -> (Runs, Runs) {
    let (mut data, mut holes) = (Vec::new(), Vec::new());
    for (i, r) in regions.iter().enumerate() {
        let mut at = 0;
        for (off, len) in vm.data_ranges(i) {
            if off > at {
                holes.push((r.gpa + at, (off - at) / PAGE as u64));
            }
            data.push((r.gpa + off, len / PAGE as u64));
            at = off + len;
        }
        if at < r.size {
            holes.push((r.gpa + at, (r.size - at) / PAGE as u64));
        }
    }
    (data, holes)
}

/// Runs of set bits in per-region dirty bitmaps.
fn dirty_runs(regions: &[RegionView], bitmaps: &[Vec<u64>]) -> (Runs, u64) {
    let mut runs = Vec::new();
    let mut total = 0;
    for (r, bm) in regions.iter().zip(bitmaps) {
        let pages = r.pages();
        let mut start: Option<u64> = None;
        let mut mark = |i: u64, set: bool, start: &mut Option<u64>| match (set, *start) {
            (true, None) => *start = Some(i),
            (false, Some(s)) => {
                runs.push((r.gpa + s * PAGE as u64, i - s));
                *start = None;
            }
            _ => {}
        };
        let mut i = 0;
        while i < pages {
            let w = bm.get((i / 64) as usize).copied().unwrap_or(0);
            // This runs in the stop-and-copy too: skip whole empty or full
            // words (64 pages) instead of testing every bit of a large VM.
            if i % 64 == 0 && i + 64 <= pages && (w == 0 || w == u64::MAX) {
                mark(i, w != 0, &mut start);
                total += if w == 0 { 0 } else { 64 };
                i += 64;
                continue;
            }
            let set = w >> (i % 64) & 1 == 1;
            mark(i, set, &mut start);
            total += set as u64;
            i += 1;
        }
        if let Some(s) = start {
            runs.push((r.gpa + s * PAGE as u64, pages - s));
        }
    }
    (runs, total)
}

fn page_at(regions: &[RegionView], gpa: u64) -> Option<&[u8]> {
    let r = regions.iter().find(|r| r.contains(gpa))?;
    Some(r.page((gpa - r.gpa) / PAGE as u64))
}

/// Sends `runs` over the bulk streams in parallel; returns the round's figures.
fn send_round(
    regions: &[RegionView],
    bulk: &mut [Conn],
    runs: &Runs,
    holes: &Runs,
    round: u32,
    cpu: &crate::stats::CpuMeter,
    limit: Option<f64>,
) -> Result<(RoundStats, Vec<u64>), MigrationError> {
    let t0 = Instant::now();
    // Known zero ranges go first, unread, on stream 0.
    let (hole_frames, hole_bytes) = protocol::write_holes(&mut bulk[0].writer, holes)?;
    let hole_pages: u64 = holes.iter().map(|h| h.1).sum();
    // Work items: one batch per 1024-page block, fragmented runs included.
    let work = crate::pipeline::group(runs);
    let queue = Mutex::new(work.into_iter());
    let (pages, zero, bytes) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let results: Vec<Result<u64, MigrationError>> = std::thread::scope(|s| {
        let handles: Vec<_> = bulk
            .iter_mut()
            .map(|conn| {
                let (queue, pages, zero, bytes) = (&queue, &pages, &zero, &bytes);
                s.spawn(move || -> Result<u64, MigrationError> {
                    let cpu0 = crate::stats::thread_cpu_secs();
                    let mut frames = 0u64;
                    let mut gpas = Vec::with_capacity(MAX_BATCH);
                    let mut data = Vec::with_capacity(MAX_BATCH * PAGE);
                    loop {
                        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                        let Some(item) = next else { break };
                        gpas.clear();
                        data.clear();
                        let mut zeros: Vec<(u64, u64)> = Vec::new();
                        let mut data_crc = 0u32;
                        let pages_of = item
                            .iter()
                            .flat_map(|&(base, n)| (0..n).map(move |i| base + i * PAGE as u64));
                        for gpa in pages_of {
                            let Some(page) = page_at(regions, gpa) else {
                                continue;
                            };
                            if is_zero(page) {
                                match zeros.last_mut() {
                                    Some((g, k)) if *g + *k * PAGE as u64 == gpa => *k += 1,
                                    _ => zeros.push((gpa, 1)),
                                }
                            } else {
                                // Copy, then checksum while the copy is hot.
                                gpas.push(gpa);
                                let at = data.len();
                                data.extend_from_slice(page);
                                data_crc = crate::checksum::append(data_crc, &data[at..]);
                            }
                        }
                        if !zeros.is_empty() {
                            let n = protocol::write_zero_ranges(&mut conn.writer, &zeros)?;
                            bytes.fetch_add(n, Ordering::Relaxed);
                            zero.fetch_add(zeros.iter().map(|z| z.1).sum(), Ordering::Relaxed);
                            frames += 1;
                        }
                        if !gpas.is_empty() {
                            // The pages were copied once, into `data` (so the
                            // checksum covers exactly what is sent while the
                            // guest keeps writing); the frame goes out in parts.
                            let count = (gpas.len() as u32).to_le_bytes();
                            let addrs: Vec<u8> =
                                gpas.iter().flat_map(|g: &u64| g.to_le_bytes()).collect();
                            protocol::write_pages_frame(
                                &mut conn.writer,
                                &count,
                                &addrs,
                                &data,
                                data_crc,
                            )
                            .map_err(crate::ProtocolError::Io)?;
                            bytes.fetch_add(
                                (protocol::HEADER + 4 + addrs.len() + data.len()) as u64,
                                Ordering::Relaxed,
                            );
                            pages.fetch_add(gpas.len() as u64, Ordering::Relaxed);
                            frames += 1;
                        }
                        // --bandwidth: all streams together stay under the limit.
                        if let Some(rate) = limit {
                            let sent = bytes.load(Ordering::Relaxed) as f64;
                            let ahead = sent / rate - secs(t0.elapsed());
                            if ahead > 0.0 {
                                conn.writer.flush().map_err(crate::ProtocolError::Io)?;
                                std::thread::sleep(Duration::from_secs_f64(ahead));
                            }
                        }
                    }
                    conn.writer.flush().map_err(crate::ProtocolError::Io)?;
                    cpu.add(crate::stats::thread_cpu_secs() - cpu0);
                    Ok(frames)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Ok(0)))
            .collect()
    });
    let mut frames = results.into_iter().collect::<Result<Vec<u64>, _>>()?;
    frames[0] += hole_frames;
    let elapsed = secs(t0.elapsed()).max(1e-9);
    let bytes = bytes.load(Ordering::Relaxed) + hole_bytes;
    Ok((
        RoundStats {
            round,
            pages: pages.load(Ordering::Relaxed),
            zero_pages: zero.load(Ordering::Relaxed) + hole_pages,
            bytes,
            secs: elapsed,
            throughput: bytes as f64 / elapsed,
            dirty_rate: 0.0,
            throttle_pct: 0,
            encoded_in: 0,
            encoded_out: 0,
        },
        frames,
    ))
}

/// The compressed path's round: zero holes first on stream 0, then each
/// stream sends its blocks through its pipeline.
#[allow(clippy::too_many_arguments)]
fn send_round_encoded(
    regions: &[RegionView],
    bulk: &mut [Conn],
    enc: &mut [crate::pipeline::EncState],
    runs: &Runs,
    holes: &Runs,
    round: u32,
    final_bytes: Option<u64>,
    policy: &crate::compress::Policy,
    opts: &PrecopyOptions,
    cpu: &crate::stats::CpuMeter,
) -> Result<(RoundStats, Vec<u64>), MigrationError> {
    let t0 = Instant::now();
    let (hole_frames, hole_bytes) = protocol::write_holes(&mut bulk[0].writer, holes)?;
    let ctx = crate::pipeline::RoundCtx {
        regions,
        round,
        final_bytes,
        policy,
        pipeline: opts.compression.pipeline,
        limit: opts.bandwidth,
        t0,
        cpu,
        pages: AtomicU64::new(0),
        zero: AtomicU64::new(0),
        bytes: AtomicU64::new(hole_bytes),
        encoded_in: AtomicU64::new(0),
        encoded_out: AtomicU64::new(0),
        raw_in: AtomicU64::new(0),
    };
    let streams = bulk.len();
    let dealt = crate::pipeline::deal(runs, streams);
    let results: Vec<Result<u64, MigrationError>> = std::thread::scope(|s| {
        let handles: Vec<_> = bulk
            .iter_mut()
            .zip(enc.iter_mut())
            .zip(dealt)
            .map(|((conn, st), items)| {
                let ctx = &ctx;
                let sock = Some(conn.writer.get_ref().as_raw_fd());
                s.spawn(move || {
                    crate::pipeline::run_stream(ctx, &mut conn.writer, sock, st, items, streams)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Ok(0)))
            .collect()
    });
    let mut frames = results.into_iter().collect::<Result<Vec<u64>, _>>()?;
    frames[0] += hole_frames;
    let elapsed = secs(t0.elapsed()).max(1e-9);
    let bytes = ctx.bytes.load(Ordering::Relaxed);
    let encoded_in = ctx.encoded_in.load(Ordering::Relaxed);
    policy.observe_round(bytes as f64 / elapsed, elapsed, encoded_in == 0);
    Ok((
        RoundStats {
            round,
            pages: ctx.pages.load(Ordering::Relaxed),
            zero_pages: ctx.zero.load(Ordering::Relaxed) + holes.iter().map(|h| h.1).sum::<u64>(),
            bytes,
            secs: elapsed,
            throughput: bytes as f64 / elapsed,
            dirty_rate: 0.0,
            throttle_pct: 0,
            encoded_in,
            encoded_out: ctx.encoded_out.load(Ordering::Relaxed),
        },
        frames,
    ))
}

/// Ends a round on the control connection and waits until the destination
/// has applied it (so a later round's copy of a page can never be overtaken).
fn barrier(ctl: &mut Conn, round: u32, frames: Vec<u64>) -> Result<(), MigrationError> {
    protocol::send(
        &mut ctl.writer,
        Kind::RoundDone,
        &RoundDone { round, frames },
    )?;
    ctl.writer.flush().map_err(crate::ProtocolError::Io)?;
    let ack: u32 = protocol::recv(&mut ctl.reader, Kind::RoundAck)?;
    if ack != round {
        return Err(crate::ProtocolError::Malformed {
            kind: Kind::RoundAck,
            reason: format!("ack for round {ack}, expected {round}"),
        }
        .into());
    }
    Ok(())
}

/// Migrates `vm` to the ferry destination at `to`. On success the VM runs at
/// the destination and the caller must release it here (it stays paused).
pub fn migrate(
    vm: &dyn MigratableVm,
    to: SocketAddr,
    opts: &PrecopyOptions,
    progress: &dyn Fn(&Progress),
) -> Result<MigrationStats, MigrationError> {
    let mut paused = false;
    let mut ctl_slot: Option<Conn> = None;
    let mut result = run(vm, to, opts, progress, &mut paused, &mut ctl_slot);
    // A broken or refused connection often means the destination refused the
    // session and closed: its Abort, if it sent one, says why better than
    // "connection reset" (a bulk connect can race its exit).
    if let (
        Err(
            MigrationError::Protocol(ProtocolError::Io(_) | ProtocolError::Closed)
            | MigrationError::Connect { .. },
        ),
        Some(ctl),
    ) = (&result, ctl_slot.as_mut())
    {
        let _ = ctl
            .reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(500)));
        loop {
            match protocol::read_frame(&mut ctl.reader) {
                Ok(_) => continue,
                Err(e @ ProtocolError::Aborted(_)) => {
                    result = Err(e.into());
                    break;
                }
                Err(_) => break,
            }
        }
    }
    if let Err(MigrationError::InDoubt(_)) = &result {
        // The VM may run at the destination: keep it paused here.
        let _ = vm.stop_dirty_log();
        return result;
    }
    if result.is_err() {
        let _ = vm.throttle(0);
        let _ = vm.stop_dirty_log();
        if paused {
            let _ = vm.resume();
        }
        if let (Some(ctl), Err(e)) = (ctl_slot.as_mut(), &result) {
            let _ = protocol::write_frame(&mut ctl.writer, Kind::Abort, e.to_string().as_bytes());
            let _ = ctl.writer.flush();
        }
    }
    result
}

fn run(
    vm: &dyn MigratableVm,
    to: SocketAddr,
    opts: &PrecopyOptions,
    progress: &dyn Fn(&Progress),
    paused: &mut bool,
    ctl_slot: &mut Option<Conn>,
) -> Result<MigrationStats, MigrationError> {
    let t_start = Instant::now();
    let cpu = crate::stats::CpuMeter::default();
    let ctl_cpu0 = crate::stats::thread_cpu_secs();
    let regions = vm.regions();
    let session = t_start.elapsed().as_nanos() as u64 ^ std::process::id() as u64;
    let streams = opts.streams.max(1);
    let ctl = ctl_slot.insert(connect(to, opts.timeout)?);
    let hello = |role| Hello {
        version_min: protocol::VERSION_MIN,
        version_max: protocol::VERSION_MAX,
        role,
        session,
        streams,
    };
    protocol::send(&mut ctl.writer, Kind::Hello, &hello(Role::Control))?;
    ctl.writer.flush().map_err(crate::ProtocolError::Io)?;
    let version: u16 = protocol::recv(&mut ctl.reader, Kind::HelloAck)?;
    let copt = &opts.compression;
    let compressed = copt.enabled() && version >= 2;
    let mut stats = MigrationStats::default();
    stats.compression.asked = copt.compress.to_string();
    stats.compression.pipeline = compressed && copt.pipeline;
    stats.compression.backend = copt.backend.name.clone();
    stats.compression.backend_note = copt.backend.note.clone();
    if copt.enabled() && !compressed {
        stats.compression.note = Some(format!(
            "the destination speaks protocol v{version}, compression needs v2: sent raw"
        ));
    }
    let layout = Layout {
        regions: regions.iter().map(|r| (r.gpa, r.size)).collect(),
        vcpus: vm.vcpus(),
    };
    protocol::send(&mut ctl.writer, Kind::Layout, &layout)?;
    ctl.writer.flush().map_err(crate::ProtocolError::Io)?;
    let mut bulk = Vec::new();
    for i in 0..streams {
        let mut c = connect(to, opts.timeout)?;
        protocol::send(&mut c.writer, Kind::Hello, &hello(Role::Bulk(i)))?;
        if compressed {
            let setup = crate::encoded::CodecSetup {
                xbzrle_bytes: copt.caches.xbzrle_bytes,
                dedup_bytes: copt.caches.dedup_bytes,
                shards: copt.workers.clamp(1, crate::encoded::MAX_SHARDS),
            };
            protocol::send(&mut c.writer, Kind::Codec, &setup)?;
        }
        c.writer.flush().map_err(crate::ProtocolError::Io)?;
        bulk.push(c);
    }
    let ctl = ctl_slot.as_mut().ok_or(crate::ProtocolError::Closed)?;
    let mut enc: Vec<crate::pipeline::EncState> = (0..bulk.len())
        .map(|_| {
            crate::pipeline::EncState::new(
                (0..copt.workers.clamp(1, crate::encoded::MAX_SHARDS))
                    .map(|_| (copt.backend.make)(copt.caches))
                    .collect(),
            )
        })
        .collect();
    let policy = crate::compress::Policy::new(
        copt,
        opts.bandwidth,
        &if compressed {
            sample_pages(vm, &regions, 256)
        } else {
            Vec::new()
        },
    );

    vm.start_dirty_log()
        .map_err(MigrationError::vm("start dirty log"))?;
    let (mut runs, mut holes) = first_round(vm, &regions);
    let mut round = 0u32;
    let mut bandwidth;
    let mut throttle = 0u32;
    loop {
        let remaining: u64 = runs.iter().map(|r| r.1).sum();
        progress(&Progress {
            round,
            remaining_pages: remaining,
            throughput: 0.0,
            bytes: stats.bytes,
            phase: "copy",
        });
        let (mut rs, frames) = if compressed {
            send_round_encoded(
                &regions, &mut bulk, &mut enc, &runs, &holes, round, None, &policy, opts, &cpu,
            )?
        } else {
            send_round(
                &regions,
                &mut bulk,
                &runs,
                &holes,
                round,
                &cpu,
                opts.bandwidth,
            )?
        };
        barrier(ctl, round, frames)?;
        let (next, dirty) = dirty_runs(
            &regions,
            &vm.take_dirty()
                .map_err(MigrationError::vm("read dirty log"))?,
        );
        rs.dirty_rate = (dirty * PAGE as u64) as f64 / rs.secs;
        rs.throttle_pct = throttle;
        bandwidth = rs.throughput.max(1.0);
        // Auto-converge (after the full copy): when the guest dirtied more
        // than half of what the round could send, take away more vCPU time,
        // 20% at first, then 10% more each round, up to 99%.
        if opts.auto_converge && round >= 1 && rs.dirty_rate > 0.5 * rs.throughput {
            throttle = if throttle == 0 {
                20
            } else {
                (throttle + 10).min(99)
            };
            vm.throttle(throttle)
                .map_err(MigrationError::vm("throttle"))?;
        }
        stats.bytes += rs.bytes;
        stats.pages += rs.pages;
        stats.zero_pages += rs.zero_pages;
        stats.rounds.push(rs);
        runs = next;
        holes.clear();
        round += 1;
        let expected_ms = (dirty * (PAGE as u64 + 8)) as f64 / bandwidth * 1e3;
        if expected_ms <= opts.downtime_ms {
            stats.converged = format!("remainder of {dirty} pages fits {:.1} ms", opts.downtime_ms);
            break;
        }
        if round > opts.max_rounds {
            stats.converged = format!(
                "max rounds ({}) reached with {dirty} pages dirty",
                opts.max_rounds
            );
            break;
        }
    }

    // Stop and copy.
    let t_pause = Instant::now();
    vm.pause().map_err(MigrationError::vm("pause"))?;
    *paused = true;
    let mut mark = t_pause;
    let mut lap = || {
        let ms = secs(mark.elapsed()) * 1e3;
        mark = Instant::now();
        ms
    };
    stats.downtime_parts.pause = lap();
    let (mut last, _) = dirty_runs(
        &regions,
        &vm.take_dirty()
            .map_err(MigrationError::vm("read dirty log"))?,
    );
    last.extend(runs);
    last.extend(
        vm.host_written_ranges()
            .into_iter()
            .map(|(gpa, len)| (gpa, len.div_ceil(PAGE as u64))),
    );
    last.sort_unstable();
    last.dedup();
    let last = merge_runs(last);
    let remaining: u64 = last.iter().map(|r| r.1).sum();
    progress(&Progress {
        round,
        remaining_pages: remaining,
        throughput: bandwidth,
        bytes: stats.bytes,
        phase: "stop-and-copy",
    });
    let (rs, frames) = if compressed {
        send_round_encoded(
            &regions,
            &mut bulk,
            &mut enc,
            &last,
            &Vec::new(),
            round,
            Some(remaining * PAGE as u64),
            &policy,
            opts,
            &cpu,
        )?
    } else {
        send_round(
            &regions,
            &mut bulk,
            &last,
            &Vec::new(),
            round,
            &cpu,
            opts.bandwidth,
        )?
    };
    barrier(ctl, round, frames)?;
    stats.bytes += rs.bytes;
    stats.pages += rs.pages;
    stats.zero_pages += rs.zero_pages;
    stats.rounds.push(rs);
    vm.stop_dirty_log()
        .map_err(MigrationError::vm("stop dirty log"))?;
    stats.downtime_parts.last_round = lap();

    let state = vm.save_state().map_err(MigrationError::vm("save state"))?;
    protocol::write_frame(&mut ctl.writer, Kind::State, &state)
        .map_err(crate::ProtocolError::Io)?;
    stats.state_bytes = state.len() as u64;
    stats.bytes += (protocol::HEADER + state.len()) as u64;
    stats.downtime_parts.save_state = lap();
    if opts.verify {
        progress(&Progress {
            round,
            remaining_pages: 0,
            throughput: bandwidth,
            bytes: stats.bytes,
            phase: "verify",
        });
        let mut hashes = Vec::new();
        for (i, r) in regions.iter().enumerate() {
            for h in crate::vm::region_hashes(r, &vm.data_ranges(i)) {
                hashes.extend_from_slice(&h.to_le_bytes());
            }
        }
        protocol::write_frame(&mut ctl.writer, Kind::Verify, &hashes)
            .map_err(crate::ProtocolError::Io)?;
        stats.verified_pages = (hashes.len() / 8) as u64;
        stats.bytes += (protocol::HEADER + hashes.len()) as u64;
    }
    stats.downtime_parts.verify = lap();
    protocol::write_frame(&mut ctl.writer, Kind::Complete, &[])
        .map_err(crate::ProtocolError::Io)?;
    ctl.writer.flush().map_err(crate::ProtocolError::Io)?;
    // From here the destination may start the VM at any moment. An Abort
    // means it did not; anything else but Started leaves the outcome unknown,
    // and resuming here could run the VM twice.
    let frame = match protocol::read_frame(&mut ctl.reader) {
        Ok(f) if f.kind == Kind::Started => f,
        Err(e @ ProtocolError::Aborted(_)) => return Err(e.into()),
        Ok(f) => {
            return Err(MigrationError::InDoubt(format!(
                "the destination answered Complete with {:?}",
                f.kind
            )))
        }
        Err(e) => return Err(MigrationError::InDoubt(e.to_string())),
    };
    stats.downtime_parts.destination = lap();
    let report: crate::stats::StartedReport = protocol::decode(&frame, Kind::Started)?;
    stats.destination_service = report.service;
    if compressed {
        stats.compression.batches = policy.summary();
        stats.compression.link_bandwidth = policy.link();
    }
    stats.compression.encoded_in = stats.rounds.iter().map(|r| r.encoded_in).sum();
    stats.compression.encoded_out = stats.rounds.iter().map(|r| r.encoded_out).sum();
    stats.destination_cpu_s = report.cpu_s;
    stats.source_cpu_s = cpu.secs() + crate::stats::thread_cpu_secs() - ctl_cpu0;
    stats.downtime_ms = secs(t_pause.elapsed()) * 1e3;
    stats.total_secs = secs(t_start.elapsed());
    progress(&Progress {
        round,
        remaining_pages: 0,
        throughput: bandwidth,
        bytes: stats.bytes,
        phase: "done",
    });
    Ok(stats)
}

/// Up to `max` non-zero pages picked at random over the VM's data, for the
/// compression policy to measure its codecs on. Random, not strided: a
/// regular stride can alias with a regular layout and see one kind of page.
fn sample_pages(vm: &dyn MigratableVm, regions: &[RegionView], max: usize) -> Vec<u8> {
    let mut ranges = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        for (off, len) in vm.data_ranges(i) {
            ranges.push((r, off / PAGE as u64, len / PAGE as u64));
        }
    }
    let total: u64 = ranges.iter().map(|c| c.2).sum();
    let mut out = Vec::with_capacity(max * PAGE);
    if total == 0 {
        return out;
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..4 * max {
        if out.len() >= max * PAGE {
            break;
        }
        // xorshift64: cheap, and the same sample every run.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut k = x % total;
        for &(r, first, n) in &ranges {
            if k < n {
                let page = r.page(first + k);
                if !is_zero(page) {
                    out.extend_from_slice(page);
                }
                break;
            }
            k -= n;
        }
    }
    out
}

/// Merges sorted, possibly overlapping runs.
fn merge_runs(sorted: Runs) -> Runs {
    let mut out: Runs = Vec::new();
    for (gpa, n) in sorted {
        match out.last_mut() {
            Some((g, k)) if gpa <= *g + *k * PAGE as u64 => {
                let end = (gpa + n * PAGE as u64).max(*g + *k * PAGE as u64);
                *k = (end - *g) / PAGE as u64;
            }
            _ => out.push((gpa, n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_from_bitmaps_and_merging() {
        let mut mem = vec![0u8; 8 * PAGE];
        let r = RegionView {
            gpa: 0x10000,
            size: 8 * PAGE as u64,
            host: mem.as_mut_ptr(),
        };
        let (runs, n) = dirty_runs(&[r], &[vec![0b1011_0110]]);
        assert_eq!(n, 5);
        assert_eq!(runs, vec![(0x11000, 2), (0x14000, 2), (0x17000, 1)]);
        // Whole words, full and empty, across word boundaries.
        let big = RegionView {
            gpa: 0,
            size: 200 * PAGE as u64,
            host: mem.as_mut_ptr(),
        };
        let (runs, n) = dirty_runs(&[big], &[vec![u64::MAX, 0, 1 << 63, 0b111]]);
        assert_eq!(n, 64 + 1 + 3);
        assert_eq!(runs, vec![(0, 64), (191 * PAGE as u64, 4)]);
        assert_eq!(
            merge_runs(vec![(0, 2), (0x1000, 3), (0x8000, 1)]),
            vec![(0, 4), (0x8000, 1)]
        );
        assert!(is_zero(&mem[..PAGE]));
        mem[PAGE + 4095] = 1;
        assert!(!is_zero(&mem[PAGE..2 * PAGE]));
    }
}
