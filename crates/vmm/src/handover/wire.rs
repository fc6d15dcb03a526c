//! The handover protocol's messages and their framing on the Unix socket
//! between the two VMM processes (docs/handover.md).
//!
//! The new process speaks first with a fixed 16-byte hello (magic, protocol
//! version, pid) that every ferry version can read, so a mismatch is named
//! rather than misparsed. Every later message is a 4-byte little-endian
//! length and a postcard body; descriptors travel with the message's first
//! byte (SCM_RIGHTS).

use std::io::{Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use ferry_migration::transport::fds::{recv_with_fds, send_with_fds, MAX_FDS};

use super::HandoverError;

/// What the hello starts with.
pub const MAGIC: [u8; 8] = *b"FERRYHO\0";
/// The handover protocol this ferry speaks.
pub const VERSION: u32 = 1;
/// Largest message body accepted (a VM state with 8 vCPUs is tens of KiB;
/// pending client bytes are bounded by the service's frame limit per
/// connection).
pub const MAX_MESSAGE: usize = 64 << 20;
/// Connections per `Conns` message (each carries one descriptor).
pub const CONNS_PER_MESSAGE: usize = 200;

/// The new process's first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Its handover protocol version.
    pub version: u32,
    /// Its process id.
    pub pid: u32,
}

impl Hello {
    /// The 16 bytes on the wire.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..].copy_from_slice(&self.pid.to_le_bytes());
        b
    }

    /// Reads and checks a hello (magic only: the caller judges the version).
    pub fn read(sock: &mut UnixStream) -> Result<Hello, HandoverError> {
        let mut b = [0u8; 16];
        sock.read_exact(&mut b).map_err(HandoverError::from_io)?;
        if b[..8] != MAGIC {
            return Err(HandoverError::NotFerry);
        }
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        Ok(Hello {
            version: word(8),
            pid: word(12),
        })
    }
}

/// The VM's shape and settings, as the new process builds it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmShape {
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// Workload spec (the guest already runs it; kept for reports).
    pub workloads: String,
    /// Guest kernel path, if not the built-in one (unused: the guest is running).
    pub kernel: Option<String>,
    /// Asynchronous page faults.
    pub apf: bool,
    /// Guest timer rate.
    pub tick_hz: u32,
    /// Workload seed.
    pub seed: u64,
    /// KVM device path.
    pub kvm_path: String,
}

/// One message after the hello.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Message {
    /// Old → new, with descriptors: every region's memfd in order, then the
    /// service device's listening socket (if `service`), then the control
    /// socket's (if `control`).
    Offer {
        /// The VM.
        shape: VmShape,
        /// (gpa, size) of each guest RAM region, one memfd each.
        regions: Vec<(u64, u64)>,
        /// A service listener follows the memfds.
        service: bool,
        /// The control socket's path, if a listener for it follows.
        control: Option<String>,
        /// Settings of the process that ran the VM, for the new one's own
        /// front end (opaque here: JSON text).
        run: String,
        /// The old process.
        from_pid: u32,
    },
    /// New → old: the VM is built around the memory; waiting for its state.
    Ready {
        /// Time spent building (ms).
        build_ms: f64,
    },
    /// Old → new, each with one socket per connection, before `State`.
    Conns {
        /// (connection id, bytes read from it and not handled), in the
        /// order of the descriptors.
        conns: Vec<(u64, Vec<u8>)>,
    },
    /// Old → new, the VM paused: its CPU and device state.
    State {
        /// [`crate::VmState`], encoded as migrations encode it.
        state: Vec<u8>,
        /// When the old process paused the VM (CLOCK_MONOTONIC, ns).
        paused_at_ns: u64,
        /// `--verify`: per-page hashes of guest memory as the old process
        /// sees it, paused (the new one compares its own mapping's).
        hashes: Option<Vec<u64>>,
    },
    /// New → old: state restored, vCPU threads ready; only `Go` is missing.
    Restored,
    /// Old → new: the commit point. The new process owns the VM.
    Go,
    /// New → old: the VM runs in the new process.
    Running {
        /// When it resumed (CLOCK_MONOTONIC, ns).
        resumed_at_ns: u64,
        /// When its service device read from clients again (CLOCK_MONOTONIC,
        /// ns; 0 without one).
        serving_at_ns: u64,
        /// CPU seconds the new process used up to here.
        cpu_s: f64,
    },
    /// Either way: this side gives up (before `Go`), and why.
    Abort {
        /// The reason, for the other side's report.
        reason: String,
    },
    /// Old → new, after `Restored` and before `Go`, for a VM fenced through
    /// a registry (docs/safety.md): the new process takes the VM from this
    /// claim at `Go`, before it resumes the vCPUs (or answers Abort). Last
    /// among the variants, so a process of the first handover version reads
    /// the rest as before (and refuses this, before `Go`).
    Owner {
        /// The registry, as `ferry_registry::open` takes it.
        registry: String,
        /// The claim (the VMM's encoding, ≤ 4 KiB).
        claim: Vec<u8>,
    },
}

impl Message {
    /// Its name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Offer { .. } => "Offer",
            Message::Ready { .. } => "Ready",
            Message::Conns { .. } => "Conns",
            Message::State { .. } => "State",
            Message::Restored => "Restored",
            Message::Go => "Go",
            Message::Running { .. } => "Running",
            Message::Abort { .. } => "Abort",
            Message::Owner { .. } => "Owner",
        }
    }
}

/// Most bytes of one disk's spec in an offer's tail.
pub const MAX_DISK_SPEC: usize = 4096;

/// Sends one message with `fds`; returns the bytes written.
pub fn send(
    sock: &mut UnixStream,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<u64, HandoverError> {
    send_with_disks(sock, msg, fds, &[])
}

/// [`send`], with the VM's disks (their `--disk` specs) after the message
/// when there are any. A message without disks is what earlier builds
/// send; an earlier build that gets disks ignores them, builds the VM
/// without them, and then refuses the state (whose disk part it does not
/// know), so a handover to it fails before its commit point rather than
/// lose a disk.
pub fn send_with_disks(
    sock: &mut UnixStream,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
    disks: &[String],
) -> Result<u64, HandoverError> {
    if fds.len() > MAX_FDS {
        return Err(HandoverError::Protocol(format!(
            "{} descriptors in one {} message (at most {MAX_FDS})",
            fds.len(),
            msg.name()
        )));
    }
    let mut body =
        postcard::to_allocvec(msg).map_err(|e| HandoverError::Protocol(e.to_string()))?;
    if !disks.is_empty() {
        let tail =
            postcard::to_allocvec(disks).map_err(|e| HandoverError::Protocol(e.to_string()))?;
        body.extend_from_slice(&tail);
    }
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    let n = send_with_fds(sock, &frame, fds).map_err(HandoverError::from_io)?;
    sock.write_all(&frame[n..])
        .map_err(HandoverError::from_io)?;
    Ok(frame.len() as u64)
}

/// Receives one message and the descriptors sent with it; returns them and
/// the bytes read.
pub fn recv(
    sock: &mut UnixStream,
    max_fds: usize,
) -> Result<(Message, Vec<OwnedFd>, u64), HandoverError> {
    let (body, fds) = recv_body(sock, max_fds)?;
    let msg = postcard::from_bytes(&body)
        .map_err(|e| HandoverError::Protocol(format!("undecodable message: {e}")))?;
    Ok((msg, fds, 4 + body.len() as u64))
}

/// [`recv`] of a message that may carry the VM's disks after it
/// ([`send_with_disks`]): at most [`crate::devices::block::MAX_DISKS`]
/// specs of at most [`MAX_DISK_SPEC`] bytes, each one a `--disk` spec.
pub fn recv_with_disks(
    sock: &mut UnixStream,
    max_fds: usize,
) -> Result<(Message, Vec<OwnedFd>, Vec<crate::devices::block::DiskSpec>), HandoverError> {
    let (body, fds) = recv_body(sock, max_fds)?;
    let bad = |why: String| HandoverError::Protocol(format!("undecodable message: {why}"));
    let (msg, rest) = postcard::take_from_bytes(&body).map_err(|e| bad(e.to_string()))?;
    if rest.is_empty() {
        return Ok((msg, fds, Vec::new()));
    }
    // The count first: a long list is refused before it is read.
    let (count, _) = postcard::take_from_bytes::<u32>(rest).map_err(|e| bad(e.to_string()))?;
    if count as usize > crate::devices::block::MAX_DISKS {
        return Err(bad(format!(
            "{count} disks (at most {})",
            crate::devices::block::MAX_DISKS
        )));
    }
    let (texts, rest): (Vec<String>, _) =
        postcard::take_from_bytes(rest).map_err(|e| bad(e.to_string()))?;
    if !rest.is_empty() {
        return Err(bad(format!("{} bytes after the disks", rest.len())));
    }
    let disks = texts
        .iter()
        .map(|t| {
            if t.len() > MAX_DISK_SPEC {
                return Err(bad(format!("a disk spec of {} bytes", t.len())));
            }
            t.parse().map_err(|e| bad(format!("disk {t:?}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((msg, fds, disks))
}

/// One message's body and descriptors.
fn recv_body(
    sock: &mut UnixStream,
    max_fds: usize,
) -> Result<(Vec<u8>, Vec<OwnedFd>), HandoverError> {
    // Only the 4-byte prefix with recvmsg: the descriptors come with the
    // message's first byte, and the read must not run into the next message.
    let mut prefix = [0u8; 4];
    let (n, fds) = recv_with_fds(sock, &mut prefix, max_fds).map_err(HandoverError::from_io)?;
    if n == 0 {
        return Err(HandoverError::Closed(String::new()));
    }
    sock.read_exact(&mut prefix[n..])
        .map_err(HandoverError::from_io)?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_MESSAGE {
        return Err(HandoverError::Protocol(format!(
            "a message of {len} bytes (at most {MAX_MESSAGE})"
        )));
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body).map_err(HandoverError::from_io)?;
    Ok((body, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn messages_and_descriptors_cross_in_order() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let (x, _y) = UnixStream::pair().unwrap();
        send(&mut a, &Message::Ready { build_ms: 1.5 }, &[]).unwrap();
        send(
            &mut a,
            &Message::Conns {
                conns: vec![(7, b"half a fr".to_vec())],
            },
            &[x.as_fd()],
        )
        .unwrap();
        send(&mut a, &Message::Go, &[]).unwrap();
        let (m, fds, _) = recv(&mut b, 4).unwrap();
        assert_eq!((m, fds.len()), (Message::Ready { build_ms: 1.5 }, 0));
        let (m, fds, _) = recv(&mut b, 4).unwrap();
        assert_eq!(fds.len(), 1);
        assert!(matches!(m, Message::Conns { conns } if conns[0].0 == 7));
        assert_eq!(recv(&mut b, 4).unwrap().0, Message::Go);
        drop(a);
        assert!(matches!(recv(&mut b, 4), Err(HandoverError::Closed(_))));
    }

    #[test]
    fn disks_ride_after_a_message_and_an_earlier_reader_ignores_them() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let go = Message::Ready { build_ms: 2.0 };
        let disks = vec![
            "/var/lib/a.img,size=1048576".to_string(),
            "nbd://10.0.0.3/web".into(),
        ];
        send_with_disks(&mut a, &go, &[], &disks).unwrap();
        let (m, _, got) = recv_with_disks(&mut b, 4).unwrap();
        assert_eq!(m, go);
        let printed: Vec<String> = got.iter().map(|d| d.to_string()).collect();
        assert_eq!(printed, disks);
        // Without disks: the same bytes as before; a reader of disks gets none.
        send(&mut a, &go, &[]).unwrap();
        assert!(recv_with_disks(&mut b, 4).unwrap().2.is_empty());
        // A reader that knows no disks (recv) takes the message and
        // leaves them.
        send_with_disks(&mut a, &go, &[], &disks).unwrap();
        assert_eq!(recv(&mut b, 4).unwrap().0, go);
        // Too many, a bad spec, garbage after: refused.
        let five: Vec<String> = (0..5).map(|i| format!("/d{i}.img")).collect();
        send_with_disks(&mut a, &go, &[], &five).unwrap();
        assert!(recv_with_disks(&mut b, 4).is_err());
        send_with_disks(&mut a, &go, &[], &["x.img,size=3".to_string()]).unwrap();
        assert!(recv_with_disks(&mut b, 4).is_err());
    }

    #[test]
    fn a_hello_names_its_version_and_garbage_is_not_ferry() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(
            &Hello {
                version: 9,
                pid: 42,
            }
            .encode(),
        )
        .unwrap();
        assert_eq!(
            Hello::read(&mut b).unwrap(),
            Hello {
                version: 9,
                pid: 42
            }
        );
        a.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(matches!(Hello::read(&mut b), Err(HandoverError::NotFerry)));
        a.write_all(&[0u8; 4]).unwrap();
        a.write_all(&(u32::MAX).to_le_bytes()).unwrap();
        assert!(matches!(recv(&mut b, 1), Err(HandoverError::Protocol(_))));
    }
}
