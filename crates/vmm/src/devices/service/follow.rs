//! Answers that follow the VM (protocol v16): when a migration's clients
//! stay on the source (forwarded), the source no longer waits in its pause
//! for the guest to answer the requests in its ring. Those requests travel
//! with the ring; the destination's guest answers them; the destination's
//! device holds the answers, and the source, once the VM runs there,
//! collects them from its service with the token both agreed over the
//! migration's control connection and hands each to its client.
//!
//! ```text
//! source                                        destination
//! answers_follow(token)   ◀── AnswersAsk/Held ──▶  hold_answers(token)
//! pause: hold, no drain; in flight = slots not free
//!                                               restore: those slots are orphans
//!                                               doorbell on an orphan: held
//! redirect ── connect, Collect(token) ─────────▶  held answers, then each new one,
//!          ◀──────────── tag:u64 | response ───   as a frame on that connection
//! each to conns[tag]; ends when all came (or a deadline passes)
//! ```
//! A stranger without the token gets nothing; everything the destination
//! holds is bounded by the ring (one answer per orphan slot).

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::conn::Outbox;
use super::wire::{self, Op, Request, Response, Status, MAX_BODY};
use super::{lock, ServiceDevice};
use crate::guest_abi::SVC_SLOTS;

/// How long the source waits for the answers it collects: the longest a
/// test's slow request spins (10 s), and then some.
const COLLECT_FOR: Duration = Duration::from_secs(20);

/// The source's side.
#[derive(Default)]
pub(super) struct Follow {
    /// Agreed with the destination: the pause does not drain.
    token: Option<[u8; 16]>,
    /// Requests in the ring when the VM paused, by connection (until the
    /// collector takes them).
    in_flight: HashMap<u64, usize>,
    /// How many there were.
    at_pause: usize,
}

/// The destination's side.
#[derive(Default)]
pub(super) struct Orphans {
    /// The source's token; None: answers to orphans are dropped.
    token: Option<[u8; 16]>,
    /// Slots in flight in the restored ring (not free in the saved state).
    slots: Vec<bool>,
    /// Where collected answers go once the source asked for them (that
    /// connection's id and outbox), until the last orphan is answered or
    /// the connection ends.
    collector: Option<(u64, Outbox)>,
    /// A collector came already: there is no second.
    collected: bool,
    /// Answers that came before the collector did: `tag | response` frames.
    held: Vec<Vec<u8>>,
}

/// Per ring slot, whether a request is in it: every slot not in `free`.
fn slots_in_flight(free: &[usize]) -> Vec<bool> {
    let mut busy = vec![true; SVC_SLOTS];
    for &s in free {
        if let Some(b) = busy.get_mut(s) {
            *b = false;
        }
    }
    busy
}

/// Splits a token into the request's key and seed.
fn token_words(t: &[u8; 16]) -> (u64, u64) {
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
    (word(&t[..8]), word(&t[8..]))
}

/// A collected answer's frame: the length, the tag, the response.
fn collected_frame(tag: u64, answer: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(12 + answer.len());
    f.extend_from_slice(&((8 + answer.len()) as u32).to_le_bytes());
    f.extend_from_slice(&tag.to_le_bytes());
    f.extend_from_slice(answer);
    f
}

/// Collects from the destination's service at `to` the answers in
/// `expected` (connection id: how many), within `within`, handing each
/// response to `deliver` as a frame for its client. Every byte is the
/// peer's: a frame over the limit, shorter than its tag, or for a
/// connection with nothing (more) in flight ends it. On Err, what is left
/// in `expected` never came.
fn collect_from(
    to: SocketAddr,
    token: [u8; 16],
    expected: &mut HashMap<u64, usize>,
    within: Duration,
    mut deliver: impl FnMut(u64, Vec<u8>),
) -> Result<(), String> {
    let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
        .map_err(|e| format!("connect: {e}"))?;
    let _ = s.set_nodelay(true);
    let (key, seed) = token_words(&token);
    (&s).write_all(&Request::new(Op::Collect, 0, key, seed).encode())
        .map_err(|e| format!("send: {e}"))?;
    let deadline = Instant::now() + within;
    let mut r = BufReader::new(&s);
    while !expected.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no answer within {within:?}"));
        }
        let _ = s.set_read_timeout(Some(left));
        let body = match wire::read_frame(&mut r, MAX_BODY + 8) {
            Ok(Some(b)) => b,
            Ok(None) => return Err("the destination closed the connection".into()),
            Err(wire::WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!("no answer within {within:?}"))
            }
            Err(e) => return Err(e.to_string()),
        };
        let Some((tag, answer)) = body.split_first_chunk::<8>() else {
            return Err("a collected answer shorter than its tag".into());
        };
        let tag = u64::from_le_bytes(*tag);
        // Only what was in flight here, once each.
        match expected.get_mut(&tag) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                expected.remove(&tag);
            }
            None => return Err(format!("an answer for connection {tag}, not in flight")),
        }
        deliver(tag, wire::frame(answer));
    }
    let _ = s.shutdown(Shutdown::Both);
    Ok(())
}

impl ServiceDevice {
    /// Source: the destination holds the answers to what is in flight at
    /// the pause (so [`pause_in_flight`](Self::pause_in_flight) need not drain).
    pub fn answers_follow(&self, token: [u8; 16]) {
        *lock(&self.follow) = Follow {
            token: Some(token),
            ..Follow::default()
        };
    }

    /// Source, before the VM pauses: stops posting; drains the ring only if
    /// the destination does not hold the answers.
    pub fn hold_for_pause(&self, timeout: Duration) -> Result<(), String> {
        // Answers this VM still owes a previous source (it came here with
        // requests in flight) cannot be collected by that source from the
        // next host: they are answered here first.
        if lock(&self.follow).token.is_none() || self.orphans_pending() {
            return self.hold_and_drain(timeout);
        }
        self.hold();
        Ok(())
    }

    /// Source, with the vCPUs paused: notes which connections have requests
    /// in the ring (their answers will come from the destination).
    pub fn pause_in_flight(&self) {
        let mut f = lock(&self.follow);
        if f.token.is_none() {
            return;
        }
        // Under the ring lock, as every post and doorbell changes it.
        let ring = lock(&self.ring);
        let busy = slots_in_flight(&ring.free);
        f.in_flight.clear();
        for (slot, _) in busy.iter().enumerate().filter(|(_, b)| **b) {
            if let Ok(tag) = self.slot_tag(slot) {
                *f.in_flight.entry(tag).or_default() += 1;
            }
        }
        f.at_pause = f.in_flight.values().sum();
    }

    /// Source: the VM runs here again (a migration failed, or none ran), or
    /// a new migration starts: the ring's answers come here until a
    /// destination agrees to hold them.
    pub fn forget_follow(&self) {
        *lock(&self.follow) = Follow::default();
    }

    /// How many requests were in flight at the pause and answer from the
    /// destination.
    pub fn answers_in_flight(&self) -> usize {
        lock(&self.follow).at_pause
    }

    /// Source, once the VM runs at `to`: collects the answers to what was
    /// in flight at the pause, on a thread of its own.
    pub(super) fn collect_answers(self: &std::sync::Arc<Self>, to: SocketAddr) {
        let (token, expected) = {
            let mut f = lock(&self.follow);
            let Some(token) = f.token.take() else { return };
            (token, std::mem::take(&mut f.in_flight))
        };
        if expected.is_empty() {
            return;
        }
        let tags: Vec<u64> = expected.keys().copied().collect();
        let d = self.clone();
        let spawned = std::thread::Builder::new()
            .name("svc-collect".into())
            .spawn(move || d.collect(to, token, expected));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the thread collecting answers in flight: {e}");
            self.close_waiting(&tags);
        }
    }

    /// Closes the clients whose answers will not come (they would wait for
    /// ever otherwise).
    fn close_waiting<'a>(&self, tags: impl IntoIterator<Item = &'a u64>) {
        let conns = lock(&self.conns);
        for tag in tags {
            if let Some(c) = conns.get(tag) {
                let _ = c.stream.shutdown(Shutdown::Both);
            }
        }
    }

    fn collect(&self, to: SocketAddr, token: [u8; 16], mut expected: HashMap<u64, usize>) {
        let total: usize = expected.values().sum();
        let deliver = |tag: u64, frame: Vec<u8>| {
            self.stats.collected.fetch_add(1, Ordering::Relaxed);
            if let Some(c) = lock(&self.conns).get(&tag) {
                let _ = c.tx.frame(frame);
            }
        };
        match collect_from(to, token, &mut expected, COLLECT_FOR, deliver) {
            Ok(()) => tracing::info!(answers = total, "answers in flight collected"),
            Err(e) => {
                // Their clients would wait for ever: close them instead.
                let missing: usize = expected.values().sum();
                tracing::warn!(%to, missing, "collecting answers in flight failed: {e}");
                self.close_waiting(expected.keys());
            }
        }
    }

    /// Destination: holds answers to what was in flight at the source's
    /// pause, for a collector that brings `token`.
    pub fn hold_answers(&self, token: [u8; 16]) {
        lock(&self.orphans).token = Some(token);
    }

    /// Destination, restoring the saved ring: the slots not free there are
    /// in flight (their connections are the source's).
    pub(super) fn note_orphans(&self, free: &[usize]) {
        lock(&self.orphans).slots = slots_in_flight(free);
    }

    /// Destination: answers to a previous source's requests are still to
    /// come from this guest.
    fn orphans_pending(&self) -> bool {
        let o = lock(&self.orphans);
        o.token.is_some() && o.slots.iter().any(|&b| b)
    }

    /// Destination: the collector's connection `id` ended; answers still
    /// to come are held (at most one a slot) rather than queued to it.
    pub(super) fn collector_gone(&self, id: u64) {
        let mut o = lock(&self.orphans);
        if o.collector.as_ref().is_some_and(|(c, _)| *c == id) {
            o.collector = None;
        }
    }

    /// Destination, at a doorbell for a connection this device does not
    /// have: if the slot was in flight at the source's pause, hold (or
    /// send) its answer for the source; else drops it.
    pub(super) fn answer_orphan(&self, slot: usize, tag: u64, answer: &[u8]) {
        let mut o = lock(&self.orphans);
        if o.token.is_none() || !o.slots.get(slot).is_some_and(|&b| b) {
            return;
        }
        o.slots[slot] = false;
        let frame = collected_frame(tag, &answer[4..]);
        match &o.collector {
            Some((_, tx)) => {
                let _ = tx.frame(frame);
            }
            None => o.held.push(frame),
        }
        // The last one: the collector's writer may end with its connection.
        if !o.slots.iter().any(|&b| b) {
            o.collector = None;
        }
    }

    /// Destination: a connection asks for the held answers. Only with the
    /// token, and only once; Err is the refusal to send before closing.
    pub(super) fn adopt_collector(
        &self,
        req: &Request,
        id: u64,
        tx: &Outbox,
    ) -> Result<(), Vec<u8>> {
        let mut o = lock(&self.orphans);
        let refuse = |why: &str| {
            Response::error(Status::BadRequest, Op::Collect as u8, req.id, why).encode()
        };
        let Some(token) = o.token else {
            return Err(refuse("no answers are held here"));
        };
        let (key, seed) = token_words(&token);
        // Both words compared whatever the first says: no early exit to time.
        if (req.key ^ key) | (req.seed ^ seed) != 0 {
            return Err(refuse("wrong token"));
        }
        if std::mem::replace(&mut o.collected, true) {
            return Err(refuse("the answers were collected already"));
        }
        for f in std::mem::take(&mut o.held) {
            let _ = tx.frame(f);
        }
        if o.slots.iter().any(|&b| b) {
            o.collector = Some((id, tx.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    #[test]
    fn a_token_splits_into_key_and_seed_and_a_collected_frame_carries_its_tag() {
        let mut t = [0u8; 16];
        t[0] = 1;
        t[15] = 0x80;
        assert_eq!(token_words(&t), (1, 0x80 << 56));
        let f = collected_frame(7, b"answer");
        let body = wire::complete_frame(&f, MAX_BODY + 8).unwrap().unwrap();
        assert_eq!(body, 8 + 6);
        assert_eq!(&f[4..12], &7u64.to_le_bytes());
        assert_eq!(&f[12..], b"answer");
    }

    /// A destination's service that checks the COLLECT request and then
    /// sends `reply` (raw bytes) and closes, or holds the line if `hold`.
    fn destination(token: [u8; 16], reply: Vec<u8>, hold: bool) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 4 + wire::REQUEST_HEADER];
            s.read_exact(&mut req).unwrap();
            let r = Request::decode(&req[4..]).unwrap();
            assert_eq!(r.op, Op::Collect);
            assert_eq!((r.key, r.seed), token_words(&token));
            s.write_all(&reply).unwrap();
            if hold {
                std::thread::sleep(Duration::from_secs(2));
            }
        });
        addr
    }

    /// What a collection returned, what it delivered, and what never came.
    type Collected = (Result<(), String>, Vec<(u64, Vec<u8>)>, HashMap<u64, usize>);

    fn collect(reply: Vec<u8>, hold: bool, expected: &[(u64, usize)]) -> Collected {
        let token = [9u8; 16];
        let to = destination(token, reply, hold);
        let mut expected: HashMap<u64, usize> = expected.iter().copied().collect();
        let mut got = Vec::new();
        let r = collect_from(
            to,
            token,
            &mut expected,
            Duration::from_millis(300),
            |t, f| got.push((t, f)),
        );
        (r, got, expected)
    }

    #[test]
    fn the_answers_in_flight_are_handed_to_their_clients_once_each() {
        let reply = [
            collected_frame(5, b"a"),
            collected_frame(9, b"bb"),
            collected_frame(5, b"c"),
        ]
        .concat();
        let (r, got, left) = collect(reply, true, &[(5, 2), (9, 1)]);
        r.unwrap();
        assert!(left.is_empty());
        let frame = wire::frame;
        assert_eq!(got, [(5, frame(b"a")), (9, frame(b"bb")), (5, frame(b"c"))]);
    }

    #[test]
    fn a_confused_or_hostile_destination_ends_the_collection() {
        // A connection with nothing in flight, or one answered too often.
        let (r, got, left) = collect(collected_frame(77, b"x"), true, &[(5, 1)]);
        assert!(r.unwrap_err().contains("not in flight"));
        assert!(got.is_empty());
        assert_eq!(left.get(&5), Some(&1), "what never came is left");
        let twice = [collected_frame(5, b"a"), collected_frame(5, b"a")].concat();
        let (r, got, _) = collect(twice, true, &[(5, 1), (9, 1)]);
        assert!(r.unwrap_err().contains("not in flight"));
        assert_eq!(got.len(), 1);
        // Shorter than its tag; over the limit; cut off; silent.
        let short = [4u32.to_le_bytes(), [1, 2, 3, 4]].concat();
        assert!(collect(short, true, &[(5, 1)])
            .0
            .unwrap_err()
            .contains("shorter than its tag"));
        let huge = ((MAX_BODY + 9) as u32).to_le_bytes().to_vec();
        assert!(collect(huge, true, &[(5, 1)])
            .0
            .unwrap_err()
            .contains("exceeds the limit"));
        let cut = collected_frame(5, b"abc")[..9].to_vec();
        assert!(collect(cut, false, &[(5, 1)]).0.is_err());
        assert!(collect(Vec::new(), false, &[(5, 1)])
            .0
            .unwrap_err()
            .contains("closed"));
        assert!(collect(Vec::new(), true, &[(5, 1)])
            .0
            .unwrap_err()
            .contains("no answer within"));
    }
}
