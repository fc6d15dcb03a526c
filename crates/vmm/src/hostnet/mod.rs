//! Host networking a VM that moves between hosts needs: its own IP address
//! on the hosts' network, added to and removed from an interface over
//! rtnetlink and announced with gratuitous ARP ([`address`]), and its
//! clients' TCP connections checkpointed and restored with TCP_REPAIR
//! ([`tcp_repair`]). Both need CAP_NET_ADMIN.

pub mod address;
pub mod tcp_repair;

pub use address::VmAddress;
pub use tcp_repair::TcpCheckpoint;

/// Why a host network operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// No interface of this host has a subnet holding the address.
    #[error("no interface on this host has a subnet holding {0}: a VM address must be on one of the host's networks")]
    NoInterface(std::net::Ipv4Addr),
    /// The address is already one of this host's.
    #[error("{ip} is already an address of this host (on {dev}): another VM holds it, or a VMM that died left it (remove it with `ip addr del {ip}/32 dev {dev}`)")]
    InUse {
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
