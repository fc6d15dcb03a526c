//! Checkpoint and restore of an established TCP connection with the
//! kernel's TCP_REPAIR mode (the way CRIU moves connections): sequence
//! numbers, both queues, the negotiated options and the windows, so the
//! peer sees a pause and nothing else. Needs CAP_NET_ADMIN.
//!
//! A socket in repair mode sends nothing (no data, no ACK, no FIN or RST
//! when closed); the caller makes sure no packet reaches the old socket
//! after its checkpoint (ferry removes the address first), or what arrives
//! then would be acknowledged here and lost.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

use super::{sock, NetError};

// linux/tcp.h
const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_REPAIR_OPTIONS: libc::c_int = 22;
const TCP_TIMESTAMP: libc::c_int = 24;
const TCP_REPAIR_WINDOW: libc::c_int = 29;
const TCP_NO_QUEUE: libc::c_int = 0;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
const TCPOPT_MSS: u32 = 2;
const TCPOPT_WINDOW: u32 = 3;
const TCPOPT_SACK_PERM: u32 = 4;
const TCPOPT_TIMESTAMP: u32 = 8;
// struct tcp_info: tcpi_options bits
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;
const TCP_ESTABLISHED: u8 = 1;
// linux/sockios.h
const SIOCINQ: libc::c_ulong = 0x541B;
const SIOCOUTQ: libc::c_ulong = 0x5411;
const SIOCOUTQNSD: libc::c_ulong = 0x894B;

/// struct tcp_repair_window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[repr(C)]
pub struct RepairWindow {
    /// Sequence number of the segment that last updated the send window.
    pub snd_wl1: u32,
    /// Send window.
    pub snd_wnd: u32,
    /// Largest window the peer offered.
    pub max_window: u32,
    /// Receive window.
    pub rcv_wnd: u32,
    /// rcv_nxt when the receive window was last advertised.
    pub rcv_wup: u32,
}

/// Everything needed to bring an established connection back in another
/// socket (another process, or another host holding the same address).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TcpCheckpoint {
    /// This end's address.
    pub local: SocketAddr,
    /// The peer.
    pub peer: SocketAddr,
    /// Next sequence number this end would send (write_seq).
    pub snd_seq: u32,
    /// Next sequence number expected from the peer (rcv_nxt).
    pub rcv_seq: u32,
    /// Bytes written and not yet acknowledged by the peer, oldest first.
    pub send_queue: Vec<u8>,
    /// How many of the last `send_queue` bytes were never transmitted.
    pub unsent: u32,
    /// Bytes received (and acknowledged) and not yet read.
    pub recv_queue: Vec<u8>,
    /// Maximum segment size.
    pub mss: u32,
    /// Window scaling, if negotiated: (send shift, receive shift).
    pub wscale: Option<(u8, u8)>,
    /// SACK negotiated.
    pub sack: bool,
    /// TCP timestamps negotiated, and this end's clock.
    pub timestamp: Option<u32>,
    /// The windows (None on kernels before 4.8).
    pub window: Option<RepairWindow>,
}

fn os(what: &'static str) -> impl Fn(std::io::Error) -> NetError {
    move |source| NetError::Repair { what, source }
}

fn last(what: &'static str) -> NetError {
    NetError::Repair {
        what,
        source: std::io::Error::last_os_error(),
    }
}

fn set_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
    what: &'static str,
) -> Result<(), NetError> {
    sock::set_int(fd, level, opt, v).map_err(os(what))
}

fn set_raw<T>(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: &T,
    what: &'static str,
) -> Result<(), NetError> {
    sock::set_opt(fd, level, opt, v).map_err(os(what))
}

/// Reads a socket option into `T`; returns the length the kernel wrote.
fn get_raw<T>(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: &mut T,
    what: &'static str,
) -> Result<usize, NetError> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is a live, writable value of `len` bytes; the kernel
    // writes at most `len` bytes and reports how many.
    let r = unsafe { libc::getsockopt(fd, level, opt, (v as *mut T).cast(), &mut len) };
    if r < 0 {
        return Err(last(what));
    }
    Ok(len as usize)
}

fn get_u32(fd: RawFd, opt: libc::c_int, what: &'static str) -> Result<u32, NetError> {
    let mut v: u32 = 0;
    get_raw(fd, libc::IPPROTO_TCP, opt, &mut v, what)?;
    Ok(v)
}

fn ioctl_int(fd: RawFd, req: libc::c_ulong, what: &'static str) -> Result<usize, NetError> {
    let mut v: libc::c_int = 0;
    // SAFETY: these socket ioctls write one int into `v`.
    let r = unsafe { libc::ioctl(fd, req as _, &mut v) };
    if r < 0 {
        return Err(last(what));
    }
    Ok(v.max(0) as usize)
}

/// Turns repair mode on or off. Off sends a window probe, which makes the
/// peer acknowledge where it is.
pub fn set_repair(sock: &impl AsRawFd, on: bool) -> Result<(), NetError> {
    set_int(
        sock.as_raw_fd(),
        libc::IPPROTO_TCP,
        TCP_REPAIR,
        on as libc::c_int,
        "TCP_REPAIR",
    )
}

fn select_queue(fd: RawFd, q: libc::c_int) -> Result<(), NetError> {
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_REPAIR_QUEUE,
        q,
        "TCP_REPAIR_QUEUE",
    )
}

/// Copies `len` bytes of the selected queue (repair mode peeks, never consumes).
fn peek_queue(fd: RawFd, len: usize, what: &'static str) -> Result<Vec<u8>, NetError> {
    let mut buf = vec![0u8; len];
    if len == 0 {
        return Ok(buf);
    }
    // SAFETY: buf is valid for writes of `len` bytes.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            len,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(last(what));
    }
    if n as usize != len {
        return Err(NetError::Repair {
            what,
            source: std::io::Error::other(format!("queue holds {n} bytes, {len} expected")),
        });
    }
    Ok(buf)
}

/// Writes `data` into the selected queue (in repair mode the send queue
/// counts as sent, the receive queue as received).
fn fill_queue(fd: RawFd, data: &[u8], what: &'static str) -> Result<(), NetError> {
    let mut off = 0;
    while off < data.len() {
        let chunk = &data[off..(off + (64 << 10)).min(data.len())];
        // SAFETY: chunk is valid for reads of its length.
        let n = unsafe {
            libc::send(
                fd,
                chunk.as_ptr().cast(),
                chunk.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n <= 0 {
            return Err(last(what));
        }
        off += n as usize;
    }
    Ok(())
}

/// Checkpoints an established connection, turning repair mode on first
/// (it stays on: the socket sends nothing from here, and closing it is
/// silent). [`resume`] turns it off if the connection stays here after all.
pub fn checkpoint(sock: &TcpStream) -> Result<TcpCheckpoint, NetError> {
    let fd = sock.as_raw_fd();
    set_repair(sock, true)?;
    let mut info = [0u8; 8];
    get_raw(fd, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info, "TCP_INFO")?;
    if info[0] != TCP_ESTABLISHED {
        return Err(NetError::NotEstablished { state: info[0] });
    }
    let options = info[5];
    let (snd_wscale, rcv_wscale) = (info[6] & 0xf, info[6] >> 4);
    let inq = ioctl_int(fd, SIOCINQ, "SIOCINQ")?;
    let outq = ioctl_int(fd, SIOCOUTQ, "SIOCOUTQ")?;
    let unsent = ioctl_int(fd, SIOCOUTQNSD, "SIOCOUTQNSD")?;
    let mss = get_u32(fd, libc::TCP_MAXSEG, "TCP_MAXSEG")?;
    let timestamp = if options & TCPI_OPT_TIMESTAMPS != 0 {
        Some(get_u32(fd, TCP_TIMESTAMP, "TCP_TIMESTAMP")?)
    } else {
        None
    };
    let mut w = RepairWindow::default();
    let window = get_raw(
        fd,
        libc::IPPROTO_TCP,
        TCP_REPAIR_WINDOW,
        &mut w,
        "TCP_REPAIR_WINDOW",
    )
    .ok()
    .map(|_| w);
    select_queue(fd, TCP_RECV_QUEUE)?;
    let rcv_seq = get_u32(fd, TCP_QUEUE_SEQ, "TCP_QUEUE_SEQ (receive)")?;
    let recv_queue = peek_queue(fd, inq, "reading the receive queue")?;
    select_queue(fd, TCP_SEND_QUEUE)?;
    let snd_seq = get_u32(fd, TCP_QUEUE_SEQ, "TCP_QUEUE_SEQ (send)")?;
    let send_queue = peek_queue(fd, outq, "reading the send queue")?;
    select_queue(fd, TCP_NO_QUEUE)?;
    Ok(TcpCheckpoint {
        local: sock.local_addr().map_err(os("getsockname"))?,
        peer: sock.peer_addr().map_err(os("getpeername"))?,
        snd_seq,
        rcv_seq,
        send_queue,
        unsent: unsent.min(outq) as u32,
        recv_queue,
        mss,
        wscale: (options & TCPI_OPT_WSCALE != 0).then_some((snd_wscale, rcv_wscale)),
        sack: options & TCPI_OPT_SACK != 0,
        timestamp,
        window,
    })
}

/// Whether this process may use TCP_REPAIR (it needs CAP_NET_ADMIN).
pub fn allowed() -> Result<(), NetError> {
    let s = sock::socket(libc::AF_INET, libc::SOCK_STREAM, 0).map_err(os("socket"))?;
    set_repair(&s, true)
}

/// A checkpointed connection stays here after all: repair mode off, and it
/// carries on (nothing was lost while it was in repair mode).
pub fn resume(sock: &TcpStream) -> Result<(), NetError> {
    set_repair(sock, false)
}

#[repr(C)]
struct RepairOpt {
    code: u32,
    val: u32,
}

/// A restored connection still in repair mode: it sends nothing until
/// [`go_live`](Self::go_live), so it can be prepared before the VM's
/// address is up here (and dropped silently if the migration fails).
#[derive(Debug)]
pub struct ParkedConn {
    stream: TcpStream,
    /// Bytes the old socket never transmitted: sent once live.
    unsent: Vec<u8>,
}

impl ParkedConn {
    /// The socket (still in repair mode).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Leaves repair mode (a window probe tells the peer where this end
    /// is) and sends what the old socket had not; needs the local address
    /// up on this host.
    pub fn go_live(self) -> Result<TcpStream, NetError> {
        set_repair(&self.stream, false)?;
        if !self.unsent.is_empty() {
            use std::io::Write;
            (&self.stream)
                .write_all(&self.unsent)
                .map_err(os("sending the unsent queue"))?;
        }
        Ok(self.stream)
    }
}

/// Brings a checkpointed connection back in a new socket, bound to the
/// same local address (which may be a listener's port, and need not be up
/// on this host yet), and leaves it in repair mode.
pub fn restore_parked(cp: &TcpCheckpoint) -> Result<ParkedConn, NetError> {
    let owned = sock::tcp_socket_for(&cp.local).map_err(os("socket"))?;
    let fd = owned.as_raw_fd();
    // Repair mode lets the socket share its port with the listener (and
    // SO_REUSEADDR would undo that, so it is not set).
    set_int(fd, libc::IPPROTO_TCP, TCP_REPAIR, 1, "TCP_REPAIR")?;
    if cp.local.is_ipv4() {
        // The address may not be up here yet: bind and connect to it anyway.
        set_int(fd, libc::IPPROTO_IP, libc::IP_FREEBIND, 1, "IP_FREEBIND")?;
        set_int(
            fd,
            libc::IPPROTO_IP,
            libc::IP_TRANSPARENT,
            1,
            "IP_TRANSPARENT",
        )?;
    }
    sock::bind(fd, &cp.local).map_err(os("bind"))?;
    let recv_len = cp.recv_queue.len() as u32;
    let send_len = cp.send_queue.len() as u32;
    select_queue(fd, TCP_RECV_QUEUE)?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_QUEUE_SEQ,
        cp.rcv_seq.wrapping_sub(recv_len) as libc::c_int,
        "TCP_QUEUE_SEQ (receive)",
    )?;
    select_queue(fd, TCP_SEND_QUEUE)?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_QUEUE_SEQ,
        cp.snd_seq.wrapping_sub(send_len) as libc::c_int,
        "TCP_QUEUE_SEQ (send)",
    )?;
    // In repair mode connect sends nothing: the socket becomes ESTABLISHED.
    sock::connect(fd, &cp.peer).map_err(os("connect (repair)"))?;
    let mut opts = vec![RepairOpt {
        code: TCPOPT_MSS,
        val: cp.mss,
    }];
    if let Some((snd, rcv)) = cp.wscale {
        opts.push(RepairOpt {
            code: TCPOPT_WINDOW,
            val: u32::from(snd) | (u32::from(rcv) << 16),
        });
    }
    if cp.sack {
        opts.push(RepairOpt {
            code: TCPOPT_SACK_PERM,
            val: 0,
        });
    }
    if cp.timestamp.is_some() {
        opts.push(RepairOpt {
            code: TCPOPT_TIMESTAMP,
            val: 0,
        });
    }
    // SAFETY: `opts` is a live array of repr(C) tcp_repair_opt of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            TCP_REPAIR_OPTIONS,
            opts.as_ptr().cast(),
            (opts.len() * std::mem::size_of::<RepairOpt>()) as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(last("TCP_REPAIR_OPTIONS"));
    }
    if let Some(ts) = cp.timestamp {
        set_int(
            fd,
            libc::IPPROTO_TCP,
            TCP_TIMESTAMP,
            ts as libc::c_int,
            "TCP_TIMESTAMP",
        )?;
    }
    select_queue(fd, TCP_RECV_QUEUE)?;
    fill_queue(fd, &cp.recv_queue, "restoring the receive queue")?;
    // What was transmitted goes back as sent and unacknowledged (the peer's
    // ACK or a retransmission settles it); what never left is sent live.
    let sent = cp.send_queue.len() - (cp.unsent as usize).min(cp.send_queue.len());
    select_queue(fd, TCP_SEND_QUEUE)?;
    fill_queue(fd, &cp.send_queue[..sent], "restoring the send queue")?;
    select_queue(fd, TCP_NO_QUEUE)?;
    if let Some(w) = &cp.window {
        set_raw(
            fd,
            libc::IPPROTO_TCP,
            TCP_REPAIR_WINDOW,
            w,
            "TCP_REPAIR_WINDOW",
        )?;
    }
    Ok(ParkedConn {
        stream: TcpStream::from(owned),
        unsent: cp.send_queue[sent..].to_vec(),
    })
}

/// [`restore_parked`], then [`ParkedConn::go_live`].
pub fn restore(cp: &TcpCheckpoint) -> Result<TcpStream, NetError> {
    restore_parked(cp)?.go_live()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    /// TCP_REPAIR needs CAP_NET_ADMIN: says so and skips without it.
    fn repair_allowed() -> bool {
        match allowed() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("SKIPPED: TCP_REPAIR not allowed here ({e}); needs CAP_NET_ADMIN");
                false
            }
        }
    }

    /// A listener on loopback, a client (reads time out after 5 s) and the
    /// server's end of its connection.
    fn connected() -> (TcpListener, TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let (server, _) = l.accept().unwrap();
        (l, client, server)
    }

    #[test]
    fn a_connection_survives_checkpoint_close_and_restore() {
        if !repair_allowed() {
            return;
        }
        let (l, mut client, mut server) = connected();
        // Unread on both sides when the server side is checkpointed.
        client.write_all(b"request one|").unwrap();
        server.write_all(b"answer one|").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let cp = checkpoint(&server).unwrap();
        assert_eq!(cp.recv_queue, b"request one|");
        assert_eq!(cp.local, l.local_addr().unwrap());
        // Closing in repair mode says nothing to the client.
        drop(server);
        // The listener still holds the port: the restored socket shares it.
        let mut back = restore(&cp).unwrap();
        back.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = [0u8; 12];
        back.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"request one|");
        let mut ans = [0u8; 11];
        client.read_exact(&mut ans).unwrap();
        assert_eq!(&ans, b"answer one|");
        // Both directions go on, in sequence.
        for i in 0..100u32 {
            let msg = format!("ping {i:04}");
            client.write_all(msg.as_bytes()).unwrap();
            let mut b = [0u8; 9];
            back.read_exact(&mut b).unwrap();
            assert_eq!(&b, msg.as_bytes());
            back.write_all(&b).unwrap();
            client.read_exact(&mut b).unwrap();
            assert_eq!(&b, msg.as_bytes());
        }
        drop(back);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }

    #[test]
    fn a_checkpointed_connection_can_stay() {
        if !repair_allowed() {
            return;
        }
        let (_l, mut client, mut server) = connected();
        client.write_all(b"abc").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let cp = checkpoint(&server).unwrap();
        assert_eq!(cp.recv_queue, b"abc");
        resume(&server).unwrap();
        let mut b = [0u8; 3];
        server.read_exact(&mut b).unwrap();
        server.write_all(b"xyz").unwrap();
        client.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"xyz");
    }

    #[test]
    fn checkpoint_refuses_a_connection_that_is_not_established() {
        if !repair_allowed() {
            return;
        }
        let (_l, client, server) = connected();
        drop(client); // the server side goes to CLOSE_WAIT
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(
            checkpoint(&server),
            Err(NetError::NotEstablished { .. })
        ));
    }
}
