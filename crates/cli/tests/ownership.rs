//! One running copy of a VM, fenced through the registry (docs/safety.md),
//! with real VMMs on this host and the embedded registry in a scratch
//! directory: a fenced VM moves and a second copy is refused; a destination
//! that cannot take the VM gives it back to its source; a destination killed
//! right after it took the VM is never run over by its source, which says
//! so; a postcopy whose destination dies after taking the VM ends within
//! seconds and says the VM is lost; a copy whose claim is taken stops; a
//! handover whose new VMM dies before it takes the VM leaves it running in
//! the old one.

mod common;
use common::{ferry, kvm_usable, Reaper, Scratch};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Each test runs VMs on 2 host cores: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// `ferry run ARGS` with its control socket at `dir/NAME.sock`, its
/// stderr in `dir/NAME.log`.
fn vmm(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> (Reaper, String) {
    let sock = dir.join(format!("{name}.sock")).display().to_string();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["run", "--control", &sock, "--mem", "128M", "--quiet"])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    (Reaper(child), sock)
}

fn log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// `ferry status --json --metrics`, once it answers.
fn status(sock: &str) -> Value {
    common::wait_status(sock)
}

fn wait_for(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The VM at `sock` runs: its state says so and its workload advances.
fn runs(sock: &str) -> bool {
    let a = status(sock);
    std::thread::sleep(Duration::from_millis(300));
    let b = status(sock);
    let p = |s: &Value| {
        s["metrics"]["workloads"][0]["progress"]
            .as_u64()
            .unwrap_or(0)
    };
    b["state"] == "running" && p(&b) > p(&a)
}

fn record(reg: &Path, vm: &str) -> Value {
    let f = reg.join("records").join(format!("owners%2F{vm}"));
    serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap()
}

fn registry(reg: &Path) -> String {
    format!("dir:{}", reg.display())
}

fn setup(name: &str) -> Option<(PathBuf, Scratch, std::sync::MutexGuard<'static, ()>)> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !kvm_usable() {
        return None;
    }
    let (dir, scratch) = Scratch::new(name);
    Some((dir, scratch, serial))
}

const WORK: &str = "dirty:rate=8,wss=16";

/// A fresh VM named `vm`, fenced through `reg`.
fn fenced_vm(dir: &Path, vm: &str, reg: &Path, env: &[(&str, &str)]) -> (Reaper, String) {
    let r = registry(reg);
    vmm(
        dir,
        "src",
        &["--workload", WORK, "--vm-name", vm, "--registry", &r],
        env,
    )
}

/// A fenced destination `name` waiting on a Unix socket of its own,
/// through `reg`, once it listens: the process and where to migrate to.
fn fenced_destination(
    dir: &Path,
    name: &str,
    reg: &Path,
    env: &[(&str, &str)],
) -> (Reaper, String) {
    let inc = dir.join(format!("{name}.in")).display().to_string();
    let to = format!("unix:{inc}");
    let (p, _) = vmm(
        dir,
        name,
        &["--incoming", &to, "--fenced", "--registry", &registry(reg)],
        env,
    );
    wait_for("the destination listens", Duration::from_secs(10), || {
        Path::new(&inc).exists()
    });
    (p, to)
}

#[test]
fn a_fenced_vm_moves_and_a_second_copy_is_refused() {
    let Some((dir, _s, _g)) = setup("ferry-own-move") else {
        return;
    };
    let reg = dir.join("reg");
    let r = registry(&reg);
    let (_src, src) = fenced_vm(&dir, "web", &reg, &[]);
    assert!(runs(&src), "{}", log(&dir, "src"));
    let rec = record(&reg, "web");
    assert_eq!(rec["epoch"], 1);
    assert_eq!(status(&src)["owner"]["state"], "holding");
    // A second fresh copy of the same VM is refused, naming the holder.
    let o = ferry(&[
        "run",
        "--mem",
        "128M",
        "--quiet",
        "--vm-name",
        "web",
        "--registry",
        &r,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("held at epoch 1"),
        "{err}"
    );
    // An unfenced destination refuses the fenced VM: it runs on here.
    let plain_in = dir.join("plain.in").display().to_string();
    let (_plain, _) = vmm(
        &dir,
        "plain",
        &["--incoming", &format!("unix:{plain_in}")],
        &[],
    );
    wait_for(
        "the plain destination listens",
        Duration::from_secs(10),
        || Path::new(&plain_in).exists(),
    );
    let o = ferry(&["migrate", &src, "--to", &format!("unix:{plain_in}")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("fenced"), "{err}");
    assert!(runs(&src), "the source runs on after the refusal");
    // A fenced destination takes it from the source's claim.
    let (_dst, to) = fenced_destination(&dir, "dst", &reg, &[]);
    let dst = dir.join("dst.sock").display().to_string();
    let o = ferry(&["migrate", &src, "--to", &to, "--verify"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(runs(&dst), "{}", log(&dir, "dst"));
    let rec = record(&reg, "web");
    assert_eq!(rec["epoch"], 2);
    assert_eq!(rec["holder"]["pid"], status(&dst)["pid"]);
    assert_eq!(status(&dst)["owner"]["state"], "holding");
    // A handover moves the claim to the new process.
    let before = status(&dst)["pid"].clone();
    let o = ferry(&["handover", &dst]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let st = status(&dst);
    assert_ne!(st["pid"], before);
    let rec = record(&reg, "web");
    assert_eq!(
        (rec["epoch"].clone(), rec["holder"]["pid"].clone()),
        (3.into(), st["pid"].clone())
    );
    assert!(runs(&dst)); // The new process is no child of this test: ended through its socket.
    let _ = ferry(&["ctl", &dst, "quit"]);
}

#[test]
fn a_destination_that_cannot_take_the_vm_gives_it_back() {
    let Some((dir, _s, _g)) = setup("ferry-own-back") else {
        return;
    };
    let (reg, other) = (dir.join("reg"), dir.join("other-reg"));
    let (_src, src) = fenced_vm(&dir, "db", &reg, &[]);
    assert!(runs(&src));
    // A destination fenced through another registry finds no claim to
    // take: it refuses at the opening, before anything moves.
    let (_other, to) = fenced_destination(&dir, "other", &other, &[]);
    let o = ferry(&["migrate", &src, "--to", &to]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no record"), "{err}");
    assert!(runs(&src), "it never left: {}", log(&dir, "src"));
    assert_eq!(status(&src)["owner"]["epoch"], 1);
    // A destination killed after Complete, before it took the VM: the
    // source's take-back wins, and it runs here again.
    let (mut dst, to) = fenced_destination(&dir, "dst", &reg, &[("FERRY_OWNER_STALL", "before")]);
    let src2 = src.clone();
    let mig = std::thread::spawn(move || ferry(&["migrate", &src2, "--to", &to]));
    wait_for(
        "the destination got Complete",
        Duration::from_secs(30),
        || log(&dir, "dst").contains("stalling the take-over"),
    );
    assert_eq!(status(&src)["state"], "paused", "paused at the switch");
    let _ = dst.0.kill();
    let _ = dst.0.wait();
    let o = mig.join().unwrap();
    assert!(!o.status.success());
    assert!(runs(&src), "taken back, it runs here: {}", log(&dir, "src"));
    let st = status(&src);
    assert_eq!(st["owner"]["state"], "holding");
    assert_eq!(st["owner"]["epoch"], 2, "the take-back moved the epoch on");
    assert!(
        log(&dir, "src").contains("never took the VM"),
        "{}",
        log(&dir, "src")
    );
}

#[test]
fn a_destination_killed_after_taking_the_vm_is_not_run_over_and_the_loss_is_said() {
    let Some((dir, _s, _g)) = setup("ferry-own-killed") else {
        return;
    };
    let reg = dir.join("reg");
    let (_src, src) = fenced_vm(&dir, "app", &reg, &[]);
    assert!(runs(&src));
    let (mut dst, to) = fenced_destination(&dir, "dst", &reg, &[("FERRY_OWNER_STALL", "taken")]);
    let src2 = src.clone();
    let mig = std::thread::spawn(move || ferry(&["migrate", &src2, "--to", &to]));
    wait_for(
        "the destination took the VM",
        Duration::from_secs(30),
        || log(&dir, "dst").contains("stalling the take-over"),
    );
    // It holds the VM and dies before its first instruction.
    assert_eq!(record(&reg, "app")["epoch"], 2);
    let _ = dst.0.kill();
    let _ = dst.0.wait();
    let o = mig.join().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("the registry says the destination took the VM"),
        "{err}"
    );
    // The source never runs it again, and says so.
    let st = status(&src);
    assert_eq!(st["state"], "paused", "{st}");
    assert_eq!(st["owner"]["state"], "handed");
    let o = ferry(&["ctl", &src, "resume"]);
    assert!(!String::from_utf8_lossy(&o.stdout).contains("ok") || !o.status.success());
    assert_eq!(status(&src)["state"], "paused");
    // Once the dead holder's renewals stop for the TTL, status says so.
    wait_for(
        "the holder is seen as lapsed",
        Duration::from_secs(15),
        || status(&src)["owner"]["holder_lapsed"] == true,
    );
}

#[test]
fn a_postcopy_whose_destination_dies_after_taking_the_vm_ends_and_says_the_vm_is_lost() {
    let Some((dir, _s, _g)) = setup("ferry-own-postcopy") else {
        return;
    };
    let reg = dir.join("reg");
    let (_src, src) = fenced_vm(&dir, "db", &reg, &[]);
    assert!(runs(&src));
    let (mut dst, to) = fenced_destination(&dir, "dst", &reg, &[]);
    let src2 = src.clone();
    // The push held back: the move stays open, only faulted pages cross.
    let mig = std::thread::spawn(move || {
        let t = Instant::now();
        let o = ferry(&[
            "migrate",
            &src2,
            "--to",
            &to,
            "--mode",
            "postcopy",
            "--push-delay",
            "20s",
        ]);
        (o, t.elapsed())
    });
    wait_for(
        "the destination took the VM",
        Duration::from_secs(30),
        || record(&reg, "db")["epoch"] == 2,
    );
    std::thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    let _ = dst.0.kill();
    let _ = dst.0.wait();
    let (o, _) = mig.join().unwrap();
    let ended = killed.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    // Not the reconnect timeout (30 s): the refused port and the lapsed
    // claim together say the destination is dead, about the TTL after.
    assert!(
        ended < Duration::from_secs(20),
        "ended {ended:?} after the kill: {err}"
    );
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("stopped renewing") && err.contains("died with it"),
        "{err}"
    );
    // The source never runs it, and stays resumable with every page.
    let st = status(&src);
    assert_eq!(st["state"], "paused", "{st}");
    assert_eq!(st["owner"]["state"], "handed");
    assert_eq!(st["owner"]["holder_lapsed"], true);
    let o = ferry(&["ctl", &src, "resume"]);
    assert!(!String::from_utf8_lossy(&o.stdout).contains("ok") || !o.status.success());
    assert_eq!(status(&src)["state"], "paused");
}

#[test]
fn a_copy_whose_claim_is_taken_stops() {
    let Some((dir, _s, _g)) = setup("ferry-own-stop") else {
        return;
    };
    let reg = dir.join("reg");
    let (_src, src) = fenced_vm(&dir, "cache", &reg, &[]);
    assert!(runs(&src));
    // Another process takes the VM behind this one's back (the record
    // rewritten whole, as a stray holder would).
    let mut rec = record(&reg, "cache");
    rec["epoch"] = 7.into();
    rec["holder"]["pid"] = 1.into();
    rec["holder"]["id"] = 42.into();
    let f = reg.join("records/owners%2Fcache");
    std::fs::write(&f, serde_json::to_vec(&rec).unwrap()).unwrap();
    wait_for("the copy stops", Duration::from_secs(5), || {
        status(&src)["state"] == "paused"
    });
    let st = status(&src);
    assert_eq!(st["owner"]["state"], "handed");
    assert_eq!(st["owner"]["epoch"], 7);
    assert!(log(&dir, "src").contains("no longer holds VM cache"));
    let o = ferry(&["ctl", &src, "resume"]);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("owner fence forbids"), "{out}");
    assert_eq!(status(&src)["state"], "paused");
}

#[test]
fn a_handover_whose_new_vmm_dies_before_taking_the_vm_leaves_it_running_here() {
    let Some((dir, _s, _g)) = setup("ferry-own-handover") else {
        return;
    };
    let reg = dir.join("reg");
    // Its new VMMs stall at Go, before they take the VM (the hook is in
    // the old VMM's environment, which the new one inherits).
    let (_src, src) = fenced_vm(&dir, "web", &reg, &[("FERRY_OWNER_STALL", "before")]);
    assert!(runs(&src));
    let pid = status(&src)["pid"].clone();
    // The new VMM stalls at Go, before it takes the VM: killed there.
    let ho = {
        let src = src.clone();
        std::thread::spawn(move || ferry(&["handover", &src]))
    };
    let new_pid = {
        let mut found = None;
        wait_for("the new VMM stalls", Duration::from_secs(20), || {
            found = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
                let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
                let environ = std::fs::read(e.path().join("environ")).ok()?;
                let cmd = String::from_utf8_lossy(&cmd).into_owned();
                let stalled =
                    String::from_utf8_lossy(&environ).contains("FERRY_OWNER_STALL=before");
                (cmd.contains("--adopt-fd") && stalled)
                    .then(|| e.file_name().to_string_lossy().into_owned())
            });
            found.is_some()
        });
        found.unwrap()
    };
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill").args(["-9", &new_pid]).status();
    let o = ho.join().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("runs here again"),
        "{err}"
    );
    assert!(runs(&src), "{}", log(&dir, "src"));
    let st = status(&src);
    assert_eq!(st["pid"], pid, "the old VMM runs it");
    assert_eq!(st["owner"]["state"], "holding");
    assert_eq!(record(&reg, "web")["holder"]["pid"], pid);
    let _ = ferry(&["ctl", &src, "quit"]);
    wait_for(
        "the VM is released at its end",
        Duration::from_secs(10),
        || record(&reg, "web")["holder"].is_null(),
    );
}
