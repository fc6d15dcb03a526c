//! A VM's own IPv4 address on the hosts' network: added to the interface
//! whose subnet holds it while the VM runs on this host, removed when the
//! VM leaves, and announced with gratuitous ARP when it arrives, so peers
//! on the segment send to this host's MAC from then on.
//!
//! The address goes on as a /32: the interface's subnet route already
//! reaches the peers, and nothing else in the host's routing changes.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{sock, NetError};

/// A VM address and the interface it lives on, on this host.
#[derive(Debug)]
pub struct VmAddress {
    ip: Ipv4Addr,
    dev: String,
    ifindex: u32,
    /// Added here by this process and not removed since.
    up: AtomicBool,
}

/// One IPv4 address of this host.
struct HostAddr {
    dev: String,
    addr: Ipv4Addr,
    mask: Ipv4Addr,
}

fn host_addrs() -> Vec<HostAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below; we only read it.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: p is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr at least as large as its family says.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET entries hold sockaddr_in for address and netmask;
        // ifa_name is a NUL-terminated string.
        let (addr, mask, dev) = unsafe {
            let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
            let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in);
            (
                Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes()),
                Ipv4Addr::from(m.sin_addr.s_addr.to_ne_bytes()),
                std::ffi::CStr::from_ptr(ifa.ifa_name)
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        out.push(HostAddr { dev, addr, mask });
    }
    // SAFETY: head came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The interface holding `ip`, if this host has the address.
pub fn device_holding(ip: Ipv4Addr) -> Option<String> {
    host_addrs()
        .into_iter()
        .find(|a| a.addr == ip)
        .map(|a| a.dev)
}

fn in_subnet(ip: Ipv4Addr, net: Ipv4Addr, mask: Ipv4Addr) -> bool {
    let m = u32::from(mask);
    m != 0 && u32::from(ip) & m == u32::from(net) & m
}

impl VmAddress {
    /// `ip` on the interface whose subnet holds it. Refuses an address the
    /// host already has (another VM's, or one a killed VMM left behind).
    pub fn on_this_host(ip: Ipv4Addr) -> Result<VmAddress, NetError> {
        let addrs = host_addrs();
        if let Some(a) = addrs.iter().find(|a| a.addr == ip) {
            let dev = a.dev.clone();
            // A VM's address is a /32; anything wider is the host's own.
            return Err(if a.mask == Ipv4Addr::BROADCAST {
                NetError::InUse { ip, dev }
            } else {
                NetError::HostAddress { ip, dev }
            });
        }
        let dev = addrs
            .iter()
            .filter(|a| !a.addr.is_loopback() && in_subnet(ip, a.addr, a.mask))
            // The most specific subnet wins.
            .max_by_key(|a| u32::from(a.mask).count_ones())
            .map(|a| a.dev.clone())
            .ok_or(NetError::NoInterface(ip))?;
        Self::on_device(ip, &dev)
    }

    /// `ip` on the interface named `dev`.
    pub fn on_device(ip: Ipv4Addr, dev: &str) -> Result<VmAddress, NetError> {
        let name = std::ffi::CString::new(dev).map_err(|_| NetError::NoInterface(ip))?;
        // SAFETY: name is a valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(NetError::NoInterface(ip));
        }
        Ok(VmAddress {
            ip,
            dev: dev.to_string(),
            ifindex,
            up: AtomicBool::new(false),
        })
    }

    /// The address.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The interface it goes on.
    pub fn device(&self) -> &str {
        &self.dev
    }

    /// Takes over an address another process of this host added (a
    /// handover): it is up, and this process removes it when the VM leaves.
    pub fn mark_up(&self) {
        self.up.store(true, Ordering::Release);
    }

    /// Another process holds the address now (a handover): leave it up
    /// when this one stops.
    pub fn forget(&self) {
        self.up.store(false, Ordering::Release);
    }

    /// True while this process holds the address on this host.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Adds the address to the interface (announce it with
    /// [`announce`](Self::announce)).
    pub fn bring_up(&self) -> Result<(), NetError> {
        netlink_addr(libc::RTM_NEWADDR, self.ip, self.ifindex)
            .or_else(|e| match e.raw_os_error() {
                // Already there (this process added it before): fine.
                Some(libc::EEXIST) if self.is_up() => Ok(()),
                _ => Err(e),
            })
            .map_err(|source| NetError::Netlink {
                what: format!("add {}/32 to {}", self.ip, self.dev),
                source,
            })?;
        self.up.store(true, Ordering::Release);
        Ok(())
    }

    /// Removes the address: from here this host no longer takes packets
    /// for it (they are dropped, not answered with resets).
    pub fn take_down(&self) -> Result<(), NetError> {
        match netlink_addr(libc::RTM_DELADDR, self.ip, self.ifindex) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {}
            Err(source) => {
                return Err(NetError::Netlink {
                    what: format!("remove {}/32 from {}", self.ip, self.dev),
                    source,
                })
            }
        }
        self.up.store(false, Ordering::Release);
        Ok(())
    }

    /// Gratuitous ARP (a request for its own address, sent to everyone):
    /// peers that know the address update its MAC at once.
    pub fn announce(&self) -> Result<(), NetError> {
        let err = |source| NetError::Announce {
            ip: self.ip,
            dev: self.dev.clone(),
            source,
        };
        let mac = hw_addr(&self.dev).map_err(err)?;
        send_garp(self.ifindex, mac, self.ip).map_err(err)
    }

    /// [`announce`](Self::announce) now and again after 50 and 250 ms (a
    /// lost frame does not strand the peers), on a thread of its own so
    /// nothing waits for it; failures are logged.
    pub fn announce_in_background(self: &std::sync::Arc<Self>) {
        let a = self.clone();
        let spawned = std::thread::Builder::new()
            .name("vm-announce".into())
            .spawn(move || {
                for wait_ms in [0, 50, 200] {
                    std::thread::sleep(std::time::Duration::from_millis(wait_ms));
                    if !a.is_up() {
                        return;
                    }
                    if let Err(e) = a.announce() {
                        tracing::warn!(error = %e, "the VM's address is up but not announced");
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot announce the VM's address");
        }
    }
}

fn os_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// The interface's MAC address (SIOCGIFHWADDR).
fn hw_addr(dev: &str) -> std::io::Result<[u8; 6]> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        family: u16,
        data: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        family: 0,
        data: [0; 22],
    };
    let n = dev.len().min(libc::IFNAMSIZ - 1);
    req.name[..n].copy_from_slice(&dev.as_bytes()[..n]);
    let s = sock::socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    // SAFETY: req is a struct ifreq-sized buffer the ioctl fills.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFHWADDR as _, &mut req) } < 0 {
        return Err(os_err());
    }
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&req.data[..6]);
    Ok(mac)
}

fn send_garp(ifindex: u32, mac: [u8; 6], ip: Ipv4Addr) -> std::io::Result<()> {
    const ETH_P_ARP: u16 = 0x0806;
    // Protocol 0: a socket that only sends. One that receives would
    // register a packet hook, and closing it waits an RCU grace period
    // (tens of ms).
    let s = sock::socket(libc::AF_PACKET, libc::SOCK_DGRAM, 0)?;
    let mut pkt = Vec::with_capacity(28);
    pkt.extend_from_slice(&1u16.to_be_bytes()); // Ethernet
    pkt.extend_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    pkt.extend_from_slice(&[6, 4]);
    pkt.extend_from_slice(&1u16.to_be_bytes()); // request
    pkt.extend_from_slice(&mac);
    pkt.extend_from_slice(&ip.octets());
    pkt.extend_from_slice(&[0; 6]);
    // Target = sender: gratuitous.
    pkt.extend_from_slice(&ip.octets());
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_protocol = ETH_P_ARP.to_be();
    to.sll_ifindex = ifindex as i32;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    // SAFETY: pkt and `to` are live buffers of the lengths given.
    let n = unsafe {
        libc::sendto(
            s.as_raw_fd(),
            pkt.as_ptr().cast(),
            pkt.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(os_err());
    }
    Ok(())
}

/// RTM_NEWADDR / RTM_DELADDR of `ip`/32 on interface `ifindex`, waiting
/// for the kernel's acknowledgement.
fn netlink_addr(op: u16, ip: Ipv4Addr, ifindex: u32) -> std::io::Result<()> {
    let s = sock::socket(libc::AF_NETLINK, libc::SOCK_RAW, libc::NETLINK_ROUTE)?;
    let mut flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    if op == libc::RTM_NEWADDR {
        flags |= (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
    }
    // nlmsghdr (16) | ifaddrmsg (8) | IFA_LOCAL (8) | IFA_ADDRESS (8)
    let len: u32 = 16 + 8 + 8 + 8;
    let mut m = Vec::with_capacity(len as usize);
    m.extend_from_slice(&len.to_ne_bytes());
    m.extend_from_slice(&op.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel fills it
    m.push(libc::AF_INET as u8);
    m.push(32); // prefix length
    m.push(0); // flags
    m.push(0); // scope: universe
    m.extend_from_slice(&ifindex.to_ne_bytes());
    for ty in [libc::IFA_LOCAL, libc::IFA_ADDRESS] {
        m.extend_from_slice(&8u16.to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&ip.octets());
    }
    // SAFETY: all-zero is a valid sockaddr_nl (pid 0: the kernel).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: m and kernel are live buffers of the lengths given.
    let n = unsafe {
        libc::sendto(
            s.as_raw_fd(),
            m.as_ptr().cast(),
            m.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(os_err());
    }
    let mut buf = [0u8; 1024];
    loop {
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = os_err();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let n = n as usize;
        let mut off = 0;
        while off + 16 <= n {
            let mlen =
                u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap_or_default()) as usize;
            let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap_or_default());
            if ty == libc::NLMSG_ERROR as u16 && off + 20 <= n {
                let code =
                    i32::from_ne_bytes(buf[off + 16..off + 20].try_into().unwrap_or_default());
                return if code == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::from_raw_os_error(-code))
                };
            }
            if mlen < 16 {
                break;
            }
            off += (mlen + 3) & !3;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets_hold_their_addresses() {
        let net = Ipv4Addr::new(10, 77, 0, 1);
        let mask = Ipv4Addr::new(255, 255, 255, 0);
        assert!(in_subnet(Ipv4Addr::new(10, 77, 0, 200), net, mask));
        assert!(!in_subnet(Ipv4Addr::new(10, 77, 1, 200), net, mask));
        assert!(!in_subnet(
            Ipv4Addr::new(10, 77, 0, 200),
            net,
            Ipv4Addr::UNSPECIFIED
        ));
    }

    /// In a network namespace of its own (this thread only): the address
    /// goes on and off the loopback interface, and a second add is refused
    /// as in use.
    #[test]
    fn an_address_goes_up_and_down() {
        crate::hostnet::in_private_netns(|| {
            let ip = Ipv4Addr::new(10, 99, 0, 7);
            let a = VmAddress::on_device(ip, "lo").unwrap();
            a.bring_up().unwrap();
            assert!(host_addrs().iter().any(|h| h.addr == ip && h.dev == "lo"));
            assert!(matches!(
                VmAddress::on_this_host(ip),
                Err(NetError::InUse { .. })
            ));
            a.take_down().unwrap();
            assert!(!host_addrs().iter().any(|h| h.addr == ip));
            a.take_down().unwrap(); // removing it twice is fine
            assert!(matches!(
                VmAddress::on_this_host(Ipv4Addr::new(10, 98, 0, 1)),
                Err(NetError::NoInterface(_))
            ));
        });
    }
}
