//! The VM's clients: whether they move with it (the destination says), the
//! answers of those that stay, and their connections sent in the pause.

use super::SourceSession;
use crate::error::MigrationError;
use crate::protocol::{self, Kind, ProtocolError};
use crate::stats::StartedReport;
use crate::vm::ClientsAnswer;

impl SourceSession<'_> {
    /// Asks the destination whether the VM's clients can move with it
    /// (v5), and tells the VM the answer.
    pub(super) fn plan_clients(&mut self) -> Result<(), MigrationError> {
        let plan = self.vm.clients_plan();
        let answer = if self.caps.clients() {
            self.ctl()?.send(Kind::ClientsPlan, &plan)?;
            if plan.is_none() {
                return Ok(());
            }
            self.ctl()?.recv::<ClientsAnswer>(Kind::ClientsAnswer)?
        } else if plan.is_some() {
            ClientsAnswer::Stay(format!(
                "the destination speaks protocol v{}; moving clients needs v{}",
                self.caps.version(),
                protocol::VERSION_CLIENTS
            ))
        } else {
            return Ok(());
        };
        tracing::info!(?answer, "clients");
        self.clients_move = answer == ClientsAnswer::Move;
        self.clients = Some(crate::stats::ClientsOutcome {
            moved: self.clients_move,
            connections: 0,
            detail: match &answer {
                ClientsAnswer::Move => String::new(),
                ClientsAnswer::Stay(why) => why.clone(),
            },
        });
        self.vm.clients_decided(&answer);
        Ok(())
    }

    /// Clients that stay here (forwarded) may have requests in the ring at
    /// the pause (v16): asks the destination to hold their answers under a
    /// fresh token, and tells the VM when it does, so its pause need not
    /// wait for the guest to answer them here.
    pub(super) fn ask_answers_held(&mut self) -> Result<(), MigrationError> {
        let token = if self.clients_move || !self.vm.answers_may_follow() {
            None
        } else {
            let mut t = [0u8; 16];
            crate::random::fill(&mut t)
                .map_err(|e| MigrationError::Internal(format!("no random token: {e}")))?;
            Some(t)
        };
        self.ctl()?.send(Kind::AnswersAsk, &token)?;
        let Some(token) = token else {
            return Ok(());
        };
        let held: bool = self.ctl()?.recv(Kind::AnswersHeld)?;
        tracing::info!(held, "answers to requests in flight at the pause");
        if held {
            self.vm.answers_follow(token);
        }
        Ok(())
    }

    /// Checkpoints the clients' connections and sends them (Clients).
    pub(super) fn send_clients(&mut self) -> Result<(), MigrationError> {
        let clients = self
            .vm
            .save_clients()
            .map_err(MigrationError::vm("checkpoint the clients"))?;
        protocol::write_frame(self.ctl()?.writer(), Kind::Clients, &clients)
            .map_err(ProtocolError::Io)?;
        self.clients_sent = true;
        Ok(())
    }

    /// From v15, in the pause right after State: the clients that move go
    /// now, so the destination restores their connections (parked) while
    /// the last round arrives instead of after Complete. Their time off
    /// this host is no longer: the restore there overlaps the round.
    /// Returns whether they went (the downtime's clients part is then the
    /// caller's lap).
    pub(crate) fn send_clients_early(&mut self) -> Result<bool, MigrationError> {
        if !self.clients_move || !self.caps.early_state() {
            return Ok(false);
        }
        self.send_clients()?;
        Ok(true)
    }

    /// Records in `stats` what the switch cost and brought: `ms` ran from
    /// the end of the previous downtime part until Started, of which the
    /// clients' checkpoint was this side's and the rest the destination's.
    pub(crate) fn note_started(
        &self,
        stats: &mut crate::stats::MigrationStats,
        report: &StartedReport,
        ms: f64,
    ) {
        let parts = &mut stats.downtime_parts;
        if self.clients_ms > 0.0 {
            // Checkpointed in complete(), inside this lap.
            parts.clients = self.clients_ms;
        }
        parts.destination = ms - self.clients_ms;
        // The destination starts hashing as the Verify frame arrives,
        // while this side is still finishing its own part: only what falls
        // in the destination's part counts there (the parts add up to the
        // downtime, and this one lies inside its part).
        parts.destination_verify = report.verify_ms.min(parts.destination);
        stats.clients = self.clients.clone();
        stats.destination_service = report.service.clone();
        stats.destination_released_bytes = self.released_ahead;
        stats.shared_offered = self.shared.as_ref().map_or(0, |o| o.len() as u64);
    }
}
