//! File descriptors over a Unix socket (SCM_RIGHTS): how guest-memory memfds
//! reach another VMM process on the same host without copying memory.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Most descriptors in one message (the kernel's SCM_MAX_FD).
pub const MAX_FDS: usize = 253;

/// Sends `data` (at least one byte) with `fds` attached; returns the bytes
/// sent (the descriptors travel with the first of them).
pub fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if data.is_empty() || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} bytes with {} descriptors: need 1+ bytes and at most {MAX_FDS} descriptors",
                data.len(),
                fds.len()
            ),
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)]; // u64: cmsghdr alignment
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds CMSG_SPACE(payload) bytes, enough
        // for one header and `payload` bytes of data; CMSG_FIRSTHDR points
        // into it, and CMSG_DATA's copy writes exactly `payload` bytes.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(c).cast(), raw.len());
        }
    }
    loop {
        // SAFETY: msg points at live buffers (iov, control) for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives into `buf` and takes up to `max_fds` descriptors sent with the
/// data (close-on-exec). Returns the bytes read (0 at end of stream) and
/// the descriptors; descriptors beyond `max_fds` are an error (the kernel
/// closed them).
pub fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let max_fds = max_fds.min(MAX_FDS);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((max_fds.max(1) * std::mem::size_of::<RawFd>()) as u32) }
        as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: msg points at live, writable buffers for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` with msg_controllen bytes of
    // well-formed cmsg headers; CMSG_FIRSTHDR/NXTHDR walk only inside it,
    // and each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4 fds
    // that are now ours to own.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    // The control buffer is rounded up, so it can hold a few more than asked.
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer sent more than {max_fds} descriptors in one message"),
        ));
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    fn memfd(content: &[u8]) -> std::fs::File {
        // SAFETY: a valid NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"fds-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.write_all(content).unwrap();
        f
    }

    #[test]
    fn memfds_cross_a_socket_and_keep_their_content() {
        let (a, b) = UnixStream::pair().unwrap();
        let (x, y) = (memfd(b"guest ram 0"), memfd(b"guest ram 1"));
        assert_eq!(
            send_with_fds(&a, b"regions", &[x.as_fd(), y.as_fd()]).unwrap(),
            7
        );
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(&b, &mut buf, 8).unwrap();
        assert_eq!(&buf[..n], b"regions");
        assert_eq!(fds.len(), 2);
        for (fd, want) in fds.into_iter().zip([&b"guest ram 0"[..], b"guest ram 1"]) {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut got = Vec::new();
            f.read_to_end(&mut got).unwrap();
            assert_eq!(got, want);
        }
        // Plain data, and too many descriptors for the receiver.
        send_with_fds(&a, b"x", &[]).unwrap();
        assert_eq!(recv_with_fds(&b, &mut buf, 8).unwrap().1.len(), 0);
        send_with_fds(&a, b"y", &[x.as_fd(), y.as_fd()]).unwrap();
        assert!(recv_with_fds(&b, &mut buf, 1).is_err());
        assert!(send_with_fds(&a, b"", &[x.as_fd()]).is_err());
    }
}
