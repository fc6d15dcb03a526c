//! The destination's entry point: receives one migration into a waiting VM
//! and starts it.

use std::time::Duration;

use crate::protocol::{Frame, Kind};
use crate::receiver::Received;
use crate::session::{DestSession, DestinationPhases};
use crate::sink::{DirectSink, SwitchSink};
use crate::stats::IncomingStats;
use crate::transport::Conn;
use crate::transport::Listener;
use crate::vm::IncomingVm;
use crate::MigrationError;

/// Receives one migration into `vm` through `listener`; `timeout` bounds
/// each step once a source has connected (waiting for one is unbounded).
/// Returns once the VM runs here and (after a postcopy switch) all its
/// memory arrived. On failure the VM was never started, unless the error is
/// [`MigrationError::PagesLost`].
pub fn receive(
    vm: &dyn IncomingVm,
    listener: &Listener,
    timeout: Duration,
) -> Result<IncomingStats, MigrationError> {
    let reconnect = Duration::from_millis(crate::options::defaults::INCOMING_RECONNECT_TIMEOUT_MS);
    receive_with_reconnect(vm, listener, timeout, reconnect)
}

/// [`receive`], where a postcopy whose link broke waits `reconnect_timeout`
/// for its source to come back before the VM is given up.
pub fn receive_with_reconnect(
    vm: &dyn IncomingVm,
    listener: &Listener,
    timeout: Duration,
    reconnect_timeout: Duration,
) -> Result<IncomingStats, MigrationError> {
    let mut session = DestSession::accept(listener, timeout)?;
    let direct = DirectSink::new(vm);
    // Pages land straight in memory until a postcopy switch, then through
    // userfaultfd (the plan tells; precopy never switches).
    let sink = SwitchSink::new(&direct);
    let id = session.session_id();
    let mut phases = Phases {
        postcopy: crate::postcopy::Incoming::new(
            vm,
            listener,
            id,
            timeout,
            reconnect_timeout,
            &sink,
        ),
        split: crate::split::incoming::Incoming::new(vm, timeout, &sink),
    };
    let result = (|| {
        session.handshake(vm)?;
        session.run(vm, &sink, &mut phases)
    })();
    drop(phases);
    if result.is_ok() {
        session.send_timeline(vm);
    }
    session.conclude(result)
}

/// A destination's phases: postcopy's (which also serve precopy and
/// hybrid), or split's once a SplitPlan arrived.
struct Phases<'a> {
    postcopy: crate::postcopy::Incoming<'a>,
    split: crate::split::incoming::Incoming<'a>,
}

impl DestinationPhases for Phases<'_> {
    fn on_message(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        match f.kind {
            Kind::SplitPlan => self.split.on_plan(f),
            Kind::GatherPlan => self.split.on_gather(f, ctl),
            _ => self.postcopy.on_message(f, ctl),
        }
    }

    fn hashes(
        &mut self,
        regions: &[crate::RegionView],
    ) -> Result<Option<Vec<u64>>, MigrationError> {
        if self.split.planned() {
            return self.split.hashes(regions).map(Some);
        }
        self.postcopy.hashes(regions)
    }

    fn before_start(&mut self, rounds: u32) -> Result<(), MigrationError> {
        if self.split.planned() {
            return self.split.before_start();
        }
        self.postcopy.before_start(rounds)
    }

    fn after_start(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut IncomingStats,
    ) -> Result<bool, MigrationError> {
        if self.split.planned() {
            self.split.after_start()?;
            return Ok(false);
        }
        self.postcopy.after_start(ctl, rx, stats)
    }
}
