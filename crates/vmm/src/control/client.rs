//! The control socket's client: what `ferry` (status, migrate, handover,
//! ctl) uses to call a VMM, progress lines included.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::protocol::{parse_reply_line, reply_result};
use super::{ControlError, Request};

/// A connection to a VMM's control socket.
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to `path`.
    pub fn connect(path: &Path) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path).map_err(|error| {
            if error.kind() == std::io::ErrorKind::PermissionDenied {
                use std::os::unix::fs::MetadataExt;
                return ControlError::Denied {
                    path: path.into(),
                    owner: std::fs::metadata(path).ok().map(|m| m.uid()),
                    // SAFETY: geteuid has no preconditions and cannot fail.
                    me: unsafe { libc::geteuid() },
                };
            }
            ControlError::Connect {
                path: path.into(),
                error,
            }
        })?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let writer = stream.try_clone()?;
        Ok(ControlClient {
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// Sends a request and returns the reply's fields (without "ok").
    pub fn call(&mut self, req: &Request) -> Result<Value, ControlError> {
        self.call_with_progress(req, &mut |_| {})
    }

    /// Like [`call`](Self::call), handing progress lines to `on_progress`.
    pub fn call_with_progress(
        &mut self,
        req: &Request,
        on_progress: &mut dyn FnMut(&Value),
    ) -> Result<Value, ControlError> {
        let line = serde_json::to_string(req).map_err(|e| ControlError::BadReply(e.to_string()))?;
        // A migration may go quiet for longer than a reply may take (a
        // round on a slow link, a postcopy reconnecting); the VMM bounds
        // each of its steps itself.
        let long = matches!(
            req,
            Request::Migrate(_) | Request::MigrateResume { .. } | Request::Handover { .. }
        );
        self.reader
            .get_ref()
            .set_read_timeout((!long).then_some(Duration::from_secs(10)))?;
        writeln!(self.writer, "{line}")?;
        let (reply, v) = loop {
            let mut reply = String::new();
            if (&mut self.reader).take(16 << 20).read_line(&mut reply)? == 0 {
                return Err(ControlError::BadReply("connection closed".into()));
            }
            let v = parse_reply_line(&reply)?;
            match v.get("progress") {
                Some(p) => on_progress(p),
                None => break (reply, v),
            }
        };
        reply_result(reply, v)
    }
}
