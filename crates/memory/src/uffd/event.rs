//! Fault events: waiting for them ([`Userfaultfd::poll`]) and draining
//! every pending one per wake-up ([`Userfaultfd::read_events`]), decoded
//! from the kernel's `uffd_msg` into [`Event`].

use std::os::fd::AsRawFd;
use std::time::Duration;

use super::{abi, UffdError, Userfaultfd};

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

impl Userfaultfd {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(event: u8, arg: [u64; 3]) -> abi::Msg {
        abi::Msg {
            event,
            arg,
            ..Default::default()
        }
    }

    #[test]
    fn kernel_messages_decode_into_events() {
        let flags = abi::PAGEFAULT_FLAG_WRITE | abi::PAGEFAULT_FLAG_WP;
        assert_eq!(
            Event::from_msg(&msg(abi::EVENT_PAGEFAULT, [flags, 0x7000, 4242])),
            Event::PageFault {
                addr: 0x7000,
                write: true,
                wp: true,
                minor: false,
                tid: 4242,
            }
        );
        assert_eq!(
            Event::from_msg(&msg(
                abi::EVENT_PAGEFAULT,
                [abi::PAGEFAULT_FLAG_MINOR, 0x9000, 0]
            )),
            Event::PageFault {
                addr: 0x9000,
                write: false,
                wp: false,
                minor: true,
                tid: 0,
            }
        );
        assert_eq!(
            Event::from_msg(&msg(abi::EVENT_REMOVE, [0x1000, 0x3000, 0])),
            Event::Remove {
                start: 0x1000,
                end: 0x3000
            }
        );
        // UFFD_EVENT_FORK: passed through by number.
        assert_eq!(Event::from_msg(&msg(0x13, [5, 0, 0])), Event::Other(0x13));
    }
}
