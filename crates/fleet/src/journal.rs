//! A drain's state in the registry (record `drains/HOST`): which moves are
//! under way and where to, renewed every second while the drain runs. So a
//! drain restarted after its process died finds the moves that were in
//! flight and settles them before planning again (no VM moved twice, no
//! waiting VMM left behind); a second drain of the same host is refused
//! while the first lives; `ferry drain HOST --cancel` reaches a drain run
//! from anywhere (record `drains/HOST.cancel`, which only the canceller
//! writes); and `ferry hosts` shows drains in progress.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_registry::Registry;

use crate::api::SentVm;
use crate::drain::{MoveReport, MoveState};
use crate::fleet::Fleet;
use crate::FleetError;

/// How often a running drain renews its record.
pub const HEARTBEAT: Duration = Duration::from_secs(1);

/// A record not renewed for this long belongs to a drain that died.
pub const STALE: Duration = Duration::from_secs(10);

/// A drain as the registry keeps it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DrainRecord {
    /// The host being emptied.
    pub host: String,
    /// Who runs it (machine and process).
    pub owner: String,
    /// When it started (Unix seconds).
    pub started_unix: f64,
    /// When it last renewed this record.
    pub heartbeat_unix: f64,
    /// Its moves so far.
    pub moves: Vec<RecordedMove>,
}

/// One move as a drain's record keeps it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RecordedMove {
    /// The VM.
    pub vm: String,
    /// Where it is going.
    pub to: String,
    /// Where the move stands.
    pub state: MoveState,
    /// Pages verified end to end, once a `--verify` move is done: a drain
    /// killed after the move still tells whether it was verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_pages: Option<u64>,
}

impl DrainRecord {
    /// True if its drain has not renewed it lately (it died).
    pub fn stale(&self) -> bool {
        now() - self.heartbeat_unix > STALE.as_secs_f64()
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn key(host: &str) -> String {
    format!("drains/{host}")
}

fn cancel_key(host: &str) -> String {
    format!("drains/{host}.cancel")
}

fn decode(key: &str, bytes: &[u8]) -> Result<DrainRecord, FleetError> {
    serde_json::from_slice(bytes)
        .map_err(|e| FleetError::Refused(format!("registry record {key} is not a drain's: {e}")))
}

/// The drain of `host` the registry holds, if any.
pub fn read(registry: &dyn Registry, host: &str) -> Result<Option<DrainRecord>, FleetError> {
    let k = key(host);
    registry.get_record(&k)?.map(|b| decode(&k, &b)).transpose()
}

/// Every drain the registry holds (running, or left by one that died).
pub fn all(registry: &dyn Registry) -> Result<Vec<DrainRecord>, FleetError> {
    let mut out = Vec::new();
    for (k, v) in registry.records("drains/")? {
        if k.ends_with(".cancel") {
            continue;
        }
        match decode(&k, &v) {
            Ok(r) => out.push(r),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    Ok(out)
}

/// Asks the running drain of `host` to start no new move.
pub fn cancel(registry: &dyn Registry, host: &str) -> Result<DrainRecord, FleetError> {
    match read(registry, host)? {
        Some(r) if !r.stale() => {
            registry.put_record(&cancel_key(host), b"cancel")?;
            Ok(r)
        }
        _ => Err(FleetError::Plan(format!(
            "no drain of {host} is running (in {})",
            registry.describe()
        ))),
    }
}

/// A running drain's record.
pub struct Journal {
    registry: Arc<dyn Registry>,
    rec: Mutex<DrainRecord>,
}

impl Journal {
    /// Takes `host`'s drain record for this process. Refused while another
    /// drain of it runs; the record of one that died is handed back, for
    /// [`settle`].
    pub fn begin(
        registry: Arc<dyn Registry>,
        host: &str,
    ) -> Result<(Journal, Option<DrainRecord>), FleetError> {
        let before = read(&*registry, host)?;
        if let Some(r) = &before {
            if !r.stale() {
                return Err(FleetError::Refused(format!(
                    "a drain of {host} is running ({}, renewed {:.0} s ago); cancel it with \
                     `ferry drain {host} --cancel`",
                    r.owner,
                    now() - r.heartbeat_unix
                )));
            }
        }
        registry.delete_record(&cancel_key(host))?;
        let machine = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        let t = now();
        let j = Journal {
            registry,
            rec: Mutex::new(DrainRecord {
                host: host.into(),
                owner: format!("{machine} pid {}", std::process::id()),
                started_unix: t,
                heartbeat_unix: t,
                moves: before.as_ref().map(|b| b.moves.clone()).unwrap_or_default(),
            }),
        };
        j.write()?;
        Ok((j, before))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DrainRecord> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> Result<(), FleetError> {
        let (k, body) = {
            let mut r = self.lock();
            r.heartbeat_unix = now();
            (key(&r.host), serde_json::to_vec(&*r).unwrap_or_default())
        };
        self.registry.put_record(&k, &body)?;
        Ok(())
    }

    /// Notes where the moves stand, writing the record when a move's state
    /// or destination changed.
    pub fn record(&self, moves: &[MoveReport]) {
        let changed = {
            let mut r = self.lock();
            let now: Vec<RecordedMove> = moves
                .iter()
                .map(|m| RecordedMove {
                    vm: m.vm.clone(),
                    to: m.to.clone(),
                    state: m.state,
                    verified_pages: m.verified_pages,
                })
                .collect();
            let changed = r.moves != now;
            r.moves = now;
            changed
        };
        if changed {
            if let Err(e) = self.write() {
                tracing::warn!("drain: cannot record its state in the registry: {e}");
            }
        }
    }

    /// Renews the record; true if a cancel was asked for.
    pub fn beat(&self) -> bool {
        if let Err(e) = self.write() {
            tracing::warn!("drain: cannot renew its record in the registry: {e}");
        }
        let host = self.lock().host.clone();
        matches!(self.registry.get_record(&cancel_key(&host)), Ok(Some(_)))
    }

    /// The drain ended: its record goes.
    pub fn end(self) {
        let host = self.lock().host.clone();
        for k in [key(&host), cancel_key(&host)] {
            if let Err(e) = self.registry.delete_record(&k) {
                tracing::warn!("drain: cannot remove {k} from the registry: {e}");
            }
        }
    }
}

/// Settles the moves a drain that died left in flight (`prev`, its record):
/// waits (at most `wait`) while such a VM is still being sent or its
/// destination still starting, then stops any VMM still waiting for it
/// where a running copy exists elsewhere (the move failed or never began).
/// Afterwards every VM is where the fleet says, so planning again moves
/// none twice. Says what it did, a line per VM.
pub fn settle(
    fleet: &Fleet,
    prev: &DrainRecord,
    wait: Duration,
) -> Result<Vec<String>, FleetError> {
    let deadline = Instant::now() + wait;
    let mut notes = Vec::new();
    // What the drained host's agent says its sends verified (a drain that
    // died mid-move never heard): asked once, when a VM is found moved.
    let mut sent_by_source: Option<Vec<SentVm>> = None;
    for m in prev
        .moves
        .iter()
        // A move left alone is settled like one under way: where its VM
        // runs is looked up again.
        .filter(|m| {
            matches!(
                m.state,
                MoveState::Preparing | MoveState::Moving | MoveState::LeftAlone
            )
        })
    {
        loop {
            // Every copy of the VM in the fleet: (host, state).
            let copies: Vec<(String, String)> = fleet
                .hosts()?
                .into_iter()
                .filter_map(|(_, h)| h.ok())
                .flat_map(|h| {
                    h.vms
                        .iter()
                        .filter(|v| v.spec.name == m.vm)
                        .map(|v| (h.name.clone(), v.state.clone()))
                        .collect::<Vec<_>>()
                })
                .collect();
            if copies
                .iter()
                .any(|(_, st)| st == "sending" || st == "starting")
            {
                if Instant::now() > deadline {
                    return Err(FleetError::Plan(format!(
                        "VM {} is still moving after {wait:?}; run the drain again later",
                        m.vm
                    )));
                }
                std::thread::sleep(Duration::from_millis(500));
                continue;
            }
            let runs = copies.iter().find(|(_, st)| st != "waiting");
            match runs {
                Some((h, _)) => {
                    // Only a VM that left the drained host has a move to tell.
                    let verified = if *h == prev.host {
                        String::new()
                    } else {
                        let sent = sent_by_source.get_or_insert_with(|| {
                            fleet.host(&prev.host).map(|h| h.sent).unwrap_or_default()
                        });
                        verification(sent, &m.vm)
                    };
                    for (w, _) in copies.iter().filter(|(_, st)| st == "waiting") {
                        fleet.agent(w)?.stop(&m.vm)?;
                        notes.push(format!(
                            "{}: runs on {h}{verified}; the VMM left waiting for it on {w} stopped",
                            m.vm
                        ));
                    }
                    if !copies.iter().any(|(_, st)| st == "waiting") {
                        notes.push(format!("{}: runs on {h}{verified}", m.vm));
                    }
                }
                // Only a waiting copy, or none: nothing here may touch it.
                None => notes.push(format!(
                    "{}: no running copy found ({copies:?}); left as it is",
                    m.vm
                )),
            }
            break;
        }
    }
    Ok(notes)
}

/// What the source's agent recorded of VM `vm`'s move, as a note: its
/// latest send of the VM.
fn verification(sent: &[SentVm], vm: &str) -> String {
    match sent.iter().rev().find(|s| s.vm == vm) {
        Some(s) if s.verify => format!(
            " (its move verified {} pages, as its source's agent recorded)",
            s.verified_pages
        ),
        Some(_) => " (its move was not verified)".into(),
        None => " (its source's agent has no record of the move's verification)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(tag: &str) -> Arc<dyn Registry> {
        let dir = std::env::temp_dir().join(format!("ferry-journal-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        ferry_registry::open(Some(&format!("dir:{}", dir.display())), None).unwrap()
    }

    #[test]
    fn one_drain_per_host_a_dead_ones_record_is_handed_on_and_cancel_reaches_it() {
        let reg = registry("one");
        assert!(cancel(&*reg, "h1").is_err(), "nothing to cancel yet");
        let (j, before) = Journal::begin(reg.clone(), "h1").unwrap();
        assert!(before.is_none());
        let e = Journal::begin(reg.clone(), "h1").err().unwrap().to_string();
        assert!(e.contains("a drain of h1 is running"), "{e}");
        // Another host's drain is its own.
        let (other, _) = Journal::begin(reg.clone(), "h2").unwrap();
        other.end();
        assert!(!j.beat());
        let asked = cancel(&*reg, "h1").unwrap();
        assert_eq!(asked.host, "h1");
        assert!(j.beat(), "the drain sees the cancel");
        // It dies: its record goes stale, and the next drain gets it.
        let mut dead = read(&*reg, "h1").unwrap().unwrap();
        dead.heartbeat_unix -= 60.0;
        dead.moves = vec![RecordedMove {
            vm: "web".into(),
            to: "h2".into(),
            state: MoveState::Moving,
            verified_pages: None,
        }];
        reg.put_record("drains/h1", &serde_json::to_vec(&dead).unwrap())
            .unwrap();
        drop(j);
        assert_eq!(all(&*reg).unwrap().len(), 1);
        let (j, before) = Journal::begin(reg.clone(), "h1").unwrap();
        assert_eq!(before.unwrap().moves, dead.moves);
        assert!(!j.beat(), "a new drain starts uncancelled");
        j.end();
        assert!(all(&*reg).unwrap().is_empty());
    }

    #[test]
    fn a_resumed_drain_tells_what_a_move_it_did_not_see_end_verified() {
        let sent = |vm: &str, verify, pages| SentVm {
            vm: vm.into(),
            to: "tcp:10.77.0.2:7100".into(),
            verify,
            verified_pages: pages,
        };
        let log = [
            sent("web", false, 0),
            sent("db", true, 9),
            sent("web", true, 65_536),
        ];
        // The latest send of the VM counts.
        assert!(verification(&log, "web").contains("verified 65536 pages"));
        assert!(verification(&log[..1], "web").contains("not verified"));
        assert!(verification(&log, "cache").contains("no record"));
    }

    #[test]
    fn a_done_moves_verification_is_in_the_record_before_the_drain_ends() {
        let reg = registry("verified");
        let (j, _) = Journal::begin(reg.clone(), "h1").unwrap();
        let mut m = MoveReport::waiting(&crate::drain::PlannedMove {
            vm: "web".into(),
            mem_bytes: 256 << 20,
            to: "h2".into(),
            mode: ferry_migration::Mode::Hybrid,
            why: String::new(),
            split: None,
        });
        j.record(std::slice::from_ref(&m));
        let rec = read(&*reg, "h1").unwrap().unwrap();
        assert_eq!(rec.moves[0].verified_pages, None);
        for next in [MoveState::Preparing, MoveState::Moving, MoveState::Done] {
            m.advance(next).unwrap();
        }
        m.verified_pages = Some(65_536);
        j.record(std::slice::from_ref(&m));
        // The drain dies here: its record still tells.
        let rec = read(&*reg, "h1").unwrap().unwrap();
        assert_eq!(rec.moves[0].state, MoveState::Done);
        assert_eq!(rec.moves[0].verified_pages, Some(65_536));
        j.end();
    }
}
