//! The agent's VM records: when a VMM counts as waiting, and which records
//! a restarted agent keeps (a live VMM that does not answer) or forgets.

use super::*;

#[test]
fn a_vmm_waits_until_its_vcpus_start_not_until_its_migration_ends() {
    let incoming = serde_json::json!({"endpoint": "tcp:10.0.0.1:1"});
    // Waiting for its source.
    assert!(waits(
        &serde_json::json!({"state": "waiting", "incoming": incoming, "uptime_s": 0.0})
    ));
    // Running by postcopy while the pages still come: not waiting.
    assert!(!waits(
        &serde_json::json!({"state": "running", "incoming": incoming, "uptime_s": 4.2})
    ));
    assert!(!waits(
        &serde_json::json!({"state": "paused", "incoming": incoming, "uptime_s": 4.2})
    ));
    // Arrived, or never incoming.
    assert!(!waits(
        &serde_json::json!({"state": "running", "incoming": null, "uptime_s": 9.0})
    ));
    // A VMM from before the "waiting" state said "running" while it waited.
    assert!(waits(
        &serde_json::json!({"state": "running", "incoming": incoming, "uptime_s": 0.0})
    ));
}

fn record(dir: &Path, name: &str, pid: u32) {
    let rec = Record {
        spec: VmSpec {
            name: name.into(),
            mem_bytes: 64 << 20,
            vcpus: 1,
            workload: "idle".into(),
            vm_address: None,
            serve: None,
        },
        // No VMM answers here.
        socket: dir.join(format!("{name}.sock")),
        pid,
        came_by: "started".into(),
        budget: None,
    };
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_vec(&rec).unwrap(),
    )
    .unwrap();
}

#[test]
fn a_vmm_that_lives_but_does_not_answer_is_kept_and_a_dead_one_forgotten() {
    let dir = std::env::temp_dir().join(format!("ferry-vms-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A live process that is no VMM: this test's own.
    record(&dir, "mute", std::process::id());
    // A process that has ended.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    record(&dir, "gone", gone_pid);
    let vms = Vms::adopt(&dir, "ferry".into(), "127.0.0.1".parse().unwrap()).unwrap();
    let listed: Vec<(String, String)> = vms
        .list()
        .into_iter()
        .map(|v| (v.spec.name, v.state))
        .collect();
    assert_eq!(
        listed,
        vec![("mute".to_string(), "unresponsive".to_string())]
    );
    assert!(
        dir.join("mute.json").exists(),
        "the live VM's record is kept"
    );
    assert!(!dir.join("gone.json").exists(), "the dead VM's record goes");
    assert_eq!(vms.taken().0, 64 << 20, "its memory still counts as taken");
    let _ = std::fs::remove_dir_all(&dir);
}
