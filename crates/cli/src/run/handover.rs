//! A run that outlives its process: what `ferry run` hands the next VMM
//! process at a handover (the run's settings), the offer that makes a
//! handover possible, and `--adopt-fd`, the new process's side.

use super::front::Carried;
use std::io::LineWriter;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_vmm::control::{ControlServer, HandoverSetup, VmControl};

use super::access::access_config;
use super::drive::drive;
use super::{console_sink, unix_ms};

/// The handover request's needs: this binary, the control socket, and
/// this run's settings for the next process.
pub(super) fn offer_handover(
    control: &VmControl,
    server: &ControlServer,
    carried: &Arc<Mutex<Carried>>,
) -> Result<()> {
    let carried = carried.clone();
    control.set_handover(HandoverSetup {
        default_binary: std::env::current_exe().context("cannot find the ferry binary")?,
        control: Some(server.socket()),
        run: Box::new(move || {
            let c = carried.lock().unwrap_or_else(|e| e.into_inner());
            serde_json::to_string(&*c).unwrap_or_default()
        }),
    });
    Ok(())
}

/// `ferry run --adopt-fd N`: the new VMM of a handover.
pub(super) fn adopt(fd: i32) -> Result<ExitCode> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: all-zero is a valid `struct stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on any integer only reads it (failing on a closed fd)
    // and writes the stat buffer we own.
    let is_open = fd >= 0 && unsafe { libc::fstat(fd, &mut st) } == 0;
    if !is_open || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        bail!("--adopt-fd {fd} is not an open socket (it is for `ferry handover`, which starts this process)");
    }
    // SAFETY: the descriptor is open (checked above) and this process owns
    // it from here: `ferry handover` passed it for this purpose alone.
    let sock = std::os::unix::net::UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let quiet = Arc::new(AtomicBool::new(true));
    let open_registry = |addr: &str| {
        crate::security::credentials_for_registry(Some(addr))
            .map_err(|e| e.to_string())
            .and_then(|tls| ferry_registry::open(Some(addr), tls).map_err(|e| e.to_string()))
    };
    let taken =
        ferry_vmm::handover::take_over(sock, Some(console_sink(quiet.clone())), &open_registry)
            .context("handover failed; the VM keeps running in the old VMM")?;
    let mut front: Carried = serde_json::from_str(&taken.run).unwrap_or_default();
    quiet.store(front.quiet, Ordering::Relaxed);
    let vm = taken.vm.clone();
    if let Some(access) = access_config(
        front.access_period_ms,
        front.access_share,
        front.access_grain,
        front.access_log_writes,
    ) {
        vm.start_access(access);
    }
    if let (Some(ip), Some(svc)) = (front.vm_address, vm.service()) {
        if let Err(e) = svc.keep_address(ip) {
            eprintln!("ferry: warning: the VM's address {ip} stays on this host, but its clients cannot move with it from this process: {e}");
        }
    }
    let control = Arc::new(VmControl::new(vm.clone()));
    // The VM runs here now: from here on a failure must not end it.
    let server = match taken.control {
        Some((path, listener)) => match ControlServer::adopt(listener, &path, control.clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("ferry: warning: the VM runs without its control socket: {e}");
                None
            }
        },
        None => None,
    };
    if !front.quiet {
        eprintln!(
            "ferry: took over the VM from pid {} ({:.2} ms downtime, {} client connections){}",
            taken.from_pid,
            taken.downtime_ms,
            taken.connections,
            server
                .as_ref()
                .map(|s| format!("; control socket {}", s.path().display()))
                .unwrap_or_default()
        );
    }
    let timeline = match &front.timeline {
        Some(p) => match std::fs::OpenOptions::new().append(true).open(p) {
            Ok(f) => Some(LineWriter::new(f)),
            Err(e) => {
                eprintln!(
                    "ferry: warning: cannot reopen timeline {}: {e}",
                    p.display()
                );
                None
            }
        },
        None => None,
    };
    // The run's clock goes on from where the old process started it.
    let ran = Duration::from_millis(unix_ms().saturating_sub(front.started_unix_ms));
    let t_start = Instant::now().checked_sub(ran).unwrap_or_else(Instant::now);
    if front.started_unix_ms == 0 {
        front.started_unix_ms = unix_ms();
    }
    let carried = Arc::new(Mutex::new(front.clone()));
    if let Some(s) = &server {
        if let Err(e) = offer_handover(&control, s, &carried) {
            eprintln!("ferry: warning: this VMM cannot hand the VM over again: {e:#}");
        }
    }
    let mut extra = serde_json::Map::new();
    extra.insert("incoming".into(), false.into());
    extra.insert(
        "handover".into(),
        serde_json::json!({
            "from_pid": taken.from_pid,
            "downtime_ms": taken.downtime_ms,
            "build_ms": taken.build_ms,
            "connections": taken.connections,
        }),
    );
    let code = drive(&vm, &front, timeline, Instant::now(), t_start, extra);
    if let Some(o) = vm.owner() {
        // Stopped here (not moved on): nobody runs it now.
        o.release();
    }
    drop(server);
    code
}
