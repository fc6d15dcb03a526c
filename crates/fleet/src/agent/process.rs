//! Starting the processes an agent keeps (VMMs, memory servers): in a
//! session of their own, so they outlive the agent and its signals, with
//! their output appended to a log file in the agent's state directory.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::FleetError;

/// Starts `ferry ARGS` detached, with `env` added to its environment, its
/// output appended to `log`.
pub fn spawn_detached(
    ferry: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Result<Child, FleetError> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(FleetError::io(format!("{}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(FleetError::io(format!("{}", log.display())))?;
    let mut cmd = Command::new(ferry);
    cmd.args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    // SAFETY: setsid is async-signal-safe and touches only the child: it
    // leaves the agent's session, so the process outlives the agent and
    // its signals.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(FleetError::io(format!("cannot start {}", ferry.display())))
}

/// The last line `log` holds that says something (why a process ended).
pub fn last_words(log: &Path) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_string()
}
