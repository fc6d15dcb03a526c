//! `upgrade` of one VM: its VMM hands it to a new VMM process on this host
//! (zero-copy), and the agent follows it to the new pid. The old VMM answers
//! when the handover ended either way; when that answer is lost (the old
//! process ended, or the new one died between taking the VM and running
//! it), the agent does not guess: it says the outcome is unknown and what
//! the VM's control socket shows now.

use std::path::Path;
use std::time::{Duration, Instant};

use ferry_vmm::control::{ControlClient, ControlError, Request as Control};

use super::vms::{self, Vms};
use crate::reply::UpgradeReply;
use crate::FleetError;

/// How long the agent watches the VM's socket after a lost answer.
const LOOK_FOR: Duration = Duration::from_secs(3);

/// Hands VM `name` to a new VMM running `binary`; its figures.
pub(super) fn handover(vms: &Vms, name: &str, binary: &Path) -> Result<UpgradeReply, FleetError> {
    let socket = vms.socket(name)?;
    let old_pid = vms.pid(name);
    let fail = |reason: String| FleetError::Vm {
        vm: name.into(),
        reason,
    };
    let reply = ControlClient::connect(&socket).and_then(|mut c| {
        c.call(&Control::Handover {
            binary: Some(binary.display().to_string()),
            verify: false,
        })
    });
    let reply = match reply {
        Ok(r) => r,
        // The old VMM answered: the handover did not happen, and the VM
        // runs on under it (the handover's commit point).
        Err(e @ (ControlError::Refused(_) | ControlError::Connect { .. })) => {
            return Err(fail(format!("handover failed: {e}")))
        }
        Err(e) => {
            let now = look(&socket, old_pid);
            if let Seen::Answers(pid) = now {
                if pid != old_pid {
                    let _ = vms.repid(name);
                }
            }
            return Err(fail(format!(
                "handover outcome unknown: the old VMM's answer was lost ({e}); {}",
                now.says(old_pid)
            )));
        }
    };
    vms.repid(name)?;
    serde_json::from_value(reply)
        .map_err(|e| fail(format!("the handover's figures are not its own: {e}")))
}

/// What the VM's control socket shows after a lost answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// A VMM answers there, with this pid.
    Answers(u32),
    /// Nothing answers, and the old VMM's process still lives.
    OldLivesSilent,
    /// Nothing answers, and the old VMM's process is gone.
    Nothing,
}

impl Seen {
    /// What the operator is told.
    fn says(self, old_pid: u32) -> String {
        match self {
            Seen::Answers(pid) if pid == old_pid => {
                format!("the old VMM (pid {pid}) answers for the VM: it kept it")
            }
            Seen::Answers(pid) => {
                format!("a new VMM (pid {pid}) answers for the VM: the handover went through")
            }
            Seen::OldLivesSilent => format!(
                "no VMM answers for the VM, and the old one (pid {old_pid}) lives: nothing is \
                 stopped; check it before acting"
            ),
            Seen::Nothing => "no VMM answers for the VM and the old one has ended: the VM may \
                              be lost (its memory was with the new VMM, which died)"
                .into(),
        }
    }
}

/// Watches `socket` for a while for a VMM that answers.
fn look(socket: &Path, old_pid: u32) -> Seen {
    let until = Instant::now() + LOOK_FOR;
    loop {
        if let Some(pid) = vms::status(socket)
            .ok()
            .and_then(|s| s["pid"].as_u64())
            .filter(|p| *p > 0)
        {
            return Seen::Answers(pid as u32);
        }
        if Instant::now() >= until {
            return if vms::process_alive(old_pid) {
                Seen::OldLivesSilent
            } else {
                Seen::Nothing
            };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_answer_is_told_as_what_the_socket_shows_never_as_a_guess() {
        assert!(Seen::Answers(7).says(7).contains("old VMM (pid 7)"));
        assert!(Seen::Answers(9).says(7).contains("new VMM (pid 9)"));
        assert!(Seen::OldLivesSilent.says(7).contains("nothing is stopped"));
        assert!(Seen::Nothing.says(7).contains("may be lost"));
        // A socket nobody serves, and an old pid that is gone.
        let dir = std::env::temp_dir().join(format!("ferry-handover-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let t = Instant::now();
        let seen = look(&dir.join("none.sock"), u32::MAX - 1);
        assert_eq!(seen, Seen::Nothing);
        assert!(t.elapsed() >= LOOK_FOR);
        // Our own process stands for an old VMM that lives but is silent.
        assert_eq!(
            look(&dir.join("none.sock"), std::process::id()),
            Seen::OldLivesSilent
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
