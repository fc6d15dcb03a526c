//! The control socket's contract: the commands a client sends
//! ([`Request`]), the reply lines the VMM answers with, and what a call can
//! fail with ([`ControlError`]). Pure data and parsing, shared by the server
//! and the client, so both read the wire the same way.

use std::path::PathBuf;

use serde_json::{json, Value};

/// Longest request line accepted.
pub const MAX_LINE: usize = 64 * 1024;

/// A control request. (A migrate request's options make it the largest
/// variant by far; requests are few and short-lived, so it is not boxed.)
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
#[allow(clippy::large_enum_variant)]
pub enum Request {
    /// State, size, workloads, uptime.
    Status,
    /// The guest's counters.
    Metrics,
    /// Stop the vCPUs.
    Pause,
    /// Run them again.
    Resume,
    /// Stop the VM and end its VMM process.
    Quit,
    /// Live-migrate the VM; progress lines precede the final reply.
    Migrate(MigrateRequest),
    /// Continue a postcopy migration that paused on a broken link (to the
    /// same destination, or where it is reachable now).
    #[serde(rename = "migrate-resume")]
    MigrateResume {
        /// The destination's address now, if it changed.
        #[serde(default)]
        to: Option<ferry_migration::Endpoint>,
        /// How long to keep reconnecting if the link breaks again (ms);
        /// the paused migration's own setting when absent.
        #[serde(default)]
        reconnect_timeout_ms: Option<u64>,
        /// Write the resumed migration's timeline here.
        #[serde(default)]
        timeline: Option<PathBuf>,
    },
    /// Move the VM to a new VMM process on this host without copying its
    /// memory; the control socket's path moves with it.
    Handover {
        /// The ferry binary the new process runs (default: this one's).
        #[serde(default)]
        binary: Option<String>,
        /// Compare per-page hashes of guest memory in both processes.
        #[serde(default)]
        verify: bool,
    },
    /// Write the guest's non-zero pages, in guest address order, to a file.
    Dump {
        /// Where (a path on the VMM's host).
        path: String,
    },
    /// Measure how fast the guest writes memory: pages logged dirty over a
    /// short window (ms, default 500, at most 5000), counted once each.
    #[serde(rename = "dirty-rate")]
    DirtyRate {
        /// The window (ms).
        #[serde(default)]
        ms: Option<u64>,
    },
}

/// Parameters of a migration request: where to, and how (the engine's
/// own options, parsed once by the client; omitted fields take their
/// defaults).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MigrateRequest {
    /// Destination, `tcp:HOST:PORT` or `unix:PATH`.
    pub to: ferry_migration::Endpoint,
    /// How to migrate.
    #[serde(flatten)]
    pub options: ferry_migration::MigrateOptions,
    /// Write the migration's timeline (JSON lines, both sides, then the
    /// summary) here, whether it succeeds or not; none when absent.
    #[serde(default)]
    pub timeline: Option<PathBuf>,
}

/// Why a control call failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Could not create the socket.
    #[error("cannot listen on control socket {path}: {source}")]
    Listen {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Another live VMM owns the socket.
    #[error("control socket {0} is in use by another running VM")]
    InUse(PathBuf),
    /// Could not reach the VMM. (The reason is in the message, not a
    /// source: `{:#}` would print it twice.)
    #[error("no VM answers on {path}: {error}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// OS error.
        error: std::io::Error,
    },
    /// The socket is not open to this user: a VMM's control socket is
    /// owner-only (0600), for its own user and root.
    #[error(
        "control socket {path} is not open to uid {me}: only the VMM's own user{} and root may \
         use it (permission denied); run this as that user",
        owner.map(|o| format!(" (uid {o}, the socket's owner)")).unwrap_or_default()
    )]
    Denied {
        /// Socket path.
        path: PathBuf,
        /// Who the socket file belongs to, if it could be seen.
        owner: Option<u32>,
        /// This process's effective uid.
        me: u32,
    },
    /// The connection failed midway.
    #[error("control connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The VMM answered something that is not a control reply.
    #[error("bad reply from the VMM: {0}")]
    BadReply(String),
    /// The VMM refused the request.
    #[error("the VMM refused: {0}")]
    Refused(String),
}

/// A request line the server will not hand to its handler, and the reply
/// it gets instead.
#[derive(Debug)]
pub(crate) struct Refusal {
    /// The error reply.
    pub reply: Value,
    /// Close the connection after the reply (the line was too long: what
    /// follows it cannot be trusted to start a line).
    pub close: bool,
}

/// What the server makes of one line it read (at most [`MAX_LINE`] + 1
/// bytes, with its newline).
pub(crate) fn parse_request(line: &[u8]) -> Result<Request, Refusal> {
    if line.len() > MAX_LINE {
        let reply = json!({"ok": false, "error": format!("request longer than {MAX_LINE} bytes")});
        return Err(Refusal { reply, close: true });
    }
    serde_json::from_slice::<Request>(line).map_err(|e| Refusal {
        reply: json!({"ok": false, "error": format!(
            "bad request ({e}); send one JSON object per line, e.g. {{\"cmd\":\"status\"}} \
             (commands: status, metrics, pause, resume, quit, migrate, migrate-resume, handover, dump)")}),
        close: false,
    })
}

/// [`parse_request`] for the fuzz targets (fuzz/, docs/fuzzing.md): the
/// request, or the refusal's reply and whether the connection closes.
#[doc(hidden)]
pub fn fuzz_parse_request(line: &[u8]) -> Result<Request, (Value, bool)> {
    parse_request(line).map_err(|r| (r.reply, r.close))
}

/// The reply line for a handler's answer: its fields with `"ok":true` (a
/// value that is not an object goes under `"value"`), or `"ok":false` and
/// the error.
pub(crate) fn reply_for(answer: Result<Value, String>) -> Value {
    match answer {
        Ok(Value::Object(mut fields)) => {
            fields.insert("ok".into(), Value::Bool(true));
            Value::Object(fields)
        }
        Ok(other) => json!({"ok": true, "value": other}),
        Err(msg) => json!({"ok": false, "error": msg}),
    }
}

/// A progress line, sent before the reply to a long command.
pub(crate) fn progress_line(p: Value) -> Value {
    json!({ "progress": p })
}

/// The client's reading of one line from the VMM: JSON, or a bad reply.
pub(crate) fn parse_reply_line(reply: &str) -> Result<Value, ControlError> {
    serde_json::from_str(reply).map_err(|e| ControlError::BadReply(e.to_string()))
}

/// The client's reading of the final reply `v` (the line `reply`): its
/// fields without `"ok"`, the VMM's refusal, or a bad reply.
pub(crate) fn reply_result(reply: String, mut v: Value) -> Result<Value, ControlError> {
    let obj = v
        .as_object_mut()
        .ok_or_else(|| ControlError::BadReply(reply.clone()))?;
    match obj.remove("ok") {
        Some(Value::Bool(true)) => Ok(v),
        Some(Value::Bool(false)) => Err(ControlError::Refused(
            obj.get("error")
                .and_then(Value::as_str)
                .unwrap_or("no reason given")
                .into(),
        )),
        _ => Err(ControlError::BadReply(reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of each command. The match below stops compiling when a
    /// command is added, so this list (and the module header, checked
    /// below) cannot silently miss it.
    fn every_request() -> Vec<Request> {
        let all = vec![
            Request::Status,
            Request::Metrics,
            Request::Pause,
            Request::Resume,
            Request::Quit,
            Request::Migrate(MigrateRequest {
                to: "tcp:127.0.0.1:4000".parse().unwrap(),
                options: Default::default(),
                timeline: None,
            }),
            Request::MigrateResume {
                to: None,
                reconnect_timeout_ms: None,
                timeline: None,
            },
            Request::Handover {
                binary: None,
                verify: false,
            },
            Request::Dump { path: "x".into() },
            Request::DirtyRate { ms: Some(200) },
        ];
        for r in &all {
            match r {
                Request::Status
                | Request::Metrics
                | Request::Pause
                | Request::Resume
                | Request::Quit
                | Request::Migrate(_)
                | Request::MigrateResume { .. }
                | Request::Handover { .. }
                | Request::Dump { .. }
                | Request::DirtyRate { .. } => {}
            }
        }
        all
    }

    fn cmd_of(r: &Request) -> String {
        serde_json::to_value(r).unwrap()["cmd"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn the_module_header_lists_every_command() {
        let header: String = include_str!("mod.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        for r in every_request() {
            let cmd = cmd_of(&r);
            assert!(
                header.contains(&format!("- `{cmd}`:")),
                "the control module's header does not list `{cmd}`"
            );
        }
    }

    #[test]
    fn every_command_round_trips_through_its_line() {
        for r in every_request() {
            let line = serde_json::to_string(&r).unwrap();
            assert_eq!(parse_request(line.as_bytes()).unwrap(), r, "{line}");
        }
    }

    #[test]
    fn valid_lines_parse_with_defaults_filled_in() {
        let r = parse_request(b"{\"cmd\":\"status\"}\n").unwrap();
        assert_eq!(r, Request::Status);
        let r = parse_request(br#"{"cmd":"migrate-resume"}"#).unwrap();
        assert_eq!(
            r,
            Request::MigrateResume {
                to: None,
                reconnect_timeout_ms: None,
                timeline: None
            }
        );
        let r = parse_request(br#"{"cmd":"handover","binary":"/bin/ferry"}"#).unwrap();
        assert_eq!(
            r,
            Request::Handover {
                binary: Some("/bin/ferry".into()),
                verify: false
            }
        );
        let Request::Migrate(m) =
            parse_request(br#"{"cmd":"migrate","to":"unix:/tmp/d.sock"}"#).unwrap()
        else {
            panic!("not a migrate")
        };
        assert_eq!(m.to.to_string(), "unix:/tmp/d.sock");
        assert_eq!(m.options, ferry_migration::MigrateOptions::default());
        assert_eq!(m.timeline, None);
    }

    #[test]
    fn unknown_and_malformed_lines_get_an_error_reply_and_keep_the_connection() {
        for line in [
            &br#"{"cmd":"explode"}"#[..],
            b"{\"cmd\":\"status\"",
            b"status",
            br#"{"cmd":"dump"}"#,
            b"",
        ] {
            let refusal = parse_request(line).unwrap_err();
            assert!(!refusal.close, "{line:?}");
            assert_eq!(refusal.reply["ok"], false);
            let error = refusal.reply["error"].as_str().unwrap();
            assert!(error.starts_with("bad request ("), "{error}");
            assert!(error.contains("commands: status"), "{error}");
        }
    }

    #[test]
    fn an_over_long_line_is_refused_and_closes_the_connection() {
        let mut line = br#"{"cmd":"dump","path":""#.to_vec();
        line.resize(MAX_LINE - 2, b'a');
        line.extend_from_slice(b"\"}");
        assert_eq!(line.len(), MAX_LINE);
        assert!(parse_request(&line).is_ok(), "exactly MAX_LINE is accepted");
        line.push(b'\n');
        let refusal = parse_request(&line).unwrap_err();
        assert!(refusal.close);
        assert_eq!(
            refusal.reply,
            json!({"ok": false, "error": format!("request longer than {MAX_LINE} bytes")})
        );
    }

    #[test]
    fn replies_carry_ok_and_the_fields_or_the_error() {
        assert_eq!(
            reply_for(Ok(json!({"state": "running"}))),
            json!({"ok": true, "state": "running"})
        );
        assert_eq!(reply_for(Ok(json!(7))), json!({"ok": true, "value": 7}));
        assert_eq!(
            reply_for(Err("no".into())),
            json!({"ok": false, "error": "no"})
        );
        assert_eq!(
            progress_line(json!({"round": 2})),
            json!({"progress": {"round": 2}})
        );
    }

    #[test]
    fn the_client_reads_replies_refusals_and_garbage() {
        let read = |line: &str| reply_result(line.into(), parse_reply_line(line)?);
        assert_eq!(
            read("{\"ok\":true,\"pid\":3}\n").unwrap(),
            json!({"pid": 3})
        );
        assert!(matches!(
            read(r#"{"ok":false,"error":"busy"}"#),
            Err(ControlError::Refused(m)) if m == "busy"
        ));
        assert!(matches!(
            read(r#"{"ok":false}"#),
            Err(ControlError::Refused(m)) if m == "no reason given"
        ));
        for bad in [r#"{"pid":3}"#, r#"{"ok":"yes"}"#, "[1,2]", "not json"] {
            assert!(matches!(read(bad), Err(ControlError::BadReply(_))), "{bad}");
        }
    }
}
