//! `ferry lab uffd-cost`: the floor under any postcopy fault on this host.

use std::time::{Duration, Instant};

use anyhow::Result;

/// The bare cost of one userfaultfd MISSING fault on this host: a thread
/// touches `pages` pages of a registered memfd one by one while another
/// resolves each with UFFDIO_COPY; returns each touch's time in µs. A
/// postcopy fault can be no cheaper than this.
pub fn fault_times(pages: u64) -> Result<Vec<f64>> {
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
