//! The session's links: the control connection and its opening (version
//! and capabilities, token, layout and the opening asks), the bulk streams,
//! and a paused postcopy's reconnection.

use std::time::{Duration, Instant};

use super::SourceSession;
use crate::encoded::CodecSetup;
use crate::error::MigrationError;
use crate::protocol::{self, Caps, Hello, Kind, ProtocolError, Role};
use crate::transport::Conn;

impl SourceSession<'_> {
    /// The control connection.
    pub(crate) fn ctl(&mut self) -> Result<&mut Conn, MigrationError> {
        self.ctl.as_mut().ok_or(ProtocolError::Closed.into())
    }

    pub(super) fn hello(&self, role: Role) -> Hello {
        Hello {
            version_min: protocol::VERSION_MIN,
            version_max: protocol::VERSION_MAX,
            role,
            session: self.id,
            streams: self.opts.streams.max(1),
        }
    }

    /// Counts `c`'s bytes as the connection of `role`.
    pub(super) fn metered(&self, mut c: Conn, role: Role) -> Conn {
        c.count_into(self.tel.link(&role.link_name()));
        c
    }

    /// Connects, agrees on a version and checks the layout.
    pub(crate) fn open(&mut self) -> Result<(), MigrationError> {
        let hello = self.hello(Role::Control);
        let ctl = self.ctl.insert(self.metered(
            Conn::open(self.to, self.opts.timeout(), &hello)?,
            Role::Control,
        ));
        ctl.flush()?;
        self.caps = Caps::of(ctl.recv(Kind::HelloAck)?);
        if self.caps.trust() {
            let token = self.opts.token.clone();
            self.ctl()?.send(Kind::Token, &token)?;
        }
        let layout = crate::session::layout_of(&self.regions, self.vm.vcpus());
        self.ctl()?.send(Kind::Layout, &layout)?;
        self.plan_clients()?;
        if self.caps.timeline() {
            let tail = self.opts.timeline_tail_ms;
            self.ctl()?.send(Kind::TimelineAsk, &tail)?;
        }
        if self.caps.landed_hashes() {
            // The copy modes compare hashes taken as pages go and land, so
            // a verified move hashes nothing in the pause: a hybrid that
            // converges verifies as a precopy does; one that switches
            // leaves the tables unused and verifies as postcopy does, at
            // its end. Split and gather land pages elsewhere, and postcopy
            // sends each page once: they hash memory when they verify.
            use crate::options::Mode;
            let hash = self.opts.verify && matches!(self.opts.mode, Mode::Precopy | Mode::Hybrid);
            self.ctl()?.send(Kind::HashAsk, &hash)?;
            if hash {
                let table = crate::verify::PageHashes::new(&self.regions);
                self.sent_hashes = Some(std::sync::Arc::new(table));
            }
        }
        if self.caps.switch_ahead() {
            use crate::options::Mode;
            // These modes need the pages still to come missing at the
            // destination when they switch; it makes them so now, while the
            // guest still runs here, instead of in the pause.
            let ahead = matches!(self.opts.mode, Mode::Postcopy | Mode::Hybrid | Mode::Split);
            self.ctl()?.send(Kind::SwitchAhead, &ahead)?;
            if ahead {
                self.released_ahead = self.ctl()?.recv(Kind::SwitchReady)?;
                tracing::info!(
                    bytes = self.released_ahead,
                    "destination gave back memory populated ahead"
                );
            }
        }
        if self.caps.shared_pages() {
            use crate::options::Mode;
            // Only the copy rounds send references (a miss goes again in
            // the next round); postcopy and split pages have no next round.
            let ask = matches!(self.opts.mode, Mode::Precopy | Mode::Hybrid);
            self.ctl()?.send(Kind::ShareAsk, &ask)?;
            if ask {
                let offer = crate::shared::recv_offer(self.ctl()?)?;
                tracing::info!(
                    keys = offer.len(),
                    "the destination's host offers pages it holds"
                );
                self.shared = Some(std::sync::Arc::new(offer));
            }
        }
        if self.caps.answers_follow() {
            self.ask_answers_held()?;
        }
        self.send_owner_claim()?;
        let total: u64 = self.regions.iter().map(|r| r.size()).sum();
        self.tel.set_total_bytes(total);
        self.tel.set_phase(self.state.phase().live());
        self.tel
            .event("open", format!("{} v{}", self.to, self.caps.version()));
        tracing::info!(to = %self.to, version = self.caps.version(), "migration session open");
        Ok(())
    }

    /// Names the ownership claim this process holds (v18), so the
    /// destination takes the VM from exactly it. A fenced VM is not sent to
    /// a destination that cannot take it that way, nor sent at all by a
    /// process that does not hold it.
    fn send_owner_claim(&mut self) -> Result<(), MigrationError> {
        let claim = match self.vm.fence() {
            None => None,
            Some(f) => Some(f.claim().ok_or_else(|| {
                MigrationError::Fence(
                    "this process does not hold the VM in the registry: it may not move it".into(),
                )
            })?),
        };
        if self.caps.owner() {
            self.ctl()?.send(Kind::Owner, &claim)?;
        } else if claim.is_some() {
            return Err(MigrationError::Fence(format!(
                "the destination speaks protocol v{}, which cannot take a fenced VM from its \
                 claim: upgrade it",
                self.caps.version()
            )));
        }
        Ok(())
    }

    /// Opens one more connection of this session in `role`.
    pub(crate) fn open_role(&self, role: Role) -> Result<Conn, MigrationError> {
        let c = Conn::open(self.to, self.opts.timeout(), &self.hello(role))?;
        Ok(self.metered(c, role))
    }

    /// Opens the bulk streams; with `codec`, each announces its codec caches.
    pub(crate) fn open_bulk(&mut self, codec: Option<&CodecSetup>) -> Result<(), MigrationError> {
        for i in 0..self.opts.streams.max(1) {
            let mut c = self.open_role(Role::Bulk(i))?;
            if let Some(setup) = codec {
                protocol::send(c.writer(), Kind::Codec, setup)?;
            }
            c.flush()?;
            self.bulk.push(c);
        }
        Ok(())
    }

    /// Closes every connection (a broken link: the threads blocked on them
    /// end, and the peer sees them go).
    pub(crate) fn drop_links(&mut self) {
        for c in self.ctl.iter().chain(self.bulk.iter()) {
            c.shutdown();
        }
        self.ctl = None;
        self.bulk.clear();
    }

    /// After a broken link in postcopy: connects again as this session
    /// (retrying until `within` ran out) and returns the pages the
    /// destination still lacks, with the new demand connection; the bulk
    /// streams are open again. A destination that refuses (it gave up, or
    /// has no such session) ends the attempt at once.
    pub(crate) fn reconnect(
        &mut self,
        within: Duration,
    ) -> Result<(Vec<crate::ranges::GpaPages>, Conn), MigrationError> {
        let deadline = Instant::now() + within;
        loop {
            match self.reconnect_once() {
                Ok(r) => return Ok(r),
                Err(e) if e.is_peer_abort() || !e.is_link_break() => return Err(e),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(e) if refused(&e) => {
                    // Nobody listens there any more. If the registry also
                    // says the destination that holds the VM stopped
                    // renewing, it is dead: waiting out the timeout would
                    // only hide that.
                    if let Some(gone) = self.vm().fence().and_then(|f| f.holder_gone()) {
                        return Err(MigrationError::Fence(format!(
                            "the destination refuses connections ({e}); {gone}"
                        )));
                    }
                    tracing::debug!(error = %e, "reconnect refused; retrying");
                    self.drop_links();
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reconnect failed; retrying");
                    self.drop_links();
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
        }
    }

    pub(super) fn reconnect_once(
        &mut self,
    ) -> Result<(Vec<crate::ranges::GpaPages>, Conn), MigrationError> {
        let hello = self.hello(Role::Resume);
        let ctl = self.ctl.insert(self.metered(
            Conn::open(self.to, self.opts.timeout(), &hello)?,
            Role::Resume,
        ));
        ctl.flush()?;
        let version: u16 = ctl.recv(Kind::HelloAck)?;
        if !Caps::of(version).resume() {
            return Err(MigrationError::Unsupported(format!(
                "the destination resumed with protocol v{version}; resuming needs v{}",
                protocol::VERSION_RESUME
            )));
        }
        let mut missing = Vec::new();
        loop {
            let part: protocol::PostcopyResume = ctl.recv(Kind::PostcopyResume)?;
            missing.extend(part.missing);
            if part.last {
                break;
            }
        }
        let mut demand = self.open_role(Role::Demand)?;
        demand.flush()?;
        self.open_bulk(None)?;
        Ok((missing, demand))
    }
}

/// A connect that the destination's host refused: no process listens on
/// its port (a dead VMM), unlike a cut or silent link.
fn refused(e: &MigrationError) -> bool {
    matches!(e, MigrationError::Connect { source, .. }
        if source.kind() == std::io::ErrorKind::ConnectionRefused)
}
