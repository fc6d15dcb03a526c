//! `ferry standby`: the postcopy safety net's third host (the engine's
//! `standby` module does the work; this is its command line).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use ferry_migration::Standby;
use ferry_migration::{Endpoint, Listener};
use serde_json::json;

use crate::format;

/// `ferry standby`.
#[derive(clap::Args)]
pub struct StandbyArgs {
    /// Where sources connect (HOST:PORT or tcp:HOST:PORT).
    #[arg(long, value_parser = format::tcp_endpoint)]
    listen: Endpoint,
    /// Guest memory it may hold for all its sources together (e.g. 4G); a
    /// source whose VM does not fit is refused before anything is held.
    #[arg(long, value_parser = format::parse_capacity)]
    capacity: Option<u64>,
    /// Stop after this long (default: until Ctrl-C or SIGTERM); VMs held
    /// then are still served to their end.
    #[arg(long, value_parser = format::parse_duration)]
    duration: Option<Duration>,
    /// Serve one source, then exit once its move ends (an agent starts a
    /// standby per move this way); exit after 10 minutes if none comes.
    #[arg(long)]
    once: bool,
    /// Print JSON for machines.
    #[arg(long)]
    json: bool,
}

/// How long a `--once` standby waits for its source.
const ONCE_WAIT: Duration = Duration::from_secs(600);

/// Runs a standby until stopped, then waits for the VMs it holds.
pub fn standby(a: StandbyArgs) -> Result<ExitCode> {
    let listener = Listener::bind(&a.listen)?;
    let at = listener.endpoint().to_string();
    if a.json {
        println!("{}", json!({"listen": at}));
    } else {
        eprintln!("ferry standby: listening on {at}");
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let standby = Standby::new(a.capacity.unwrap_or(u64::MAX));
    let serving = {
        let s = standby.clone();
        std::thread::Builder::new()
            .name("standby".into())
            .spawn(move || s.serve(&listener))?
    };
    let t0 = Instant::now();
    while !stop.load(Ordering::Relaxed) && a.duration.is_none_or(|d| t0.elapsed() < d) {
        // An agent stops its standby at each move's end: seen within 20 ms.
        std::thread::sleep(Duration::from_millis(20));
        if serving.is_finished() {
            break;
        }
        if a.once {
            let accepted = standby.stats.accepted.load(Ordering::Acquire);
            if accepted > 0 || t0.elapsed() > ONCE_WAIT {
                // Take no one else; the source taken in is served to its end.
                break;
            }
        }
    }
    standby.stop();
    let served = serving
        .join()
        .map_err(|_| anyhow::anyhow!("the standby thread panicked"))?;
    // A move being finished from here must not be cut off.
    while standby.stats.held.load(Ordering::Acquire) > 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
    served?;
    let s = &standby.stats;
    let (released, finished, handed, failed, verified) = (
        s.released.load(Ordering::Relaxed),
        s.finished.load(Ordering::Relaxed),
        s.handed.load(Ordering::Relaxed),
        s.failed.load(Ordering::Relaxed),
        s.verified_pages.load(Ordering::Relaxed),
    );
    if a.json {
        println!(
            "{}",
            json!({"released": released, "finished": finished, "handed": handed, "failed": failed,
                   "verified_pages": verified})
        );
    } else {
        eprintln!(
            "ferry standby: {released} move(s) released by their source, {finished} finished from here ({verified} pages verified by the destination; {handed} handed over by their source), {failed} failed"
        );
    }
    Ok(if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
