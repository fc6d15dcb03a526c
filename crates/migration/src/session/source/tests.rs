//! The source session's end over a socket pair, the test playing the
//! destination: a round's barrier, Complete and Started, and what
//! `conclude` leaves of the VM after each way a migration can end.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::SourceSession;
use crate::error::{MigrationError, VmOpError};
use crate::memory::RegionView;
use crate::options::MigrateOptions;
use crate::paused::Outcome;
use crate::protocol::{self, Caps, Kind, ProtocolError, RoundDone};
use crate::ranges::{GpaBytes, GpaPages};
use crate::session::state::SourcePhase;
use crate::stats::{MigrationStats, StartedReport};
use crate::transport::{Conn, Endpoint, Stream};
use crate::vm::{MigratableVm, OwnerFence, TakeBackAnswer};

const MEM: usize = 1 << 20;

/// A VM that only records what was done to it.
struct Vm {
    mem: Vec<u64>,
    paused: AtomicBool,
    resumed: AtomicU32,
    dirty_log: AtomicBool,
    fence: Option<Arc<Fence>>,
}

impl Vm {
    fn new() -> Vm {
        Vm {
            mem: vec![0; MEM / 8],
            paused: AtomicBool::new(false),
            resumed: AtomicU32::new(0),
            dirty_log: AtomicBool::new(false),
            fence: None,
        }
    }

    fn runs(&self) -> bool {
        !self.paused.load(Ordering::SeqCst)
    }
}

/// An owner fence whose take-back answers as told, recording the calls.
struct Fence {
    answer: TakeBackAnswer,
    calls: std::sync::Mutex<Vec<&'static str>>,
}

impl Fence {
    fn new(answer: TakeBackAnswer) -> Arc<Fence> {
        Arc::new(Fence {
            answer,
            calls: Default::default(),
        })
    }
    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().clone()
    }
    fn call(&self, what: &'static str) {
        self.calls.lock().unwrap().push(what);
    }
}

impl OwnerFence for Fence {
    fn claim(&self) -> Option<Vec<u8>> {
        Some(b"claim".to_vec())
    }
    fn take_over(&self, _claim: &[u8]) -> Result<String, String> {
        Err("a source does not take over".into())
    }
    fn completing(&self) {
        self.call("completing");
    }
    fn handed(&self) {
        self.call("handed");
    }
    fn take_back(&self) -> TakeBackAnswer {
        self.call("take_back");
        self.answer.clone()
    }
}

impl MigratableVm for Vm {
    fn fence(&self) -> Option<Arc<dyn OwnerFence>> {
        self.fence.clone().map(|f| f as Arc<dyn OwnerFence>)
    }
    fn regions(&self) -> Vec<RegionView> {
        // SAFETY: `mem` is this VM's own buffer, alive as long as the VM,
        // which outlives every session in these tests; nothing here copies
        // pages through the view (the barrier only checks ranges).
        vec![unsafe { RegionView::new(0, MEM as u64, self.mem.as_ptr() as *mut u8) }]
    }
    fn vcpus(&self) -> u32 {
        1
    }
    fn start_dirty_log(&self) -> Result<(), VmOpError> {
        self.dirty_log.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn take_dirty(&self) -> Result<Vec<Vec<u64>>, VmOpError> {
        Ok(Vec::new())
    }
    fn stop_dirty_log(&self) -> Result<(), VmOpError> {
        self.dirty_log.store(false, Ordering::SeqCst);
        Ok(())
    }
    fn pause(&self) -> Result<(), VmOpError> {
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn resume(&self) -> Result<(), VmOpError> {
        self.paused.store(false, Ordering::SeqCst);
        self.resumed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn save_state(&self) -> Result<Vec<u8>, VmOpError> {
        Ok(vec![1, 2, 3])
    }
    fn host_written_ranges(&self) -> Vec<GpaBytes> {
        Vec::new()
    }
}

fn pair() -> (Conn, Conn) {
    let (a, b) = UnixStream::pair().unwrap();
    let t = Some(Duration::from_secs(5));
    (
        Conn::new(Stream::unix(a), t).unwrap(),
        Conn::new(Stream::unix(b), t).unwrap(),
    )
}

/// A session whose control connection is one end of a pair (the other is
/// returned: the destination), at the newest protocol, dirty log on.
fn session<'a>(
    vm: &'a Vm,
    to: &'a Endpoint,
    opts: &'a MigrateOptions,
) -> (SourceSession<'a>, Conn) {
    let (ours, theirs) = pair();
    let mut s = SourceSession::new(vm, to, opts);
    s.ctl = Some(ours);
    s.caps = Caps::of(protocol::VERSION_MAX);
    s.start_dirty_log().unwrap();
    (s, theirs)
}

fn to() -> Endpoint {
    "unix:/nonexistent".parse().unwrap()
}

fn done() -> Result<Outcome, MigrationError> {
    Ok(Outcome::Done(MigrationStats::default()))
}

#[test]
fn a_barrier_waits_for_its_rounds_ack_and_refuses_another() {
    let (vm, to, opts) = (Vm::new(), to(), MigrateOptions::default());
    let (mut s, mut peer) = session(&vm, &to, &opts);
    let dest = std::thread::spawn(move || {
        for _ in 0..2 {
            let done: RoundDone = peer.recv(Kind::RoundDone).unwrap();
            // The first is acked right, the second for the round before.
            let ack = if done.round == 3 { 3 } else { done.round - 1 };
            peer.send(Kind::RoundAck, &ack).unwrap();
            peer.flush().unwrap();
        }
        peer
    });
    s.barrier(3, vec![10]).unwrap();
    let e = s.barrier(4, vec![]).unwrap_err();
    assert!(e.to_string().contains("ack for round 3, expected 4"), "{e}");
    dest.join().unwrap();
}

#[test]
fn pages_missed_by_reference_are_kept_for_the_next_round_only_inside_guest_ram() {
    let (vm, to, opts) = (Vm::new(), to(), MigrateOptions::default());
    let (mut s, mut peer) = session(&vm, &to, &opts);
    // The destination's host offers pages (v14): the session may then hear
    // of some it could not resolve.
    crate::shared::send_offer(&mut peer, 7, &[1, 2, 3]).unwrap();
    peer.flush().unwrap();
    s.shared = Some(Arc::new(
        crate::shared::recv_offer(s.ctl().unwrap()).unwrap(),
    ));
    let dest = std::thread::spawn(move || {
        let _: RoundDone = peer.recv(Kind::RoundDone).unwrap();
        peer.send(Kind::SharedMissed, &vec![GpaPages::new(4096, 2)])
            .unwrap();
        peer.send(Kind::RoundAck, &0u32).unwrap();
        peer.flush().unwrap();
        let _: RoundDone = peer.recv(Kind::RoundDone).unwrap();
        // A page past the VM's 1 MiB.
        peer.send(Kind::SharedMissed, &vec![GpaPages::new(MEM as u64, 1)])
            .unwrap();
        peer.flush().unwrap();
        peer
    });
    s.barrier(0, vec![]).unwrap();
    assert_eq!(s.take_missed(), [GpaPages::new(4096, 2)]);
    assert!(s.take_missed().is_empty(), "taken once");
    let e = s.barrier(1, vec![]).unwrap_err();
    assert!(e.to_string().contains("outside guest RAM"), "{e}");
    dest.join().unwrap();
}

#[test]
fn started_ends_the_move_and_the_vm_stays_paused_here_for_good() {
    let (vm, to, opts) = (Vm::new(), to(), MigrateOptions::default());
    let (mut s, mut peer) = session(&vm, &to, &opts);
    s.pause().unwrap();
    s.last_round_done(5, vec![]).unwrap();
    let dest = std::thread::spawn(move || {
        let _: RoundDone = peer.recv(Kind::RoundDone).unwrap();
        peer.read_frame().unwrap(); // Complete
        peer.send(Kind::RoundAck, &5u32).unwrap();
        let report = StartedReport {
            service: Some("10.0.0.2:7000".into()),
            ..Default::default()
        };
        peer.send(Kind::Started, &report).unwrap();
        peer.flush().unwrap();
        peer
    });
    let report = s.complete(SourcePhase::Done).unwrap();
    assert_eq!(report.service.as_deref(), Some("10.0.0.2:7000"));
    assert!(s.downtime_ms() > 0.0);
    let _peer = dest.join().unwrap();
    s.conclude(done()).unwrap();
    assert!(!vm.runs(), "the VM runs at the destination only");
    assert_eq!(vm.resumed.load(Ordering::SeqCst), 0);
}

/// Complete goes out and the destination answers `answer` (None: it
/// closes without a word); the VM after `conclude`, its error, and what
/// the destination heard after its answer.
fn completed_then(answer: Option<Kind>) -> (Vm, String, Vec<Kind>) {
    completed_with(Vm::new(), answer)
}

/// [`completed_then`] with this `vm` (and its fence, if any).
fn completed_with(vm: Vm, answer: Option<Kind>) -> (Vm, String, Vec<Kind>) {
    let (to, opts) = (to(), MigrateOptions::default());
    let (err, heard) = {
        let (mut s, mut peer) = session(&vm, &to, &opts);
        s.pause().unwrap();
        let dest = std::thread::spawn(move || {
            peer.read_frame().unwrap(); // Complete
            match answer {
                Some(Kind::Abort) => peer.abort("no room"),
                Some(kind) => {
                    peer.send_frame(kind, &[]).unwrap();
                    peer.flush().unwrap();
                }
                None => peer.shutdown(),
            }
            peer
        });
        let r = s
            .complete(SourcePhase::Done)
            .map(|_| Outcome::Done(MigrationStats::default()));
        let mut peer = dest.join().unwrap();
        let err = s.conclude(r).err().map(|e| e.to_string());
        let mut heard = Vec::new();
        if answer.is_some() {
            let _ = peer.set_read_timeout(Some(Duration::from_millis(200)));
            loop {
                match peer.read_frame() {
                    Ok(f) => heard.push(f.kind),
                    Err(ProtocolError::Aborted(_)) => heard.push(Kind::Abort),
                    Err(_) => break,
                }
            }
        }
        (err.expect("a failed migration"), heard)
    };
    (vm, err, heard)
}

#[test]
fn an_abort_after_complete_proves_the_destination_never_ran_it_so_it_runs_here() {
    let (vm, err, heard) = completed_then(Some(Kind::Abort));
    assert!(err.contains("no room"), "{err}");
    assert!(vm.runs(), "resumed here");
    assert_eq!(vm.resumed.load(Ordering::SeqCst), 1);
    assert!(!vm.dirty_log.load(Ordering::SeqCst), "dirty log off");
    assert_eq!(heard, [Kind::Abort], "the destination is told");
}

#[test]
fn any_other_answer_to_complete_leaves_the_vm_paused_in_doubt() {
    // A frame that is not Started, or silence: the destination may have
    // started the VM, so resuming here could run it twice.
    for answer in [Some(Kind::RoundAck), Some(Kind::Finished), None] {
        let (vm, err, heard) = completed_then(answer);
        assert!(!vm.runs(), "{answer:?}: never resumed ({err})");
        assert_eq!(vm.resumed.load(Ordering::SeqCst), 0);
        assert!(!vm.dirty_log.load(Ordering::SeqCst), "{answer:?}");
        assert!(
            !heard.contains(&Kind::Abort),
            "{answer:?}: no abort, which would say the VM runs here: {heard:?}"
        );
    }
}

#[test]
fn a_failure_before_complete_resumes_the_vm_and_tells_the_destination() {
    let (vm, to, opts) = (Vm::new(), to(), MigrateOptions::default());
    let (mut s, mut peer) = session(&vm, &to, &opts);
    s.pause().unwrap();
    let r = s.conclude(Err(MigrationError::Internal("a round failed".into())));
    assert!(r.is_err());
    assert!(vm.runs() && !vm.dirty_log.load(Ordering::SeqCst));
    let e = peer.read_frame().unwrap_err();
    assert!(
        matches!(e, ProtocolError::Aborted(ref m) if m.contains("a round failed")),
        "{e:?}"
    );
    // Before the pause, nothing is resumed: it never stopped.
    let vm = Vm::new();
    let (s, _peer) = session(&vm, &to, &opts);
    let _ = s.conclude(Err(MigrationError::Internal("no".into())));
    assert_eq!(vm.resumed.load(Ordering::SeqCst), 0);
    assert!(vm.runs());
}

/// A fenced source: whatever the destination answered to Complete, the VM
/// runs here again only if the registry gives it back; if the registry
/// says the destination holds it, it never runs here again and the
/// destination is not told to abort (it runs the VM); if the registry is
/// silent, it stays paused in doubt.
#[test]
fn a_fenced_source_resumes_after_complete_only_if_the_registry_gives_the_vm_back() {
    for answer in [Some(Kind::Abort), Some(Kind::RoundAck), None] {
        let back = TakeBackAnswer::Back("epoch 3".into());
        let gone = TakeBackAnswer::Gone("pid 9 on h2".into());
        let unknown = TakeBackAnswer::Unknown("etcd down".into());
        for (take_back, runs) in [
            (back, true),
            (gone.clone(), false),
            (unknown.clone(), false),
        ] {
            let fence = Fence::new(take_back.clone());
            let vm = Vm {
                fence: Some(fence.clone()),
                ..Vm::new()
            };
            let (vm, err, heard) = completed_with(vm, answer);
            let case = format!("{answer:?} then {take_back:?}: {err}");
            assert_eq!(fence.calls(), ["completing", "take_back"], "{case}");
            assert_eq!(vm.runs(), runs, "{case}");
            assert_eq!(vm.resumed.load(Ordering::SeqCst), u32::from(runs), "{case}");
            assert!(!vm.dirty_log.load(Ordering::SeqCst), "{case}");
            if take_back == gone {
                assert!(
                    err.contains("pid 9 on h2") && err.contains("runs there"),
                    "{case}"
                );
            }
            if take_back == unknown {
                assert!(
                    err.contains("etcd down") && err.contains("by itself"),
                    "{case}"
                );
            }
            if answer.is_some() {
                // Only a VM taken back here tells the destination to abort.
                assert_eq!(heard.contains(&Kind::Abort), runs, "{case}: {heard:?}");
            }
        }
    }
}

#[test]
fn a_fenced_source_hands_over_at_started_and_needs_no_take_back_before_complete() {
    let fence = Fence::new(TakeBackAnswer::Back("never asked".into()));
    let vm = Vm {
        fence: Some(fence.clone()),
        ..Vm::new()
    };
    let (to, opts) = (to(), MigrateOptions::default());
    {
        let (mut s, mut peer) = session(&vm, &to, &opts);
        s.pause().unwrap();
        let dest = std::thread::spawn(move || {
            peer.read_frame().unwrap(); // Complete
            peer.send(Kind::Started, &StartedReport::default()).unwrap();
            peer.flush().unwrap();
            peer
        });
        s.complete(SourcePhase::Done).unwrap();
        let _peer = dest.join().unwrap();
        s.conclude(done()).unwrap();
    }
    assert_eq!(fence.calls(), ["completing", "handed"]);
    assert!(!vm.runs());
    // Failing before Complete: the VM never left, so it resumes without
    // asking the registry.
    let fence = Fence::new(TakeBackAnswer::Gone("never asked".into()));
    let vm = Vm {
        fence: Some(fence.clone()),
        ..Vm::new()
    };
    {
        let (mut s, _peer) = session(&vm, &to, &opts);
        s.pause().unwrap();
        let _ = s.conclude(Err(MigrationError::Internal("a round failed".into())));
    }
    assert!(fence.calls().is_empty());
    assert!(vm.runs());
}

/// Postcopy and hybrid after their switch: the destination runs the VM, so
/// a failure then (a broken link, the destination gone) never asks for the
/// VM back — it stays paused here with its memory, whatever the registry
/// could say.
#[test]
fn a_fenced_source_after_a_postcopy_switch_never_takes_the_vm_back() {
    let fence = Fence::new(TakeBackAnswer::Back("would be wrong".into()));
    let vm = Vm {
        fence: Some(fence.clone()),
        ..Vm::new()
    };
    let (to, opts) = (to(), MigrateOptions::default());
    {
        let (mut s, mut peer) = session(&vm, &to, &opts);
        s.pause().unwrap();
        let dest = std::thread::spawn(move || {
            peer.read_frame().unwrap(); // Complete
            peer.send(Kind::Started, &StartedReport::default()).unwrap();
            peer.flush().unwrap();
            peer
        });
        s.complete(SourcePhase::Switched).unwrap();
        let _peer = dest.join().unwrap();
        let r = s.conclude(Err(MigrationError::Internal("the push failed".into())));
        assert!(r.is_err());
    }
    assert_eq!(fence.calls(), ["completing", "handed"]);
    assert!(!vm.runs());
    assert_eq!(vm.resumed.load(Ordering::SeqCst), 0);
}
