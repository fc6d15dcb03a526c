//! The host registry with real processes: `ferry memserver` advertises
//! itself, `ferry hosts` lists it with the room it has left as pages land,
//! a stopped server withdraws, a killed one disappears when its entry
//! expires. Once with the embedded registry, once with a real etcd started
//! here (Debian's etcd-server; scripts/setup.sh installs it) that speaks
//! mutual TLS: `etcds://`, this host's credentials from `FERRY_TLS_DIR`.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ferry, free_port, wait_listening};
use ferry_migration::memserver::{StoreClient, StoreOpen, StoreSecret};
use ferry_migration::Endpoint;
use serde_json::Value;

/// Kills a child when dropped (a failing test leaves no server behind).
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ferry` with this host's credentials in `tls` (for an etcds:// registry).
fn ferry_cmd(tls: Option<&Path>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.envs(tls.map(|d| (ferry_tls::TLS_DIR_ENV, d)));
    c
}

fn hosts(registry: &str, tls: Option<&Path>) -> Vec<Value> {
    let out = ferry_cmd(tls)
        .args(["hosts", "--registry", registry, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ferry hosts: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Vec<Value>>(&out.stdout).unwrap()
}

/// Waits until `ferry hosts` satisfies `ok`; returns what it listed.
fn until(
    registry: &str,
    tls: Option<&Path>,
    within: Duration,
    what: &str,
    ok: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + within;
    loop {
        let h = hosts(registry, tls);
        if ok(&h) {
            return h;
        }
        assert!(
            Instant::now() < deadline,
            "registry {registry}: {what} within {within:?}; it lists {h:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn start_memserver(registry: &str, tls: Option<&Path>, port: u16, name: &str) -> Reap {
    let child = ferry_cmd(tls)
        .args([
            "memserver",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--capacity",
            "16M",
        ])
        .args(["--registry", registry, "--name", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port, Duration::from_secs(10));
    Reap(child)
}

/// What every registry must do.
fn exercise(registry: &str, tls: Option<&Path>) {
    // This process talks to the memory servers itself (StoreClient), over
    // TLS as the host whose credentials they run with: one test at a time,
    // since a process has one identity.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    common::fleet();
    let dir: std::path::PathBuf = match tls {
        Some(d) => d.into(),
        None => std::env::var_os("FERRY_TLS_DIR").unwrap().into(),
    };
    ferry_migration::transport::install(ferry_migration::transport::Security::Tls(
        ferry_tls::Credentials::load(&dir).unwrap(),
    ));
    let (p1, p2) = (free_port(), free_port());
    let mut a = start_memserver(registry, tls, p1, "ms-a");
    let _b = start_memserver(registry, tls, p2, "ms-b");
    let listed = until(
        registry,
        tls,
        Duration::from_secs(10),
        "both servers listed",
        |h| h.len() >= 2,
    );
    let a_entry = listed.iter().find(|h| h["name"] == "ms-a").unwrap();
    assert_eq!(a_entry["kind"], "memserver");
    assert_eq!(a_entry["addr"], format!("127.0.0.1:{p1}"));
    assert_eq!(a_entry["capacity"], 16 << 20);
    // 1 MiB of pages lands on ms-a: its free room goes down in the registry.
    let at = Endpoint::Tcp(format!("127.0.0.1:{p1}").parse().unwrap());
    let open = StoreOpen {
        vm: "t".into(),
        regions: vec![(0, 4 << 20)],
        reserve_pages: 256,
        secret: StoreSecret::random().unwrap(),
    };
    let (mut c, _) = StoreClient::open(&at, Duration::from_secs(5), &open).unwrap();
    let gpas: Vec<u64> = (0..256u64).map(|i| i * 4096).collect();
    c.put(&gpas, &vec![7u8; 256 * 4096]).unwrap();
    assert_eq!(c.sync().unwrap().held_pages, 256);
    until(
        registry,
        tls,
        Duration::from_secs(10),
        "ms-a's free room updated",
        |h| {
            h.iter()
                .any(|e| e["name"] == "ms-a" && e["free"] == (15u64 << 20))
        },
    );
    drop(c);
    // SIGTERM: ms-a withdraws at once.
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(a.0.id() as i32, libc::SIGTERM) };
    let _ = a.0.wait();
    until(
        registry,
        tls,
        Duration::from_secs(3),
        "ms-a withdrawn",
        |h| !h.iter().any(|e| e["name"] == "ms-a") && h.iter().any(|e| e["name"] == "ms-b"),
    );
    // SIGKILL: ms-b cannot withdraw; its entry expires (5 s TTL).
    drop(_b);
    let t = Instant::now();
    until(
        registry,
        tls,
        Duration::from_secs(15),
        "ms-b expired",
        |h| !h.iter().any(|e| e["name"] == "ms-b"),
    );
    eprintln!(
        "{registry}: a killed server disappeared after {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn embedded_registry_lists_advertises_and_forgets() {
    let dir = std::env::temp_dir().join(format!("ferry-registry-test-{}", std::process::id()));
    let _scratch = common::Scratch(dir.clone());
    let _ = std::fs::remove_dir_all(&dir);
    exercise(&format!("dir:{}", dir.display()), None);
    // A bad address is a clear error.
    let out = ferry(&["hosts", "--registry", "zookeeper://x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("etcd://HOST:PORT"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_etcds_registry_without_credentials_names_the_directory() {
    let dir = std::env::temp_dir().join(format!("ferry-no-tls-{}", std::process::id()));
    let _scratch = common::Scratch(dir.clone());
    let out = ferry_cmd(Some(&dir))
        .args(["hosts", "--registry", "etcds://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("speaks TLS")
            && err.contains(&format!("no TLS credentials in {}", dir.display())),
        "{err}"
    );
}

#[test]
fn etcd_registry_lists_advertises_and_forgets() {
    let Ok(path) = which("etcd") else {
        eprintln!("SKIP: no etcd binary (apt install etcd-server; scripts/setup.sh does): this test needs a real etcd");
        return;
    };
    let (client, peer) = (free_port(), free_port());
    let tmp = std::env::temp_dir().join(format!("ferry-etcd-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    // The fleet's CA, etcd's certificate (naming the address it is dialed
    // at) and this host's, as `ferry pki` makes them.
    let (ca, server, host) = (tmp.join("ca"), tmp.join("etcd"), tmp.join("host"));
    let days = || ferry_tls::pki::Validity::days(1);
    ferry_tls::pki::init_ca(&ca, "test fleet", days()).unwrap();
    ferry_tls::pki::issue(&ca, "etcd", &server, &["127.0.0.1".into()], days()).unwrap();
    ferry_tls::pki::issue(&ca, "host", &host, &["127.0.0.1".into()], days()).unwrap();
    let file = |d: &Path, f: &str| d.join(f).display().to_string();
    let url = |scheme: &str, p: u16| format!("{scheme}://127.0.0.1:{p}");
    let etcd = Command::new(path)
        .args(["--name", "ferry-test", "--data-dir", &file(&tmp, "data")])
        .args([
            "--listen-client-urls",
            &url("https", client),
            "--advertise-client-urls",
            &url("https", client),
        ])
        .args(["--cert-file", &file(&server, "cert.pem")])
        .args(["--key-file", &file(&server, "key.pem")])
        .args(["--trusted-ca-file", &file(&server, "ca.pem")])
        .arg("--client-cert-auth")
        .args([
            "--listen-peer-urls",
            &url("http", peer),
            "--initial-advertise-peer-urls",
            &url("http", peer),
        ])
        .args([
            "--initial-cluster",
            &format!("ferry-test={}", url("http", peer)),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _etcd = Reap(etcd);
    wait_listening(client, Duration::from_secs(20));
    let registry = format!("etcds://127.0.0.1:{client}");
    // etcd answers before it has a leader: wait until a read works.
    let deadline = Instant::now() + Duration::from_secs(20);
    let list = || {
        ferry_cmd(Some(&host))
            .args(["hosts", "--registry", &registry])
            .output()
            .unwrap()
    };
    while !list().status.success() {
        assert!(
            Instant::now() < deadline,
            "etcd never answered: {}",
            String::from_utf8_lossy(&list().stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    exercise(&registry, Some(&host));
    let _ = std::fs::remove_dir_all(&tmp);
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([
            std::path::PathBuf::from("/usr/bin"),
            std::path::PathBuf::from("/usr/sbin"),
        ])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}
