//! Non-blocking socket calls and a poll with a deadline: every wait of the
//! TLS socket is bounded by the socket's own timeouts (a reader or writer
//! waits holding its own half's lock, never the key schedule's).

use std::io::{self, IoSlice};
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Most slices one sendmsg(2) takes on Linux (UIO_MAXIOV).
const IOV_MAX: usize = 1024;

/// recv(2) without waiting; `WouldBlock` when nothing has arrived.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: recv writes at most buf.len() bytes into buf, which we
        // borrow mutably.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// sendmsg(2) of `iov`, without waiting and without SIGPIPE; `WouldBlock`
/// when the socket is full.
pub fn send_vectored(fd: RawFd, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; all zeros is valid (no name, no
    // control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec; sendmsg only reads them.
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len().min(IOV_MAX) as _;
    loop {
        // SAFETY: msg points at msg_iovlen valid iovecs borrowed for the
        // call.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends all of `buf`, waiting for room until `deadline` (None: forever);
/// `WouldBlock` at the deadline, as a socket's own send timeout gives.
pub fn send_all(fd: RawFd, buf: &[u8], deadline: Option<Instant>) -> io::Result<()> {
    send_all_vectored(fd, &mut [IoSlice::new(buf)], deadline)
}

/// [`send_all`] of the slices of `iov`, in order (it is consumed).
pub fn send_all_vectored(
    fd: RawFd,
    mut iov: &mut [IoSlice<'_>],
    deadline: Option<Instant>,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut iov, 0);
    while !iov.is_empty() {
        match send_vectored(fd, iov) {
            Ok(n) => IoSlice::advance_slices(&mut iov, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !poll_until(fd, libc::POLLOUT, deadline)? {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The deadline a wait of `t` from now gives (None: no limit).
pub fn deadline(t: Option<Duration>) -> Option<Instant> {
    t.and_then(|t| Instant::now().checked_add(t))
}

/// Waits until `events` on `fd` or `deadline` (None: forever); false at
/// the deadline.
pub fn poll_until(fd: RawFd, events: i16, deadline: Option<Instant>) -> io::Result<bool> {
    loop {
        let ms = match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
            None => -1,
            Some(l) => {
                i32::try_from(l.as_millis().max(u128::from(!l.is_zero()))).unwrap_or(i32::MAX)
            }
        };
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid, exclusively borrowed pollfd and a count of 1.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return Ok(true);
        }
        if r == 0 {
            if ms == 0 {
                return Ok(false);
            }
            continue;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
