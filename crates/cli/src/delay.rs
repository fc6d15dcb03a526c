//! `ferry lab delay`: a TCP proxy that adds a fixed delay in each direction,
//! for links longer than a veth pair. This kernel has no sch_netem, so the
//! lab delays at the application layer instead: every chunk read on one
//! side is written to the other side `rtt/2` after it was read, in order.
//! Bandwidth is untouched (the proxy forwards as fast as it reads), so a
//! delayed link keeps its rate; only its round trip grows.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Forwards connections from `listen` to `to`, adding `rtt / 2` each way.
/// Runs until killed; prints the address it listens on first.
pub fn run(listen: SocketAddr, to: SocketAddr, rtt: Duration) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    println!("{}", l.local_addr()?);
    std::io::stdout().flush()?;
    let one_way = rtt / 2;
    for client in l.incoming() {
        let Ok(client) = client else { continue };
        let server = match TcpStream::connect(to) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("ferry lab delay: cannot reach {to}: {e}");
                continue;
            }
        };
        for s in [&client, &server] {
            let _ = s.set_nodelay(true);
        }
        let (c2, s2) = (client.try_clone()?, server.try_clone()?);
        std::thread::spawn(move || pipe(client, server, one_way));
        std::thread::spawn(move || pipe(s2, c2, one_way));
    }
    Ok(())
}

/// Copies `from` to `to`, each chunk `delay` after it was read.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
}
