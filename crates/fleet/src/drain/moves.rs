//! One move's phases and the rule that a drain never loses a VM, as data.
//!
//! A move goes Waiting → Preparing (the destination's VMM, memory servers
//! and standby are started) → Moving (the source was asked to send) →
//! Done | Failed | LeftAlone; a failed move may wait again for another
//! host. [`MoveState::may_go_to`] says which steps exist, and every step a
//! drain takes is checked against it.
//!
//! What a failure leaves where is decided by [`Failure::outcome`] alone, in
//! the way `session/state.rs` decides a migration's cleanup: before the
//! source was asked to send, the VM runs at the source and what was started
//! for it goes; once it was asked, the destination's agent is asked what it
//! holds ([`Seen`]): a running copy there means the move is done (stopping
//! it would lose the VM), a VMM still waiting means the VM stayed at the
//! source, and anything else (a VMM that does not answer, an agent that
//! does not answer, no copy listed) means nobody knows where the newest
//! copy is, so every copy, the standby's included, is left alone and the
//! move is not retried. Above both stands the registry's owner record of a
//! fenced VM ([`Holds`], docs/safety.md): the host whose process holds the
//! VM is where it runs, whatever an agent says or fails to say.

/// Where a move stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoveState {
    /// Not started.
    Waiting,
    /// The destination is being made ready.
    Preparing,
    /// Pages are moving.
    Moving,
    /// The VM runs at the destination.
    Done,
    /// It stays where it was.
    Failed,
    /// Where its newest copy runs is not known: nothing was stopped, and a
    /// later drain (or the operator) settles it.
    #[serde(rename = "left-alone")]
    LeftAlone,
}

/// A step between phases that does not exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a move cannot go from {from:?} to {to:?}")]
pub struct IllegalStep {
    /// Where it stood.
    pub from: MoveState,
    /// Where it was asked to go.
    pub to: MoveState,
}

impl MoveState {
    /// True if a move may go from this phase to `next`.
    pub fn may_go_to(self, next: MoveState) -> bool {
        use MoveState::*;
        matches!(
            (self, next),
            (Waiting, Preparing)
                | (Preparing, Moving | Failed)
                | (Moving, Done | Failed | LeftAlone)
                | (Failed, Waiting)
        )
    }

    /// `next`, if this phase may go there.
    pub fn step(self, next: MoveState) -> Result<MoveState, IllegalStep> {
        if self.may_go_to(next) {
            Ok(next)
        } else {
            Err(IllegalStep {
                from: self,
                to: next,
            })
        }
    }

    /// True once the move has ended (one way or another).
    pub fn ended(self) -> bool {
        matches!(
            self,
            MoveState::Done | MoveState::Failed | MoveState::LeftAlone
        )
    }

    /// The phase's name as the CLI and the journal show it.
    pub fn name(self) -> &'static str {
        match self {
            MoveState::Waiting => "waiting",
            MoveState::Preparing => "preparing",
            MoveState::Moving => "moving",
            MoveState::Done => "done",
            MoveState::Failed => "failed",
            MoveState::LeftAlone => "left alone",
        }
    }
}

/// What the destination's agent says of the VM after the source's answer
/// to a send was an error, or was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Its VMM there runs the VM (by postcopy it may still be fetching
    /// pages): in the agent's words.
    Arrived(String),
    /// Its VMM there still waits for the VM (or is still starting).
    Waiting,
    /// Its VMM there lives but does not answer.
    Unresponsive,
    /// The agent answered and lists no VMM for the VM.
    NotListed,
    /// The agent did not answer.
    NoAnswer(String),
}

impl Seen {
    /// What a listing's state for the VM says.
    pub fn from_state(state: &str) -> Seen {
        match state {
            "waiting" | "starting" => Seen::Waiting,
            "unresponsive" => Seen::Unresponsive,
            other => Seen::Arrived(other.to_string()),
        }
    }
}

/// Where the VM runs after a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmAt {
    /// Still at the source (it never left, or the move rolled back).
    Source,
    /// At the destination.
    Destination,
    /// Not known.
    Unknown,
}

/// What a drain stops after a try: each `true` is stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// The destination's VMM (only ever one that waits for the VM).
    pub waiting_vmm: bool,
    /// The memory servers started for a split move.
    pub stores: bool,
    /// The postcopy standby on a third host.
    pub standby: bool,
}

/// Why a try failed, at which phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The VM is no longer on the drained host (nothing was started).
    Gone(String),
    /// Making the destination ready failed: the source was never asked to
    /// send.
    Preparing(String),
    /// The source's send failed or its answer was lost; the destination's
    /// agent then said `seen`, and the registry `holds`.
    Moving {
        /// The source's error.
        error: String,
        /// The source's agent answered (the move ended there, with its
        /// take-back if the switch failed); false: its answer was lost (its
        /// link broke, it died), and its VMM may still be sending.
        answered: bool,
        /// What the destination said.
        seen: Seen,
        /// Who the registry says holds the VM.
        holds: Holds,
    },
}

/// Who holds a VM by the registry's owner record (docs/safety.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holds {
    /// A process on the destination: it took the VM at the switch.
    Destination,
    /// A process on the source: the destination never took it.
    Source,
    /// Nobody said (an unfenced VM, an unreachable registry, another host).
    Unknown,
}

/// What a failed try leaves where, and what the drain does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The move's phase now.
    pub state: MoveState,
    /// Where the VM runs.
    pub vm_at: VmAt,
    /// What to stop.
    pub cleanup: Cleanup,
    /// May the VM be tried on another host?
    pub retry: bool,
    /// What the report says.
    pub note: String,
}

impl Failure {
    /// The rule: what this failure leaves where.
    pub fn outcome(&self, to: &str) -> Outcome {
        let all = Cleanup {
            waiting_vmm: true,
            stores: true,
            standby: true,
        };
        match self {
            Failure::Gone(e) => Outcome {
                state: MoveState::Failed,
                vm_at: VmAt::Unknown,
                cleanup: Cleanup::default(),
                retry: false,
                note: e.clone(),
            },
            // The destination's VMM is not stopped by name: an agent that
            // refused may hold another VMM of that name.
            Failure::Preparing(e) => Outcome {
                state: MoveState::Failed,
                vm_at: VmAt::Source,
                cleanup: Cleanup {
                    waiting_vmm: false,
                    ..all
                },
                retry: true,
                note: e.clone(),
            },
            Failure::Moving {
                error,
                holds: Holds::Destination,
                ..
            } => Outcome {
                state: MoveState::Done,
                vm_at: VmAt::Destination,
                cleanup: Cleanup::default(),
                retry: false,
                note: format!("{error}; the registry says {to} holds the VM: it runs there"),
            },
            // The destination never took it (and never will: its take-over
            // starts from a claim the source's take-back moved on), so
            // whatever its agent says, what was started for the move goes.
            // No answer, and the destination still waits: the source's VMM
            // may still be sending (a dead agent does not stop it), and the
            // registry's "source" may be a moment before the switch. A
            // VMM stopped now could be the one about to take the VM: nothing
            // is stopped, and the VM is not tried elsewhere.
            Failure::Moving {
                error,
                answered: false,
                seen: Seen::Waiting,
                ..
            } => left_alone(format!(
                "{error}; the source's agent gave no answer while {to}'s VMM still waits for the \
                 VM: the move may still be running, so nothing is stopped"
            )),
            Failure::Moving {
                error,
                holds: Holds::Source,
                seen,
                ..
            } if *seen != Seen::Waiting => Outcome {
                state: MoveState::Failed,
                vm_at: VmAt::Source,
                cleanup: Cleanup {
                    waiting_vmm: matches!(seen, Seen::NotListed | Seen::NoAnswer(_)),
                    ..all
                },
                retry: true,
                note: format!("{error}; the registry says the source still holds the VM"),
            },
            Failure::Moving { error, seen, .. } => match seen {
                // Stopping the VMM there would lose the VM; its memory
                // servers and standby serve it.
                Seen::Arrived(state) => Outcome {
                    state: MoveState::Done,
                    vm_at: VmAt::Destination,
                    cleanup: Cleanup::default(),
                    retry: false,
                    note: format!(
                        "the source's answer was lost ({error}); the VM runs at {to} ({state})"
                    ),
                },
                Seen::Waiting => Outcome {
                    state: MoveState::Failed,
                    vm_at: VmAt::Source,
                    cleanup: all,
                    retry: true,
                    note: error.clone(),
                },
                Seen::Unresponsive => left_alone(format!(
                    "{error}; the VMM at {to} does not answer, so it is left running"
                )),
                Seen::NotListed => left_alone(format!(
                    "{error}; {to}'s agent lists no VMM for the VM, so where it runs is not known"
                )),
                Seen::NoAnswer(why) => left_alone(format!(
                    "{error}; {to}'s agent does not say where the VM is ({why}), so its VMM \
                     there is left as it is"
                )),
            },
        }
    }
}

/// Nobody knows where the newest copy runs: nothing is stopped (the
/// standby may hold the only copy of pages the destination lacks), and the
/// VM is not tried elsewhere.
fn left_alone(note: String) -> Outcome {
    Outcome {
        state: MoveState::LeftAlone,
        vm_at: VmAt::Unknown,
        cleanup: Cleanup::default(),
        retry: false,
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MoveState::*;

    const ALL: [MoveState; 6] = [Waiting, Preparing, Moving, Done, Failed, LeftAlone];

    #[test]
    fn a_move_takes_only_the_steps_of_its_phases() {
        let legal = [
            (Waiting, Preparing),
            (Preparing, Moving),
            (Preparing, Failed),
            (Moving, Done),
            (Moving, Failed),
            (Moving, LeftAlone),
            (Failed, Waiting),
        ];
        for from in ALL {
            for to in ALL {
                let ok = legal.contains(&(from, to));
                assert_eq!(from.may_go_to(to), ok, "{from:?} -> {to:?}");
                assert_eq!(from.step(to).is_ok(), ok);
            }
        }
        // Done and LeftAlone are final; a failed move may only wait again.
        assert!(ALL
            .iter()
            .all(|&s| !Done.may_go_to(s) && !LeftAlone.may_go_to(s)));
        assert!(ALL.iter().filter(|s| s.ended()).count() == 3);
        let e = Done.step(Moving).unwrap_err().to_string();
        assert!(e.contains("Done") && e.contains("Moving"), "{e}");
    }

    #[test]
    fn a_vm_gone_from_the_host_is_not_tried_again_and_nothing_is_stopped() {
        let o = Failure::Gone("VM web is no longer on h1".into()).outcome("h2");
        assert_eq!(o.state, Failed);
        assert_eq!(o.cleanup, Cleanup::default());
        assert!(!o.retry);
        assert!(Preparing.may_go_to(o.state));
    }

    #[test]
    fn a_failure_while_preparing_leaves_the_vm_at_the_source_and_stops_what_was_started() {
        let o = Failure::Preparing("no room on h2".into()).outcome("h2");
        assert_eq!((o.state, o.vm_at), (Failed, VmAt::Source));
        assert!(o.cleanup.stores && o.cleanup.standby);
        assert!(
            !o.cleanup.waiting_vmm,
            "a refusing agent may hold another VMM of that name"
        );
        assert!(o.retry);
        assert!(Preparing.may_go_to(o.state) && o.state.may_go_to(Waiting));
    }

    #[test]
    fn the_registry_decides_a_failed_send_whatever_the_destination_says() {
        let moving = |seen: Seen, holds: Holds| {
            Failure::Moving {
                error: "link reset".into(),
                answered: true,
                seen,
                holds,
            }
            .outcome("h2")
        };
        let all_seen = [
            Seen::from_state("running"),
            Seen::Waiting,
            Seen::Unresponsive,
            Seen::NotListed,
            Seen::NoAnswer("connection refused".into()),
        ];
        for seen in all_seen.clone() {
            // Held at the destination: done, nothing there touched.
            let o = moving(seen.clone(), Holds::Destination);
            assert_eq!((o.state, o.vm_at), (Done, VmAt::Destination), "{seen:?}");
            assert_eq!(o.cleanup, Cleanup::default());
            assert!(!o.retry && o.note.contains("h2 holds the VM"), "{}", o.note);
            assert!(Moving.may_go_to(o.state));
            // Held at the source: it runs there, the move may go elsewhere.
            let o = moving(seen.clone(), Holds::Source);
            assert_eq!((o.state, o.vm_at), (Failed, VmAt::Source), "{seen:?}");
            assert!(o.retry && o.cleanup.stores && o.cleanup.standby, "{seen:?}");
            assert!(Moving.may_go_to(o.state));
        }
        // A VMM that does not answer is not stopped (it cannot run the VM
        // without its claim); one that waits, or is not there, is.
        assert!(
            !moving(Seen::Unresponsive, Holds::Source)
                .cleanup
                .waiting_vmm
        );
        assert!(moving(Seen::Waiting, Holds::Source).cleanup.waiting_vmm);
        assert!(moving(Seen::NotListed, Holds::Source).cleanup.waiting_vmm);
    }

    /// Chaos seed 227 trial 14: the source's agent killed mid-drain; the
    /// drain read "held at the source, destination waiting" a moment before
    /// the switch, stopped the waiting VMM later (it had taken the VM by
    /// then, and the standby finished the move into it), and the VM was
    /// gone. Without the source's answer, a waiting destination is left.
    #[test]
    fn without_the_sources_answer_a_waiting_destination_is_not_stopped() {
        for holds in [Holds::Source, Holds::Unknown] {
            let o = Failure::Moving {
                error: "agent 10.77.0.1:7700: closed without answering send".into(),
                answered: false,
                seen: Seen::Waiting,
                holds: holds.clone(),
            }
            .outcome("h2");
            assert_eq!((o.state, o.vm_at), (LeftAlone, VmAt::Unknown), "{holds:?}");
            assert_eq!(o.cleanup, Cleanup::default(), "{holds:?}");
            assert!(!o.retry, "{holds:?}");
            assert!(o.note.contains("may still be running"), "{}", o.note);
        }
        // Held at the destination: done, answer or not.
        let o = Failure::Moving {
            error: "closed without answering send".into(),
            answered: false,
            seen: Seen::Waiting,
            holds: Holds::Destination,
        }
        .outcome("h2");
        assert_eq!((o.state, o.vm_at), (Done, VmAt::Destination));
    }

    #[test]
    fn a_failed_send_is_decided_by_what_the_destination_holds() {
        let moving = |seen: Seen| {
            Failure::Moving {
                error: "link reset".into(),
                answered: true,
                seen,
                holds: Holds::Unknown,
            }
            .outcome("h2")
        };
        // A running copy there: done, and nothing there is touched.
        for state in ["running", "paused", "forwarding", "sending"] {
            let o = moving(Seen::from_state(state));
            assert_eq!((o.state, o.vm_at), (Done, VmAt::Destination), "{state}");
            assert_eq!(o.cleanup, Cleanup::default());
            assert!(!o.retry);
            assert!(o.note.contains("runs at h2"), "{}", o.note);
        }
        // Still waiting: the VM stayed at the source; everything started
        // for the move goes, and another host may be tried.
        for state in ["waiting", "starting"] {
            let o = moving(Seen::from_state(state));
            assert_eq!((o.state, o.vm_at), (Failed, VmAt::Source), "{state}");
            assert!(o.cleanup.waiting_vmm && o.cleanup.stores && o.cleanup.standby);
            assert!(o.retry);
        }
        // Not known: every copy, the standby's too, is left alone, and the
        // VM is not moved again (it may run at h2).
        for seen in [
            Seen::from_state("unresponsive"),
            Seen::NotListed,
            Seen::NoAnswer("connection refused".into()),
        ] {
            let o = moving(seen.clone());
            assert_eq!((o.state, o.vm_at), (LeftAlone, VmAt::Unknown), "{seen:?}");
            assert_eq!(o.cleanup, Cleanup::default(), "{seen:?}");
            assert!(!o.retry, "{seen:?}");
            assert!(o.note.starts_with("link reset; "), "{}", o.note);
        }
        // Every outcome of a send is a step a moving move may take.
        for seen in [Seen::Waiting, Seen::Unresponsive, Seen::NotListed] {
            assert!(Moving.may_go_to(moving(seen).state));
        }
    }

    #[test]
    fn the_journal_keeps_the_old_names_and_the_new_one() {
        let names: Vec<String> = ALL
            .iter()
            .map(|s| serde_json::to_string(s).unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "\"waiting\"",
                "\"preparing\"",
                "\"moving\"",
                "\"done\"",
                "\"failed\"",
                "\"left-alone\""
            ]
        );
    }
}
