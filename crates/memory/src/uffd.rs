//! A small safe wrapper over Linux userfaultfd, for guest RAM on memfds.
//!
//! ferry uses it for postcopy and remote paging (MISSING faults resolved with
//! [`Userfaultfd::copy`]), access sampling (MINOR faults after
//! [`crate::MemfdRegion::discard`], resolved with [`Userfaultfd::continue_range`])
//! and page-out (write protection). On the test machines each fault costs
//! ~30-90 µs end to end, mostly thread wake-ups: handlers should drain every
//! pending event per wake-up ([`Userfaultfd::read_events`]) and resolve in batches.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Why a userfaultfd call failed.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// Neither /dev/userfaultfd nor the syscall gave a descriptor.
    #[error("cannot open userfaultfd: {0} (needs /dev/userfaultfd access or vm.unprivileged_userfaultfd=1)")]
    Open(std::io::Error),
    /// The API handshake failed or lacks requested features.
    #[error("userfaultfd API handshake failed: {0}")]
    Api(String),
    /// Registering a range failed.
    #[error("cannot register {len:#x} bytes at {addr:#x} with userfaultfd: {source}")]
    Register {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// The page is already mapped (another thread resolved it first).
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
    /// Reading events failed.
    #[error("reading userfaultfd events failed: {0}")]
    Read(std::io::Error),
}

/// Optional kernel features to request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Features {
    /// MISSING faults on shmem/memfd.
    pub missing_shmem: bool,
    /// MINOR faults on shmem/memfd.
    pub minor_shmem: bool,
    /// Write protection on shmem/memfd.
    pub wp_shmem: bool,
}

/// Which faults a registered range raises.
#[derive(Clone, Copy, Debug, Default)]
pub struct RegisterMode {
    /// Access to a page with no backing page.
    pub missing: bool,
    /// Access to a page present in the page cache but not mapped here.
    pub minor: bool,
    /// Write to a write-protected page.
    pub wp: bool,
}

/// One event read from the descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A thread faulted and waits.
    PageFault {
        /// Faulting address (page-aligned by the caller where needed).
        addr: u64,
        /// A write access.
        write: bool,
        /// Raised by write protection.
        wp: bool,
        /// A MINOR fault.
        minor: bool,
    },
    /// Pages were removed (MADV_DONTNEED/REMOVE) from a range.
    Remove {
        /// Start.
        start: u64,
        /// End.
        end: u64,
    },
    /// Another event type (fork, remap, unmap).
    Other(u8),
}

const UFFD_API: u64 = 0xAA;
const FEATURE_MISSING_SHMEM: u64 = 1 << 5;
const FEATURE_MINOR_SHMEM: u64 = 1 << 10;
const FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const MODE_MISSING: u64 = 1 << 0;
const MODE_WP: u64 = 1 << 1;
const MODE_MINOR: u64 = 1 << 2;
const COPY_MODE_DONTWAKE: u64 = 1 << 0;
const WP_MODE_WP: u64 = 1 << 0;
const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_REMOVE: u8 = 0x15;
const FLAG_WRITE: u64 = 1 << 0;
const FLAG_WP: u64 = 1 << 1;
const FLAG_MINOR: u64 = 1 << 2;

const fn iowr(nr: u64, size: usize) -> u64 {
    (3 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}
const fn ior(nr: u64, size: usize) -> u64 {
    (2 << 30) | ((size as u64) << 16) | (0xAA << 8) | nr
}

#[repr(C)]
#[derive(Default)]
struct Range {
    start: u64,
    len: u64,
}
#[repr(C)]
#[derive(Default)]
struct ApiArg {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default)]
struct RegisterArg {
    range: Range,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Default)]
struct CopyArg {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
#[derive(Default)]
struct RangeModeArg {
    range: Range,
    mode: u64,
    result: i64,
}
#[repr(C)]
#[derive(Default)]
struct WriteProtectArg {
    range: Range,
    mode: u64,
}
/// struct uffd_msg: 8 bytes of header, then a 24-byte union.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Msg {
    event: u8,
    _reserved: [u8; 7],
    arg: [u64; 3],
}

const UFFDIO_API: u64 = iowr(0x3F, std::mem::size_of::<ApiArg>());
const UFFDIO_REGISTER: u64 = iowr(0x00, std::mem::size_of::<RegisterArg>());
const UFFDIO_UNREGISTER: u64 = ior(0x01, std::mem::size_of::<Range>());
const UFFDIO_WAKE: u64 = ior(0x02, std::mem::size_of::<Range>());
const UFFDIO_COPY: u64 = iowr(0x03, std::mem::size_of::<CopyArg>());
const UFFDIO_ZEROPAGE: u64 = iowr(0x04, std::mem::size_of::<RangeModeArg>());
const UFFDIO_WRITEPROTECT: u64 = iowr(0x06, std::mem::size_of::<WriteProtectArg>());
const UFFDIO_CONTINUE: u64 = iowr(0x07, std::mem::size_of::<RangeModeArg>());
const USERFAULTFD_IOC_NEW: u64 = 0xAA00;

/// An open userfaultfd (non-blocking, close-on-exec).
pub struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Opens a userfaultfd and completes the API handshake with `features`.
    pub fn new(features: Features) -> Result<Self, UffdError> {
        let fd = open_uffd()?;
        let mut want = 0;
        if features.missing_shmem {
            want |= FEATURE_MISSING_SHMEM;
        }
        if features.minor_shmem {
            want |= FEATURE_MINOR_SHMEM;
        }
        if features.wp_shmem {
            want |= FEATURE_WP_HUGETLBFS_SHMEM | FEATURE_PAGEFAULT_FLAG_WP;
        }
        let mut api = ApiArg {
            api: UFFD_API,
            features: want,
            ioctls: 0,
        };
        // SAFETY: fd is a userfaultfd; `api` is a correctly sized uffdio_api.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) } < 0 {
            let e = std::io::Error::last_os_error();
            let names = [
                (FEATURE_MISSING_SHMEM, "MISSING_SHMEM"),
                (FEATURE_MINOR_SHMEM, "MINOR_SHMEM"),
                (FEATURE_WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
            ];
            let asked: Vec<&str> = names
                .iter()
                .filter(|(b, _)| want & b != 0)
                .map(|(_, n)| *n)
                .collect();
            return Err(UffdError::Api(format!(
                "{e}; requested features [{}] may be missing from this kernel",
                asked.join(", ")
            )));
        }
        Ok(Userfaultfd { fd })
    }

    fn ioctl<T>(
        &self,
        op: &'static str,
        req: u64,
        arg: &mut T,
        addr: u64,
        len: u64,
    ) -> Result<(), UffdError> {
        // SAFETY: `req` is the ioctl matching `T`'s layout (repr(C) mirrors of
        // linux/userfaultfd.h, sizes checked in tests); the fd is ours.
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

    /// Registers `[addr, addr+len)` for the given fault kinds; returns the
    /// bitmask of ioctls the kernel allows on it.
    pub fn register(&self, addr: u64, len: u64, mode: RegisterMode) -> Result<u64, UffdError> {
        let mut m = 0;
        if mode.missing {
            m |= MODE_MISSING;
        }
        if mode.minor {
            m |= MODE_MINOR;
        }
        if mode.wp {
            m |= MODE_WP;
        }
        let mut arg = RegisterArg {
            range: Range { start: addr, len },
            mode: m,
            ioctls: 0,
        };
        self.ioctl("REGISTER", UFFDIO_REGISTER, &mut arg, addr, len)
            .map_err(|e| match e {
                UffdError::Ioctl { source, .. } => UffdError::Register { addr, len, source },
                other => other,
            })?;
        Ok(arg.ioctls)
    }

    /// Stops handling faults for a range.
    pub fn unregister(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = Range { start: addr, len };
        self.ioctl("UNREGISTER", UFFDIO_UNREGISTER, &mut r, addr, len)
    }

    /// Fills missing pages at `dst` with `src` (a whole number of pages) and,
    /// if `wake`, wakes the threads waiting on them.
    pub fn copy(&self, dst: u64, src: &[u8], wake: bool) -> Result<u64, UffdError> {
        let len = src.len() as u64;
        let mode = if wake { 0 } else { COPY_MODE_DONTWAKE };
        let mut a = CopyArg {
            dst,
            src: src.as_ptr() as u64,
            len,
            mode,
            copy: 0,
        };
        self.ioctl("COPY", UFFDIO_COPY, &mut a, dst, len)?;
        Ok(a.copy.max(0) as u64)
    }

    /// Maps zero pages at a missing range and wakes waiters.
    pub fn zeropage(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut a = RangeModeArg {
            range: Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        self.ioctl("ZEROPAGE", UFFDIO_ZEROPAGE, &mut a, addr, len)
    }

    /// Resolves MINOR faults: maps the page-cache pages already there.
    pub fn continue_range(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut a = RangeModeArg {
            range: Range { start: addr, len },
            mode: 0,
            result: 0,
        };
        self.ioctl("CONTINUE", UFFDIO_CONTINUE, &mut a, addr, len)
    }

    /// Write-protects (or unprotects, waking writers) a range.
    pub fn write_protect(&self, addr: u64, len: u64, protect: bool) -> Result<(), UffdError> {
        let mode = if protect { WP_MODE_WP } else { 0 };
        let mut a = WriteProtectArg {
            range: Range { start: addr, len },
            mode,
        };
        self.ioctl("WRITEPROTECT", UFFDIO_WRITEPROTECT, &mut a, addr, len)
    }

    /// Wakes threads waiting on a range (after DONTWAKE copies).
    pub fn wake(&self, addr: u64, len: u64) -> Result<(), UffdError> {
        let mut r = Range { start: addr, len };
        self.ioctl("WAKE", UFFDIO_WAKE, &mut r, addr, len)
    }

    /// Appends every pending event to `out`; returns how many were read.
    pub fn read_events(&self, out: &mut Vec<Event>) -> Result<usize, UffdError> {
        let mut msgs = [Msg::default(); 64];
        let mut total = 0;
        loop {
            // SAFETY: reading into a buffer of whole uffd_msg structs we own.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr().cast(),
                    std::mem::size_of_val(&msgs),
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    return Ok(total);
                }
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(UffdError::Read(e));
            }
            let count = n as usize / std::mem::size_of::<Msg>();
            for m in &msgs[..count] {
                out.push(match m.event {
                    EVENT_PAGEFAULT => Event::PageFault {
                        addr: m.arg[1],
                        write: m.arg[0] & FLAG_WRITE != 0,
                        wp: m.arg[0] & FLAG_WP != 0,
                        minor: m.arg[0] & FLAG_MINOR != 0,
                    },
                    EVENT_REMOVE => Event::Remove {
                        start: m.arg[0],
                        end: m.arg[1],
                    },
                    other => Event::Other(other),
                });
            }
            total += count;
            if count < msgs.len() {
                return Ok(total);
            }
        }
    }

    /// Waits up to `timeout` for events; true if some are pending.
    pub fn poll(&self, timeout: Duration) -> Result<bool, UffdError> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(UffdError::Read(e));
        }
        Ok(r > 0)
    }
}

impl AsRawFd for Userfaultfd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

fn open_uffd() -> Result<OwnedFd, UffdError> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    if let Ok(dev) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
    {
        // SAFETY: USERFAULTFD_IOC_NEW on /dev/userfaultfd returns a new fd or -1.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
        if fd >= 0 {
            // SAFETY: fd is a fresh descriptor we own.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
    // SAFETY: the userfaultfd syscall takes only flags and returns an fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(UffdError::Open(std::io::Error::last_os_error()));
    }
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemfdRegion;
    use std::sync::Arc;

    #[test]
    fn struct_sizes_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<ApiArg>(), 24);
        assert_eq!(std::mem::size_of::<RegisterArg>(), 32);
        assert_eq!(std::mem::size_of::<CopyArg>(), 40);
        assert_eq!(std::mem::size_of::<RangeModeArg>(), 32);
        assert_eq!(std::mem::size_of::<WriteProtectArg>(), 24);
        assert_eq!(std::mem::size_of::<Msg>(), 32);
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
    }

    fn uffd(features: Features) -> Option<Userfaultfd> {
        match Userfaultfd::new(features) {
            Ok(u) => Some(u),
            Err(e) => {
                eprintln!("SKIP: userfaultfd unavailable: {e}");
                None
            }
        }
    }

    /// Waits for one page fault event (failing instead of hanging).
    fn next_fault(u: &Userfaultfd) -> Event {
        let mut ev = Vec::new();
        for _ in 0..50 {
            if u.poll(Duration::from_millis(100)).unwrap() && u.read_events(&mut ev).unwrap() > 0 {
                return ev[0];
            }
        }
        panic!("no userfaultfd event within 5 s");
    }

    #[test]
    fn missing_fault_is_resolved_by_copy() {
        let Some(u) = uffd(Features {
            missing_shmem: true,
            ..Default::default()
        }) else {
            return;
        };
        let r = Arc::new(MemfdRegion::new("uffd-missing", 0, 4 * 4096).unwrap());
        let base = r.host_addr() as u64;
        u.register(
            base,
            4 * 4096,
            RegisterMode {
                missing: true,
                ..Default::default()
            },
        )
        .unwrap();
        let r2 = r.clone();
        // SAFETY: page 1 of a live 4-page mapping held by the Arc.
        let reader = std::thread::spawn(move || unsafe { *r2.host_addr().add(4096 + 7) });
        let Event::PageFault { addr, minor, .. } = next_fault(&u) else {
            panic!("not a fault")
        };
        assert_eq!(addr & !4095, base + 4096);
        assert!(!minor);
        assert_eq!(u.copy(base + 4096, &[0xab; 4096], true).unwrap(), 4096);
        assert_eq!(reader.join().unwrap(), 0xab);
        assert!(matches!(
            u.copy(base + 4096, &[0; 4096], true),
            Err(UffdError::AlreadyMapped { .. })
        ));
    }

    #[test]
    fn minor_fault_after_discard_keeps_data() {
        let Some(u) = uffd(Features {
            minor_shmem: true,
            ..Default::default()
        }) else {
            return;
        };
        let r = Arc::new(MemfdRegion::new("uffd-minor", 0, 2 * 4096).unwrap());
        let base = r.host_addr() as u64;
        // SAFETY: byte 5 of the live mapping.
        unsafe { *r.host_addr().add(5) = 42 };
        r.discard(0, 4096).unwrap();
        u.register(
            base,
            2 * 4096,
            RegisterMode {
                minor: true,
                ..Default::default()
            },
        )
        .unwrap();
        let r2 = r.clone();
        // SAFETY: as above.
        let reader = std::thread::spawn(move || unsafe { *r2.host_addr().add(5) });
        let Event::PageFault { addr, minor, .. } = next_fault(&u) else {
            panic!("not a fault")
        };
        assert!(minor && addr & !4095 == base);
        u.continue_range(base, 4096).unwrap();
        assert_eq!(reader.join().unwrap(), 42);
    }

    #[test]
    fn write_protect_blocks_writers_until_unprotected() {
        let Some(u) = uffd(Features {
            wp_shmem: true,
            ..Default::default()
        }) else {
            return;
        };
        let r = Arc::new(MemfdRegion::new("uffd-wp", 0, 4096).unwrap());
        let base = r.host_addr() as u64;
        // SAFETY: byte 0 of the live mapping (populates the page).
        unsafe { *r.host_addr() = 1 };
        u.register(
            base,
            4096,
            RegisterMode {
                missing: true,
                wp: true,
                ..Default::default()
            },
        )
        .unwrap();
        u.write_protect(base, 4096, true).unwrap();
        let r2 = r.clone();
        // SAFETY: as above.
        let writer = std::thread::spawn(move || unsafe { *r2.host_addr() = 9 });
        let Event::PageFault { wp, write, .. } = next_fault(&u) else {
            panic!("not a fault")
        };
        assert!(wp && write);
        // SAFETY: reading the page while the writer is blocked.
        let during = unsafe { *r.host_addr() };
        assert_eq!(during, 1, "the write waits for the handler");
        u.write_protect(base, 4096, false).unwrap();
        writer.join().unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { *r.host_addr() }, 9);
    }
}
