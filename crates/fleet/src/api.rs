//! What an agent is asked and what it answers: one JSON request line, then
//! zero or more progress lines (`{"progress": …}`, for a move under way),
//! then one reply line: `{"ok": true, …}` or `{"ok": false, "error": …}`.
//! Every line from a peer is at most [`MAX_LINE`] bytes (docs/agent.md).

use std::path::PathBuf;

use ferry_migration::Mode;

use crate::FleetError;

/// The longest line either side reads.
pub const MAX_LINE: usize = 1 << 20;

/// The longest VM name: letters, digits, `-`, `_` and `.`.
pub const MAX_NAME: usize = 64;

/// A VM as an operator asks for it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VmSpec {
    /// Its name, unique in the fleet.
    pub name: String,
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// What the guest runs (`ferry run --workload`).
    pub workload: String,
    /// The VM's own address (`ferry run --vm-address`): its clients follow it.
    #[serde(default)]
    pub vm_address: Option<String>,
    /// Where its service listens (`ferry run --serve`).
    #[serde(default)]
    pub serve: Option<String>,
}

impl VmSpec {
    /// Checks what a peer may not choose freely: the name (it becomes a
    /// file name) and sizes ferry can run.
    pub fn check(&self) -> Result<(), FleetError> {
        check_name(&self.name)?;
        if self.mem_bytes == 0 || !self.mem_bytes.is_multiple_of(4096) || self.mem_bytes > 1 << 40 {
            return Err(FleetError::Refused(format!(
                "VM {}: {} bytes of RAM is not a size ferry runs (whole pages, up to 1 TiB)",
                self.name, self.mem_bytes
            )));
        }
        if !(1..=8).contains(&self.vcpus) {
            return Err(FleetError::Refused(format!(
                "VM {}: {} vCPUs (1 to 8)",
                self.name, self.vcpus
            )));
        }
        if self.workload.len() > 4096 {
            return Err(FleetError::Refused("a workload spec over 4 KiB".into()));
        }
        Ok(())
    }
}

/// A send request that does not say leaves the link's queue to the VMs'
/// own traffic, as `ferry migrate` does.
fn share_link_default() -> bool {
    ferry_migration::defaults::SHARE_LINK
}

/// Refuses a VM name that could not be a file name of its own.
pub fn check_name(name: &str) -> Result<(), FleetError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(FleetError::Refused(format!(
            "{name:?} is not a VM name (1 to {MAX_NAME} letters, digits, '-', '_' or '.', not \
             starting with '.')"
        )))
    }
}

/// The longest token or host name a request may carry.
pub const MAX_FIELD: usize = 256;

/// Reads one request line as an agent does: JSON into a [`Request`], then
/// the fields a peer may not choose freely (names, sizes, lengths)
/// checked, so a handler never sees one that fails them.
pub fn parse_request(line: &[u8]) -> Result<Request, FleetError> {
    if line.len() > MAX_LINE {
        return Err(FleetError::Refused(format!(
            "a request line over {MAX_LINE} bytes"
        )));
    }
    let req: Request = serde_json::from_slice(line)
        .map_err(|e| FleetError::Refused(format!("not a request this agent knows: {e}")))?;
    let short = |what: &str, v: &str| {
        if v.is_empty() || v.len() > MAX_FIELD {
            Err(FleetError::Refused(format!(
                "{what} of {} bytes (1 to {MAX_FIELD})",
                v.len()
            )))
        } else {
            Ok(())
        }
    };
    match &req {
        Request::Info | Request::DirtyRates => {}
        Request::Start { vm } => vm.check()?,
        Request::Stop { name } | Request::Upgrade { name, .. } => check_name(name)?,
        Request::Receive {
            vm,
            from,
            token,
            budget,
            ..
        } => {
            vm.check()?;
            short("a source host name", from)?;
            short("a token", token)?;
            if budget.is_some_and(|b| b == 0 || b > vm.mem_bytes) {
                return Err(FleetError::Refused(format!(
                    "VM {}: a main-host budget of {budget:?} bytes (1 to its {} bytes)",
                    vm.name, vm.mem_bytes
                )));
            }
        }
        Request::Send {
            name,
            to,
            token,
            split,
            bandwidth,
            safety_net,
            ..
        } => {
            check_name(name)?;
            short("a destination", to)?;
            short("a token", token)?;
            if let Some(net) = safety_net {
                short("a standby address", net)?;
            }
            if bandwidth.is_some_and(|x| !(x > 0.0 && x.is_finite())) {
                return Err(FleetError::Refused("bandwidth must be positive".into()));
            }
            if let Some(sp) = split {
                if sp.subs.is_empty() || sp.subs.len() > MAX_STORES {
                    return Err(FleetError::Refused(format!(
                        "a split onto {} memory servers (1 to {MAX_STORES})",
                        sp.subs.len()
                    )));
                }
                for sub in &sp.subs {
                    short("a memory server address", sub)?;
                }
            }
        }
        Request::Store { vm, bytes } | Request::Standby { vm, bytes } => {
            check_name(vm)?;
            if *bytes == 0 || *bytes > 1 << 40 {
                return Err(FleetError::Refused(format!(
                    "a memory server or standby of {bytes} bytes (1 to 1 TiB)"
                )));
            }
        }
    }
    Ok(req)
}

/// The most memory servers one split VM's pages are spread over.
pub const MAX_STORES: usize = 16;

/// How a VM moves split: the main host holds `main_budget` bytes of it, the
/// rest goes to the memory servers `subs` (`tcp:HOST:PORT`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SplitSpec {
    /// The memory servers.
    pub subs: Vec<String>,
    /// What the main host holds (bytes).
    pub main_budget: u64,
}

/// A memory server an agent runs for a split VM.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreInfo {
    /// The VM whose pages it holds.
    pub vm: String,
    /// Where it listens (`tcp:HOST:PORT`).
    pub addr: String,
    /// Its capacity (bytes).
    pub bytes: u64,
    /// Its process.
    pub pid: u32,
    /// A postcopy standby (`ferry standby`), not a memory server.
    #[serde(default)]
    pub standby: bool,
}

/// What an agent is asked.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// The host and its VMs.
    Info,
    /// Start a VM here.
    Start {
        /// The VM.
        vm: VmSpec,
    },
    /// Stop a VM here (its VMM ends), or give up waiting for one; the
    /// memory servers this host runs for it end too.
    Stop {
        /// Its name.
        name: String,
    },
    /// Wait for VM `vm` to arrive from the host named `from` (its
    /// certificate's name), which must bring `token`; answers the address
    /// to move it to.
    Receive {
        /// The VM, as it runs at the source.
        vm: VmSpec,
        /// The source host's name.
        from: String,
        /// The one-time migration token the source must present.
        token: String,
        /// For a split VM: what of its memory this host holds (bytes).
        #[serde(default)]
        budget: Option<u64>,
        /// How it comes (for the record: `migrated by MODE`).
        #[serde(default)]
        mode: Option<Mode>,
    },
    /// Move VM `name` to `to` (a destination another agent made ready)
    /// with `token`; progress lines, then the migration's figures.
    Send {
        /// The VM.
        name: String,
        /// Where to (`tcp:HOST:PORT`).
        to: String,
        /// The destination's token.
        token: String,
        /// How.
        mode: Mode,
        /// Compare every page's hash at the end.
        #[serde(default)]
        verify: bool,
        /// Hybrid: when to switch to postcopy (`1|20s`: after a dirty
        /// round that did not converge, or at the move's deadline).
        #[serde(default)]
        postcopy_after: Option<ferry_migration::PostcopyAfter>,
        /// Limit the move's bandwidth (bytes/s).
        #[serde(default)]
        bandwidth: Option<f64>,
        /// Precopy rounds leave the bottleneck's queue to the VMs' own
        /// traffic (`ferry migrate`'s default; absent: on).
        #[serde(default = "share_link_default")]
        share_link: bool,
        /// For mode split: the main host's share and the memory servers.
        #[serde(default)]
        split: Option<SplitSpec>,
        /// Postcopy and hybrid: a standby (`tcp:HOST:PORT`) that holds the
        /// pages the destination lacks after the switch and finishes the
        /// move if the source dies.
        #[serde(default)]
        safety_net: Option<String>,
        /// With a safety net: the standby finishes the move (the source
        /// sends each page once, to it, and hands the move over once it
        /// holds them, waiting as its backup).
        #[serde(default)]
        net_finishes: bool,
    },
    /// Measure how fast each VM here dirties memory (half a second each,
    /// all at once); answers `rates`: VM name → bytes/s.
    DirtyRates,
    /// Run a memory server of `bytes` here for split VM `vm`'s pages;
    /// answers its address.
    Store {
        /// The VM.
        vm: String,
        /// Its capacity.
        bytes: u64,
    },
    /// Run a postcopy standby here for VM `vm`'s move (`ferry standby`,
    /// holding at most `bytes`); answers its address. Stopped with the
    /// VM's name like a memory server.
    Standby {
        /// The VM.
        vm: String,
        /// The most it may hold (the VM's memory).
        bytes: u64,
    },
    /// Hand VM `name` over to a fresh VMM process on this host (zero-copy):
    /// `binary`, or the agent's own ferry.
    Upgrade {
        /// The VM.
        name: String,
        /// The ferry binary the new process runs.
        #[serde(default)]
        binary: Option<PathBuf>,
    },
}

impl Request {
    /// A short name for logs and errors.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Info => "info",
            Request::Start { .. } => "start",
            Request::Stop { .. } => "stop",
            Request::Receive { .. } => "receive",
            Request::Send { .. } => "send",
            Request::Upgrade { .. } => "upgrade",
            Request::Store { .. } => "store",
            Request::Standby { .. } => "standby",
            Request::DirtyRates => "dirty-rates",
        }
    }
}

/// A VM as its agent sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmInfo {
    /// What was asked for.
    pub spec: VmSpec,
    /// `running`, `paused`, `waiting` (a destination not yet filled), …:
    /// what its VMM says.
    pub state: String,
    /// Its VMM's process.
    pub pid: u32,
    /// Its control socket on the host.
    pub socket: PathBuf,
    /// Seconds its VMM has run.
    pub uptime_s: f64,
    /// How it came here: `started`, `arriving [by MODE]`, `migrated [by
    /// MODE]` (moved here), `forwarding` (its VM runs elsewhere, its
    /// clients are forwarded there).
    pub came_by: String,
    /// Its workloads' progress counters added up (what the guest has done:
    /// it grows while the guest runs work), when its VMM said.
    #[serde(default)]
    pub progress: Option<u64>,
    /// How fast it dirties memory (bytes/s), when measured (`dirty-rates`:
    /// half a second of KVM's dirty log, what precopy would have to send
    /// again).
    #[serde(default)]
    pub dirty_bytes_per_s: Option<f64>,
}

impl VmInfo {
    /// True if its VM runs under this listing's host: not a VMM still
    /// waiting for its VM, nor one forwarding clients to a VM that runs
    /// elsewhere.
    pub fn runs_here(&self) -> bool {
        self.state != "waiting" && self.state != "forwarding"
    }
}

/// A host as its agent sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HostInfo {
    /// The host's name (its certificate's).
    pub name: String,
    /// Where its agent listens.
    pub addr: String,
    /// Guest RAM it offers VMs in all.
    pub mem_bytes: u64,
    /// Of that, not taken by a VM.
    pub free_mem: u64,
    /// vCPUs it offers in all.
    pub vcpus: u32,
    /// Of those, not taken.
    pub free_vcpus: u32,
    /// Its link's speed (bits/s; 0: unknown).
    pub link_bps: u64,
    /// Its VMs.
    pub vms: Vec<VmInfo>,
    /// The memory servers it runs for split VMs.
    #[serde(default)]
    pub stores: Vec<StoreInfo>,
    /// VMs it sent away lately (the newest last), and what their moves
    /// verified: a drain that died mid-move reads it when it resumes.
    #[serde(default)]
    pub sent: Vec<SentVm>,
}

/// A VM an agent sent away, as its move ended.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SentVm {
    /// The VM.
    pub vm: String,
    /// Where it went.
    pub to: String,
    /// The move was asked to compare every page's hash.
    pub verify: bool,
    /// Pages whose hashes matched end to end (0 without `verify`).
    pub verified_pages: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requests_bandwidth_reads_back_exactly_after_it_is_written() {
        // Found by fuzz/agent_api: serde_json's fast float parsing read
        // 125000000.5555555555550 one step off the value its own shortest
        // form reads as, so a Send written back did not read as itself.
        let line = br#"{"op":"send","name":"web","to":"tcp:10.77.0.2:41234","token":"00112233445566778899aabbccddeeff","mode":"hybrid","verify":true,"postcopy_after":"1|20s","bandwidth":125000000.5555555555550}"#;
        let req = parse_request(line).unwrap();
        let again = serde_json::to_vec(&req).unwrap();
        assert_eq!(parse_request(&again).unwrap(), req);
    }

    #[test]
    fn requests_read_back_and_names_that_could_escape_are_refused() {
        let r = Request::Send {
            name: "web-1".into(),
            to: "tcp:10.77.0.2:7100".into(),
            token: "t".into(),
            mode: Mode::Hybrid,
            verify: true,
            postcopy_after: Some(ferry_migration::PostcopyAfter::Either(1, 20.0)),
            bandwidth: None,
            share_link: true,
            split: None,
            safety_net: Some("tcp:10.77.0.3:7101".into()),
            net_finishes: true,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.contains(r#""op":"send""#), "{line}");
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        for bad in ["", "../etc", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["web-1", "db_2.prod", &"x".repeat(64)] {
            check_name(good).unwrap();
        }
        // The agent's reading refuses the same in every request.
        assert_eq!(parse_request(line.as_bytes()).unwrap(), r);
        for bad in [
            r#"{"op":"stop","name":"../x"}"#,
            r#"{"op":"send","name":"a","to":"tcp:1.2.3.4:5","token":"","mode":"precopy"}"#,
            r#"{"op":"launch"}"#,
            "not json",
        ] {
            assert!(parse_request(bad.as_bytes()).is_err(), "{bad}");
        }
        let spec = |mem, vcpus| VmSpec {
            name: "v".into(),
            mem_bytes: mem,
            vcpus,
            workload: "idle".into(),
            vm_address: None,
            serve: None,
        };
        spec(128 << 20, 2).check().unwrap();
        assert!(spec(0, 1).check().is_err());
        assert!(spec(4097, 1).check().is_err());
        assert!(spec(128 << 20, 0).check().is_err());
        assert!(spec(128 << 20, 9).check().is_err());
    }
}
