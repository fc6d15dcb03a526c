//! Fleet operations across lab hosts (issue 33): an agent on each host,
//! VMs started through them, a host drained while a destination's agent is
//! dead (its moves go elsewhere), an agent restarted under running VMs
//! (adopted), and a host upgraded in place (zero-copy handovers). No VM is
//! lost, every move passes --verify, and every guest keeps counting.

mod common;
use common::lab::{in_host, lab_up, lab_up_n, tls_etcd_on_h3};
use common::{kvm_usable, progress, wait_status};

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An agent on a lab host, killed when dropped (its VMs run on).
struct AgentProc(Child);

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Ends every VMM the test's agents started (they outlive the agents).
struct VmReaper(String);

impl Drop for VmReaper {
    fn drop(&mut self) {
        let _ = Command::new("pkill").args(["-f", &self.0]).status();
    }
}

/// Starts the agent of lab host `n` offering `mem`, and waits until it is
/// registered (its `--json` line).
fn agent(n: u32, registry: &str, state: &std::path::Path, mem: &str, extra: &[&str]) -> AgentProc {
    let host = format!("ferry-h{n}");
    let listen = format!("10.77.0.{n}:7700");
    let mut c = in_host(
        &host,
        &[
            "agent",
            "--name",
            &host,
            "--listen",
            &listen,
            "--registry",
            registry,
            "--mem",
            mem,
            "--state-dir",
            state.join(&host).to_str().unwrap(),
            "--json",
        ],
    )
    .args(extra)
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut line = String::new();
    BufReader::new(c.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("agent {host} did not start ({e}): {line:?}"));
    assert_eq!(ready["tls"], true, "{ready}");
    AgentProc(c)
}

/// `ferry ARGS --registry R --json` as the operator (on ferry-h3, with its
/// fleet certificate); the parsed output, or the error.
fn op(registry: &str, args: &[&str]) -> Result<serde_json::Value, String> {
    let o = in_host("ferry-h3", args)
        .args(["--registry", registry, "--json"])
        .output()
        .unwrap();
    let out = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    if o.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "ferry {args:?}: {}{out}",
            String::from_utf8_lossy(&o.stderr)
        ))
    }
}

/// A VM as `ferry vm list` shows it: name, VMM pid, state, control socket.
type Vm = (String, u64, String, String);

/// Each host's VMs, from `ferry vm list`.
fn vms_by_host(registry: &str) -> Vec<(String, Vec<Vm>)> {
    let list = op(registry, &["vm", "list"]).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .map(|h| {
            let host = &h["host"];
            let vms = host["vms"]
                .as_array()
                .map(|v| {
                    v.iter()
                        .map(|vm| {
                            (
                                vm["spec"]["name"].as_str().unwrap().to_string(),
                                vm["pid"].as_u64().unwrap(),
                                vm["state"].as_str().unwrap().to_string(),
                                vm["socket"].as_str().unwrap().to_string(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            (host["name"].as_str().unwrap().to_string(), vms)
        })
        .collect()
}

fn vms_on(registry: &str, host: &str) -> Vec<Vm> {
    vms_by_host(registry)
        .into_iter()
        .find(|(h, _)| h == host)
        .map(|(_, v)| v)
        .unwrap_or_default()
}

/// Waits until every VM of `vms` counts on past `before` (name → count).
/// Waits (at most 30 s) until a drain in the registry has a move under
/// way; `what` names the drain in the failure.
fn wait_for_a_move(registry: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let d = op(registry, &["hosts", "--drains"]).unwrap();
        let moving = d["drains"].as_array().is_some_and(|ds| {
            ds.iter().any(|d| {
                d["moves"]
                    .as_array()
                    .is_some_and(|ms| ms.iter().any(|m| m["state"] == "moving"))
            })
        });
        if moving {
            return;
        }
        assert!(Instant::now() < deadline, "{what} never moved: {d}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn still_counting(vms: &[Vm], before: &[(String, u64)]) {
    for (name, _, _, socket) in vms {
        let Some((_, b)) = before.iter().find(|(n, _)| n == name) else {
            continue;
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = progress(&wait_status(socket));
            if now > *b {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "VM {name} stopped counting at {now}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn a_host_is_drained_through_its_agents_and_upgraded_in_place_and_no_vm_is_lost() {
    if !kvm_usable() {
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let registry = format!("dir:{}", dir.join("registry").display());
    let reg = registry.as_str();
    let _a1 = agent(1, reg, &dir, "1G", &[]);
    let mut a2 = agent(2, reg, &dir, "1G", &[]);
    // ferry-h3 offers the most room, but its VMMs cannot start (a broken
    // install: its ferry is /bin/false).
    let _a3 = agent(3, reg, &dir, "2G", &["--binary", "/bin/false"]);

    // Three VMs on ferry-h1, through its agent.
    for (name, workload, vcpus) in [
        ("web", "compute+dirty:rate=32,wss=32", "1"),
        ("batch", "compute", "2"),
        ("quiet", "compute:tasks=1", "1"),
    ] {
        op(
            reg,
            &[
                "vm",
                "start",
                name,
                "--host",
                "ferry-h1",
                "--mem",
                "128M",
                "--vcpus",
                vcpus,
                "--workload",
                workload,
            ],
        )
        .unwrap();
    }
    let on_h1 = vms_on(reg, "ferry-h1");
    assert_eq!(on_h1.len(), 3, "{on_h1:?}");
    assert!(on_h1.iter().all(|v| v.2 == "running"), "{on_h1:?}");
    let e = op(reg, &["vm", "start", "web", "--host", "ferry-h2"]).unwrap_err();
    assert!(e.contains("runs on ferry-h1 already"), "{e}");
    // Every VM an agent runs is fenced through the fleet's registry under
    // its name (docs/safety.md).
    for (name, _, _, socket) in &on_h1 {
        let owner = &wait_status(socket)["owner"];
        assert_eq!(
            (owner["vm"].as_str(), owner["state"].as_str()),
            (Some(name.as_str()), Some("holding")),
            "{owner}"
        );
        assert_eq!(owner["epoch"], 1, "{owner}");
    }
    let before: Vec<(String, u64)> = on_h1
        .iter()
        .map(|(n, _, _, s)| (n.clone(), progress(&wait_status(s))))
        .collect();

    // The plan sends VMs to ferry-h3 (the most room); those moves fail
    // before anything moves (no VMM there to receive them), and the VMs go
    // to ferry-h2 instead.
    let plan = op(reg, &["drain", "ferry-h1", "--dry-run"]).unwrap();
    assert_eq!(plan["moves"].as_array().unwrap().len(), 3, "{plan}");
    assert_eq!(plan["moves"][0]["to"], "ferry-h3", "{plan}");
    let report = op(reg, &["drain", "ferry-h1", "--verify"]).unwrap();
    let moves = report["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 3, "{report}");
    for m in moves {
        assert_eq!(m["state"], "done", "{m}");
        assert_eq!(m["to"], "ferry-h2", "{m}");
        assert!(m["downtime_ms"].as_f64().unwrap() > 0.0, "{m}");
        // --verify: every move says how many pages it compared.
        assert!(m["verified_pages"].as_u64().unwrap() > 0, "{m}");
    }
    assert!(
        moves.iter().any(|m| m["errors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("to ferry-h3"))),
        "the broken host was tried and given up: {report}"
    );
    assert!(vms_on(reg, "ferry-h1").is_empty(), "ferry-h1 emptied");
    let on_h2 = vms_on(reg, "ferry-h2");
    assert_eq!(on_h2.len(), 3, "no VM lost or doubled: {on_h2:?}");
    still_counting(&on_h2, &before);
    // Each arrived VM took its claim from its source's, one epoch on.
    for (_, _, _, socket) in &on_h2 {
        let owner = &wait_status(socket)["owner"];
        assert_eq!(
            (owner["state"].as_str(), owner["epoch"].as_u64()),
            (Some("holding"), Some(2)),
            "{owner}"
        );
    }

    // ferry-h2's agent dies under its VMs: they run on, and its next start
    // adopts them.
    let _ = a2.0.kill();
    let _ = a2.0.wait();
    for (name, pid, _, socket) in &on_h2 {
        assert_eq!(
            wait_status(socket)["pid"].as_u64(),
            Some(*pid),
            "VM {name} runs on without its agent"
        );
    }
    std::thread::sleep(Duration::from_secs(6)); // its lease runs out
    let h = op(reg, &["hosts", "--drains"]).unwrap();
    assert!(
        h["dead"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["name"] == "ferry-h2"),
        "a host whose lease lapsed is reported dead: {h}"
    );
    a2 = agent(2, reg, &dir, "1G", &[]);
    let adopted = vms_on(reg, "ferry-h2");
    let mut names: Vec<&str> = adopted.iter().map(|v| v.0.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["batch", "quiet", "web"], "adopted: {adopted:?}");

    // An upgrade to a binary that cannot run: the first handover fails
    // before its commit point, the VM stays with its old process, and the
    // upgrade stops there.
    let e = op(reg, &["upgrade", "ferry-h2", "--binary", "/bin/false"]).unwrap_err();
    assert!(e.contains("\"error\""), "{e}");
    let kept = vms_on(reg, "ferry-h2");
    for (name, pid, state, _) in &kept {
        let was = adopted.iter().find(|v| &v.0 == name).unwrap();
        assert_eq!(
            (pid, state.as_str()),
            (&was.1, "running"),
            "VM {name} kept its process"
        );
    }

    // ferry-h2 upgraded in place: each VM under a new VMM process, no guest
    // memory copied, still counting.
    let mid: Vec<(String, u64)> = adopted
        .iter()
        .map(|(n, _, _, s)| (n.clone(), progress(&wait_status(s))))
        .collect();
    let up = op(reg, &["upgrade", "ferry-h2", "--parallel", "3"]).unwrap();
    let handed = up["vms"].as_array().unwrap();
    assert_eq!(handed.len(), 3, "{up}");
    for r in handed {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["copied_bytes"], 0, "{r}");
        assert_ne!(r["new_pid"], r["old_pid"], "{r}");
        // The handover's own account comes with it, and it is the one the
        // report's figures were taken from.
        let h = &r["handover"];
        assert_eq!(h["downtime_ms"], r["downtime_ms"], "{r}");
        assert_eq!(h["memory_bytes_copied"], 0, "{r}");
        assert_eq!(h["new_pid"], r["new_pid"], "{r}");
        assert!(
            h["save_ms"].as_f64().unwrap() <= h["downtime_ms"].as_f64().unwrap(),
            "{r}"
        );
    }
    let after = vms_on(reg, "ferry-h2");
    for (name, pid, state, _) in &after {
        assert_eq!(state, "running", "{name}");
        let r = handed.iter().find(|r| r["vm"] == name.as_str()).unwrap();
        assert_eq!(Some(*pid), r["new_pid"].as_u64(), "{name}: {r}");
    }
    still_counting(&after, &mid);

    // A drain of ferry-h2 is killed while its first move is under way; a
    // second drain finds its record, settles the move in flight and moves
    // the rest: every VM ends on ferry-h1 (ferry-h3 still cannot take
    // any), each exactly once, none left waiting anywhere.
    let counts: Vec<(String, u64)> = after
        .iter()
        .map(|(n, _, _, s)| (n.clone(), progress(&wait_status(s))))
        .collect();
    let mut first = in_host(
        "ferry-h3",
        &[
            "drain",
            "ferry-h2",
            "--per-host",
            "1",
            "--registry",
            reg,
            "--json",
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_a_move(reg, "the first drain");
    let _ = first.kill();
    let _ = first.wait();
    let e = op(reg, &["drain", "ferry-h2"]).unwrap_err();
    assert!(
        e.contains("a drain of ferry-h2 is running"),
        "refused while its record is fresh: {e}"
    );
    std::thread::sleep(Duration::from_secs(11)); // its record goes stale
    let resumed = op(reg, &["drain", "ferry-h2"]).unwrap();
    assert!(
        resumed["moves"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["state"] == "done"),
        "{resumed}"
    );
    let by_host = vms_by_host(reg);
    let mut seen: Vec<&str> = by_host
        .iter()
        .flat_map(|(_, vms)| vms.iter().map(|v| v.0.as_str()))
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, ["batch", "quiet", "web"], "each VM once: {by_host:?}");
    let after = vms_on(reg, "ferry-h1");
    assert_eq!(after.len(), 3, "{by_host:?}");
    assert!(after.iter().all(|v| v.2 == "running"), "{after:?}");
    still_counting(&after, &counts);
    assert!(
        op(reg, &["hosts", "--drains"]).unwrap()["drains"]
            .as_array()
            .unwrap()
            .is_empty(),
        "the drain's record went with it"
    );

    // Stopped through the fleet, each VM's VMM ends.
    for (name, pid, _, _) in &after {
        op(reg, &["vm", "stop", name]).unwrap();
        // SAFETY: kill with signal 0 only asks whether the process exists.
        assert_ne!(unsafe { libc::kill(*pid as i32, 0) }, 0, "VM {name} ended");
    }
    assert!(vms_on(reg, "ferry-h1").is_empty());
    drop(a2);
}

/// A VM that no host can take whole (issue 33's "fits nowhere"): the drain
/// splits it, its main host holding what it has room for and a memory
/// server started on another host holding the rest; it passes --verify,
/// counts on, and stopping it ends its memory server too.
#[test]
fn a_vm_that_fits_nowhere_whole_is_drained_split_and_stopped_with_its_memory_server() {
    if !kvm_usable() {
        return;
    }
    if let Err(e) = ferry_memory::Userfaultfd::new(ferry_memory::Features {
        missing_shmem: true,
        wp_shmem: true,
        ..Default::default()
    }) {
        eprintln!("SKIP: split needs userfaultfd MISSING+WP on memfd: {e}");
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet-split");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let registry = format!("dir:{}", dir.join("registry").display());
    let reg = registry.as_str();
    let _a1 = agent(1, reg, &dir, "2G", &[]);
    let _a2 = agent(2, reg, &dir, "512M", &[]);
    let _a3 = agent(3, reg, &dir, "512M", &[]);
    op(
        reg,
        &[
            "vm",
            "start",
            "big",
            "--host",
            "ferry-h1",
            "--mem",
            "768M",
            "--workload",
            "compute+dirty:rate=16,wss=64",
        ],
    )
    .unwrap();
    let before = vms_on(reg, "ferry-h1");
    let counted = vec![("big".to_string(), progress(&wait_status(&before[0].3)))];
    let plan = op(reg, &["drain", "ferry-h1", "--dry-run"]).unwrap();
    assert_eq!(plan["moves"][0]["mode"], "split", "{plan}");
    let report = op(reg, &["drain", "ferry-h1", "--verify"]).unwrap();
    let m = &report["moves"][0];
    assert_eq!(m["state"], "done", "{report}");
    assert_eq!(m["mode"], "split", "{report}");
    let main = m["to"].as_str().unwrap().to_string();
    let on_main = vms_on(reg, &main);
    assert_eq!(on_main.len(), 1, "{on_main:?}");
    still_counting(&on_main, &counted);
    let list = op(reg, &["vm", "list"]).unwrap();
    let stores: Vec<serde_json::Value> = list
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|h| h["host"]["stores"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(stores.len(), 1, "{list}");
    assert_eq!(stores[0]["vm"], "big");
    let store_pid = stores[0]["pid"].as_u64().unwrap();
    let stopped = op(reg, &["vm", "stop", "big"]).unwrap();
    assert_eq!(
        stopped["stores_stopped_on"].as_array().unwrap().len(),
        1,
        "{stopped}"
    );
    // SAFETY: kill with signal 0 only asks whether the process exists.
    let alive = unsafe { libc::kill(store_pid as i32, 0) } == 0;
    assert!(!alive, "the memory server ended");
}

/// A kv VM with its own address under 128 clients is drained off its host
/// while the clients keep sending: its address and their connections move
/// with it, no request fails or gets a wrong value, and it passes --verify.
/// The fleet is in a real etcd over mutual TLS (the lab CA's certificates).
#[test]
fn a_kv_vm_under_128_clients_is_drained_through_an_etcd_fleet_without_an_error() {
    if !kvm_usable() {
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet-kv");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let Some((etcd, registry)) = tls_etcd_on_h3(&dir) else {
        eprintln!("SKIP: no etcd binary (apt install etcd-server; scripts/setup.sh does)");
        return;
    };
    let mut etcd = AgentProc(etcd);
    let reg = registry.as_str();
    // etcd may still be electing itself: agents start once it answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    while op(reg, &["hosts"]).is_err() {
        assert!(Instant::now() < deadline, "etcd never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
    let _a1 = agent(1, reg, &dir, "2G", &[]);
    let _a2 = agent(2, reg, &dir, "2G", &[]);
    let svc = "10.77.0.100:7100";
    op(
        reg,
        &[
            "vm",
            "start",
            "kv",
            "--host",
            "ferry-h1",
            "--mem",
            "512M",
            "--vcpus",
            "2",
            "--workload",
            "kv:workers=4,keys=65536,value=1024",
            "--vm-address",
            "10.77.0.100",
            "--serve",
            svc,
        ],
    )
    .unwrap();
    let socket = vms_on(reg, "ferry-h1")[0].3.clone();
    let load = in_host(
        "ferry-h3",
        &[
            "load",
            "--target",
            svc,
            "--clients",
            "128",
            "--duration",
            "15s",
            "--json",
            "--quiet",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress(&wait_status(&socket)) < 1000 {
        assert!(Instant::now() < deadline, "the VM never served the load");
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    let report = op(reg, &["drain", "ferry-h1", "--verify"]).unwrap();
    let m = &report["moves"][0];
    assert_eq!(
        (m["state"].as_str(), m["to"].as_str()),
        (Some("done"), Some("ferry-h2")),
        "{report}"
    );
    // The load ends by itself after its 15 s.
    let out = load.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["wrong_values"], 0, "{v}");
    assert!(v["requests"].as_u64().unwrap_or(0) > 1000, "{v}");
    assert!(
        vms_on(reg, "ferry-h1").is_empty(),
        "its clients moved with it: no VMM stays behind forwarding them"
    );
    let on_h2 = vms_on(reg, "ferry-h2");
    assert_eq!(on_h2.len(), 1);
    // Its agent says how it came (the mode the drain chose).
    let list = op(reg, &["vm", "list"]).unwrap();
    let came_by: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|h| h["host"]["vms"].as_array().cloned().unwrap_or_default())
        .map(|v| v["came_by"].as_str().unwrap_or("").to_string())
        .collect();
    let mode = m["mode"].as_str().unwrap();
    assert_eq!(came_by, [format!("migrated by {mode}")], "{list}");
    let served = progress(&wait_status(&on_h2[0].3));
    assert!(served > 1000, "the VM served on at ferry-h2: {served}");
    let _ = etcd.0.kill();
}

/// A destination's agent killed in the middle of a drain: the move under
/// way ends (its VMM needs no agent) and the next one, which that agent
/// can no longer prepare, fails and leaves its VM running on the source;
/// the agent's next start adopts the VM that arrived. No VM is lost.
#[test]
fn a_destination_agent_killed_mid_drain_loses_no_vm() {
    if !kvm_usable() {
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet-dest");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let registry = format!("dir:{}", dir.join("registry").display());
    let reg = registry.as_str();
    let _a1 = agent(1, reg, &dir, "2G", &[]);
    let mut a2 = agent(2, reg, &dir, "2G", &[]);
    for name in ["first", "second"] {
        op(
            reg,
            &[
                "vm",
                "start",
                name,
                "--host",
                "ferry-h1",
                "--mem",
                "256M",
                "--workload",
                "compute+dirty:rate=32,wss=96",
            ],
        )
        .unwrap();
    }
    let before: Vec<(String, u64)> = vms_on(reg, "ferry-h1")
        .iter()
        .map(|(n, _, _, s)| (n.clone(), progress(&wait_status(s))))
        .collect();
    let drain = in_host(
        "ferry-h3",
        &[
            "drain",
            "ferry-h1",
            "--per-host",
            "1",
            "--retries",
            "0",
            "--registry",
            reg,
            "--json",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    // Once the first move is under way, ferry-h2's agent dies.
    wait_for_a_move(reg, "the drain");
    let _ = a2.0.kill();
    let _ = a2.0.wait();
    let out = drain.wait_with_output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let states: Vec<&str> = report["moves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["done", "failed"], "{report}");
    assert!(!out.status.success(), "the host was not emptied");
    // The VM that stayed runs on at the source.
    let stayed = vms_on(reg, "ferry-h1");
    assert_eq!(stayed.len(), 1, "{stayed:?}");
    // The one that moved runs at the destination; the agent's next start
    // adopts it.
    std::thread::sleep(Duration::from_secs(6)); // its lease runs out
    a2 = agent(2, reg, &dir, "2G", &[]);
    let arrived = vms_on(reg, "ferry-h2");
    assert_eq!(arrived.len(), 1, "{arrived:?}");
    assert_ne!(arrived[0].0, stayed[0].0);
    let both: Vec<Vm> = stayed.into_iter().chain(arrived).collect();
    assert!(both.iter().all(|v| v.2 == "running"), "{both:?}");
    still_counting(&both, &before);
    drop(a2);
}

/// Issue 33: a drain's postcopy move gets a standby on a third host.
/// ferry-h1's VM moves to another host by postcopy at 16 MB/s (its 384 MiB
/// of data take 24 s to push); once the standby on the third host holds
/// what the destination lacks, the source VMM is killed (SIGKILL). The drain
/// counts the move done, the VM runs at its destination and counts on, and
/// its VMM there finished the move with every page verified against the
/// source's hashes.
#[test]
fn a_source_vmm_killed_mid_postcopy_drain_is_survived_from_the_standby() {
    if !kvm_usable() {
        return;
    }
    let Some(_lab) = lab_up() else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet-net");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let registry = format!("dir:{}", dir.join("registry").display());
    let reg = registry.as_str();
    let _agents: Vec<AgentProc> = (1..=3).map(|n| agent(n, reg, &dir, "2G", &[])).collect();
    op(
        reg,
        &[
            "vm",
            "start",
            "fast",
            "--host",
            "ferry-h1",
            "--mem",
            "512M",
            "--workload",
            "dirty:rate=32,wss=16,pattern=random+fill:content=worst,mib=384",
        ],
    )
    .unwrap();
    let (_, pid, _, socket) = vms_on(reg, "ferry-h1").remove(0);
    // The fill is done before the move (its pages are the push).
    let deadline = Instant::now() + Duration::from_secs(60);
    while wait_status(&socket)["metrics"]["workloads"][1]["tasks_done"].as_u64() != Some(1) {
        assert!(Instant::now() < deadline, "the fill never finished");
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = vec![("fast".to_string(), progress(&wait_status(&socket)))];
    let drain = in_host(
        "ferry-h3",
        &[
            "drain",
            "ferry-h1",
            "--mode",
            "postcopy",
            "--verify",
            "--bandwidth",
            "16M",
            // The source pushes (paced) while the standby stands by; by
            // default it would hand the move over once the standby held
            // every page, and wait as its backup.
            "--source-finishes",
            "--retries",
            "0",
            "--registry",
            reg,
            "--json",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // The switch: the source pauses for good; the standby's copy (not
    // paced) takes a second or two of the lab's links.
    let deadline = Instant::now() + Duration::from_secs(60);
    while wait_status(&socket)["state"] != "paused" {
        assert!(Instant::now() < deadline, "the move never switched");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(4));
    let killed = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = drain.wait_with_output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let m = &report["moves"][0];
    assert_eq!(
        m["state"],
        "done",
        "{report} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The destination and the standby are the other two hosts.
    let to = m["to"].as_str().unwrap().to_string();
    let standby = m["standby"].as_str().unwrap_or_default();
    assert!(
        to != "ferry-h1" && !standby.is_empty() && standby != to && standby != "ferry-h1",
        "{m}"
    );
    assert!(vms_on(reg, "ferry-h1").is_empty());
    let arrived = vms_on(reg, &to);
    assert_eq!(arrived.len(), 1, "{arrived:?}");
    still_counting(&arrived, &before);
    // The standby finished the move: the destination took every page and
    // matched it against the source's hash. (Stopped by the drain once the
    // move's source was gone, it ends when that move does.)
    let log = dir.join(standby).join("stores").join("fast.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("finished from here") {
            assert!(
                text.contains("1 finished from here (131072 pages verified"),
                "{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the move never finished: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Issue 33's system test: four lab hosts with an agent each and the fleet
/// in etcd over mutual TLS; six VMs of mixed kinds on ferry-h1 (kv under
/// 128 clients through its own address, one dirtying faster than the link
/// carries, an idle one, sort, memtouch, and one no other host can take
/// whole). `ferry drain ferry-h1 --verify` is killed in the middle and run
/// again: it resumes and empties ferry-h1, no VM lost or doubled, the split
/// VM over a main host and a memory server, every guest still counting and
/// the kv clients without an error. Then `ferry upgrade ferry-h2`: every VM
/// there under a new VMM process, 0 bytes of guest memory copied.
#[test]
fn six_mixed_vms_are_drained_off_a_host_resumed_after_a_crash_and_upgraded() {
    if !kvm_usable() {
        return;
    }
    if ferry_memory::Userfaultfd::new(ferry_memory::Features {
        missing_shmem: true,
        wp_shmem: true,
        ..Default::default()
    })
    .is_err()
    {
        eprintln!("SKIP: postcopy and split need userfaultfd MISSING+WP on memfd");
        return;
    }
    let Some(_lab) = lab_up_n(4) else { return };
    let (dir, _scratch) = common::Scratch::new("ferry-fleet-six");
    let _vms = VmReaper(dir.to_str().unwrap().to_string());
    let Some((etcd, registry)) = tls_etcd_on_h3(&dir) else {
        eprintln!("SKIP: no etcd binary (apt install etcd-server; scripts/setup.sh does)");
        return;
    };
    let mut etcd = AgentProc(etcd);
    let reg = registry.as_str();
    let deadline = Instant::now() + Duration::from_secs(30);
    while op(reg, &["hosts"]).is_err() {
        assert!(Instant::now() < deadline, "etcd never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Each host says its link is 1 Gbit/s: the drain weighs dirty rates
    // against it.
    let link = ["--link", "1gbit"];
    let _a1 = agent(1, reg, &dir, "4G", &link);
    let _others: Vec<AgentProc> = (2..=4).map(|n| agent(n, reg, &dir, "1G", &link)).collect();
    let svc = "10.77.0.100:7100";
    let vms: [(&str, &str, &str, &[&str]); 6] = [
        ("big", "1152M", "compute+dirty:rate=16,wss=64", &[]),
        (
            "kv",
            "256M",
            "kv:workers=4,keys=32768,value=1024",
            &["--vm-address", "10.77.0.100", "--serve", svc],
        ),
        ("fast", "256M", "dirty:rate=256,wss=128,pattern=random", &[]),
        // compute first: the counter the test watches (sort and memtouch
        // finish their jobs).
        ("sort", "256M", "compute+sort:mib=32", &[]),
        (
            "touch",
            "256M",
            "compute+memtouch:tasks=2,mib=32,after=migrate",
            &[],
        ),
        ("quiet", "128M", "idle", &[]),
    ];
    for (name, mem, workload, extra) in vms {
        let mut args = vec![
            "vm",
            "start",
            name,
            "--host",
            "ferry-h1",
            "--mem",
            mem,
            "--workload",
            workload,
        ];
        args.extend_from_slice(extra);
        op(reg, &args).unwrap();
    }
    let socket_of = |host: &str, vm: &str| {
        vms_on(reg, host)
            .into_iter()
            .find(|v| v.0 == vm)
            .map(|v| v.3)
            .unwrap()
    };
    let load = in_host(
        "ferry-h4",
        &[
            "load",
            "--target",
            svc,
            "--clients",
            "128",
            "--duration",
            "45s",
            "--json",
            "--quiet",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress(&wait_status(&socket_of("ferry-h1", "kv"))) < 1000 {
        assert!(Instant::now() < deadline, "the kv VM never served the load");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The guests that count: all but the idle one.
    let counting = ["big", "kv", "fast", "sort", "touch"];
    let before: Vec<(String, u64)> = counting
        .iter()
        .map(|n| {
            (
                n.to_string(),
                progress(&wait_status(&socket_of("ferry-h1", n))),
            )
        })
        .collect();
    let plan = op(reg, &["drain", "ferry-h1", "--dry-run"]).unwrap();
    let modes: Vec<(String, String)> = plan["moves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["vm"].as_str().unwrap().into(),
                m["mode"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert!(modes.contains(&("big".into(), "split".into())), "{plan}");
    // The mode follows the dirty rate the drain measured. On two busy
    // cores the fast guest may get too little CPU to dirty at its rate: it
    // then goes by hybrid, and the plan must say what it measured.
    if !modes.contains(&("fast".into(), "postcopy".into())) {
        let why = plan["moves"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["vm"] == "fast")
            .map(|m| m["why"].as_str().unwrap_or("").to_string())
            .unwrap_or_default();
        assert!(
            why.starts_with("hybrid: it dirties"),
            "the fast VM's rate was not measured: {plan}"
        );
        eprintln!("NOTE: the fast VM was starved of CPU on this machine: {why}");
    }

    // The first drain dies with a move under way.
    let mut first = in_host(
        "ferry-h4",
        &["drain", "ferry-h1", "--verify", "--registry", reg, "--json"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let d = op(reg, &["hosts", "--drains"]).unwrap();
        let done = d["drains"]
            .as_array()
            .and_then(|ds| ds.first())
            .map_or(0, |d| {
                d["moves"]
                    .as_array()
                    .map_or(0, |ms| ms.iter().filter(|m| m["state"] == "done").count())
            });
        if done >= 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the first drain never finished a move: {d}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = first.kill();
    let _ = first.wait();
    std::thread::sleep(Duration::from_secs(11)); // its record goes stale
    let resumed = op(reg, &["drain", "ferry-h1", "--verify"]).unwrap();
    // A move the dead drain left under way is settled, and what it verified
    // comes from its source's agent (the dead drain never heard).
    let settled = resumed["settled"].as_array().cloned().unwrap_or_default();
    eprintln!("settled: {settled:?}");
    for note in settled.iter().filter_map(|n| n.as_str()) {
        if note.contains(": runs on") && !note.contains(": runs on ferry-h1") {
            assert!(
                note.contains("verified") && !note.contains("not verified"),
                "{note}"
            );
        }
    }
    assert!(
        resumed["moves"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["state"] == "done"),
        "{resumed}"
    );
    assert!(vms_on(reg, "ferry-h1").is_empty(), "ferry-h1 emptied");
    let by_host = vms_by_host(reg);
    let mut seen: Vec<&str> = by_host
        .iter()
        .flat_map(|(_, v)| v.iter().map(|x| x.0.as_str()))
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        ["big", "fast", "kv", "quiet", "sort", "touch"],
        "each VM once: {by_host:?}"
    );
    let all: Vec<Vm> = by_host.iter().flat_map(|(_, v)| v.clone()).collect();
    assert!(all.iter().all(|v| v.2 == "running"), "{all:?}");
    still_counting(&all, &before);
    let list = op(reg, &["vm", "list"]).unwrap();
    let stores: usize = list
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            h["host"]["stores"].as_array().map_or(0, |s| {
                // Postcopy standbys end with their move.
                s.iter().filter(|s| s["standby"] != true).count()
            })
        })
        .sum();
    assert_eq!(stores, 1, "the split VM's memory server: {list}");
    let out = load.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["errors"].as_u64(), v["wrong_values"].as_u64()),
        (Some(0), Some(0)),
        "{v}"
    );
    // ferry-h2 upgraded in place.
    let on_h2 = vms_on(reg, "ferry-h2");
    assert!(!on_h2.is_empty());
    let up = op(reg, &["upgrade", "ferry-h2", "--parallel", "2"]).unwrap();
    let handed = up["vms"].as_array().unwrap();
    assert_eq!(handed.len(), on_h2.len(), "{up}");
    assert!(
        handed
            .iter()
            .all(|r| r["error"].is_null() && r["copied_bytes"] == 0),
        "{up}"
    );
    let after = vms_on(reg, "ferry-h2");
    assert!(after.iter().all(|v| v.2 == "running"), "{after:?}");
    let _ = etcd.0.kill();
}
