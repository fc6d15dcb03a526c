//! Registering ranges and resolving faults on them: the ioctls that fill
//! (copy, zeropage), map (continue), protect and wake, with their errors
//! typed (a page another thread mapped first is [`UffdError::AlreadyMapped`]).

use std::os::fd::AsRawFd;

use super::{abi, Ioctls, RegisterMode, UffdError, Userfaultfd};

impl Userfaultfd {
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
        self.copy_mode(dst, src, wake, false)
    }

    /// Like [`copy`](Self::copy), but the pages land write-protected in the
    /// same ioctl (the range must be registered for WP): no writer can
    /// reach them before the first write faults.
    pub fn copy_protected(&self, dst: u64, src: &[u8], wake: bool) -> Result<u64, UffdError> {
        self.copy_mode(dst, src, wake, true)
    }

    fn copy_mode(&self, dst: u64, src: &[u8], wake: bool, wp: bool) -> Result<u64, UffdError> {
        let len = src.len() as u64;
        let mut mode = if wake { 0 } else { abi::COPY_MODE_DONTWAKE };
        if wp {
            mode |= abi::COPY_MODE_WP;
        }
        let mut a = abi::Copy {
            dst,
            src: src.as_ptr() as u64,
            len,
            mode,
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
        self.continue_mode(addr, len, 0)
    }

    /// Like [`continue_range`](Self::continue_range), but the pages are
    /// mapped write-protected (kernels from 6.4; older ones refuse it with
    /// EINVAL): a page kept write-protected stays so when its entry is
    /// dropped and mapped back.
    pub fn continue_protected(&self, addr: u64, len: u64) -> Result<u64, UffdError> {
        self.continue_mode(addr, len, abi::CONTINUE_MODE_WP)
    }

    fn continue_mode(&self, addr: u64, len: u64, mode: u64) -> Result<u64, UffdError> {
        let mut a = abi::RangeMode {
            range: abi::Range { start: addr, len },
            mode,
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
}
