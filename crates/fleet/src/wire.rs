//! The agent link: one JSON line each way (a reply may follow progress
//! lines), over a [`Connection`] that is mutual TLS unless the process runs
//! `--insecure`. A line is read only up to [`MAX_LINE`](crate::api::MAX_LINE)
//! bytes and within a deadline: a peer that sends more, or trickles, costs
//! one connection.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use ferry_tls::Connection;
use serde_json::Value;

/// Reads one line (without its newline) of at most `max` bytes by
/// `deadline`; `Ok(None)` at a clean end before its first byte.
pub fn read_line(
    c: &mut Connection,
    max: usize,
    deadline: Option<Instant>,
) -> io::Result<Option<String>> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no whole line within the time allowed",
                ));
            }
            c.tcp().set_read_timeout(Some(left))?;
        } else {
            c.tcp().set_read_timeout(None)?;
        }
        match c.read(&mut byte) {
            Ok(0) if line.is_empty() => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => {
                if line.len() >= max {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a line over {max} bytes"),
                    ));
                }
                line.push(byte[0]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no whole line within the time allowed",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    String::from_utf8(line)
        .map(Some)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a line that is not UTF-8"))
}

/// Writes `v` as one line.
pub fn write_line(c: &mut Connection, v: &Value) -> io::Result<()> {
    let mut line = serde_json::to_vec(v)?;
    line.push(b'\n');
    c.write_all(&line)
}

/// How long a request line may take to arrive once connected.
pub const REQUEST_WITHIN: Duration = Duration::from_secs(10);

/// How long a handshake may take.
pub const HANDSHAKE_WITHIN: Duration = Duration::from_secs(5);
