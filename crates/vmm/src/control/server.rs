//! The control socket's server: binding (owner-only, see [`super::access`])
//! or adopting the socket, the accept loop, and one thread per connection
//! that first checks who connected (this user or root), then reads request
//! lines (each at most [`MAX_LINE`] bytes), hands them to the
//! [`ControlHandler`] and writes the replies. What a command does is the
//! handler's business.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

use super::protocol::{parse_request, progress_line, reply_for, Refusal};
use super::{ControlError, Request, MAX_LINE};

/// Serves requests; implemented by whatever owns the VM.
pub trait ControlHandler: Send + Sync {
    /// Handles one request: Ok(fields to add to the reply) or Err(message).
    fn handle(&self, req: Request, progress: &mut dyn FnMut(Value)) -> Result<Value, String>;

    /// Runs once the reply to a request has been written: effects that may
    /// end the VMM process (a finished migration) wait for it, so the client
    /// always gets its whole answer.
    fn after_reply(&self) {}
}

/// A control socket's listener, shared by its accept thread and a handover
/// (which lends it to the next VMM process, so clients keep the path).
pub struct ControlSocket {
    path: PathBuf,
    listener: UnixListener,
    /// False while a handover holds new clients in the listen queue.
    accepting: AtomicBool,
    stop: AtomicBool,
    /// Another process serves the path now: do not remove it.
    retired: AtomicBool,
}

impl crate::handover::MovingListener for ControlSocket {
    /// The socket path.
    fn path(&self) -> &Path {
        &self.path
    }

    /// The listening socket, to duplicate for the next process.
    fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// New clients wait in the listen queue until `accept_again`
    /// (or the next process accepts them).
    fn hold_clients(&self) {
        self.accepting.store(false, Ordering::Release);
    }

    /// Accept clients again (a handover failed).
    fn accept_again(&self) {
        self.accepting.store(true, Ordering::Release);
    }

    /// Another process serves this path now: stop accepting for good, and
    /// leave the path in place when this server is dropped.
    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Release);
    }
}

/// A listening control socket; removed when dropped (unless retired).
pub struct ControlServer {
    socket: Arc<ControlSocket>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `path` (a socket only this user and root may use,
    /// whatever the umask) and serves each connection on its own thread.
    pub fn start(path: &Path, handler: Arc<dyn ControlHandler>) -> Result<Self, ControlError> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(ControlError::InUse(path.into()));
            }
            let _ = std::fs::remove_file(path); // stale socket of a VMM that died
        }
        let listener =
            super::access::bind_owner_only(path).map_err(|source| ControlError::Listen {
                path: path.into(),
                source,
            })?;
        Self::adopt(listener, path, handler)
    }

    /// Serves a listening socket bound at `path` by another VMM process
    /// (a handover): the path stays, clients queued on it are served here.
    pub fn adopt(
        listener: UnixListener,
        path: &Path,
        handler: Arc<dyn ControlHandler>,
    ) -> Result<Self, ControlError> {
        let listen_err = |source| ControlError::Listen {
            path: path.into(),
            source,
        };
        listener.set_nonblocking(true).map_err(listen_err)?;
        let socket = Arc::new(ControlSocket {
            path: path.into(),
            listener,
            accepting: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        });
        let s = socket.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(&s, handler))
            .map_err(listen_err)?;
        Ok(ControlServer {
            socket,
            thread: Some(thread),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.socket.path
    }

    /// The shared listener (for a handover).
    pub fn socket(&self) -> Arc<ControlSocket> {
        self.socket.clone()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.socket.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if !self.socket.retired.load(Ordering::Acquire) {
            let _ = std::fs::remove_file(&self.socket.path);
        }
    }
}

fn accept_loop(socket: &ControlSocket, handler: Arc<dyn ControlHandler>) {
    while !socket.stop.load(Ordering::Acquire) {
        if !socket.accepting.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        match socket.listener.accept() {
            Ok((stream, _)) => {
                let h = handler.clone();
                let _ = std::thread::Builder::new()
                    .name("control-conn".into())
                    .spawn(move || serve(stream, h));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn serve(stream: UnixStream, handler: Arc<dyn ControlHandler>) {
    let _ = stream.set_nonblocking(false);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    if let Some(why) = super::access::refusal(&stream) {
        tracing::warn!("control socket: {why}");
        let _ = writeln!(writer, "{}", reply_for(Err(why)));
        return;
    }
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = match parse_request(&line) {
            Err(Refusal { reply, close: true }) => {
                let _ = writeln!(writer, "{reply}");
                return;
            }
            Err(Refusal { reply, .. }) => reply,
            Ok(req) => reply_for(handler.handle(req, &mut |p| {
                let _ = writeln!(writer, "{}", progress_line(p));
            })),
        };
        let written = writeln!(writer, "{reply}").and_then(|_| writer.flush());
        handler.after_reply();
        if written.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ControlClient;
    use serde_json::json;
    use std::sync::Mutex;

    struct Echo(Mutex<Vec<Request>>);
    impl ControlHandler for Echo {
        fn handle(&self, req: Request, _: &mut dyn FnMut(Value)) -> Result<Value, String> {
            self.0.lock().unwrap().push(req.clone());
            match req {
                Request::Quit => Err("no".into()),
                _ => Ok(json!({"seen": true})),
            }
        }
    }

    #[test]
    fn requests_replies_and_errors() {
        let dir = std::env::temp_dir().join(format!("ferry-ctl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vm.sock");
        let handler = Arc::new(Echo(Mutex::new(Vec::new())));
        let server = ControlServer::start(&path, handler.clone()).unwrap();
        assert!(matches!(
            ControlServer::start(&path, handler.clone()),
            Err(ControlError::InUse(_))
        ));
        let mut c = ControlClient::connect(&path).unwrap();
        assert_eq!(c.call(&Request::Status).unwrap()["seen"], true);
        assert!(matches!(c.call(&Request::Quit), Err(ControlError::Refused(m)) if m == "no"));

        // Garbage and oversized lines get an error reply, not a crash.
        let mut raw = UnixStream::connect(&path).unwrap();
        writeln!(raw, "{{\"cmd\":\"explode\"}}").unwrap();
        let mut r = BufReader::new(raw.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(
            line.contains("\"ok\":false") && line.contains("commands: status"),
            "{line}"
        );
        raw.write_all(&vec![b'x'; MAX_LINE + 10]).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert!(line.contains("longer than"), "{line}");

        drop(server);
        assert!(!path.exists());
        assert!(matches!(
            ControlClient::connect(&path),
            Err(ControlError::Connect { .. })
        ));
        assert_eq!(handler.0.lock().unwrap().len(), 2);
    }

    /// A control socket in a fresh directory of the temp dir.
    fn socket_path(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-ctl-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        dir.join("vm.sock")
    }

    #[test]
    fn the_socket_is_owner_only_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let path = socket_path("umask");
        let handler = Arc::new(Echo(Mutex::new(Vec::new())));
        // SAFETY: umask only swaps the process's mask; it is put back below
        // (other tests' files made meanwhile just get wider modes).
        let old = unsafe { libc::umask(0) };
        let server = ControlServer::start(&path, handler);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let server = server.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600, "socket mode {mode:o} under umask 000");
        // Nothing else is left beside it, and it works.
        let beside: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, [std::ffi::OsString::from("vm.sock")]);
        let mut c = ControlClient::connect(&path).unwrap();
        assert_eq!(c.call(&Request::Status).unwrap()["seen"], true);
        drop(server);
        // A directory so deep that the temporary path beside the socket is
        // too long to bind directly (it is reached through /proc).
        let base = std::env::temp_dir().join(format!("ferry-deep-{}-", std::process::id()));
        let pad = 90usize.saturating_sub(base.as_os_str().len()).max(1);
        let deep = PathBuf::from(format!("{}{}", base.display(), "d".repeat(pad)));
        let _ = std::fs::remove_dir_all(&deep);
        std::fs::create_dir_all(&deep).unwrap();
        let long = deep.join("vm.sock");
        assert!(long.as_os_str().len() < 100, "{}", long.display());
        let server = ControlServer::start(&long, Arc::new(Echo(Mutex::new(Vec::new())))).unwrap();
        let mode = std::fs::metadata(&long).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        drop(server);
        let _ = std::fs::remove_dir_all(&deep);
    }

    /// Run by `a_peer_of_another_uid_is_refused` as another user: connects
    /// to FERRY_CTL_PEER, asks for status, prints what happened.
    #[test]
    #[ignore = "a helper run as another uid by a_peer_of_another_uid_is_refused"]
    fn peer_as_another_uid() {
        let path = std::env::var("FERRY_CTL_PEER").expect("FERRY_CTL_PEER");
        if let Err(e) = ControlClient::connect(Path::new(&path)) {
            println!("CLIENT-SAYS {e}");
        }
        match UnixStream::connect(&path) {
            Err(e) => println!("CONNECT-FAILED {e}"),
            Ok(s) => {
                let _ = writeln!(&s, "{{\"cmd\":\"status\"}}");
                let mut line = String::new();
                let _ = BufReader::new(&s).read_line(&mut line);
                println!("REPLY {}", line.trim_end());
            }
        }
    }

    #[test]
    fn a_peer_of_another_uid_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: running a peer as another uid needs root");
            return;
        }
        let path = socket_path("peer");
        let handler = Arc::new(Echo(Mutex::new(Vec::new())));
        let server = ControlServer::start(&path, handler.clone()).unwrap();
        let as_nobody = || {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "control::server::tests::peer_as_another_uid"])
                .args(["--ignored", "--nocapture", "--test-threads=1"])
                .env("FERRY_CTL_PEER", &path)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = |marker: &str| {
                text.find(marker)
                    .map(|at| text[at..].lines().next().unwrap_or("").to_string())
            };
            (
                ["CONNECT-FAILED", "REPLY "]
                    .iter()
                    .find_map(|m| line(m))
                    .unwrap_or_else(|| panic!("the peer said nothing useful: {text}")),
                line("CLIENT-SAYS"),
            )
        };
        // Owner-only: another uid cannot even connect, and the client says
        // whose socket it is.
        let (said, client) = as_nobody();
        assert!(said.contains("Permission denied"), "{said}");
        let client = client.expect("the client failed to connect");
        assert!(
            client.contains("is not open to uid 65534")
                && client.contains("(uid 0, the socket's owner) and root"),
            "{client}"
        );
        // Loosened by hand (or inherited): it connects, and is refused by
        // its credentials.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let (said, _) = as_nobody();
        assert!(
            said.contains("\"ok\":false")
                && said.contains("refused")
                && said.contains("not uid 65534"),
            "{said}"
        );
        assert!(
            handler.0.lock().unwrap().is_empty(),
            "no request was handled"
        );
        // Its own user still is served.
        let mut c = ControlClient::connect(&path).unwrap();
        assert_eq!(c.call(&Request::Status).unwrap()["seen"], true);
        drop(server);
    }
}
