//! Which one process may run each VM: an epoch per VM in the registry,
//! changed only by compare-and-swap, so two processes can never both
//! believe they hold it.
//!
//! The record `owners/<vm>` says the VM's epoch, the process that holds it
//! (host, pid and a random id of that process) and when it took it; it
//! changes only at a step, so a destination may read it at a migration's
//! opening and take the VM at the switch with one compare-and-swap. The
//! holder's sign of life is another record, `owners-alive/<vm>` (its id and
//! the time), written every [`RENEW_EVERY`]. The rule ([`decide`]), one step
//! each:
//!
//! | step | allowed when the record is | writes |
//! |---|---|---|
//! | `Boot` (a fresh VM starts) | absent, or released | epoch + 1, held by me |
//! | `TakeOver` (a destination, before the guest's first instruction) | the source's exact claim | epoch + 1, held by me |
//! | `TakeBack` (a source that sent Complete, before it resumes) | still its own claim | epoch + 1, held by me |
//! | `Renew` (the holder, every second) | still its own claim | nothing (its sign of life) |
//! | `Release` (the holder stops the VM) | still its own claim | epoch + 1, held by none |
//!
//! A step whose write landed but whose answer was lost finds the record
//! already as it would have written it ([`Decision::Already`]), so every
//! step may be retried. A destination and a source that race for the same
//! claim cannot both win: each writes only against the version it read.
//! A holder that finds its claim gone must stop its copy ([`Fence`]).
//!
//! The sign of life is the holder's wall clock; it only ever tells an
//! operator or a source that a holder seems dead (its renewals stopped), and
//! is never the reason anyone takes the VM: nothing here takes a VM from a
//! holder that stopped renewing (docs/safety.md says why).

mod fence;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use fence::{Fence, FenceStatus, Hooks, TakeBack};

use crate::{Registry, RegistryError};

/// How long after a holder's last renewal it is said to have stopped.
pub const OWNER_TTL: Duration = Duration::from_secs(5);
/// How often a holder renews (and so checks) its claim.
pub const RENEW_EVERY: Duration = Duration::from_secs(1);

/// One process that may hold VMs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    /// The host, as the fleet names it.
    pub host: String,
    /// Its process id there.
    pub pid: u32,
    /// Random, drawn once per process: a restarted process with the same
    /// pid is another holder.
    pub id: u64,
}

impl Holder {
    /// This process on `host`.
    pub fn this_process(host: &str) -> Holder {
        Holder {
            host: host.into(),
            pid: std::process::id(),
            id: random_u64(),
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} on {} ({:016x})", self.pid, self.host, self.id)
    }
}

/// The registry's record of one VM's owner.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OwnerRecord {
    /// The VM.
    pub vm: String,
    /// Its epoch: each change of owner adds one.
    pub epoch: u64,
    /// Who holds it (None: released, nobody runs it).
    pub holder: Option<Holder>,
    /// When the step that wrote it was taken, seconds since 1970 by the
    /// writer's clock.
    pub since: f64,
}

impl OwnerRecord {
    fn held_by(&self, h: &Holder) -> bool {
        self.holder.as_ref() == Some(h)
    }

    /// One line for messages.
    pub fn describe(&self) -> String {
        match &self.holder {
            Some(h) => format!("VM {} is held at epoch {} by {h}", self.vm, self.epoch),
            None => format!("VM {} is released (epoch {})", self.vm, self.epoch),
        }
    }
}

/// A holder's sign of life (`owners-alive/<vm>`), written every
/// [`RENEW_EVERY`] while it holds the VM.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Alive {
    /// The holder's id.
    pub id: u64,
    /// When, by its clock.
    pub renewed: f64,
}

/// Seconds the holder of `rec` has been silent, by this host's clock: since
/// its last sign of life, or since it took the VM if it gave none yet.
/// None for a released VM.
pub fn silent_for(rec: &OwnerRecord, alive: Option<&Alive>) -> Option<f64> {
    let h = rec.holder.as_ref()?;
    let last = match alive {
        Some(a) if a.id == h.id => a.renewed.max(rec.since),
        _ => rec.since,
    };
    Some((now() - last).max(0.0))
}

/// What a process holds: the VM at an epoch. It travels to a migration's
/// destination, which takes the VM from exactly this claim.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Claim {
    /// The VM.
    pub vm: String,
    /// The epoch held.
    pub epoch: u64,
    /// Who holds it.
    pub holder: Holder,
}

/// One step of the rule (the module header's table).
#[derive(Clone, Debug)]
pub enum Step {
    /// A fresh VM starts here.
    Boot,
    /// A destination takes the VM from the source's claim.
    TakeOver(Claim),
    /// A source takes its VM back after Complete.
    TakeBack(Claim),
    /// The holder renews its claim.
    Renew(Claim),
    /// The holder gives the VM up (it stopped it).
    Release(Claim),
}

/// Why a step may not be taken.
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    /// Another process holds the VM (the record as it is).
    HeldBy(OwnerRecord),
    /// The claim the step starts from is not the record's any more.
    Moved(OwnerRecord),
    /// There is no record of the VM (nothing to take, renew or release).
    Missing,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::HeldBy(r) => write!(f, "{}", r.describe()),
            Refusal::Moved(r) => write!(f, "the claim moved on: {}", r.describe()),
            Refusal::Missing => f.write_str("the registry has no record of the VM"),
        }
    }
}

/// What a step does given the record now.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Write this record (against the version read).
    Write(OwnerRecord),
    /// The record is already what the step would write (an earlier try
    /// landed): this claim is held.
    Already(Claim),
    /// The step may not be taken.
    Refuse(Refusal),
}

/// The rule: what `step` by `me` may do when the record of `vm` is `now`
/// (None: no record), at time `t`.
pub fn decide(vm: &str, step: &Step, now: Option<&OwnerRecord>, me: &Holder, t: f64) -> Decision {
    let mine = |epoch| OwnerRecord {
        vm: vm.into(),
        epoch,
        holder: Some(me.clone()),
        since: t,
    };
    let claim = |epoch| Claim {
        vm: vm.into(),
        epoch,
        holder: me.clone(),
    };
    let Some(rec) = now else {
        return match step {
            Step::Boot => Decision::Write(mine(1)),
            _ => Decision::Refuse(Refusal::Missing),
        };
    };
    // The claim a step starts from is the record exactly: same epoch, same
    // holder.
    let is = |c: &Claim| rec.epoch == c.epoch && rec.holder.as_ref() == Some(&c.holder);
    // An earlier try of a step that moves the epoch on to me landed.
    let landed = |from: &Claim| rec.epoch == from.epoch + 1 && rec.held_by(me);
    match step {
        Step::Boot => match &rec.holder {
            None => Decision::Write(mine(rec.epoch + 1)),
            Some(_) => Decision::Refuse(Refusal::HeldBy(rec.clone())),
        },
        Step::TakeOver(from) | Step::TakeBack(from) => {
            if matches!(step, Step::TakeBack(_)) && from.holder != *me {
                // Only the claim's own holder takes it back.
                return Decision::Refuse(Refusal::Moved(rec.clone()));
            }
            if is(from) {
                Decision::Write(mine(from.epoch + 1))
            } else if landed(from) {
                Decision::Already(claim(rec.epoch))
            } else {
                Decision::Refuse(Refusal::Moved(rec.clone()))
            }
        }
        Step::Renew(c) => {
            if is(c) && c.holder == *me {
                Decision::Already(c.clone())
            } else {
                Decision::Refuse(Refusal::Moved(rec.clone()))
            }
        }
        Step::Release(c) => {
            if is(c) && c.holder == *me {
                Decision::Write(OwnerRecord {
                    holder: None,
                    ..mine(c.epoch + 1)
                })
            } else if rec.holder.is_none() && rec.epoch == c.epoch + 1 {
                Decision::Already(c.clone())
            } else {
                Decision::Refuse(Refusal::Moved(rec.clone()))
            }
        }
    }
}

/// Why an ownership step failed.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// The rule refused it.
    #[error("{0}")]
    Refused(Refusal),
    /// The registry did not answer (the step's outcome may be unknown:
    /// retry it, it is safe to).
    #[error("the registry cannot be reached: {0}")]
    Unreachable(RegistryError),
    /// A VM name that cannot be a registry key.
    #[error("bad VM name {0:?}: 1 to 100 of A-Z a-z 0-9 . _ -")]
    BadName(String),
    /// A record that does not decode.
    #[error("the registry's record of VM {vm} is damaged: {reason}")]
    Damaged {
        /// The VM.
        vm: String,
        /// Why.
        reason: String,
    },
    /// The record kept changing under the step.
    #[error("the registry's record of VM {0} kept changing; try again")]
    Busy(String),
}

/// The owners' records in one registry.
#[derive(Clone)]
pub struct Owners {
    registry: Arc<dyn Registry>,
}

/// Checks a VM name: one registry key segment.
pub fn check_vm_name(vm: &str) -> Result<(), OwnershipError> {
    let ok = !vm.is_empty()
        && vm.len() <= 100
        && vm != "."
        && vm != ".."
        && vm
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(OwnershipError::BadName(vm.into()))
    }
}

fn key(vm: &str) -> String {
    format!("owners/{vm}")
}

fn alive_key(vm: &str) -> String {
    format!("owners-alive/{vm}")
}

/// A record read, with its version: what a step may start from.
pub type Read = (OwnerRecord, u64);

impl Owners {
    /// The owners kept in `registry`.
    pub fn new(registry: Arc<dyn Registry>) -> Owners {
        Owners { registry }
    }

    /// Where, for messages.
    pub fn describe(&self) -> String {
        self.registry.describe()
    }

    /// The record of `vm`, with its version.
    pub fn read(&self, vm: &str) -> Result<Option<Read>, OwnershipError> {
        check_vm_name(vm)?;
        let Some((bytes, version)) = self
            .registry
            .get_versioned(&key(vm))
            .map_err(OwnershipError::Unreachable)?
        else {
            return Ok(None);
        };
        let rec: OwnerRecord =
            serde_json::from_slice(&bytes).map_err(|e| OwnershipError::Damaged {
                vm: vm.into(),
                reason: e.to_string(),
            })?;
        if rec.vm != vm {
            return Err(OwnershipError::Damaged {
                vm: vm.into(),
                reason: format!("it names VM {:?}", rec.vm),
            });
        }
        Ok(Some((rec, version)))
    }

    /// The record of `vm` now, if any.
    pub fn record(&self, vm: &str) -> Result<Option<OwnerRecord>, OwnershipError> {
        Ok(self.read(vm)?.map(|(r, _)| r))
    }

    /// Takes `step` for `me`: reads the record, asks the rule, writes
    /// against the version read; a write that lost a race reads again. The
    /// claim held afterwards.
    pub fn step(&self, vm: &str, step: &Step, me: &Holder) -> Result<Claim, OwnershipError> {
        self.step_from(vm, step, me, None)
    }

    /// [`Owners::step`], its first try starting from `read` (a record read
    /// earlier: the switch then costs one compare-and-swap if nothing
    /// changed since; if something did, the swap fails and the step reads
    /// again).
    pub fn step_from(
        &self,
        vm: &str,
        step: &Step,
        me: &Holder,
        mut read: Option<Read>,
    ) -> Result<Claim, OwnershipError> {
        for _ in 0..16 {
            let now = match read.take() {
                Some(r) => Some(r),
                None => self.read(vm)?,
            };
            let version = now.as_ref().map_or(0, |(_, v)| *v);
            match decide(vm, step, now.as_ref().map(|(r, _)| r), me, self::now()) {
                Decision::Already(c) => return Ok(c),
                Decision::Refuse(r) => return Err(OwnershipError::Refused(r)),
                Decision::Write(rec) => {
                    let body = serde_json::to_vec(&rec).map_err(|e| OwnershipError::Damaged {
                        vm: vm.into(),
                        reason: e.to_string(),
                    })?;
                    let won = self
                        .registry
                        .put_if_version(&key(vm), &body, version)
                        .map_err(OwnershipError::Unreachable)?;
                    if won {
                        return Ok(Claim {
                            vm: vm.into(),
                            epoch: rec.epoch,
                            holder: me.clone(),
                        });
                    }
                }
            }
        }
        Err(OwnershipError::Busy(vm.into()))
    }

    /// The holder's sign of life: `claim` is still the record (else the
    /// refusal says whose it is), and `owners-alive/<vm>` says it lives.
    pub fn renew(&self, claim: &Claim, me: &Holder) -> Result<(), OwnershipError> {
        self.step(&claim.vm, &Step::Renew(claim.clone()), me)?;
        let body = serde_json::to_vec(&Alive {
            id: me.id,
            renewed: now(),
        })
        .unwrap_or_default();
        self.registry
            .put_record(&alive_key(&claim.vm), &body)
            .map_err(OwnershipError::Unreachable)
    }

    /// The sign of life of `vm`'s holder, if any.
    pub fn alive(&self, vm: &str) -> Result<Option<Alive>, OwnershipError> {
        check_vm_name(vm)?;
        let Some(b) = self
            .registry
            .get_record(&alive_key(vm))
            .map_err(OwnershipError::Unreachable)?
        else {
            return Ok(None);
        };
        Ok(serde_json::from_slice(&b).ok())
    }

    /// True if `rec`'s holder has been silent for longer than
    /// [`OWNER_TTL`] (it seems dead).
    pub fn lapsed(&self, rec: &OwnerRecord) -> bool {
        let alive = self.alive(&rec.vm).ok().flatten();
        silent_for(rec, alive.as_ref()).is_some_and(|s| s > OWNER_TTL.as_secs_f64())
    }

    /// Removes the record of `vm` whoever holds it: the operator's last
    /// resort when its holder is surely dead (`ferry owners release`).
    pub fn forget(&self, vm: &str) -> Result<(), OwnershipError> {
        check_vm_name(vm)?;
        let _ = self.registry.delete_record(&alive_key(vm));
        self.registry
            .delete_record(&key(vm))
            .map_err(OwnershipError::Unreachable)
    }

    /// Every VM's record.
    pub fn all(&self) -> Result<Vec<OwnerRecord>, OwnershipError> {
        let mut out = Vec::new();
        for (k, v) in self
            .registry
            .records("owners/")
            .map_err(OwnershipError::Unreachable)?
        {
            match serde_json::from_slice::<OwnerRecord>(&v) {
                Ok(r) => out.push(r),
                Err(e) => tracing::warn!("skipping registry record {k}: {e}"),
            }
        }
        Ok(out)
    }
}

/// Seconds since 1970 by this host's clock.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b, which lives
    // for the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // No entropy call: the time and pid still set processes apart.
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(b)
}
