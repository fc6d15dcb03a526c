//! Host networking a VM that moves between hosts needs: its own IP address
//! on the hosts' network, added to and removed from an interface over
//! rtnetlink and announced with gratuitous ARP ([`address`]), and its
//! clients' TCP connections checkpointed and restored with TCP_REPAIR
//! ([`tcp_repair`]). Both need CAP_NET_ADMIN.

pub mod address;
mod sock;
pub mod tcp_repair;

pub use address::VmAddress;
pub use sock::listen_anywhere;
pub use tcp_repair::TcpCheckpoint;

/// Grows this process's descriptor table to hold `n` more descriptors
/// now, so opening them later does not grow it: in a process with many
/// threads each growth waits an RCU grace period (tens of ms on some
/// hosts), which must not fall in a VM's downtime. Best effort (bounded
/// by RLIMIT_NOFILE).
pub fn reserve_fds(n: usize) {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::File::open("/dev/null") else {
        return;
    };
    // SAFETY: all-zero is a valid rlimit; getrlimit writes it.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: lim is a valid rlimit to write.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let want = (f.as_raw_fd() as u64 + n as u64).min(lim.rlim_cur.saturating_sub(1));
    // SAFETY: F_DUPFD_CLOEXEC duplicates an open descriptor to the lowest
    // free number >= want; the duplicate is closed at once.
    let d = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, want as libc::c_int) };
    if d >= 0 {
        // SAFETY: d was just opened here and nothing else uses it.
        unsafe { libc::close(d) };
    }
}

/// Why a host network operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// No interface of this host has a subnet holding the address.
    #[error("no interface on this host has a subnet holding {0}: a VM address must be on one of the host's networks")]
    NoInterface(std::net::Ipv4Addr),
    /// The address is already on this host as a /32: another VM's.
    #[error("{ip} is already an address of this host (on {dev}): another VM holds it, or a VMM that died left it (remove it with `ip addr del {ip}/32 dev {dev}`)")]
    InUse {
        /// The address.
        ip: std::net::Ipv4Addr,
        /// Where it is.
        dev: String,
    },
    /// The address is the host's own (on its interface with a subnet).
    #[error("{ip} is this host's own address (on {dev}): give the VM an address of its own in that subnet")]
    HostAddress {
        /// The address.
        ip: std::net::Ipv4Addr,
        /// Where it is.
        dev: String,
    },
    /// A netlink request failed.
    #[error("cannot {what} (needs CAP_NET_ADMIN): {source}")]
    Netlink {
        /// What was asked.
        what: String,
        /// The kernel's answer.
        source: std::io::Error,
    },
    /// Announcing the address failed.
    #[error("cannot announce {ip} on {dev} (gratuitous ARP): {source}")]
    Announce {
        /// The address.
        ip: std::net::Ipv4Addr,
        /// The interface.
        dev: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A TCP_REPAIR step failed.
    #[error("TCP_REPAIR: {what} failed: {source}")]
    Repair {
        /// Which step.
        what: &'static str,
        /// OS error.
        source: std::io::Error,
    },
    /// Only established connections are checkpointed.
    #[error("the connection is not established (TCP state {state})")]
    NotEstablished {
        /// Kernel TCP state number.
        state: u8,
    },
}

/// Runs `f` on a thread in a network namespace of its own (unshare
/// affects only that thread), or says why it cannot and skips.
#[cfg(test)]
pub(crate) fn in_private_netns(f: impl FnOnce() + Send + 'static) {
    let t = std::thread::spawn(move || {
        // SAFETY: unshare affects only this thread's network namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            eprintln!(
                "SKIPPED: cannot make a network namespace ({}); needs root",
                std::io::Error::last_os_error()
            );
            return;
        }
        f();
    });
    t.join().unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
    use std::time::Duration;

    /// The whole move in one network namespace (this thread's own): the
    /// address goes down, the connection is checkpointed and its socket
    /// closed, it is restored while the address is still down, and goes
    /// live once the address is back; the client never notices.
    #[test]
    fn a_connection_moves_with_its_address() {
        in_private_netns(|| {
            // The host's own subnet (the client's side of it stays up
            // throughout, as the peers' network does), and the VM's address.
            let host = |args: &[&str]| {
                std::process::Command::new("ip")
                    .args(args)
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if !(host(&["link", "set", "lo", "up"])
                && host(&["addr", "add", "10.99.0.1/24", "dev", "lo"]))
            {
                eprintln!("SKIPPED: cannot set up loopback (ip link / ip addr)");
                return;
            }
            let ip = Ipv4Addr::new(10, 99, 0, 9);
            let addr = VmAddress::on_this_host(ip).unwrap();
            assert_eq!(addr.device(), "lo");
            addr.bring_up().unwrap();
            let l = TcpListener::bind(SocketAddr::from((ip, 7000))).unwrap();
            let mut client = connect_from(Ipv4Addr::new(10, 99, 0, 1), ip, 7000);
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let (server, _) = l.accept().unwrap();
            client.write_all(b"in flight").unwrap();
            std::thread::sleep(Duration::from_millis(20));
            addr.take_down().unwrap();
            let cp = tcp_repair::checkpoint(&server).unwrap();
            drop(server);
            let parked = tcp_repair::restore_parked(&cp).unwrap();
            addr.bring_up().unwrap();
            let mut live = parked.go_live().unwrap();
            live.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut b = [0u8; 9];
            live.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"in flight");
            live.write_all(b"answered!").unwrap();
            client.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"answered!");
        });
    }

    /// A client bound to `from`, connected to `to:port`.
    fn connect_from(from: Ipv4Addr, to: Ipv4Addr, port: u16) -> TcpStream {
        use std::os::fd::AsRawFd;
        let s = sock::socket(libc::AF_INET, libc::SOCK_STREAM, 0).unwrap();
        sock::bind(s.as_raw_fd(), &SocketAddr::from((from, 0))).unwrap();
        sock::connect(s.as_raw_fd(), &SocketAddr::from((to, port))).unwrap();
        TcpStream::from(s)
    }
}
