//! The raw socket calls the host-network wrappers share (sockets of any
//! kind, options, bind and connect to a std address), as `io::Result`:
//! each caller says which of its steps failed.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// socket(2), close-on-exec.
pub(crate) fn socket(
    domain: libc::c_int,
    ty: libc::c_int,
    proto: libc::c_int,
) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A TCP socket of the address family of `a`.
pub(crate) fn tcp_socket_for(a: &SocketAddr) -> io::Result<OwnedFd> {
    let family = if a.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    socket(family, libc::SOCK_STREAM, 0)
}

/// setsockopt(2) with a value of any plain type.
pub(crate) fn set_opt<T>(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: `v` points to a live value of the size passed; the kernel only
    // reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// setsockopt(2) with an int.
pub(crate) fn set_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    set_opt(fd, level, opt, &v)
}

fn sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// bind(2) to `a`.
pub(crate) fn bind(fd: RawFd, a: &SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(a);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    if unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// connect(2) to `a`.
pub(crate) fn connect(fd: RawFd, a: &SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(a);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    if unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A TCP listener on `addr` whether or not the address is up on this host
/// yet (IP_FREEBIND): a migration's destination listens on the VM's
/// address before the address moves there.
pub fn listen_anywhere(addr: SocketAddr) -> io::Result<TcpListener> {
    let s = tcp_socket_for(&addr)?;
    let fd = s.as_raw_fd();
    set_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if addr.is_ipv4() {
        set_int(fd, libc::IPPROTO_IP, libc::IP_FREEBIND, 1)?;
    }
    bind(fd, &addr)?;
    // SAFETY: listen(2) on a bound socket we own.
    if unsafe { libc::listen(fd, 1024) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(s))
}
