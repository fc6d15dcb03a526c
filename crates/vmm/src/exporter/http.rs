//! The metrics endpoint's HTTP: just enough of HTTP/1.1 for `GET
//! /metrics`, bounded against clients that are slow or hostile. Each
//! connection is answered on a short-lived thread of its own (at most
//! [`Limits::max_clients`] at once; one more gets 503 at once), so a slow
//! client never holds up a scrape; a request head is read up to
//! [`Limits::head_bytes`] (431 past it) and within [`Limits::deadline`]
//! (408 past it), so no client can make the endpoint buffer or wait
//! without bound. Given a host's fleet credentials it speaks HTTPS with
//! mutual TLS: only a client with a certificate from the fleet's CA (a
//! scraper's, from `ferry pki issue`) gets an answer; its handshake runs
//! on its own thread within the same deadline.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_tls::{Connection as Client, Credentials};

/// What the endpoint grants one client.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Clients answered at once.
    pub max_clients: usize,
    /// Bytes of a request's head (request line and headers).
    pub head_bytes: usize,
    /// Time to send the head and read the answer.
    pub deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_clients: 32,
            head_bytes: 8 << 10,
            deadline: Duration::from_secs(5),
        }
    }
}

/// Why a request head was not read.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// The head did not end within the byte limit.
    #[error("request head over {0} bytes")]
    TooLarge(usize),
    /// The connection ended before the head did.
    #[error("the connection ended inside the request head")]
    Truncated,
    /// The socket failed or the deadline passed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Serves `page` (None once there is nothing to serve any more: the VM is
/// gone, and the endpoint stops after answering so) on `listener`, from a
/// thread of its own; over mutual TLS with `tls`'s certificate when given.
pub fn serve(
    listener: TcpListener,
    limits: Limits,
    tls: Option<Arc<Credentials>>,
    page: impl Fn() -> Option<String> + Send + Sync + 'static,
) -> io::Result<()> {
    let page = Arc::new(page);
    let gone = Arc::new(AtomicBool::new(false));
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else {
                    // Out of descriptors, say: wait for some to come back.
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                if gone.load(Ordering::Relaxed) {
                    break;
                }
                let taken = busy.fetch_add(1, Ordering::AcqRel);
                if taken >= limits.max_clients {
                    busy.fetch_sub(1, Ordering::AcqRel);
                    // A TLS client could not read a plain answer: it is
                    // only closed.
                    if tls.is_none() {
                        turn_away(conn);
                    }
                    continue;
                }
                let (page, gone, mine, limits, tls) = (
                    page.clone(),
                    gone.clone(),
                    busy.clone(),
                    limits.clone(),
                    tls.clone(),
                );
                let spawned = std::thread::Builder::new()
                    .name("metrics-client".into())
                    .spawn(move || {
                        // A scraper's handshake, on its own thread.
                        match Client::accept(conn, tls.as_deref(), limits.deadline) {
                            Ok(client) => {
                                let _ = answer(client, &limits, &*page, &gone);
                            }
                            Err(e) => tracing::debug!("metrics: a client's handshake failed: {e}"),
                        }
                        mine.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    // The closure went with the error, unrun: give its
                    // slot back here.
                    busy.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!("metrics: cannot start a client thread");
                }
            }
        })?;
    Ok(())
}

/// Answers a client past the limit at once, without reading its request.
fn turn_away(mut conn: TcpStream) {
    let _ = conn.set_write_timeout(Some(Duration::from_millis(200)));
    let _ = respond(
        &mut conn,
        "503 Service Unavailable",
        "too many scrapes at once\n",
    );
    let _ = conn.shutdown(Shutdown::Write);
}

/// Reads from a client until `at`, then fails with TimedOut.
struct Until<'a> {
    c: &'a mut Client,
    at: Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.c.tcp().set_read_timeout(Some(left))?;
        self.c.read(buf)
    }
}

/// Reads a request head (up to its blank line) of at most `max` bytes;
/// returns its request line. Never reads more than `max` bytes.
pub fn read_head(r: &mut impl Read, max: usize) -> Result<String, HeadError> {
    let mut head = Vec::new();
    let mut piece = [0u8; 1024];
    loop {
        let room = max - head.len();
        if room == 0 {
            return Err(HeadError::TooLarge(max));
        }
        let n = match r.read(&mut piece[..room.min(1024)]) {
            Ok(0) => return Err(HeadError::Truncated),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        // Look for the end from a little before the new bytes (it may
        // straddle two reads).
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&piece[..n]);
        let tail = &head[from..];
        let ended =
            tail.windows(4).any(|w| w == b"\r\n\r\n") || tail.windows(2).any(|w| w == b"\n\n");
        if ended {
            let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
            return Ok(String::from_utf8_lossy(line).trim_end().to_string());
        }
    }
}

fn answer(
    mut conn: Client,
    limits: &Limits,
    page: &dyn Fn() -> Option<String>,
    gone: &AtomicBool,
) -> io::Result<()> {
    let at = Instant::now() + limits.deadline;
    conn.tcp().set_write_timeout(Some(limits.deadline))?;
    let head = read_head(&mut Until { c: &mut conn, at }, limits.head_bytes);
    let request = match head {
        Ok(line) => line,
        Err(HeadError::TooLarge(n)) => {
            let why = format!("a request head is at most {n} bytes\n");
            respond(&mut conn, "431 Request Header Fields Too Large", &why)?;
            return close(conn);
        }
        Err(HeadError::Io(e))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            let why = format!("no whole request within {:?}\n", limits.deadline);
            respond(&mut conn, "408 Request Timeout", &why)?;
            return close(conn);
        }
        Err(_) => return Ok(()),
    };
    let path = request.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = match (request.starts_with("GET "), path) {
        (true, "/metrics") => match page() {
            Some(text) => ("200 OK", text),
            None => {
                gone.store(true, Ordering::Relaxed);
                ("503 Service Unavailable", "the VM is gone\n".into())
            }
        },
        (true, _) => ("404 Not Found", "ferry serves /metrics only\n".into()),
        _ => ("405 Method Not Allowed", "GET /metrics\n".into()),
    };
    respond(&mut conn, status, &body)?;
    close(conn)
}

fn respond(conn: &mut impl Write, status: &str, body: &str) -> io::Result<()> {
    write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Ends the answer (a TLS client is told close_notify first); what the
/// client still sends is read (briefly) and dropped, so closing does not
/// reset the connection under the answer.
fn close(mut conn: Client) -> io::Result<()> {
    conn.finish()?;
    conn.tcp()
        .set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut sink = [0u8; 4096];
    let mut left = 64usize;
    while left > 0 && matches!(conn.read(&mut sink), Ok(n) if n > 0) {
        left -= 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    /// A page that counts its scrapes.
    fn endpoint(limits: Limits) -> std::net::SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        serve(l, limits, None, || Some("ferry_up 1\n".to_string())).unwrap();
        at
    }

    /// One scrape: the status line and the body.
    fn scrape(at: std::net::SocketAddr) -> (String, String) {
        let mut s = TcpStream::connect(at).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        let status = text.lines().next().unwrap_or("").to_string();
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (status, body)
    }

    #[test]
    fn a_slow_client_does_not_hold_up_a_scrape() {
        let at = endpoint(Limits::default());
        // Half a request line, then nothing.
        let mut slow = TcpStream::connect(at).unwrap();
        slow.write_all(b"GET /met").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let (status, body) = scrape(at);
        let took = t.elapsed();
        assert_eq!(
            (status.as_str(), body.as_str()),
            ("HTTP/1.1 200 OK", "ferry_up 1\n")
        );
        assert!(took < Duration::from_secs(1), "the scrape took {took:?}");
        drop(slow);
    }

    #[test]
    fn a_megabyte_request_line_is_refused_reading_at_most_the_limit() {
        let at = endpoint(Limits::default());
        let s = TcpStream::connect(at).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let writer = s.try_clone().unwrap();
        let t = std::thread::spawn(move || {
            let mut w = writer;
            let mut line = b"GET /".to_vec();
            line.resize(1 << 20, b'a');
            let _ = w.write_all(&line);
        });
        let mut status = String::new();
        std::io::BufReader::new(&s).read_line(&mut status).unwrap();
        assert_eq!(
            status.trim_end(),
            "HTTP/1.1 431 Request Header Fields Too Large"
        );
        drop(s);
        let _ = t.join();
        // The head reader itself never takes more than its limit.
        struct Endless(usize);
        impl Read for Endless {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                buf.fill(b'a');
                self.0 += buf.len();
                Ok(buf.len())
            }
        }
        let mut r = Endless(0);
        let e = read_head(&mut r, 8 << 10).unwrap_err();
        assert!(matches!(e, HeadError::TooLarge(8192)), "{e:?}");
        assert_eq!(r.0, 8 << 10, "read exactly the limit");
        // A head split across reads still ends where it should.
        let mut two = io::Cursor::new(b"GET /metrics HTTP/1.0\r\nA: b\r\n\r\nrest".to_vec());
        assert_eq!(
            read_head(&mut two, 8 << 10).unwrap(),
            "GET /metrics HTTP/1.0"
        );
    }

    #[test]
    fn past_the_client_limit_one_more_gets_503_and_silent_ones_time_out() {
        let at = endpoint(Limits {
            max_clients: 2,
            head_bytes: 8 << 10,
            deadline: Duration::from_millis(500),
        });
        let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(at).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        let (status, _) = scrape(at);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable");
        for mut s in silent {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            assert!(text.starts_with("HTTP/1.1 408"), "{text:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(scrape(at).0, "HTTP/1.1 200 OK");
    }

    #[test]
    fn only_get_metrics_is_served() {
        let at = endpoint(Limits::default());
        for (req, want) in [
            (
                &b"GET /other HTTP/1.1\r\n\r\n"[..],
                "HTTP/1.1 404 Not Found",
            ),
            (
                b"POST /metrics HTTP/1.1\r\n\r\n",
                "HTTP/1.1 405 Method Not Allowed",
            ),
        ] {
            let mut s = TcpStream::connect(at).unwrap();
            s.write_all(req).unwrap();
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            assert!(text.starts_with(want), "{text:?}");
        }
    }

    /// A scrape over mutual TLS with the certificate in `client` (a host
    /// directory of `ferry pki`): the status line, or why it failed.
    fn scrape_tls(at: std::net::SocketAddr, client: &std::path::Path) -> Result<String, String> {
        let creds = Credentials::load(client).map_err(|e| e.to_string())?;
        let mut t =
            Client::connect(at, Some(&creds), Duration::from_secs(5)).map_err(|e| e.to_string())?;
        t.tcp()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        t.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut text = String::new();
        t.read_to_string(&mut text).map_err(|e| e.to_string())?;
        Ok(text.lines().next().unwrap_or("").to_string())
    }

    #[test]
    fn over_tls_only_a_fleet_scraper_reads_the_figures() {
        let dir = std::env::temp_dir().join(format!("ferry-metrics-{}", std::process::id()));
        let host = ferry_tls::pki::local_fleet(&dir, "vmm-host").unwrap();
        let scraper = dir.join("scraper");
        ferry_tls::pki::issue(
            &dir.join("ca"),
            "scraper",
            &scraper,
            &[],
            ferry_tls::pki::Validity::days(1),
        )
        .unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let tls = Some(Credentials::load(&host).unwrap());
        serve(l, Limits::default(), tls, || {
            Some("ferry_up 1\n".to_string())
        })
        .unwrap();
        assert_eq!(scrape_tls(at, &scraper).unwrap(), "HTTP/1.1 200 OK");
        // Plain HTTP gets no answer at all.
        let (status, _) = scrape(at);
        assert!(!status.starts_with("HTTP/"), "{status}");
        // A scraper of another fleet is refused in the handshake.
        let other = ferry_tls::pki::local_fleet(&dir.join("other"), "scraper").unwrap();
        let e = scrape_tls(at, &other).unwrap_err();
        assert!(e.contains("not from") || e.contains("refused"), "{e}");
        // And the endpoint still serves its own.
        assert_eq!(scrape_tls(at, &scraper).unwrap(), "HTTP/1.1 200 OK");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
