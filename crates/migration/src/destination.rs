//! The destination's entry point: receives one migration into a waiting VM
//! and starts it.

use std::time::Duration;

use crate::error::MigrationError;
use crate::protocol::{Frame, Kind};
use crate::receiver::Received;
use crate::session::{DestSession, DestinationContext, DestinationMode};
use crate::sink::{DirectSink, SwitchSink};
use crate::stats::DestinationStats;
use crate::transport::Conn;
use crate::transport::Listener;
use crate::vm::DestinationVm;

/// Receives one migration into `vm` through `listener`; `timeout` bounds
/// each step once a source has connected (waiting for one is unbounded).
/// Returns once the VM runs here and (after a postcopy switch) all its
/// memory arrived. On failure the VM was never started, unless the error is
/// [`MigrationError::PagesLost`].
pub fn receive(
    vm: &dyn DestinationVm,
    listener: &Listener,
    timeout: Duration,
) -> Result<DestinationStats, MigrationError> {
    let reconnect = Duration::from_millis(crate::options::defaults::INCOMING_RECONNECT_TIMEOUT_MS);
    receive_with_reconnect(vm, listener, timeout, reconnect)
}

/// [`receive`], where a postcopy whose link broke waits `reconnect_timeout`
/// for its source to come back before the VM is given up.
pub fn receive_with_reconnect(
    vm: &dyn DestinationVm,
    listener: &Listener,
    timeout: Duration,
    reconnect_timeout: Duration,
) -> Result<DestinationStats, MigrationError> {
    let mut session = DestSession::accept(listener, timeout, vm)?;
    vm.admitted();
    let direct = DirectSink::new(vm);
    // Pages land straight in memory until a postcopy switch, then through
    // userfaultfd (the plan tells; precopy never switches).
    let sink = SwitchSink::new(&direct);
    let mut phases = Phases {
        mode: DestMode::Precopy,
        cx: DestinationContext {
            vm,
            listener,
            session: session.session_id(),
            timeout,
            reconnect_timeout,
            sink: &sink,
        },
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

/// The destination's mode, picked by the first plan message that arrives:
/// none is a precopy (the session's own defaults), a PostcopyPlan (or a
/// hybrid's DropAhead before it) makes it postcopy's (pure or hybrid), a
/// SplitPlan or GatherPlan split's.
enum DestMode<'a> {
    Precopy,
    Postcopy(crate::postcopy::PostcopyDestination<'a>),
    Split(crate::split::destination::SplitDestination<'a>),
}

/// The session's hooks, handed to the mode picked so far, and what it
/// takes to make one.
struct Phases<'a> {
    mode: DestMode<'a>,
    cx: DestinationContext<'a>,
}

impl<'a> Phases<'a> {
    /// The mode `f` asks for, made on its first plan message; a second
    /// plan of another mode is refused.
    fn pick(&mut self, f: &Frame) -> Result<&mut dyn DestinationMode, MigrationError> {
        let wanted = match f.kind {
            Kind::PostcopyPlan | Kind::DropAhead => Some(Kind::PostcopyPlan),
            Kind::SplitPlan | Kind::GatherPlan => Some(Kind::SplitPlan),
            _ => None,
        };
        if let (DestMode::Precopy, Some(kind)) = (&self.mode, wanted) {
            self.mode = if kind == Kind::PostcopyPlan {
                DestMode::Postcopy(crate::postcopy::PostcopyDestination::new(self.cx))
            } else {
                DestMode::Split(crate::split::destination::SplitDestination::new(self.cx))
            };
        }
        Ok(match &mut self.mode {
            DestMode::Precopy => return Err(unexpected(f)),
            DestMode::Postcopy(p) => p,
            DestMode::Split(sp) => sp,
        })
    }

    fn current(&mut self) -> Option<&mut dyn DestinationMode> {
        match &mut self.mode {
            DestMode::Precopy => None,
            DestMode::Postcopy(p) => Some(p),
            DestMode::Split(sp) => Some(sp),
        }
    }
}

fn unexpected(f: &Frame) -> MigrationError {
    crate::protocol::ProtocolError::Unexpected {
        got: f.kind,
        want: "RoundDone, State, Verify, a plan or Complete",
    }
    .into()
}

impl DestinationMode for Phases<'_> {
    fn on_message(&mut self, f: &Frame, ctl: &mut Conn) -> Result<(), MigrationError> {
        self.pick(f)?.on_message(f, ctl)
    }

    fn hashes(
        &mut self,
        regions: &[crate::memory::RegionView],
    ) -> Result<Option<Vec<u64>>, MigrationError> {
        match self.current() {
            Some(m) => m.hashes(regions),
            None => Ok(None),
        }
    }

    fn before_start(&mut self, rounds: u32) -> Result<(), MigrationError> {
        match self.current() {
            Some(m) => m.before_start(rounds),
            None => Ok(()),
        }
    }

    fn after_start(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut DestinationStats,
    ) -> Result<bool, MigrationError> {
        match self.current() {
            Some(m) => m.after_start(ctl, rx, stats),
            None => Ok(false),
        }
    }
}
