//! A peer on the other end of a real socket: the code under test gets a
//! [`Conn`] (the engine's own buffered connection, the path every peer
//! byte takes), and a thread on the far end writes the fuzzer's bytes,
//! closes its sending half, and reads whatever comes back until the code
//! under test closes the connection.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_migration::transport::{Conn, Stream};

/// How long any read or write of the code under test may wait: a target
/// that waits this long for bytes that will never come has hung.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The far end of a connection.
pub struct Peer {
    thread: Option<JoinHandle<Vec<u8>>>,
}

impl Peer {
    /// A connection whose peer sends `bytes`, then closes its sending half
    /// and reads until the connection closes.
    pub fn connect(bytes: Vec<u8>) -> (Conn, Peer) {
        let (near, mut far) = UnixStream::pair().expect("socketpair");
        let thread = std::thread::spawn(move || {
            let _ = far.set_read_timeout(Some(IO_TIMEOUT));
            let _ = far.set_write_timeout(Some(IO_TIMEOUT));
            // The code under test may stop reading early (an error): the
            // rest of the bytes then has nowhere to go.
            let _ = far.write_all(&bytes);
            let _ = far.shutdown(Shutdown::Write);
            let mut back = Vec::new();
            let _ = far.read_to_end(&mut back);
            back
        });
        let conn = Conn::new(Stream::unix(near), Some(IO_TIMEOUT)).expect("a connection");
        (
            conn,
            Peer {
                thread: Some(thread),
            },
        )
    }

    /// What the code under test sent, once it closed the connection (drop
    /// the [`Conn`] first).
    pub fn answers(mut self) -> Vec<u8> {
        self.thread
            .take()
            .map(|t| t.join().expect("the peer thread"))
            .unwrap_or_default()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
