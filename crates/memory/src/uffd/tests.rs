//! Tests against the real kernel interface: each opens a userfaultfd and
//! skips, saying why, where this host offers none (or lacks the feature).

use super::abi::feature;
use super::*;
use crate::region::{MemfdRegion, PAGE_SIZE};
use std::sync::Arc;
use std::time::Duration;

const PAGE: usize = PAGE_SIZE as usize;

fn uffd(features: Features) -> Option<Userfaultfd> {
    match Userfaultfd::new(features) {
        Ok(u) => Some(u),
        Err(e @ (UffdError::Open { .. } | UffdError::MissingFeatures { .. })) => {
            eprintln!("SKIP: userfaultfd test not run because this host cannot give it: {e}");
            None
        }
        Err(e) => panic!("userfaultfd handshake: {e}"),
    }
}

/// Waits up to 5 s for the next event (failing instead of hanging).
fn next_event(u: &Userfaultfd) -> Event {
    let mut ev = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if u.poll(Duration::from_millis(100)).unwrap() && u.read_events(&mut ev).unwrap() > 0 {
            return ev[0];
        }
    }
    panic!("no userfaultfd event within 5 s");
}

/// Joins a thread that may be blocked in a fault; fails after 5 s.
fn join<T>(h: std::thread::JoinHandle<T>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !h.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "faulting thread still blocked after 5 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    h.join().unwrap()
}

fn read_byte(r: &Arc<MemfdRegion>, offset: usize) -> std::thread::JoinHandle<u8> {
    let r = r.clone();
    // SAFETY: callers pass offsets inside the mapping, which the Arc keeps alive.
    std::thread::spawn(move || unsafe { r.host_addr().add(offset).read_volatile() })
}

#[test]
fn missing_fault_is_resolved_by_copy() {
    let Some(u) = uffd(Features {
        missing_shmem: true,
        thread_id: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-missing", 0, 4 * PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    let ioctls = u
        .register(
            base,
            4 * PAGE_SIZE,
            RegisterMode {
                missing: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(
        ioctls.copy() && ioctls.zeropage() && ioctls.wake(),
        "{ioctls:?}"
    );
    let reader = read_byte(&r, PAGE + 7);
    let ev = next_event(&u);
    let Event::PageFault { tid, .. } = ev else {
        panic!("{ev:?}")
    };
    assert_eq!(
        ev,
        Event::PageFault {
            addr: base + PAGE_SIZE,
            write: false,
            wp: false,
            minor: false,
            tid,
        }
    );
    // The reader is one of this process's threads, and not this one.
    assert!(std::path::Path::new(&format!("/proc/self/task/{tid}")).exists());
    // SAFETY: gettid has no preconditions.
    assert_ne!(tid as i32, unsafe { libc::gettid() });
    assert_eq!(
        u.copy(base + PAGE_SIZE, &[0xab; PAGE], true).unwrap(),
        PAGE_SIZE
    );
    assert_eq!(join(reader), 0xab);
    assert!(matches!(
        u.copy(base + PAGE_SIZE, &[0; PAGE], true),
        Err(UffdError::AlreadyMapped { .. })
    ));
    assert!(matches!(
        u.copy(base + 1, &[0; PAGE], true),
        Err(UffdError::Ioctl { op: "COPY", .. })
    ));
}

#[test]
fn missing_fault_is_resolved_by_zeropage_and_batched_wake() {
    let Some(u) = uffd(Features {
        missing_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-zero", 0, 4 * PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    let mode = RegisterMode {
        missing: true,
        ..Default::default()
    };
    u.register(base, 4 * PAGE_SIZE, mode).unwrap();
    let zero_reader = read_byte(&r, 3);
    assert!(matches!(next_event(&u), Event::PageFault { addr, .. } if addr == base));
    assert_eq!(u.zeropage(base, PAGE_SIZE).unwrap(), PAGE_SIZE);
    assert_eq!(join(zero_reader), 0);

    // Copy without waking, then wake the range once.
    let reader = read_byte(&r, 2 * PAGE);
    assert!(matches!(next_event(&u), Event::PageFault { .. }));
    u.copy(base + 2 * PAGE_SIZE, &[5; 2 * PAGE], false).unwrap();
    u.wake(base + 2 * PAGE_SIZE, 2 * PAGE_SIZE).unwrap();
    assert_eq!(join(reader), 5);

    u.unregister(base, 4 * PAGE_SIZE).unwrap();
    let mut none = Vec::new();
    assert_eq!(u.read_events(&mut none).unwrap(), 0, "EAGAIN reads as 0");
    assert!(!u.poll(Duration::from_millis(1)).unwrap());
}

#[test]
fn minor_fault_after_discard_keeps_data() {
    let Some(u) = uffd(Features {
        minor_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-minor", 0, 2 * PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    // SAFETY: byte 5 of the live mapping.
    unsafe { *r.host_addr().add(5) = 42 };
    r.discard(0, PAGE_SIZE).unwrap();
    let ioctls = u
        .register(
            base,
            2 * PAGE_SIZE,
            RegisterMode {
                minor: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(ioctls.continue_range(), "{ioctls:?}");
    let reader = read_byte(&r, 5);
    let ev = next_event(&u);
    assert!(
        matches!(ev, Event::PageFault { addr, minor: true, .. } if addr == base),
        "{ev:?}"
    );
    assert_eq!(u.continue_range(base, PAGE_SIZE).unwrap(), PAGE_SIZE);
    assert_eq!(join(reader), 42);
}

#[test]
fn write_protect_blocks_writers_until_unprotected() {
    let Some(u) = uffd(Features {
        wp_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-wp", 0, PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    // SAFETY: byte 0 of the live mapping (populates the page).
    unsafe { *r.host_addr() = 1 };
    let ioctls = u
        .register(
            base,
            PAGE_SIZE,
            RegisterMode {
                missing: true,
                wp: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(ioctls.write_protect(), "{ioctls:?}");
    u.write_protect(base, PAGE_SIZE, true).unwrap();
    let r2 = r.clone();
    // SAFETY: byte 0 of the mapping, kept alive by the Arc.
    let writer = std::thread::spawn(move || unsafe { r2.host_addr().write_volatile(9) });
    let ev = next_event(&u);
    assert!(
        matches!(ev, Event::PageFault { addr, write: true, wp: true, minor: false, .. } if addr == base),
        "{ev:?}"
    );
    // SAFETY: reading the page while the writer is blocked.
    let during = unsafe { r.host_addr().read_volatile() };
    assert_eq!(during, 1, "the write waits for the handler");
    u.write_protect(base, PAGE_SIZE, false).unwrap();
    join(writer);
    // SAFETY: as above.
    assert_eq!(unsafe { r.host_addr().read_volatile() }, 9);
}

/// On shmem, write protection also holds for pages not mapped in this
/// process (the kernel leaves a pte marker), without WP_UNPOPULATED.
#[test]
fn write_protect_covers_discarded_shmem_pages() {
    let Some(u) = uffd(Features {
        wp_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-wp-none", 0, PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    // SAFETY: byte 0 of the live mapping.
    unsafe { *r.host_addr() = 1 };
    r.discard(0, PAGE_SIZE).unwrap();
    let wp = RegisterMode {
        wp: true,
        ..Default::default()
    };
    u.register(base, PAGE_SIZE, wp).unwrap();
    u.write_protect(base, PAGE_SIZE, true).unwrap();
    let r2 = r.clone();
    // SAFETY: byte 0 of the mapping, kept alive by the Arc.
    let writer = std::thread::spawn(move || unsafe { r2.host_addr().write_volatile(9) });
    let ev = next_event(&u);
    assert!(matches!(ev, Event::PageFault { wp: true, .. }), "{ev:?}");
    u.write_protect(base, PAGE_SIZE, false).unwrap();
    join(writer);
    // SAFETY: as above.
    assert_eq!(unsafe { r.host_addr().read_volatile() }, 9);
}

#[test]
fn handshake_reports_features_and_bad_registrations() {
    let Some(u) = uffd(Features::default()) else {
        return;
    };
    eprintln!("kernel userfaultfd features: {:?}", u.available_features());
    let r = MemfdRegion::new("uffd-bad", 0, 2 * PAGE_SIZE).unwrap();
    let base = r.host_addr() as u64;
    let missing = RegisterMode {
        missing: true,
        ..Default::default()
    };
    for (addr, len) in [(base + 1, PAGE_SIZE), (base, 100), (base, 0)] {
        let err = u.register(addr, len, missing).unwrap_err();
        assert!(matches!(err, UffdError::Register { .. }), "{err}");
    }
    let err = u
        .register(base, PAGE_SIZE, RegisterMode::default())
        .unwrap_err();
    assert!(matches!(err, UffdError::Register { .. }), "no mode: {err}");
    // The *_SHMEM feature bits are probes only: registering shmem for
    // MINOR works on a descriptor that did not ask for MINOR_SHMEM.
    let minor = RegisterMode {
        minor: true,
        ..Default::default()
    };
    u.register(base, PAGE_SIZE, minor).unwrap();
}

#[test]
fn missing_features_are_named() {
    let names = feature::names(feature::MINOR_SHMEM | 1 << 40);
    assert_eq!(
        names,
        vec!["MINOR_SHMEM".to_string(), "0x10000000000".into()]
    );
    let e = UffdError::MissingFeatures {
        missing: vec!["WP_UNPOPULATED".into()],
        available: vec![],
    };
    assert!(e.to_string().contains("WP_UNPOPULATED"));
}

/// Pages filled ahead of any fault (as postcopy's background pushes do)
/// read back with no handler; a page already there and a call past the
/// registered range come back as their typed errors.
#[test]
fn copy_and_zeropage_fill_ahead_of_faults_and_type_their_errors() {
    let Some(u) = uffd(Features {
        missing_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = MemfdRegion::new("uffd-ahead", 0, 4 * PAGE_SIZE).unwrap();
    let base = r.host_addr() as u64;
    let missing = RegisterMode {
        missing: true,
        ..Default::default()
    };
    // Only the first two pages: the other two are mapped but not registered.
    u.register(base, 2 * PAGE_SIZE, missing).unwrap();

    let mut page = vec![0u8; PAGE];
    page.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 251) as u8);
    assert_eq!(u.copy(base, &page, true).unwrap(), PAGE_SIZE);
    assert_eq!(u.zeropage(base + PAGE_SIZE, PAGE_SIZE).unwrap(), PAGE_SIZE);
    // SAFETY: both pages are now mapped (no fault can block this thread),
    // inside the live mapping `r` owns.
    let (copied, zeroed) = unsafe {
        (
            std::slice::from_raw_parts(r.host_addr(), PAGE).to_vec(),
            std::slice::from_raw_parts(r.host_addr().add(PAGE), PAGE).to_vec(),
        )
    };
    assert_eq!(copied, page, "UFFDIO_COPY put the bytes in");
    assert!(
        zeroed.iter().all(|&b| b == 0),
        "UFFDIO_ZEROPAGE mapped zeros"
    );

    // Already mapped, by either call.
    for err in [
        u.zeropage(base, PAGE_SIZE).unwrap_err(),
        u.copy(base + PAGE_SIZE, &page, true).unwrap_err(),
    ] {
        assert!(matches!(err, UffdError::AlreadyMapped { .. }), "{err}");
    }
    assert!(matches!(
        u.zeropage(base + PAGE_SIZE, PAGE_SIZE),
        Err(UffdError::AlreadyMapped { addr }) if addr == base + PAGE_SIZE
    ));

    // Past the registered range, and a length that is not whole pages.
    let past = base + 2 * PAGE_SIZE;
    let err = u.copy(past, &page, true).unwrap_err();
    assert!(
        matches!(&err, UffdError::Ioctl { op: "COPY", addr, len, source }
            if *addr == past && *len == PAGE_SIZE && source.raw_os_error().is_some()),
        "{err:?}"
    );
    let err = u.zeropage(past, PAGE_SIZE).unwrap_err();
    assert!(
        matches!(&err, UffdError::Ioctl { op: "ZEROPAGE", addr, .. } if *addr == past),
        "{err:?}"
    );
    let err = u.zeropage(base, 100).unwrap_err();
    assert!(
        matches!(
            &err,
            UffdError::Ioctl {
                op: "ZEROPAGE",
                len: 100,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("ZEROPAGE"), "{err}");
    // Unregistered, the range takes no more fills (not even a typed
    // AlreadyMapped: the range is no longer this descriptor's).
    u.unregister(base, 2 * PAGE_SIZE).unwrap();
    let err = u.copy(base, &page, true).unwrap_err();
    assert!(
        matches!(err, UffdError::Ioctl { op: "COPY", .. }),
        "{err:?}"
    );
}

/// `continue_prefix` maps what is in the page cache up to the first page
/// that is not, and answers 0 (not an error) at a hole or a mapped page.
#[test]
fn continue_prefix_stops_at_the_first_page_not_in_the_cache() {
    let Some(u) = uffd(Features {
        minor_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = MemfdRegion::new("uffd-prefix", 0, 4 * PAGE_SIZE).unwrap();
    let base = r.host_addr() as u64;
    for p in 0..2 {
        // SAFETY: byte 0 of page p < 4 of the live mapping (not registered yet).
        unsafe { r.host_addr().add(p * PAGE).write_volatile(10 + p as u8) };
    }
    // Pages 0 and 1 stay in the page cache; 2 and 3 were never written.
    r.discard(0, 4 * PAGE_SIZE).unwrap();
    let minor = RegisterMode {
        minor: true,
        ..Default::default()
    };
    u.register(base, 4 * PAGE_SIZE, minor).unwrap();

    assert_eq!(
        u.continue_prefix(base, 4 * PAGE_SIZE).unwrap(),
        2 * PAGE_SIZE
    );
    // SAFETY: pages 0 and 1 were just mapped, so these reads cannot fault.
    let bytes = unsafe {
        [
            r.host_addr().read_volatile(),
            r.host_addr().add(PAGE).read_volatile(),
        ]
    };
    assert_eq!(bytes, [10, 11], "the page cache's data came back");
    assert_eq!(u.continue_prefix(base, PAGE_SIZE).unwrap(), 0, "mapped");
    assert_eq!(
        u.continue_prefix(base + 2 * PAGE_SIZE, 2 * PAGE_SIZE)
            .unwrap(),
        0,
        "a hole"
    );
    // The whole-range call makes the same cases errors.
    assert!(matches!(
        u.continue_range(base, PAGE_SIZE),
        Err(UffdError::AlreadyMapped { .. })
    ));
    let err = u
        .continue_range(base + 2 * PAGE_SIZE, PAGE_SIZE)
        .unwrap_err();
    assert!(
        matches!(err, UffdError::Ioctl { op: "CONTINUE", .. }),
        "{err:?}"
    );
}

/// A page copied in write-protected (one ioctl) is readable at once and its
/// first write faults WP: nothing can write it between landing and
/// protection.
#[test]
fn a_page_copied_in_protected_faults_on_its_first_write() {
    let Some(u) = uffd(Features {
        missing_shmem: true,
        wp_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-copy-wp", 0, PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    let both = RegisterMode {
        missing: true,
        wp: true,
        ..Default::default()
    };
    u.register(base, PAGE_SIZE, both).unwrap();
    let page = vec![7u8; PAGE];
    assert_eq!(u.copy_protected(base, &page, true).unwrap(), PAGE_SIZE);
    assert_eq!(join(read_byte(&r, 3)), 7, "reads pass");
    let r2 = r.clone();
    // SAFETY: byte 0 of the mapping, kept alive by the Arc.
    let writer = std::thread::spawn(move || unsafe { r2.host_addr().write_volatile(9) });
    let ev = next_event(&u);
    assert!(
        matches!(ev, Event::PageFault { addr, wp: true, .. } if addr == base),
        "{ev:?}"
    );
    u.write_protect(base, PAGE_SIZE, false).unwrap();
    join(writer);
    // SAFETY: as above.
    assert_eq!(unsafe { r.host_addr().read_volatile() }, 9);
}

/// A page mapped back by CONTINUE in WP mode keeps its protection: the
/// write after the MINOR fault faults WP. Kernels before 6.4 refuse the
/// mode; the test says so and checks that the refusal is an error.
#[test]
fn a_page_mapped_back_protected_faults_on_its_first_write() {
    let Some(u) = uffd(Features {
        minor_shmem: true,
        wp_shmem: true,
        ..Default::default()
    }) else {
        return;
    };
    let r = Arc::new(MemfdRegion::new("uffd-continue-wp", 0, PAGE_SIZE).unwrap());
    let base = r.host_addr() as u64;
    // SAFETY: byte 5 of the live mapping.
    unsafe { *r.host_addr().add(5) = 42 };
    let both = RegisterMode {
        minor: true,
        wp: true,
        ..Default::default()
    };
    u.register(base, PAGE_SIZE, both).unwrap();
    u.write_protect(base, PAGE_SIZE, true).unwrap();
    r.discard(0, PAGE_SIZE).unwrap();
    let reader = read_byte(&r, 5);
    let ev = next_event(&u);
    assert!(matches!(ev, Event::PageFault { minor: true, .. }), "{ev:?}");
    match u.continue_protected(base, PAGE_SIZE) {
        Ok(n) => assert_eq!(n, PAGE_SIZE),
        Err(e) => {
            eprintln!("SKIP: this kernel cannot map back write-protected: {e}");
            u.continue_range(base, PAGE_SIZE).unwrap();
            join(reader);
            return;
        }
    }
    assert_eq!(join(reader), 42);
    let r2 = r.clone();
    // SAFETY: byte 5 of the mapping, kept alive by the Arc.
    let writer = std::thread::spawn(move || unsafe { r2.host_addr().add(5).write_volatile(9) });
    let ev = next_event(&u);
    assert!(matches!(ev, Event::PageFault { wp: true, .. }), "{ev:?}");
    u.write_protect(base, PAGE_SIZE, false).unwrap();
    join(writer);
    // SAFETY: as above.
    assert_eq!(unsafe { r.host_addr().add(5).read_volatile() }, 9);
}
