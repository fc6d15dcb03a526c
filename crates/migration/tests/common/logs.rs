//! What the engine logs, kept in memory, for the tests that check what a
//! destination said about a peer it refused (its only word on a refusal
//! made before any ferry frame can be sent, a failed TLS handshake say).

use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Sink;

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps this process's log (warnings and up) from now on; once per test
/// binary, later calls do nothing.
pub fn capture() {
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Sink)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
}

/// The first logged line that holds every one of `words`, waiting up to
/// `wait` for it (a refusal is logged by a thread of its own).
pub fn line_with(words: &[&str], wait: Duration) -> Option<String> {
    let deadline = Instant::now() + wait;
    loop {
        let found = {
            let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
            String::from_utf8_lossy(&log)
                .lines()
                .find(|l| words.iter().all(|w| l.contains(w)))
                .map(str::to_string)
        };
        if found.is_some() || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
