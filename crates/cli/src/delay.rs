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

/// The bare cost of one userfaultfd MISSING fault on this host: a thread
/// touches `pages` pages of a registered memfd one by one while another
/// resolves each with UFFDIO_COPY; returns each touch's time in µs. A
/// postcopy fault can be no cheaper than this.
pub fn uffd_fault_cost(pages: u64) -> Result<Vec<f64>> {
    use ferry_memory::{Event, Features, MemfdRegion, RegisterMode, Userfaultfd};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const PAGE: u64 = 4096;
    let uffd = Arc::new(Userfaultfd::new(Features {
        missing_shmem: true,
        ..Default::default()
    })?);
    let region = Arc::new(MemfdRegion::new("uffd-cost", 0, pages * PAGE)?);
    let base = region.host_addr() as u64;
    uffd.register(
        base,
        pages * PAGE,
        RegisterMode {
            missing: true,
            ..Default::default()
        },
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let handler = {
        let (uffd, stop) = (uffd.clone(), stop.clone());
        std::thread::spawn(move || -> Result<()> {
            let page = vec![7u8; PAGE as usize];
            let mut events = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if !uffd.poll(Duration::from_millis(20))? {
                    continue;
                }
                events.clear();
                uffd.read_events(&mut events)?;
                for ev in &events {
                    if let Event::PageFault { addr, .. } = *ev {
                        uffd.copy(addr & !(PAGE - 1), &page, true)?;
                    }
                }
            }
            Ok(())
        })
    };
    let mut times = Vec::with_capacity(pages as usize);
    for p in 0..pages {
        let t = Instant::now();
        // SAFETY: the page lies inside the live mapping `region` owns; the
        // read blocks until the handler supplies it.
        let v = unsafe { (region.host_addr().add((p * PAGE) as usize)).read_volatile() };
        times.push(t.elapsed().as_secs_f64() * 1e6);
        debug_assert_eq!(v, 7);
    }
    stop.store(true, Ordering::Relaxed);
    handler
        .join()
        .map_err(|_| anyhow::anyhow!("the fault handler panicked"))??;
    Ok(times)
}
