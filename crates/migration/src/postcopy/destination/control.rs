//! The control connection within one epoch of the phase: wait for the
//! source's next message for as long as pages keep landing, then answer
//! it (RoundDone: ack once every page landed; Verify: compare the hashes;
//! Complete: the fault report, and the phase ends). Apart from the
//! connection handling in `epoch` because this is the phase's protocol,
//! the same in every epoch; the silence rule is a pure [`Silence`] so it
//! is tested without a source.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Live, PostcopyDestination};
use crate::error::MigrationError;
use crate::protocol::{self, Kind, ProtocolError};
use crate::receiver::Received;
use crate::stats::DestinationStats;
use crate::transport::Conn;

impl PostcopyDestination<'_> {
    /// One connection epoch of the phase, until Complete or a failure.
    pub(super) fn serve(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut DestinationStats,
    ) -> Result<(), MigrationError> {
        let t0 = Instant::now();
        loop {
            self.wait_for_source(ctl, rx)?;
            let f = match protocol::read_frame(ctl.reader()) {
                Ok(f) => f,
                Err(e) => return Err(self.failure().unwrap_or(e.into())),
            };
            let live = self.live.as_ref().ok_or(ProtocolError::Closed)?;
            match f.kind {
                Kind::RoundDone => {
                    let rx = live.link.rx.as_deref().unwrap_or(rx);
                    let rd = crate::session::destination::round_done(&f, rx)?;
                    rx.barrier(&rd.frames, self.cx.timeout)?;
                    self.wait_landed(live)?;
                    tracing::info!(
                        secs = t0.elapsed().as_secs_f64(),
                        "postcopy: every page arrived"
                    );
                    ctl.send(Kind::RoundAck, &rd.round)?;
                }
                Kind::Verify => {
                    let mine = live.shared.tracker.hashes().unwrap_or_default();
                    stats.verified_pages =
                        crate::session::compare_hashes(&live.shared.regions, &mine, &f.body)?;
                }
                Kind::Complete => {
                    if live.shared.tracker.missing() > 0 {
                        return Err(ProtocolError::Unexpected {
                            got: Kind::Complete,
                            want: "every pending page first",
                        }
                        .into());
                    }
                    let report = self.report(live);
                    ctl.send(Kind::Finished, &report)?;
                    tracing::info!(
                        faults = report.faults,
                        major = report.major,
                        p50_us = report.latency_us.p50,
                        "postcopy finished"
                    );
                    stats.postcopy = Some(report);
                    return Ok(());
                }
                Kind::Abort => {
                    return Err(
                        ProtocolError::Aborted(String::from_utf8_lossy(&f.body).into()).into(),
                    )
                }
                k => {
                    return Err(ProtocolError::Unexpected {
                        got: k,
                        want: "RoundDone, Verify or Complete after the switch",
                    }
                    .into())
                }
            }
        }
    }

    /// Waits for the next control message for as long as pages keep
    /// landing (the push takes as long as memory takes to cross the link);
    /// a source that sends nothing for the session timeout is gone.
    fn wait_for_source(&self, ctl: &Conn, rx: &Received) -> Result<(), MigrationError> {
        let live = self.live.as_ref().ok_or(ProtocolError::Closed)?;
        let rx = live.link.rx.as_deref().unwrap_or(rx);
        let mut silence = Silence::new(live.shared.tracker.missing(), Instant::now());
        loop {
            if ctl.wait_readable(Duration::from_millis(100)) {
                return Ok(());
            }
            if let Some(e) = self.failure().or_else(|| rx.take_failure()) {
                return Err(e);
            }
            let missing = live.shared.tracker.missing();
            if silence.too_long(missing, Instant::now(), self.cx.timeout) {
                // A silent link counts as a broken one.
                return Err(ProtocolError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the source sent nothing for {:.0} s",
                        self.cx.timeout.as_secs_f64()
                    ),
                ))
                .into());
            }
        }
    }

    /// Waits until every pending page has landed.
    fn wait_landed(&self, live: &Live) -> Result<(), MigrationError> {
        let deadline = Instant::now() + self.cx.timeout;
        while live.shared.tracker.missing() > 0 {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(ProtocolError::Io(std::io::ErrorKind::TimedOut.into()).into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The fault report, once every page is here (the guest's counters
    /// read true then).
    pub(super) fn report(&self, live: &Live) -> crate::stats::FaultReport {
        let vcpus: Vec<u32> = self.cx.vm.vcpu_tids();
        let own = |tid: u32| std::path::Path::new(&format!("/proc/self/task/{tid}")).exists();
        let absorbed = self
            .guest_apf_base
            .zip(self.cx.vm.guest_apf_count())
            .map(|(base, now)| now.saturating_sub(base));
        let mut report = live.shared.tracker.report(&vcpus, &own, absorbed);
        let s = live.shared.sink.stats();
        report.supplied_pages = s.copied + s.zero_filled;
        report.kept_pages = s.kept;
        report.demand_pages = live.shared.demand_pages.load(Ordering::Relaxed);
        report
    }
}

/// Whether the source has gone quiet: no control message, and the count of
/// missing pages unchanged for the session timeout (landing pages show a
/// push still crossing the link, however long it takes).
#[derive(Clone, Copy, Debug)]
struct Silence {
    missing: u64,
    /// When `missing` last changed.
    since: Instant,
}

impl Silence {
    fn new(missing: u64, now: Instant) -> Self {
        Silence {
            missing,
            since: now,
        }
    }

    /// Notes `missing` at `now`: true once it stayed the same for `timeout`.
    fn too_long(&mut self, missing: u64, now: Instant, timeout: Duration) -> bool {
        if missing != self.missing {
            (self.missing, self.since) = (missing, now);
            false
        } else {
            now.duration_since(self.since) >= timeout
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_counts_from_the_last_landed_page() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = Silence::new(10, t0);
        assert!(!w.too_long(10, t0 + s * 4, s * 5), "4 s quiet of 5");
        assert!(
            !w.too_long(9, t0 + s * 6, s * 5),
            "a page landed: not quiet"
        );
        assert!(!w.too_long(9, t0 + s * 10, s * 5), "4 s since the page");
        assert!(w.too_long(9, t0 + s * 11, s * 5), "5 s since the page");
        assert!(w.too_long(9, t0 + s * 30, s * 5), "and stays so");
    }

    #[test]
    fn any_change_of_the_missing_count_restarts_the_clock() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut w = Silence::new(0, t0);
        // More missing (a resume's count) is a change too.
        assert!(!w.too_long(3, t0 + s * 9, s * 2));
        assert!(!w.too_long(3, t0 + s * 10, s * 2));
        assert!(w.too_long(3, t0 + s * 11, s * 2));
        // Nothing missing and nothing said is silence as well.
        let mut done = Silence::new(0, t0);
        assert!(!done.too_long(0, t0 + s, s * 2));
        assert!(done.too_long(0, t0 + s * 2, s * 2));
    }
}
