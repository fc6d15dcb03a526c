//! Opening a userfaultfd (through /dev/userfaultfd, else the syscall) and
//! the API handshake, which names the features the kernel lacks when it
//! refuses some.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::abi::{self, feature};
use super::{Features, UffdError, Userfaultfd};

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
