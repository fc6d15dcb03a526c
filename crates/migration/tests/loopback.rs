//! The engine on plain memory over loopback TCP and a Unix socket: no KVM
//! involved.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ferry_migration::{
    incoming, Backend, ClientsAnswer, ClientsPlan, Endpoint, GpaBytes, GpaPages, IncomingVm,
    Listener, MigratableVm, MigrateOptions, MigrationError, MigrationStats, OffsetBytes, PageStore,
    Progress, RegionView, VmOpError,
};

const PAGE: usize = 4096;

/// (offset, length) runs of one region.
type Ranges = Vec<OffsetBytes>;

/// How the two sides are connected.
#[derive(Clone, Copy, Debug)]
enum Via {
    Tcp,
    Unix,
}

/// A destination listener and the endpoint a source dials.
fn listen(via: Via) -> (Listener, Endpoint) {
    let at = match via {
        Via::Tcp => "tcp:127.0.0.1:0".parse().unwrap(),
        Via::Unix => {
            static N: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "ferry-loopback-{}-{}.sock",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            Endpoint::Unix(path)
        }
    };
    let l = Listener::bind(&at).unwrap();
    let ep = l.endpoint();
    (l, ep)
}

fn migrate(
    vm: &FakeVm,
    to: &Endpoint,
    opts: &MigrateOptions,
    progress: &dyn Fn(&Progress),
) -> Result<MigrationStats, MigrationError> {
    ferry_migration::migrate(vm, to, opts, &Backend::cpu(), progress)
}

struct FakeVm {
    mem: Vec<Mutex<Vec<u8>>>,
    layout: Vec<(u64, u64)>,
    /// Pages "dirtied" per take_dirty call, scripted.
    dirty_script: Mutex<Vec<Vec<u64>>>,
    pauses: AtomicU32,
    resumes: AtomicU32,
    state: Mutex<Vec<u8>>,
    started: AtomicU32,
    throttles: Mutex<Vec<u32>>,
    /// How long start() takes (a destination that hangs while starting).
    start_delay: Mutex<Duration>,
    /// What IncomingVm::nonzero_ranges reports (None: the default).
    nonzero: Mutex<Option<Vec<Ranges>>>,
    /// Pages IncomingVm::zero was asked to clear.
    zeroed: AtomicU64,
    /// Clients: the source's plan, the answer it was told, how often it
    /// checkpointed them; the destination's answer to a plan, whether its
    /// restore fails, and what it restored (before it started).
    clients_plan: Option<ClientsPlan>,
    decided: Mutex<Option<ClientsAnswer>>,
    clients_saved: AtomicU32,
    accepts_clients: Result<(), String>,
    restore_fails: bool,
    restored_clients: Mutex<Option<(Vec<u8>, u32)>>,
}

impl FakeVm {
    fn new(layout: &[(u64, u64)], fill: bool) -> FakeVm {
        let mem = layout
            .iter()
            .map(|&(_, size)| {
                let mut v = vec![0u8; size as usize];
                if fill {
                    for (i, b) in v.iter_mut().enumerate() {
                        // Every third page stays zero.
                        if !(i / PAGE).is_multiple_of(3) {
                            *b = (i as u64).wrapping_mul(2654435761).to_le_bytes()[3];
                        }
                    }
                }
                Mutex::new(v)
            })
            .collect();
        FakeVm {
            mem,
            layout: layout.to_vec(),
            dirty_script: Mutex::new(Vec::new()),
            pauses: AtomicU32::new(0),
            resumes: AtomicU32::new(0),
            state: Mutex::new(b"vcpu state".to_vec()),
            started: AtomicU32::new(0),
            throttles: Mutex::new(Vec::new()),
            start_delay: Mutex::new(Duration::ZERO),
            nonzero: Mutex::new(None),
            zeroed: AtomicU64::new(0),
            clients_plan: None,
            decided: Mutex::new(None),
            clients_saved: AtomicU32::new(0),
            accepts_clients: Err("a fake VM has no clients".into()),
            restore_fails: false,
            restored_clients: Mutex::new(None),
        }
    }
}

impl MigratableVm for FakeVm {
    fn regions(&self) -> Vec<RegionView> {
        self.layout
            .iter()
            .zip(&self.mem)
            // SAFETY: each Vec lives as long as the FakeVm and is never
            // resized, so the pointer stays valid while the engine uses it.
            .map(|(&(gpa, size), m)| unsafe {
                RegionView::new(gpa, size, m.lock().unwrap().as_mut_ptr())
            })
            .collect()
    }
    fn vcpus(&self) -> u32 {
        1
    }
    fn start_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(())
    }
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError> {
        // Each call: the scripted pages of region 0 get new content and are reported dirty.
        let pages = self.dirty_script.lock().unwrap().pop().unwrap_or_default();
        let mut bm = vec![0u64; (self.layout[0].1 as usize / PAGE).div_ceil(64)];
        let mut m = self.mem[0].lock().unwrap();
        for p in pages {
            m[p as usize * PAGE] ^= 0xff;
            bm[(p / 64) as usize] |= 1 << (p % 64);
        }
        let mut out = vec![bm];
        out.extend(
            self.layout[1..]
                .iter()
                .map(|r| vec![0u64; (r.1 as usize / PAGE).div_ceil(64)]),
        );
        Ok(out)
    }
    fn stop_dirty_log(&self) -> Result<(), VmOpError> {
        Ok(())
    }
    fn pause(&self) -> Result<(), VmOpError> {
        self.pauses.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn resume(&self) -> Result<(), VmOpError> {
        self.resumes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn save_state(&self) -> Result<Vec<u8>, VmOpError> {
        Ok(self.state.lock().unwrap().clone())
    }
    fn throttle(&self, pct: u32) -> Result<(), VmOpError> {
        self.throttles.lock().unwrap().push(pct);
        Ok(())
    }
    fn host_written_ranges(&self) -> Vec<GpaBytes> {
        vec![GpaBytes::new(self.layout[0].0, PAGE as u64)]
    }
    fn clients_plan(&self) -> Option<ClientsPlan> {
        self.clients_plan.clone()
    }
    fn clients_decided(&self, answer: &ClientsAnswer) {
        *self.decided.lock().unwrap() = Some(answer.clone());
    }
    fn save_clients(&self) -> Result<Vec<u8>, VmOpError> {
        assert_eq!(
            self.pauses.load(Ordering::SeqCst),
            1,
            "checkpointed while paused"
        );
        self.clients_saved.fetch_add(1, Ordering::SeqCst);
        Ok(b"checkpointed connections".to_vec())
    }
}

impl PageStore for FakeVm {
    fn regions(&self) -> Vec<RegionView> {
        MigratableVm::regions(self)
    }
    fn nonzero_ranges(&self, index: usize) -> Vec<OffsetBytes> {
        match &*self.nonzero.lock().unwrap() {
            Some(r) => r[index].clone(),
            None => vec![OffsetBytes::new(0, self.layout[index].1)],
        }
    }
    fn discard(&self, run: GpaPages) -> Result<(), VmOpError> {
        let (gpa, len) = (run.gpa, run.bytes());
        self.zeroed.fetch_add(run.pages, Ordering::SeqCst);
        for (i, &(base, size)) in self.layout.iter().enumerate() {
            if gpa >= base && gpa + len <= base + size {
                let off = (gpa - base) as usize;
                self.mem[i].lock().unwrap()[off..off + len as usize].fill(0);
                return Ok(());
            }
        }
        Err("zero outside memory".into())
    }
}

impl IncomingVm for FakeVm {
    fn vcpus(&self) -> u32 {
        1
    }
    fn restore_state(&self, state: &[u8]) -> Result<(), VmOpError> {
        *self.state.lock().unwrap() = state.to_vec();
        Ok(())
    }
    fn start(&self) -> Result<(), VmOpError> {
        std::thread::sleep(*self.start_delay.lock().unwrap());
        self.started.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn prepare_clients(&self, _plan: &ClientsPlan) -> Result<(), String> {
        self.accepts_clients.clone()
    }
    fn restore_clients(&self, clients: &[u8]) -> Result<String, VmOpError> {
        if self.restore_fails {
            return Err("the fake destination cannot restore its clients".into());
        }
        let started = self.started.load(Ordering::SeqCst);
        *self.restored_clients.lock().unwrap() = Some((clients.to_vec(), started));
        Ok("3 connections restored".into())
    }
}

const LAYOUT: &[(u64, u64)] = &[(0, 64 * PAGE as u64), (0x10_0000, 200 * PAGE as u64)];

#[test]
fn precopy_moves_every_page_and_the_state() {
    for via in [Via::Tcp, Via::Unix] {
        precopy_moves_every_page_and_the_state_via(via);
    }
}

fn precopy_moves_every_page_and_the_state_via(via: Via) {
    let src = FakeVm::new(LAYOUT, true);
    *src.dirty_script.lock().unwrap() = vec![vec![], vec![1, 2, 3], (0..40).collect()];
    let dst = FakeVm::new(LAYOUT, false);
    // Garbage the destination must overwrite, including where the source has zeros.
    dst.mem[1].lock().unwrap().fill(0xee);
    let (listener, addr) = listen(via);
    let opts = MigrateOptions {
        streams: 3,
        downtime_ms: 0.0,
        max_rounds: 2,
        verify: true,
        ..Default::default()
    };
    let (stats, istats) = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {}).unwrap();
        (st, d.join().unwrap().unwrap())
    });
    for (a, b) in src.mem.iter().zip(&dst.mem) {
        assert!(*a.lock().unwrap() == *b.lock().unwrap(), "memory differs");
    }
    assert_eq!(*dst.state.lock().unwrap(), b"vcpu state");
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            src.pauses.load(Ordering::SeqCst),
            src.resumes.load(Ordering::SeqCst)
        ),
        (1, 0)
    );
    assert_eq!(stats.verified_pages, 264);
    assert_eq!(istats.verified_pages, 264);
    // Round 0 sends 2/3 of the pages as data and 1/3 as zero ranges.
    assert_eq!(stats.rounds[0].pages + stats.rounds[0].zero_pages, 264);
    assert!(stats.rounds[0].zero_pages >= 80);
    assert!(
        stats.rounds.len() >= 3,
        "max_rounds 2 plus stop-and-copy: {:?}",
        stats.rounds.len()
    );
}

#[test]
fn zero_ranges_clear_only_pages_that_may_hold_data() {
    let src = FakeVm::new(LAYOUT, true);
    // Page 5 holds one byte; the scripted dirtying flips it back to zero,
    // so a later round sends it as a zero range over a page round 0 wrote.
    src.mem[0].lock().unwrap()[5 * PAGE..6 * PAGE].fill(0);
    src.mem[0].lock().unwrap()[5 * PAGE] = 0xff;
    *src.dirty_script.lock().unwrap() = vec![vec![], vec![5]];
    let dst = FakeVm::new(LAYOUT, false);
    // The destination's VMM wrote region 1's pages 10..20 before the
    // migration; everything else reads as zeros.
    dst.mem[1].lock().unwrap()[10 * PAGE..20 * PAGE].fill(0xee);
    *dst.nonzero.lock().unwrap() = Some(vec![
        vec![],
        vec![OffsetBytes::new(10 * PAGE as u64, 10 * PAGE as u64)],
    ]);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 2,
        verify: true,
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        st
    });
    for (a, b) in src.mem.iter().zip(&dst.mem) {
        assert!(*a.lock().unwrap() == *b.lock().unwrap(), "memory differs");
    }
    assert!(
        stats.zero_pages >= 80,
        "zero ranges were sent: {}",
        stats.zero_pages
    );
    // Cleared: region 1's zero pages among 10..20 (12, 15, 18) and page 5.
    assert_eq!(dst.zeroed.load(Ordering::SeqCst), 4);
}

#[test]
fn a_mismatched_destination_refuses_and_the_source_resumes_untouched() {
    let src = FakeVm::new(LAYOUT, true);
    let dst = FakeVm::new(&LAYOUT[..1], false);
    let (listener, addr) = listen(Via::Tcp);
    let before = src.mem[0].lock().unwrap().clone();
    let (err, derr) = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
        (e, d.join().unwrap().unwrap_err())
    });
    assert!(matches!(derr, MigrationError::Mismatch(_)), "{derr}");
    assert!(
        err.to_string().contains("does not match") || err.to_string().contains("aborted"),
        "{err}"
    );
    assert_eq!(dst.started.load(Ordering::SeqCst), 0);
    assert_eq!(src.pauses.load(Ordering::SeqCst), 0);
    assert!(*src.mem[0].lock().unwrap() == before);
}

#[test]
fn a_dead_destination_is_a_clear_error() {
    let src = FakeVm::new(LAYOUT, true);
    let (listener, addr) = listen(Via::Tcp);
    drop(listener);
    let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
    assert!(matches!(e, MigrationError::Connect { .. }), "{e}");
}

#[test]
fn auto_converge_throttles_a_guest_that_outruns_the_link() {
    let src = FakeVm::new(LAYOUT, true);
    // The same 48 pages dirtied every round: the guest never lets up.
    *src.dirty_script.lock().unwrap() = (0..8).map(|_| (0..48).collect()).collect();
    let dst = FakeVm::new(LAYOUT, false);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        downtime_ms: 0.0,
        max_rounds: 4,
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        st
    });
    let t = src.throttles.lock().unwrap().clone();
    assert_eq!(
        &t[..2],
        &[20, 30],
        "20% first, then 10% more per round: {t:?}"
    );
    assert!(stats.rounds.iter().any(|r| r.throttle_pct > 0));
    for (a, b) in src.mem.iter().zip(&dst.mem) {
        assert!(*a.lock().unwrap() == *b.lock().unwrap(), "memory differs");
    }
}

#[test]
fn bandwidth_limit_paces_the_copy() {
    let src = FakeVm::new(LAYOUT, true);
    let dst = FakeVm::new(LAYOUT, false);
    let (listener, addr) = listen(Via::Tcp);
    // About 0.7 MiB of non-zero pages at 1 MiB/s.
    let opts = MigrateOptions {
        bandwidth: Some(1024.0 * 1024.0),
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        st
    });
    let r0 = &stats.rounds[0];
    assert!(
        r0.throughput < 1.3 * 1024.0 * 1024.0,
        "round 0 at {:.0} B/s",
        r0.throughput
    );
    assert!(
        stats.total_secs > 0.5,
        "paced copy took {:.3} s",
        stats.total_secs
    );
}

/// 3 blocks of 1024 pages and a small region, so batches spread over
/// streams and shards.
const BIG: &[(u64, u64)] = &[(0, 3000 * PAGE as u64), (0x100_0000, 64 * PAGE as u64)];

fn migrate_compressed(compress: &str, pipeline: bool) -> MigrationStats {
    migrate_compressed_via(compress, pipeline, Via::Tcp)
}

fn migrate_compressed_via(compress: &str, pipeline: bool, via: Via) -> MigrationStats {
    let src = FakeVm::new(BIG, true);
    // Round after round the same pages change a little: xbzrle's case.
    *src.dirty_script.lock().unwrap() = vec![
        (0..2000).step_by(7).collect(),
        (0..3000).step_by(5).collect(),
        (100..900).collect(),
    ];
    let dst = FakeVm::new(BIG, false);
    dst.mem[0].lock().unwrap().fill(0xee);
    let (listener, addr) = listen(via);
    let opts = MigrateOptions {
        streams: 2,
        downtime_ms: 0.0,
        max_rounds: 3,
        verify: true,
        bandwidth: Some(4e9),
        compression: ferry_migration::CompressOptions {
            compress: compress.parse().unwrap(),
            pipeline,
            workers: 2,
            caches: ferry_codec::CacheSizes {
                xbzrle_bytes: 8 << 20,
                dedup_bytes: 1 << 20,
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {});
        let got = d.join().unwrap();
        let st = st.unwrap_or_else(|e| panic!("{compress} pipeline={pipeline}: {e}"));
        got.unwrap();
        st
    });
    for (a, b) in src.mem.iter().zip(&dst.mem) {
        assert!(
            *a.lock().unwrap() == *b.lock().unwrap(),
            "{compress} pipeline={pipeline}: memory differs"
        );
    }
    assert_eq!(stats.verified_pages, 3064);
    assert_eq!(stats.compression.pipeline, pipeline);
    stats
}

#[test]
fn every_codec_moves_memory_exactly_with_and_without_the_pipeline() {
    for compress in ["rle", "xbzrle", "dedup", "lz4", "zstd:3", "auto"] {
        for pipeline in [true, false] {
            let st = migrate_compressed(compress, pipeline);
            if compress != "auto" {
                assert!(
                    st.compression.encoded_in > 0,
                    "{compress}: nothing went through the codec"
                );
            }
        }
    }
    // The compressed path over a Unix socket, too.
    migrate_compressed_via("zstd:3", true, Via::Unix);
    // xbzrle codes the re-sent pages as small deltas: dirty rounds shrink.
    let st = migrate_compressed("xbzrle", true);
    let resent: Vec<_> = st.rounds[1..].iter().filter(|r| r.pages > 0).collect();
    assert!(!resent.is_empty());
    for r in resent {
        assert!(
            r.encoded_out * 10 < r.encoded_in,
            "round {}: {} page bytes became {}",
            r.round,
            r.encoded_in,
            r.encoded_out
        );
    }
}

/// A destination that got everything but never confirms the start: the
/// source cannot know whether the VM runs there, so it keeps it paused
/// rather than risk two running copies.
#[test]
fn no_confirmation_after_complete_keeps_the_source_paused() {
    let src = FakeVm::new(LAYOUT, true);
    let dst = FakeVm::new(LAYOUT, false);
    *dst.start_delay.lock().unwrap() = Duration::from_millis(1500);
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions {
        downtime_ms: 1000.0,
        timeout_ms: 500,
        ..Default::default()
    };
    let err = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &opts, &|_| {}).unwrap_err();
        let _ = d.join();
        e
    });
    assert!(matches!(err, MigrationError::InDoubt(_)), "{err}");
    assert!(err.to_string().contains("stays paused"), "{err}");
    assert_eq!(src.pauses.load(Ordering::SeqCst), 1);
    assert_eq!(
        src.resumes.load(Ordering::SeqCst),
        0,
        "resumed an in-doubt VM"
    );
}

fn with_clients(mut src: FakeVm) -> FakeVm {
    src.clients_plan = Some(ClientsPlan {
        ip: std::net::Ipv4Addr::new(10, 77, 0, 100),
        port: 7000,
        connections: 3,
    });
    src
}

/// Protocol v5: a destination that takes the clients gets their checkpoint
/// before its vCPUs start, and the source reports them moved with the
/// destination's words.
#[test]
fn clients_move_when_the_destination_takes_them() {
    let src = with_clients(FakeVm::new(LAYOUT, true));
    let mut dst = FakeVm::new(LAYOUT, false);
    dst.accepts_clients = Ok(());
    let (listener, addr) = listen(Via::Tcp);
    let opts = MigrateOptions::default();
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &opts, &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        st
    });
    assert_eq!(*src.decided.lock().unwrap(), Some(ClientsAnswer::Move));
    assert_eq!(src.clients_saved.load(Ordering::SeqCst), 1);
    let (blob, started) = dst.restored_clients.lock().unwrap().clone().unwrap();
    assert_eq!(blob, b"checkpointed connections");
    assert_eq!(started, 0, "restored before the vCPUs started");
    let c = stats.clients.unwrap();
    assert!(c.moved);
    assert_eq!(c.detail, "3 connections restored");
}

/// A destination that refuses the clients: they stay (the source forwards
/// them), nothing is checkpointed, and the reason reaches the report.
#[test]
fn clients_stay_when_the_destination_refuses_them() {
    let src = with_clients(FakeVm::new(LAYOUT, true));
    let mut dst = FakeVm::new(LAYOUT, false);
    dst.accepts_clients = Err("no interface for 10.77.0.100 here".into());
    let (listener, addr) = listen(Via::Tcp);
    let stats = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let st = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap();
        d.join().unwrap().unwrap();
        st
    });
    assert_eq!(
        *src.decided.lock().unwrap(),
        Some(ClientsAnswer::Stay(
            "no interface for 10.77.0.100 here".into()
        ))
    );
    assert_eq!(src.clients_saved.load(Ordering::SeqCst), 0);
    assert!(dst.restored_clients.lock().unwrap().is_none());
    let c = stats.clients.unwrap();
    assert!(!c.moved);
    assert!(c.detail.contains("no interface"), "{}", c.detail);
    assert_eq!(dst.started.load(Ordering::SeqCst), 1);
}

/// A destination whose restore of the clients fails aborts at once (it
/// does not wait for its bulk streams to time out), and the source runs
/// the VM on: resumed once, never in doubt.
#[test]
fn a_failed_client_restore_aborts_at_once_and_the_source_resumes() {
    let src = with_clients(FakeVm::new(LAYOUT, true));
    let mut dst = FakeVm::new(LAYOUT, false);
    dst.accepts_clients = Ok(());
    dst.restore_fails = true;
    let (listener, addr) = listen(Via::Tcp);
    let t = std::time::Instant::now();
    let err = std::thread::scope(|s| {
        let d = s.spawn(|| incoming::receive(&dst, &listener, Duration::from_secs(10)));
        let e = migrate(&src, &addr, &MigrateOptions::default(), &|_| {}).unwrap_err();
        assert!(d.join().unwrap().is_err());
        e
    });
    assert!(err.is_peer_abort(), "{err}");
    assert!(
        err.to_string().contains("cannot restore its clients"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(src.resumes.load(Ordering::SeqCst), 1);
    assert_eq!(dst.started.load(Ordering::SeqCst), 0);
}
