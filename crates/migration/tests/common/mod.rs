//! What the engine tests share: the one fake VM ([`fake_vm::FakeVm`]), a memory
//! server on loopback, and the userfaultfd probe the tests that need it
//! skip on.
// Each test file uses its own subset of these.
#![allow(dead_code)]

pub mod fake_vm;
pub mod logs;
pub mod postcopy_rig;
pub mod store_peer;

use std::sync::Arc;

use ferry_migration::memserver::MemServer;
use ferry_migration::{Endpoint, Listener};

/// A memory server of `pages` pages serving on a loopback TCP port.
pub fn mem_server(pages: u64) -> (Arc<MemServer>, Endpoint) {
    let l = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".parse().unwrap())).unwrap();
    let at = l.endpoint();
    let s = MemServer::new(pages);
    let s2 = s.clone();
    std::thread::spawn(move || s2.serve(&l));
    (s, at)
}

/// Whether userfaultfd with `features` works here; if not, says that
/// `what` is skipped and why.
pub fn uffd_usable(features: ferry_memory::Features, what: &str) -> bool {
    match ferry_memory::Userfaultfd::new(features) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP: {what}: {e}");
            false
        }
    }
}

/// The figures of a migration that finished; a paused postcopy fails the
/// test (no test here cuts a link for longer than its reconnect timeout).
pub fn done(o: ferry_migration::Outcome) -> ferry_migration::MigrationStats {
    o.done()
        .expect("the migration finished (not a paused postcopy)")
}

/// Every test's TCP links speak mutual TLS, as ferry's do: a throwaway
/// fleet (one CA, one host valid for 127.0.0.1) made once per test binary
/// and installed as this process's security.
pub fn secure() {
    static FLEET: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    FLEET.get_or_init(|| {
        // Made anew each run (what the last run of this binary left goes).
        let _ = std::fs::remove_dir_all(fleet_dir());
        let fleet =
            ferry_migration::transport::Security::local_fleet(&fleet_dir()).expect("a test fleet");
        ferry_migration::transport::install(fleet);
    });
}

/// Where [`secure`] makes its fleet: the CA in `ca/` (tests issue other
/// hosts' certificates from it) and the one host, `local-host`, in
/// `local-host/`.
/// One per test binary (named after it, not after the process: test runs
/// would otherwise leave one each).
pub fn fleet_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().ok();
    let name = exe
        .as_deref()
        .and_then(|e| e.file_stem())
        .map_or("tests".into(), |s| s.to_string_lossy().into_owned());
    std::env::temp_dir().join(format!("ferry-test-fleet-migration-{name}"))
}

/// Plaintext links, for the tests that must read the frames on the wire
/// (a relay cutting at a given message): what `--insecure` gives.
pub fn insecure() {
    ferry_migration::transport::install(ferry_migration::transport::Security::Insecure);
}

/// What a source sends after HelloAck, as the engine's source does: the
/// token, the memory layout of `regions` (one vCPU), no clients plan, a
/// timeline ask of 0, no switch ahead and no shared pages. For tests that play a source by hand.
pub fn send_opening(
    c: &mut ferry_migration::transport::Conn,
    token: Option<&str>,
    regions: &[(u64, u64)],
) {
    send_opening_hashing(c, token, regions, false)
}

/// [`send_opening`], asking (`hash`) that pages be hashed as they land.
pub fn send_opening_hashing(
    c: &mut ferry_migration::transport::Conn,
    token: Option<&str>,
    regions: &[(u64, u64)],
    hash: bool,
) {
    use ferry_migration::protocol::{Kind, Layout};
    c.send(Kind::Token, &token.map(str::to_string)).unwrap();
    let layout = Layout {
        regions: regions.to_vec(),
        vcpus: 1,
    };
    c.send(Kind::Layout, &layout).unwrap();
    c.send(Kind::ClientsPlan, &None::<ferry_migration::ClientsPlan>)
        .unwrap();
    c.send(Kind::TimelineAsk, &0u32).unwrap();
    c.send(Kind::HashAsk, &hash).unwrap();
    // No switch to postcopy announced, so no SwitchReady to wait for; no
    // shared pages asked for, so no offer to read.
    c.send(Kind::SwitchAhead, &false).unwrap();
    c.send(Kind::ShareAsk, &false).unwrap();
    // No clients stay behind with requests in flight: nothing to hold.
    c.send(Kind::AnswersAsk, &None::<[u8; 16]>).unwrap();
    // An unfenced VM: no ownership claim (v18).
    c.send(Kind::Owner, &None::<Vec<u8>>).unwrap();
}
