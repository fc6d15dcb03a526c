//! A small safe wrapper over Linux userfaultfd, for guest RAM on memfds.
//!
//! ferry uses it for postcopy and remote paging (MISSING faults resolved with
//! [`Userfaultfd::copy`]), access sampling (MINOR faults after
//! [`crate::MemfdRegion::discard`], resolved with [`Userfaultfd::continue_range`])
//! and page-out (write protection).
//!
//! Cost: every fault is two thread wake-ups (faulting thread -> handler ->
//! faulting thread). On the 2-core development VM (Linux 6.18) a host thread
//! fault resolved by a handler measured ~8-10 µs back to back and ~20-25 µs
//! when the handler was asleep in poll; budget ~30-90 µs per fault for vCPUs
//! (KVM adds its own exit and retry). So handlers should
//! [`Userfaultfd::poll`], drain every pending event per wake-up with
//! [`Userfaultfd::read_events`], and resolve in batches (copy with
//! `wake: false`, then one [`Userfaultfd::wake`]), ideally ahead of faults.
//!
//! Register only guest memory (mappings that no Rust reference points into):
//! the resolving calls fill pages behind the compiler's back, and a thread
//! touching a registered range blocks until its fault is resolved.

mod abi;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use abi::feature;

/// Why a userfaultfd call failed.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// Neither /dev/userfaultfd nor the syscall gave a descriptor.
    #[error(
        "cannot open userfaultfd: /dev/userfaultfd: {dev}; userfaultfd(2): {syscall} \
         (needs access to /dev/userfaultfd, CAP_SYS_PTRACE, or vm.unprivileged_userfaultfd=1)"
    )]
    Open {
        /// Why /dev/userfaultfd (open or USERFAULTFD_IOC_NEW) failed.
        dev: std::io::Error,
        /// Why the userfaultfd(2) syscall failed.
        syscall: std::io::Error,
    },
    /// The kernel does not offer some requested features.
    #[error("this kernel's userfaultfd lacks {missing:?} (it offers {available:?})")]
    MissingFeatures {
        /// Requested features the kernel lacks (UFFD_FEATURE_* names).
        missing: Vec<String>,
        /// What the kernel offers.
        available: Vec<String>,
    },
    /// The API handshake failed for another reason.
    #[error("userfaultfd API handshake (features {requested:?}) failed: {source}")]
    Api {
        /// Requested features.
        requested: Vec<String>,
        /// OS error.
        source: std::io::Error,
    },
    /// Registering a range failed.
    #[error("cannot register {len:#x} bytes at {addr:#x} with userfaultfd ({mode:?}): {source}")]
    Register {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Requested fault kinds.
        mode: RegisterMode,
        /// OS error (EINVAL: unaligned, or a mode the mapping or fd does not
        /// support; EBUSY: registered with another userfaultfd).
        source: std::io::Error,
    },
    /// The page is already mapped (e.g. another thread resolved it first);
    /// callers resolving faults may ignore this.
    #[error("page at {addr:#x} is already mapped")]
    AlreadyMapped {
        /// Address.
        addr: u64,
    },
    /// Any other ioctl failure.
    #[error("userfaultfd {op} at {addr:#x}+{len:#x} failed: {source}")]
    Ioctl {
        /// Which ioctl.
        op: &'static str,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// Reading or polling for events failed.
    #[error("reading userfaultfd events failed: {0}")]
    Read(std::io::Error),
}

/// Optional kernel features to request in the API handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// MISSING faults on shmem/memfd (UFFD_FEATURE_MISSING_SHMEM).
    pub missing_shmem: bool,
    /// MINOR faults on shmem/memfd (UFFD_FEATURE_MINOR_SHMEM).
    pub minor_shmem: bool,
    /// Write protection on shmem/memfd (UFFD_FEATURE_WP_HUGETLBFS_SHMEM and
    /// UFFD_FEATURE_PAGEFAULT_FLAG_WP).
    pub wp_shmem: bool,
    /// Write protection also of never-populated anonymous pages
    /// (UFFD_FEATURE_WP_UNPOPULATED, Linux 6.4+). shmem gets this without it.
    pub wp_unpopulated: bool,
    /// The faulting thread's id in each fault event (UFFD_FEATURE_THREAD_ID).
    pub thread_id: bool,
}

impl Features {
    fn bits(self) -> u64 {
        let mut bits = 0;
        if self.missing_shmem {
            bits |= feature::MISSING_SHMEM;
        }
        if self.minor_shmem {
            bits |= feature::MINOR_SHMEM;
        }
        if self.wp_shmem {
            bits |= feature::WP_HUGETLBFS_SHMEM | feature::PAGEFAULT_FLAG_WP;
        }
        if self.wp_unpopulated {
            bits |= feature::WP_UNPOPULATED | feature::PAGEFAULT_FLAG_WP;
        }
        if self.thread_id {
            bits |= feature::THREAD_ID;
        }
        bits
    }
}

/// Which faults a registered range raises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisterMode {
    /// Access to a page with no backing page.
    pub missing: bool,
    /// Access to a page present in the page cache but not mapped here.
    pub minor: bool,
    /// Write to a write-protected page.
    pub wp: bool,
}

impl RegisterMode {
    fn bits(self) -> u64 {
        let mut bits = 0;
        if self.missing {
            bits |= abi::REGISTER_MODE_MISSING;
        }
        if self.minor {
            bits |= abi::REGISTER_MODE_MINOR;
        }
        if self.wp {
            bits |= abi::REGISTER_MODE_WP;
        }
        bits
    }
}

/// The ioctls the kernel allows on a registered range (it depends on the
/// mapping type and the mode), so callers can check before relying on one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ioctls(u64);

impl Ioctls {
    fn has(self, nr: u64) -> bool {
        self.0 & (1 << nr) != 0
    }

    /// The raw bitmask (bit n = ioctl number n).
    pub fn bits(self) -> u64 {
        self.0
    }

    /// [`Userfaultfd::copy`] works on the range.
    pub fn copy(self) -> bool {
        self.has(abi::nr::COPY)
    }

    /// [`Userfaultfd::zeropage`] works on the range.
    pub fn zeropage(self) -> bool {
        self.has(abi::nr::ZEROPAGE)
    }

    /// [`Userfaultfd::continue_range`] works on the range.
    pub fn continue_range(self) -> bool {
        self.has(abi::nr::CONTINUE)
    }

    /// [`Userfaultfd::write_protect`] works on the range.
    pub fn write_protect(self) -> bool {
        self.has(abi::nr::WRITEPROTECT)
    }

    /// [`Userfaultfd::wake`] works on the range.
    pub fn wake(self) -> bool {
        self.has(abi::nr::WAKE)
    }
}

/// One event read from the descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A thread faulted and waits until the page is resolved.
    PageFault {
        /// Faulting address, rounded down to its page.
        addr: u64,
        /// A write access.
        write: bool,
        /// Raised by write protection.
        wp: bool,
        /// A MINOR fault.
        minor: bool,
        /// The faulting thread (0 unless [`Features::thread_id`] was asked).
        tid: u32,
    },
    /// Pages were removed (MADV_DONTNEED/REMOVE) from a range (only with
    /// UFFD_FEATURE_EVENT_REMOVE, which [`Features`] does not request).
    Remove {
        /// Start.
        start: u64,
        /// End (exclusive).
        end: u64,
    },
    /// Another event type (UFFD_EVENT_FORK 0x13, REMAP 0x14, UNMAP 0x16).
    Other(u8),
}

impl Event {
    fn from_msg(m: &abi::Msg) -> Self {
        match m.event {
            abi::EVENT_PAGEFAULT => {
                let flags = m.arg[0];
                Event::PageFault {
                    addr: m.arg[1],
                    write: flags & abi::PAGEFAULT_FLAG_WRITE != 0,
                    wp: flags & abi::PAGEFAULT_FLAG_WP != 0,
                    minor: flags & abi::PAGEFAULT_FLAG_MINOR != 0,
                    tid: m.arg[2] as u32,
                }
            }
            abi::EVENT_REMOVE => Event::Remove {
                start: m.arg[0],
                end: m.arg[1],
            },
            other => Event::Other(other),
        }
    }
}

/// An open userfaultfd (non-blocking, close-on-exec).
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
    available: u64,
}

impl Userfaultfd {
    /// Opens a userfaultfd and completes the API handshake with `features`.
    pub fn new(features: Features) -> Result<Self, UffdError> {
        let requested = features.bits();
        let fd = open_uffd()?;
        match handshake(&fd, requested) {
            Ok(api) => Ok(Userfaultfd {
                fd,
                available: api.features,
            }),
            Err(source) => {
                // The kernel zeroes its answer on failure, so name what is
                // missing by asking a second descriptor for no features.
                drop(fd);
                let available = open_uffd()
                    .ok()
                    .and_then(|probe| handshake(&probe, 0).ok())
                    .map(|api| api.features);
                match available {
                    Some(available) if requested & !available != 0 => {
                        Err(UffdError::MissingFeatures {
                            missing: feature::names(requested & !available),
                            available: feature::names(available),
                        })
                    }
                    _ => Err(UffdError::Api {
                        requested: feature::names(requested),
                        source,
                    }),
                }
            }
        }
    }

    /// The UFFD_FEATURE_* names the kernel offers (not only those requested).
    pub fn available_features(&self) -> Vec<String> {
        feature::names(self.available)
    }

    fn ioctl<T>(
        &self,
        op: &'static str,
        req: u64,
        arg: &mut T,
        addr: u64,
        len: u64,
    ) -> Result<(), UffdError> {
        // SAFETY: every caller pairs `req` with the repr(C) mirror of the
        // struct that ioctl takes (layouts pinned by abi's tests); `arg` is a
        // live exclusive borrow for the call; the fd is ours.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), req as _, arg as *mut T) } < 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::EEXIST) {
                return Err(UffdError::AlreadyMapped { addr });
            }
            return Err(UffdError::Ioctl {
                op,
                addr,
                len,
                source,
            });
        }
        Ok(())
    }

    /// Registers `[addr, addr+len)` (page-aligned) for the given fault kinds;
    /// returns the ioctls the kernel allows on it.
    pub fn register(&self, addr: u64, len: u64, mode: RegisterMode) -> Result<Ioctls, UffdError> {
        let mut arg = abi::Register {
            range: abi::Range { start: addr, len },
            mode: mode.bits(),
            ioctls: 0,
        };
        self.ioctl("REGISTER", abi::UFFDIO_REGISTER, &mut arg, addr, len)
            .map_err(|e| match e {
                UffdError::Ioctl { source, .. } => UffdError::Register {
                    addr,
                    len,
                    mode,
                    source,
                },
                other => other,
            })?;
        Ok(Ioctls(arg.ioctls))
    }

    /// Stops handling faults for a range (waiting threads are woken).
    pub fn unregister(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = abi::Range { start: addr, len };
        self.ioctl("UNREGISTER", abi::UFFDIO_UNREGISTER, &mut r, addr, len)
    }

    /// Fills missing pages at `dst` (page-aligned) with `src` (a whole number
    /// of pages) and, if `wake`, wakes the threads waiting on them; returns
    /// the bytes copied.
    pub fn copy(&self, dst: u64, src: &[u8], wake: bool) -> Result<u64, UffdError> {
        let len = src.len() as u64;
        let mut a = abi::Copy {
            dst,
            src: src.as_ptr() as u64,
            len,
            mode: if wake { 0 } else { abi::COPY_MODE_DONTWAKE },
            copy: 0,
        };
        self.ioctl("COPY", abi::UFFDIO_COPY, &mut a, dst, len)?;
        Ok(u64::try_from(a.copy).unwrap_or(0))
    }

    /// Maps zero pages at a missing range and wakes waiters; returns the
    /// bytes mapped.
    pub fn zeropage(&self, addr: u64, len: u64) -> Result<u64, UffdError> {
        let mut a = abi::RangeMode {
            range: abi::Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        self.ioctl("ZEROPAGE", abi::UFFDIO_ZEROPAGE, &mut a, addr, len)?;
        Ok(u64::try_from(a.result).unwrap_or(0))
    }

    /// Resolves MINOR faults: maps the page-cache pages already there and
    /// wakes waiters; returns the bytes mapped.
    pub fn continue_range(&self, addr: u64, len: u64) -> Result<u64, UffdError> {
        let mut a = abi::RangeMode {
            range: abi::Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        self.ioctl("CONTINUE", abi::UFFDIO_CONTINUE, &mut a, addr, len)?;
        Ok(u64::try_from(a.result).unwrap_or(0))
    }

    /// Like [`continue_range`](Self::continue_range), but a page the
    /// kernel cannot map ends the call, not the whole range: returns the
    /// bytes mapped (and woken) from `addr` before it, which may be 0 (the
    /// page at `addr` is mapped already, or not in the page cache). Other
    /// failures are errors.
    pub fn continue_prefix(&self, addr: u64, len: u64) -> Result<u64, UffdError> {
        let mut a = abi::RangeMode {
            range: abi::Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        match self.ioctl("CONTINUE", abi::UFFDIO_CONTINUE, &mut a, addr, len) {
            Ok(()) => Ok(len),
            // A partial map ends in EAGAIN with the bytes done in `result`.
            Err(_) if a.result > 0 => Ok(a.result as u64),
            Err(UffdError::AlreadyMapped { .. }) => Ok(0),
            Err(UffdError::Ioctl { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EFAULT | libc::ENOENT)) =>
            {
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// Write-protects a range, or removes the protection and wakes the
    /// writers blocked on it.
    pub fn write_protect(&self, addr: u64, len: u64, protect: bool) -> Result<(), UffdError> {
        let mut a = abi::WriteProtect {
            range: abi::Range { start: addr, len },
            mode: if protect {
                abi::WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        self.ioctl("WRITEPROTECT", abi::UFFDIO_WRITEPROTECT, &mut a, addr, len)
    }

    /// Wakes threads waiting on a range (after copies with `wake: false`).
    pub fn wake(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = abi::Range { start: addr, len };
        self.ioctl("WAKE", abi::UFFDIO_WAKE, &mut r, addr, len)
    }

    /// Appends every pending event to `out` without blocking; returns how
    /// many were read (0 when none are pending).
    pub fn read_events(&self, out: &mut Vec<Event>) -> Result<usize, UffdError> {
        let mut msgs = [abi::Msg::default(); 64];
        let mut total = 0;
        loop {
            // SAFETY: the buffer is ours, writable and exactly
            // size_of_val(&msgs) bytes; the kernel writes whole uffd_msg
            // structs, whose layout abi::Msg mirrors.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr().cast(),
                    size_of_val(&msgs),
                )
            };
            let Ok(n) = usize::try_from(n) else {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::WouldBlock => return Ok(total),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => return Err(UffdError::Read(e)),
                }
            };
            let count = n / size_of::<abi::Msg>();
            out.extend(msgs[..count].iter().map(Event::from_msg));
            total += count;
            if count < msgs.len() {
                return Ok(total);
            }
        }
    }

    /// Waits up to `timeout` for events; true if some are pending (false on
    /// timeout or when a signal interrupted the wait).
    pub fn poll(&self, timeout: Duration) -> Result<bool, UffdError> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Round up so a sub-millisecond timeout still waits.
        let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: one valid, exclusively borrowed pollfd and a count of 1.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(UffdError::Read(e));
        }
        Ok(r > 0 && p.revents & libc::POLLIN != 0)
    }
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// UFFDIO_API with `features`; returns the kernel's answer.
fn handshake(fd: &OwnedFd, features: u64) -> Result<abi::Api, std::io::Error> {
    let mut api = abi::Api {
        api: abi::UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: fd is a fresh userfaultfd and `api` a live, exclusively
    // borrowed uffdio_api of the size UFFDIO_API encodes.
    if unsafe { libc::ioctl(fd.as_raw_fd(), abi::UFFDIO_API as _, &mut api) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(api)
}

/// Opens a userfaultfd (O_CLOEXEC|O_NONBLOCK) through /dev/userfaultfd,
/// which any user with access to the node may use, else the syscall.
fn open_uffd() -> Result<OwnedFd, UffdError> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    let dev = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
    {
        Ok(dev) => {
            // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and
            // returns a new descriptor or -1.
            let fd = unsafe { libc::ioctl(dev.as_raw_fd(), abi::USERFAULTFD_IOC_NEW as _, flags) };
            if fd >= 0 {
                // SAFETY: fd is a fresh descriptor nobody else owns.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
            std::io::Error::last_os_error()
        }
        Err(e) => e,
    };
    // SAFETY: the userfaultfd syscall takes only flags and returns a new
    // descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    match RawFd::try_from(fd) {
        // SAFETY: fd is a fresh descriptor nobody else owns.
        Ok(fd) if fd >= 0 => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        _ => Err(UffdError::Open {
            dev,
            syscall: std::io::Error::last_os_error(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemfdRegion, PAGE_SIZE};
    use std::sync::Arc;

    const PAGE: usize = PAGE_SIZE as usize;

    fn uffd(features: Features) -> Option<Userfaultfd> {
        match Userfaultfd::new(features) {
            Ok(u) => Some(u),
            Err(e @ (UffdError::Open { .. } | UffdError::MissingFeatures { .. })) => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
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
}
