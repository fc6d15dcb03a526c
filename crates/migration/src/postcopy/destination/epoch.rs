//! The phase's connection epochs: an epoch's connections and their landing
//! threads ([`Link`], [`Shared::connect`], the demand lander), and what
//! happens when the link breaks: the phase pauses, waits for the source to
//! come back as the same session, tells it the pages still missing and
//! starts the next epoch; or, when it does not come back, ends well if
//! every page is here. Apart from the hooks because a pause touches every
//! connection and thread of the phase but none of its start or its account.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use super::{spawn, PostcopyDestination, Shared};
use crate::error::MigrationError;
use crate::protocol::{self, Kind, ProtocolError, Role};
use crate::receiver::Received;
use crate::stats::DestinationStats;
use crate::transport::{Closer, Conn, ConnReader};

/// One connection epoch of the phase: the demand connection's landing
/// thread and, after a resume, the bulk streams' (the first epoch's bulk
/// streams belong to the session).
#[derive(Default)]
pub(super) struct Link {
    socks: Vec<Closer>,
    threads: Vec<JoinHandle<()>>,
    /// The resumed bulk streams' frame counts and failures.
    pub(super) rx: Option<Arc<Received>>,
}

impl Link {
    /// Shuts the connections and waits for their threads.
    pub(super) fn cut(&mut self) {
        if let Some(rx) = &self.rx {
            rx.stop();
        }
        for s in &self.socks {
            s.shutdown();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl PostcopyDestination<'_> {
    /// The phase: serve the source until it says Complete; on a broken
    /// link, pause and wait for it to resume.
    pub(super) fn run_phase(
        &mut self,
        ctl: &mut Conn,
        rx: &Received,
        stats: &mut DestinationStats,
    ) -> Result<(), MigrationError> {
        loop {
            match self.serve(ctl, rx, stats) {
                Err(e) if e.is_link_break() => {
                    let t = Instant::now();
                    let missing = self.live.as_ref().map_or(0, |l| l.shared.tracker.missing());
                    tracing::warn!(
                        error = %e,
                        missing,
                        wait_s = self.cx.reconnect_timeout.as_secs_f64(),
                        "postcopy paused: the link to the source broke; the VM runs on, vCPUs touching a missing page wait for the source to reconnect"
                    );
                    self.tel.event("link_broken", e.to_string());
                    self.tel.set_phase(crate::telemetry::LivePhase::Paused);
                    ctl.shutdown();
                    rx.cut();
                    if let Some(live) = self.live.as_mut() {
                        // Sockets first: a fault thread blocked writing a
                        // request holds the writer until its socket is shut.
                        live.link.cut();
                        live.shared.requests_to(None);
                        // Failures of the cut connections are this pause.
                        let _ = live.shared.take_failure();
                    }
                    let resumed = self.await_resume(&e);
                    // The streams of the switch's own link were cut with
                    // it: a reset one of them read is this same break, not
                    // a cause to report later (the session prefers a bulk
                    // stream's failure to the phase's own).
                    let _ = rx.take_failure();
                    *ctl = match resumed {
                        Ok(c) => c,
                        Err(gone) => {
                            self.end_without_source(gone, stats)?;
                            self.pauses += 1;
                            self.paused += t.elapsed();
                            return Ok(());
                        }
                    };
                    ctl.count_into(self.tel.link(&protocol::Role::Control.link_name()));
                    self.tel.set_phase(crate::telemetry::LivePhase::Postcopy);
                    self.pauses += 1;
                    self.paused += t.elapsed();
                    tracing::info!(paused_s = t.elapsed().as_secs_f64(), "postcopy resumed");
                }
                r => return r,
            }
        }
    }

    /// The source did not come back (`gone`). With every page here the VM
    /// needs nothing more from it: the phase ends well, with this side's
    /// report, and only the source's last word is lost. Else `gone`.
    fn end_without_source(
        &mut self,
        gone: MigrationError,
        stats: &mut DestinationStats,
    ) -> Result<(), MigrationError> {
        let Some(live) = self
            .live
            .as_ref()
            .filter(|l| l.shared.tracker.missing() == 0)
        else {
            return Err(gone);
        };
        let verified = if stats.verified_pages > 0 {
            "verified"
        } else {
            "not verified"
        };
        tracing::warn!(
            error = %gone,
            verified,
            "postcopy: the source did not come back, but every page had arrived; the VM runs on"
        );
        self.tel.event(
            "finished",
            format!("every page arrived ({verified}); the source's last word is lost: {gone}"),
        );
        stats.postcopy = Some(self.report(live));
        Ok(())
    }

    /// Waits for this session's source to connect again (Role::Resume),
    /// tells it the pages still missing, and takes its new demand and bulk
    /// connections. Gives up after the reconnect timeout.
    fn await_resume(&mut self, why: &MigrationError) -> Result<Conn, MigrationError> {
        let deadline = Instant::now() + self.cx.reconnect_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MigrationError::Unsupported(format!(
                    "the link to the source broke ({why}) and the source did not come back within {:.0} s",
                    self.cx.reconnect_timeout.as_secs_f64()
                )));
            }
            let session = self.cx.session;
            let (mut c, h) = match self
                .cx
                .listener
                .accept_matching(left, |h| h.role == Role::Resume && h.session == session)
            {
                Ok(got) => got,
                Err(MigrationError::Listen { source, .. })
                    if source.kind() != std::io::ErrorKind::TimedOut =>
                {
                    return Err(MigrationError::Listen {
                        addr: self.cx.listener.endpoint().to_string(),
                        source,
                    })
                }
                Err(_) => continue,
            };
            match self.resume_with(&mut c, &h) {
                Ok(()) => return Ok(c),
                Err(e) => {
                    tracing::warn!(error = %e, "a resume attempt failed; waiting for another");
                    if !e.is_link_break() {
                        c.abort(&e.to_string());
                    }
                }
            }
        }
    }

    /// The resume handshake on `c`: version, the missing pages, the new
    /// connections; then the waiting faults are asked for again.
    fn resume_with(&mut self, c: &mut Conn, h: &protocol::Hello) -> Result<(), MigrationError> {
        let version = protocol::negotiate(h)?;
        if !crate::protocol::Caps::of(version).resume() {
            return Err(MigrationError::Unsupported(format!(
                "resuming needs protocol v{}, the source speaks v{version}",
                protocol::VERSION_RESUME
            )));
        }
        c.send(Kind::HelloAck, &version)?;
        let missing = self
            .live
            .as_ref()
            .ok_or(ProtocolError::Closed)?
            .shared
            .tracker
            .missing_runs();
        for (share, last) in protocol::run_frames(&missing) {
            let part = protocol::PostcopyResume {
                missing: share.to_vec(),
                last,
            };
            protocol::send(c.writer(), Kind::PostcopyResume, &part)?;
        }
        c.flush()?;
        // The source opens its demand connection, then the bulk streams.
        let demand = self.accept_demand()?;
        let bulk = crate::session::destination::accept_bulk(
            self.cx.listener,
            self.cx.timeout,
            self.cx.session,
            h.streams,
            &self.tel,
        )?;
        let live = self.live.as_mut().ok_or(ProtocolError::Closed)?;
        live.link = live.shared.connect(demand, bulk)?;
        let again = live.shared.tracker.waiting_pages();
        tracing::info!(
            missing = live.shared.tracker.missing(),
            asked_again = again.len(),
            "postcopy resuming"
        );
        live.shared.request(&again);
        Ok(())
    }
}

impl Shared {
    /// Starts a connection epoch: requests go out on `demand`, its answers
    /// and (after a resume) the `bulk` streams land on threads of their own.
    pub(super) fn connect(
        self: &Arc<Self>,
        demand: Conn,
        bulk: Vec<Conn>,
    ) -> Result<Link, MigrationError> {
        let mut link = Link::default();
        let _ = demand.set_read_timeout(None);
        link.socks.push(demand.closer().map_err(ProtocolError::Io)?);
        let (reader, writer) = demand.into_parts();
        let sh = self.clone();
        link.threads.push(spawn("postcopy-demand", move || {
            if let Err(e) = sh.land_demand(reader) {
                sh.fail(e);
            }
        })?);
        if !bulk.is_empty() {
            let rx = Arc::new(Received::new(bulk.len()));
            for (i, c) in bulk.into_iter().enumerate() {
                link.socks.push(c.closer().map_err(ProtocolError::Io)?);
                let (reader, _) = c.into_parts();
                let (sh, rx2) = (self.clone(), rx.clone());
                link.threads.push(spawn("postcopy-bulk", move || {
                    let sink: &dyn crate::sink::PageSink = sh.sink.as_ref();
                    if let Err(e) = crate::receiver::bulk_loop(&sh.regions, sink, reader, i, &rx2) {
                        rx2.fail(i, e);
                    }
                })?);
            }
            link.rx = Some(rx);
        }
        self.requests_to(Some(writer));
        Ok(link)
    }

    /// Lands the source's answers until the connection closes.
    fn land_demand(&self, mut r: ConnReader) -> Result<(), MigrationError> {
        crate::priority::fault_path();
        let (mut scratch, mut data) = (Vec::new(), Vec::new());
        loop {
            let h = match protocol::read_header(&mut r) {
                Err(ProtocolError::Closed) => return Ok(()),
                Err(e) => return Err(e.into()),
                Ok(h) => h,
            };
            if h.kind != Kind::Pages {
                return Err(ProtocolError::Unexpected {
                    got: h.kind,
                    want: "Pages on the demand connection",
                }
                .into());
            }
            let n = crate::pagein::read_pages(
                &mut r,
                &h,
                &self.regions,
                self.sink.as_ref(),
                &mut scratch,
                &mut data,
            )?;
            self.demand_pages.fetch_add(n, Ordering::Relaxed);
        }
    }
}
