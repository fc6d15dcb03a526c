//! The registry's etcd client against a real etcd that speaks TLS and
//! demands client certificates (`--client-cert-auth`), with a fleet CA and
//! certificates made by ferry-tls's pki, as `ferry pki` makes them: a fleet
//! host advertises, lists and withdraws over `etcds://`; a host whose
//! certificate comes from another CA is refused by etcd and writes
//! nothing; plaintext spoken to the TLS port, TLS spoken to a plaintext
//! port, an etcd certificate from another CA and one that does not name
//! the host dialed are each a clear error.
//!
//! Needs the etcd binary (Debian's etcd-server; scripts/setup.sh installs
//! it); without it the test says SKIP and passes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_registry::{HostEntry, HostKind, Registry, RegistryError};
use ferry_tls::pki::{self, Validity};
use ferry_tls::Credentials;

/// Kills etcd when dropped (a failing test leaves no server behind).
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn etcd_binary() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn entry(name: &str) -> HostEntry {
    HostEntry {
        name: name.into(),
        kind: HostKind::Memserver,
        addr: "10.0.0.9:7000".into(),
        capacity: 1 << 30,
        free: 1 << 29,
        agent: None,
    }
}

fn open(addr: &str, dir: &Path) -> Arc<dyn Registry> {
    ferry_registry::open(Some(addr), Some(Credentials::load(dir).unwrap())).unwrap()
}

fn names(r: &dyn Registry) -> Vec<String> {
    r.hosts().unwrap().into_iter().map(|e| e.name).collect()
}

/// `r.hosts()`'s error, which must be one (shown with --nocapture).
fn refusal(r: &dyn Registry) -> String {
    match r.hosts() {
        Ok(h) => panic!("{} answered {h:?}", r.describe()),
        Err(e @ RegistryError::Etcd { .. }) => {
            eprintln!("refused: {e}");
            e.to_string()
        }
        Err(e) => panic!("not an etcd error: {e}"),
    }
}

#[test]
fn etcd_over_mutual_tls_serves_fleet_hosts_and_refuses_strangers() {
    let Some(bin) = etcd_binary() else {
        eprintln!(
            "\n\n*** SKIP etcd_over_mutual_tls_serves_fleet_hosts_and_refuses_strangers: no etcd \
             binary (apt-get install etcd-server; scripts/setup.sh does). The registry's TLS \
             client was NOT tested against a real etcd. ***\n"
        );
        return;
    };
    let tmp = std::env::temp_dir().join(format!("ferry-etcd-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let days = || Validity::days(1);
    // The fleet: its CA, etcd's certificate (it must name 127.0.0.1, the
    // address clients dial; its gateway dials it too), a host's.
    pki::init_ca(&tmp.join("ca"), "test fleet", days()).unwrap();
    let ips = ["127.0.0.1".to_string()];
    pki::issue(&tmp.join("ca"), "etcd", &tmp.join("etcd"), &ips, days()).unwrap();
    pki::issue(&tmp.join("ca"), "host-a", &tmp.join("host"), &[], days()).unwrap();
    // A stranger's certificate from another CA. It trusts the fleet CA, so
    // it accepts etcd: only etcd's check of the client certificate can
    // stop it.
    pki::init_ca(&tmp.join("other-ca"), "other fleet", days()).unwrap();
    pki::issue(&tmp.join("other-ca"), "host-x", &tmp.join("x"), &[], days()).unwrap();
    std::fs::copy(tmp.join("ca/ca.pem"), tmp.join("x/ca.pem")).unwrap();
    // Another stranger, wholly of the other CA: it does not trust etcd.
    pki::issue(&tmp.join("other-ca"), "host-y", &tmp.join("y"), &[], days()).unwrap();

    let (tls_port, plain_port, peer_port) = (free_port(), free_port(), free_port());
    let s = |p: &Path| p.display().to_string();
    let log = tmp.join("etcd.log");
    let etcd = Command::new(&bin)
        .args([
            "--name",
            "ferry-tls-test",
            "--data-dir",
            &s(&tmp.join("data")),
        ])
        .args([
            "--listen-client-urls",
            &format!("https://127.0.0.1:{tls_port},http://127.0.0.1:{plain_port}"),
            "--advertise-client-urls",
            &format!("https://127.0.0.1:{tls_port}"),
        ])
        .args(["--cert-file", &s(&tmp.join("etcd/cert.pem"))])
        .args(["--key-file", &s(&tmp.join("etcd/key.pem"))])
        .args(["--trusted-ca-file", &s(&tmp.join("etcd/ca.pem"))])
        .arg("--client-cert-auth")
        .args([
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer_port}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer_port}"),
            "--initial-cluster",
            &format!("ferry-tls-test=http://127.0.0.1:{peer_port}"),
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _etcd = Reap(etcd);
    let etcd_log = || std::fs::read_to_string(&log).unwrap_or_default();

    let tls_addr = format!("etcds://127.0.0.1:{tls_port}");
    let fleet = open(&tls_addr, &tmp.join("host"));
    // etcd listens before it has a leader: wait until a read works.
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = fleet.hosts() {
        assert!(
            Instant::now() < deadline,
            "etcd never answered over TLS: {e}\netcd's log:\n{}",
            etcd_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A fleet host: advertise, list, renew, withdraw.
    let ttl = Duration::from_secs(30);
    fleet.advertise(&entry("memserver@a"), ttl).unwrap();
    fleet.advertise(&entry("memserver@b"), ttl).unwrap();
    assert_eq!(names(&*fleet), ["memserver@a", "memserver@b"]);
    let listed = fleet.hosts().unwrap();
    assert_eq!(listed[0], entry("memserver@a"));
    fleet.refresh("memserver@a", ttl).unwrap();
    fleet.withdraw("memserver@b").unwrap();
    assert_eq!(names(&*fleet), ["memserver@a"]);
    assert_eq!(fleet.describe(), tls_addr);

    // The fleet's records (a drain's state): no lease, listed by prefix,
    // never mistaken for hosts.
    fleet
        .put_record("drains/h1", b"{\"cancel\":false}")
        .unwrap();
    fleet.put_record("drains/h2", b"two").unwrap();
    fleet.put_record("drainsx", b"not under drains/").unwrap();
    assert_eq!(
        fleet.get_record("drains/h1").unwrap().as_deref(),
        Some(&b"{\"cancel\":false}"[..])
    );
    let keys: Vec<String> = fleet
        .records("drains/")
        .unwrap()
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(keys, ["drains/h1", "drains/h2"]);
    fleet.delete_record("drains/h1").unwrap();
    assert_eq!(fleet.get_record("drains/h1").unwrap(), None);
    assert_eq!(names(&*fleet), ["memserver@a"]);

    // Compare-and-swap (an etcd transaction on the key's revision), and the
    // ownership rule over it: a destination and a source racing for one
    // claim, many times; exactly one wins each time.
    assert!(fleet.put_if_version("cas/a", b"1", 0).unwrap());
    assert!(
        !fleet.put_if_version("cas/a", b"x", 0).unwrap(),
        "it exists"
    );
    let (v, rev) = fleet.get_versioned("cas/a").unwrap().unwrap();
    assert_eq!((v.as_slice(), rev > 0), (&b"1"[..], true));
    assert!(fleet.put_if_version("cas/a", b"2", rev).unwrap());
    assert!(!fleet.put_if_version("cas/a", b"3", rev).unwrap(), "stale");
    assert_eq!(
        fleet.get_record("cas/a").unwrap().as_deref(),
        Some(&b"2"[..])
    );
    ownership_race(fleet.clone());

    // A certificate from another CA: etcd refuses it, and nothing it tried
    // to write is there.
    let stranger = open(&tls_addr, &tmp.join("x"));
    let err = stranger
        .advertise(&entry("memserver@intruder"), ttl)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("etcd refused this host's client certificate")
            && err.contains(&s(&tmp.join("x/cert.pem"))),
        "{err}"
    );
    let err = refusal(&*stranger);
    assert!(
        err.contains("refused this host's client certificate"),
        "{err}"
    );
    assert_eq!(names(&*fleet), ["memserver@a"]);

    // Wholly of another CA: it refuses etcd's certificate first.
    let err = refusal(&*open(&tls_addr, &tmp.join("y")));
    assert!(
        err.contains("etcd's certificate is not trusted") && err.contains(&s(&tmp.join("y"))),
        "{err}"
    );

    // A name etcd's certificate does not carry (it names 127.0.0.1).
    let err = refusal(&*open(
        &format!("etcds://localhost:{tls_port}"),
        &tmp.join("host"),
    ));
    assert!(
        err.contains("etcd's certificate is not trusted") && err.contains("name localhost"),
        "{err}"
    );

    // Plaintext to the TLS port.
    let plain_to_tls =
        ferry_registry::open(Some(&format!("etcd://127.0.0.1:{tls_port}")), None).unwrap();
    let err = refusal(&*plain_to_tls);
    assert!(err.contains("use etcds://"), "{err}");

    // TLS to the plaintext port (etcd serves one beside it here).
    let err = refusal(&*open(
        &format!("etcds://127.0.0.1:{plain_port}"),
        &tmp.join("host"),
    ));
    assert!(
        err.contains("if this etcd port is plaintext, use etcd://"),
        "{err}"
    );

    // The fleet host still works after all that.
    fleet.withdraw("memserver@a").unwrap();
    assert!(names(&*fleet).is_empty());
    drop(_etcd);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A source and a destination racing for the same claim over `r` (the
/// take-back against the take-over of every mode's switch): each round
/// exactly one wins, and the record names the winner.
fn ownership_race(r: Arc<dyn Registry>) {
    use ferry_registry::ownership::{Holder, Owners, Step};
    let owners = Owners::new(r);
    let src = Holder::this_process("h1");
    let mut c = owners.step("vm-race", &Step::Boot, &src).unwrap();
    for round in 0..20 {
        let dst = Holder::this_process("h2");
        let (o1, o2) = (owners.clone(), owners.clone());
        let (f1, f2, s, d) = (c.clone(), c.clone(), c.holder.clone(), dst.clone());
        let back = std::thread::spawn(move || o1.step("vm-race", &Step::TakeBack(f1), &s));
        let over = std::thread::spawn(move || o2.step("vm-race", &Step::TakeOver(f2), &d));
        let (back, over) = (back.join().unwrap(), over.join().unwrap());
        assert!(
            back.is_ok() != over.is_ok(),
            "round {round}: {back:?} {over:?}"
        );
        let won = back.or(over).unwrap();
        assert_eq!(won.epoch, c.epoch + 1);
        let rec = owners.record("vm-race").unwrap().unwrap();
        assert_eq!(rec.holder.as_ref(), Some(&won.holder));
        c = won;
    }
    owners.step("vm-race", &Step::Release(c), &src).ok();
}
