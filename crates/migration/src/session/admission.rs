//! How a waiting destination picks its source among the control
//! connections that passed the listener's gate: each one's opening (a
//! version both speak, the token the destination demands, this VM's
//! layout) runs on a thread of its own, within
//! [`ADMISSION_TIMEOUT`](crate::transport::ADMISSION_TIMEOUT) in all,
//! and the first that passes wins. A peer that stalls or trickles its
//! opening (a fleet host without the token, say) therefore costs a thread
//! for a few seconds and never holds up the real source behind it.

use std::io;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::MigrationError;
use crate::protocol::{self, Hello, Kind, Layout, ProtocolError, Role};
use crate::transport::{Admission, Conn, Listener, ADMISSION_TIMEOUT};

/// An opening that ended: its session id, and the source if it passed.
type Ended = (u64, Option<Admitted>);

/// A source whose opening passed.
pub(crate) struct Admitted {
    /// Its control connection (timeouts still the opening's).
    pub(crate) conn: Conn,
    /// Its Hello.
    pub(crate) hello: Hello,
    /// The protocol version agreed on.
    pub(crate) version: u16,
}

/// Openings under way at once; a later control connection waits in the
/// listener's queue until one ends (each ends within the admission limit).
const MAX_OPENING: usize = 64;

/// How often the wait looks at the listener while openings are under way
/// (the delay a real source's admission can see from this loop).
const TICK: Duration = Duration::from_millis(5);

/// How long one wait on the listener lasts while no opening is under way.
const IDLE_WAIT: Duration = Duration::from_secs(24 * 3600);

/// The largest Token or Layout body read while opening (a token is 32
/// characters, a layout 20 bytes a region at most).
const MAX_OPENING_BODY: u32 = 1 << 20;

/// Waits (as long as it takes) for the first control connection whose
/// opening passes against `mine` and the listener's rules. Everyone else
/// is told why with an Abort, on its own thread, and the wait goes on. A
/// connection of another role is refused too, unless its session is being
/// admitted (it is held for the session then).
pub(crate) fn first_source(listener: &Listener, mine: &Layout) -> Result<Admitted, MigrationError> {
    let (tx, rx) = mpsc::channel::<Ended>();
    // The session ids of the openings under way.
    let mut opening: Vec<u64> = Vec::new();
    loop {
        // Openings that ended: the first that passed wins. At the limit,
        // wait for one to end before taking more.
        loop {
            let ended = if opening.len() >= MAX_OPENING {
                rx.recv().ok()
            } else {
                rx.try_recv().ok()
            };
            let Some((session, ended)) = ended else { break };
            if let Some(i) = opening.iter().position(|&s| s == session) {
                opening.swap_remove(i);
            }
            if let Some(won) = ended {
                return Ok(won);
            }
        }
        let wait = if opening.is_empty() { IDLE_WAIT } else { TICK };
        let (mut c, hello) = match listener.accept_hello(wait) {
            Ok(a) => a,
            Err(MigrationError::Listen { source, .. })
                if source.kind() == io::ErrorKind::TimedOut =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        if hello.role != Role::Control {
            if opening.contains(&hello.session) {
                // A source being admitted opens its bulk streams already:
                // the session takes them once it won.
                listener.hold(c, hello);
            } else {
                c.abort("expected a ferry migration control Hello: no migration runs here yet");
            }
            continue;
        }
        let (tx, rules, mine) = (tx.clone(), listener.admission(), mine.clone());
        let session = hello.session;
        let started = std::thread::Builder::new()
            .name("ferry-opening".into())
            .spawn(move || open_one(c, hello, &rules, &mine, &tx));
        match started {
            Ok(_) => opening.push(session),
            // The connection went with the closure: closed.
            Err(e) => tracing::warn!("cannot start a thread to admit a source: {e}"),
        }
    }
}

/// One control connection's opening, reported on `tx` (None: refused,
/// and told why).
fn open_one(mut c: Conn, hello: Hello, rules: &Admission, mine: &Layout, tx: &mpsc::Sender<Ended>) {
    let who = c
        .peer()
        .map(|p| p.name().to_string())
        .unwrap_or_else(|| "a peer".into());
    let session = hello.session;
    let admitted = match opening(&mut c, &hello, rules, mine) {
        Ok(version) => Some(Admitted {
            conn: c,
            hello,
            version,
        }),
        Err(why) => {
            tracing::warn!(peer = %who, "refused a migration: {why}; still waiting");
            c.abort(&why);
            c.drain(Duration::from_millis(200));
            None
        }
    };
    // Another source won while this one opened.
    if let Err(mpsc::SendError((_, Some(mut late)))) = tx.send((session, admitted)) {
        late.conn
            .abort("another source was admitted first: this destination takes one migration");
    }
}

/// One source's opening on its control connection, by the admission
/// limit: a version both speak (HelloAck), the token `rules` demand (v9)
/// and this VM's layout. Nothing of the VM moves before it passes; the
/// error says why not.
fn opening(c: &mut Conn, hello: &Hello, rules: &Admission, mine: &Layout) -> Result<u16, String> {
    let deadline = Instant::now() + ADMISSION_TIMEOUT;
    c.set_timeouts(Some(ADMISSION_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let version = protocol::negotiate(hello).map_err(|e| e.to_string())?;
    if rules.token.is_some() && !crate::protocol::Caps::of(version).trust() {
        return Err(format!(
            "this destination demands a migration token (protocol v{}); the source speaks v{version}",
            protocol::VERSION_TRUST
        ));
    }
    c.send(Kind::HelloAck, &version)
        .map_err(|e| e.to_string())?;
    let late = |e: ProtocolError| match e {
        ProtocolError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ) =>
        {
            format!("the source did not open its migration within {ADMISSION_TIMEOUT:?}")
        }
        e => e.to_string(),
    };
    if crate::protocol::Caps::of(version).trust() {
        let token: Option<String> = recv_by(c, Kind::Token, deadline).map_err(late)?;
        if let Some(want) = &rules.token {
            let want = crate::options::MigrationToken(want.clone());
            match token {
                Some(t) if want.matches(&t) => {}
                Some(_) => return Err("wrong migration token".into()),
                None => {
                    return Err(
                        "this destination demands a migration token (ferry migrate --token)".into(),
                    )
                }
            }
        }
    }
    let layout: Layout = recv_by(c, Kind::Layout, deadline).map_err(late)?;
    if &layout != mine {
        return Err(MigrationError::Mismatch(format!(
            "source has memory {:?} and {} vCPUs, this VM {:?} and {} vCPUs",
            layout.regions, layout.vcpus, mine.regions, mine.vcpus
        ))
        .to_string());
    }
    Ok(version)
}

/// Reads a message of `kind` by `deadline` whatever the peer's pace, and
/// no larger than an opening message may be.
fn recv_by<T: serde::de::DeserializeOwned>(
    c: &mut Conn,
    kind: Kind,
    deadline: Instant,
) -> Result<T, ProtocolError> {
    let mut r = c.reader().until(deadline);
    let h = protocol::read_header(&mut r)?;
    if h.len > MAX_OPENING_BODY {
        return Err(ProtocolError::Malformed {
            kind: h.kind,
            reason: format!(
                "{} bytes, over the {MAX_OPENING_BODY}-byte limit of a migration's opening messages",
                h.len
            ),
        });
    }
    let mut body = Vec::new();
    protocol::read_body_into(&mut r, &h, &mut body)?;
    protocol::decode(&protocol::Frame { kind: h.kind, body }, kind)
}
