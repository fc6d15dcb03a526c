//! `ferry agent`: one per host. It registers the host under a lease (what
//! it offers VMs and how many it runs, renewed while it lives), answers the
//! fleet's requests ([`Request`]) over mutual TLS, and keeps the host's VMs
//! ([`vms`]): their VMMs run in sessions of their own and outlive the agent,
//! which adopts them again when it restarts.
//!
//! Who may ask: any peer whose certificate chains to the fleet CA (an
//! operator's, or another host's agent during a drain). A VM is moved only
//! with a one-time token the destination's agent made for that move, and
//! a waiting destination admits only the source host it was told of.

mod handover;
mod process;
mod stores;
mod vms;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_migration::{Endpoint, MigrateOptions, MigrationToken};
use ferry_registry::{Advertisement, AgentOffer, HostEntry, HostKind, Registry};
use ferry_tls::{Connection, Credentials};
use ferry_vmm::control::{ControlClient, MigrateRequest, Request as Control};
use serde_json::{json, Value};

use crate::api::{HostInfo, Request, SentVm, MAX_LINE};
use crate::reply::{
    InfoReply, RatesReply, ReadyReply, SendReply, StartReply, StopReply, StoreReply,
};
use crate::wire::{self, HANDSHAKE_WITHIN, REQUEST_WITHIN};
use crate::FleetError;
use stores::Stores;
use vms::Vms;

/// Requests served at once; one more is closed unanswered.
const MAX_CLIENTS: usize = 64;

/// What an agent is and offers.
pub struct AgentOptions {
    /// The host's name (its certificate's, so peers can name it as a source).
    pub name: String,
    /// Where it listens (an address other hosts reach: VMs arrive there too).
    pub listen: SocketAddr,
    /// Guest RAM it offers VMs in all.
    pub mem_bytes: u64,
    /// vCPUs it offers in all.
    pub vcpus: u32,
    /// Its link's speed (bits/s; 0: unknown).
    pub link_bps: u64,
    /// Where it keeps its VMs' records, control sockets and logs.
    pub state_dir: PathBuf,
    /// The ferry binary its VMMs run.
    pub ferry: PathBuf,
    /// Its credentials (None: plaintext, `--insecure`).
    pub tls: Option<Arc<Credentials>>,
    /// Its VMs run with `--share-pages` (pages shared across VMs, v14).
    pub share_pages: bool,
}

/// A running agent.
pub struct Agent {
    opts: AgentOptions,
    vms: Vms,
    stores: Stores,
    /// Held while a request takes room (a VM, a waiting VMM, a memory
    /// server): one admission at a time, so two cannot both take the last
    /// of it, and the VMs' and stores' books are read in one order.
    admit: std::sync::Mutex<()>,
    /// The VMs sent away lately, newest last (at most [`SENT_KEPT`]).
    sent: std::sync::Mutex<std::collections::VecDeque<SentVm>>,
    advert: Advertisement,
    local: SocketAddr,
}

impl Agent {
    /// Adopts the VMs recorded in its state directory, binds its address
    /// and registers the host in `registry`.
    pub fn start(opts: AgentOptions, registry: Arc<dyn Registry>) -> Result<Arc<Self>, FleetError> {
        if opts.listen.ip().is_unspecified() {
            return Err(FleetError::Refused(format!(
                "the agent listens on {}: give it an address other hosts reach (VMs arrive there)",
                opts.listen
            )));
        }
        let vms = Vms::adopt(&opts.state_dir, opts.ferry.clone(), opts.listen.ip())?
            .sharing(opts.share_pages)
            .fenced(registry.describe(), &opts.name);
        let stores = Stores::adopt(&opts.state_dir, opts.ferry.clone(), opts.listen.ip())?;
        let listener = TcpListener::bind(opts.listen)
            .map_err(FleetError::io(format!("cannot listen on {}", opts.listen)))?;
        let local = listener
            .local_addr()
            .map_err(FleetError::io("the agent's address"))?;
        let entry = HostEntry {
            name: opts.name.clone(),
            kind: HostKind::Agent,
            addr: local.to_string(),
            capacity: opts.mem_bytes,
            free: 0,
            agent: Some(AgentOffer::default()),
        };
        // Known beyond its lease: a host whose lease lapses is then
        // reported dead, not forgotten.
        let known = serde_json::to_vec(&json!({
            "name": opts.name, "addr": local.to_string(),
            "started_unix": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        }))
        .unwrap_or_default();
        registry.put_record(&crate::fleet::known_key(&opts.name), &known)?;
        let advert = Advertisement::start(registry, entry, ferry_registry::DEFAULT_TTL)?;
        let agent = Arc::new(Agent {
            opts,
            vms,
            stores,
            admit: std::sync::Mutex::new(()),
            sent: Default::default(),
            advert,
            local,
        });
        agent.advertise();
        let serving = agent.clone();
        std::thread::Builder::new()
            .name("agent".into())
            .spawn(move || serving.serve(listener))
            .map_err(FleetError::io("cannot start the agent's thread"))?;
        Ok(agent)
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The host and its VMs now.
    pub fn info(&self) -> HostInfo {
        let vms = self.vms.list();
        let stores = self.stores.list();
        let (mem, vcpus, _) = self.vms.taken();
        HostInfo {
            name: self.opts.name.clone(),
            addr: self.local.to_string(),
            mem_bytes: self.opts.mem_bytes,
            free_mem: self
                .opts
                .mem_bytes
                .saturating_sub(mem + self.stores.taken()),
            vcpus: self.opts.vcpus,
            free_vcpus: self.opts.vcpus.saturating_sub(vcpus),
            link_bps: self.opts.link_bps,
            vms,
            stores,
            sent: self
                .sent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect(),
        }
    }

    /// Publishes what is free now.
    fn advertise(&self) {
        let (mem, vcpus, n) = self.vms.taken();
        let free = self
            .opts
            .mem_bytes
            .saturating_sub(mem + self.stores.taken());
        let offer = AgentOffer {
            vcpus: self.opts.vcpus,
            free_vcpus: self.opts.vcpus.saturating_sub(vcpus),
            link_bps: self.opts.link_bps,
            vms: n,
        };
        if let Err(e) = self.advert.update_with(|e| {
            e.free = free;
            e.agent = Some(offer);
        }) {
            tracing::warn!("agent: cannot update the registry: {e}");
        }
    }

    /// Keeps the books between requests: reaps VMMs that ended, notices
    /// VMs that are gone, and republishes what is free.
    pub fn tick(&self) {
        self.vms.reap();
        let _ = self.vms.list();
        let _ = self.stores.list();
        self.advertise();
    }

    fn serve(self: Arc<Self>, listener: TcpListener) {
        let busy = Arc::new(AtomicUsize::new(0));
        for conn in listener.incoming() {
            let Ok(tcp) = conn else {
                // Out of descriptors, say: wait for some to come back.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            };
            if busy.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                busy.fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            let (me, mine) = (self.clone(), busy.clone());
            let spawned = std::thread::Builder::new()
                .name("agent-client".into())
                .spawn(move || {
                    me.answer(tcp);
                    mine.fetch_sub(1, Ordering::AcqRel);
                });
            if spawned.is_err() {
                busy.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// One client: its handshake, its request line, the answer.
    fn answer(&self, tcp: std::net::TcpStream) {
        let peer = tcp
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let mut c = match Connection::accept(tcp, self.opts.tls.as_deref(), HANDSHAKE_WITHIN) {
            Ok(c) => c,
            Err(e) => {
                tracing::info!("agent: {peer} refused: {e}");
                return;
            }
        };
        let who = c
            .peer()
            .map(|p| p.to_string())
            .unwrap_or_else(|| format!("{peer} (plaintext)"));
        let deadline = Some(Instant::now() + REQUEST_WITHIN);
        let req = match wire::read_line(&mut c, MAX_LINE, deadline) {
            Ok(Some(line)) => crate::api::parse_request(line.as_bytes()),
            Ok(None) => return,
            Err(e) => Err(FleetError::Refused(format!("no request: {e}"))),
        };
        let reply = match req {
            Ok(req) => {
                if !matches!(req, Request::Info) {
                    tracing::info!("agent: {} from {who}", req.op());
                }
                let mut progress = |p: Value| {
                    let _ = wire::write_line(&mut c, &json!({ "progress": p }));
                };
                let r = self.handle(req, &mut progress);
                self.advertise();
                r
            }
            Err(e) => Err(e),
        };
        let line = match reply {
            Ok(mut v) => {
                if let Some(m) = v.as_object_mut() {
                    m.insert("ok".into(), json!(true));
                }
                v
            }
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        };
        let _ = wire::write_line(&mut c, &line);
        let _ = c.finish();
    }

    fn handle(&self, req: Request, progress: &mut dyn FnMut(Value)) -> Result<Value, FleetError> {
        match req {
            Request::Info => reply_of(InfoReply { host: self.info() }),
            Request::DirtyRates => {
                // Every running VM at once, each for half a second.
                let vms: Vec<_> = self
                    .vms
                    .list()
                    .into_iter()
                    .filter(|v| v.state == "running")
                    .collect();
                let rates = std::thread::scope(|sc| {
                    let asked: Vec<_> = vms
                        .iter()
                        .map(|v| (v.spec.name.clone(), sc.spawn(|| vms::dirty_rate(&v.socket))))
                        .collect();
                    asked
                        .into_iter()
                        .filter_map(|(n, h)| h.join().ok().flatten().map(|r| (n, r)))
                        .collect()
                });
                reply_of(RatesReply { rates })
            }
            Request::Start { vm } => {
                let _one = self.admit.lock().unwrap_or_else(|p| p.into_inner());
                let stores = self.stores.taken();
                let info = self.vms.start(&vm, None, &[], "started", |m, c, tm, tc| {
                    self.fits(&vm.name, m, c, tm + stores, tc)
                })?;
                reply_of(StartReply { vm: info })
            }
            Request::Stop { name } => {
                let vm = self.vms.has(&name);
                if vm {
                    self.vms.stop(&name)?;
                }
                let store = self.stores.stop(&name);
                if !vm && !store {
                    return Err(FleetError::Refused(format!(
                        "no VM named {name} runs here, and no memory server for one"
                    )));
                }
                reply_of(StopReply { vm, store })
            }
            Request::Store { vm, bytes } => {
                let _one = self.admit.lock().unwrap_or_else(|p| p.into_inner());
                let (mem, vcpus, _) = self.vms.taken();
                let info = self.stores.start(&vm, bytes, false, |stores| {
                    self.fits(&vm, bytes, 0, mem + stores, vcpus)
                })?;
                reply_of(StoreReply {
                    addr: info.addr.clone(),
                    store: info,
                })
            }
            Request::Standby { vm, bytes } => {
                let (mem, vcpus, _) = self.vms.taken();
                let info = self.stores.start(&vm, bytes, true, |stores| {
                    self.fits(&vm, bytes, 0, mem + stores, vcpus)
                })?;
                reply_of(StoreReply {
                    addr: info.addr.clone(),
                    store: info,
                })
            }
            Request::Receive {
                vm,
                from,
                token,
                budget,
                mode,
            } => {
                let came_by = match mode {
                    Some(m) => format!("arriving by {}", m.name()),
                    None => "arriving".into(),
                };
                let to = self.vms.incoming_addr()?;
                let extra = [
                    "--incoming".to_string(),
                    to.clone(),
                    "--from".into(),
                    from,
                    "--token".into(),
                    token,
                ];
                let _one = self.admit.lock().unwrap_or_else(|p| p.into_inner());
                let stores = self.stores.taken();
                let info = self
                    .vms
                    .start(&vm, budget, &extra, &came_by, |m, c, tm, tc| {
                        self.fits(&vm.name, m, c, tm + stores, tc)
                    })?;
                reply_of(ReadyReply { to, vm: info })
            }
            Request::Send {
                name,
                to,
                token,
                mode,
                verify,
                postcopy_after,
                bandwidth,
                share_link,
                split,
                safety_net,
                net_finishes,
            } => {
                let mut options = MigrateOptions {
                    mode,
                    verify,
                    token: Some(MigrationToken(token)),
                    bandwidth,
                    share_link,
                    // The fleet keeps no timeline: no waiting for the
                    // destination's tail of one (a second a move).
                    timeline_tail_ms: 0,
                    net_finishes,
                    ..Default::default()
                };
                if let Some(after) = postcopy_after {
                    options.postcopy_after = after;
                }
                if let Some(net) = safety_net {
                    options.safety_net =
                        Some(net.parse::<Endpoint>().map_err(|e| {
                            FleetError::Refused(format!("a standby's address: {e}"))
                        })?);
                }
                if let Some(sp) = split {
                    options.split.main_budget = sp.main_budget;
                    options.split.subs = sp
                        .subs
                        .iter()
                        .map(|s| s.parse::<Endpoint>())
                        .collect::<Result<_, _>>()
                        .map_err(|e| {
                            FleetError::Refused(format!("a memory server address: {e}"))
                        })?;
                }
                self.send(&name, &to, options, progress)
            }
            Request::Upgrade { name, binary } => {
                let binary = binary.unwrap_or_else(|| self.opts.ferry.clone());
                reply_of(handover::handover(&self.vms, &name, &binary)?)
            }
        }
    }

    /// Room for `mem` bytes and `vcpus` vCPUs of VM `vm` beside the
    /// `taken_mem` (VMs and memory servers) and `taken_vcpus` taken already.
    fn fits(
        &self,
        vm: &str,
        mem: u64,
        vcpus: u32,
        taken_mem: u64,
        taken_vcpus: u32,
    ) -> Result<(), FleetError> {
        let free_mem = self.opts.mem_bytes.saturating_sub(taken_mem);
        let free_vcpus = self.opts.vcpus.saturating_sub(taken_vcpus);
        if mem > free_mem || vcpus > free_vcpus {
            return Err(FleetError::Refused(format!(
                "no room for VM {vm} on {}: it needs {} MiB and {vcpus} vCPUs here, {} MiB and \
                 {free_vcpus} vCPUs are free",
                self.opts.name,
                mem >> 20,
                free_mem >> 20,
            )));
        }
        Ok(())
    }

    fn send(
        &self,
        name: &str,
        to: &str,
        options: MigrateOptions,
        progress: &mut dyn FnMut(Value),
    ) -> Result<Value, FleetError> {
        let socket = self.vms.socket(name)?;
        let _sending = self.vms.sending(name)?;
        let (verify_asked, to_named) = (options.verify, to.to_string());
        let to: Endpoint = to
            .parse()
            .map_err(|e| FleetError::Refused(format!("destination {to}: {e}")))?;
        let req = Control::Migrate(MigrateRequest {
            to,
            options,
            timeline: None,
        });
        let reply = ControlClient::connect(&socket)
            .and_then(|mut c| c.call_with_progress(&req, &mut |p| progress(p.clone())))
            .map_err(|e| FleetError::Vm {
                vm: name.into(),
                reason: e.to_string(),
            })?;
        // It runs at the destination now: its VMM here ends, unless its
        // clients could not move with it (it forwards them, and stays).
        // The VM has left whether or not its figures read: the books follow
        // it first.
        let reply = serde_json::from_value::<SendReply>(reply).map_err(|e| FleetError::Vm {
            vm: name.into(),
            reason: format!("moved, but the migration's figures do not read: {e}"),
        });
        let forwarded = reply
            .as_ref()
            .is_ok_and(|r| r.stats.clients.as_ref().is_some_and(|c| !c.moved));
        if let Ok(r) = &reply {
            let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
            if sent.len() == SENT_KEPT {
                sent.pop_front();
            }
            sent.push_back(SentVm {
                vm: name.into(),
                to: to_named,
                verify: verify_asked,
                verified_pages: r.stats.verified_pages,
            });
        }
        if forwarded {
            self.vms.forwarding(name);
        } else {
            // The reply need not wait for the old process to wind down:
            // the VM is forgotten here now, and the agent's tick reaps its
            // VMM once it ends (a move that waited for it took longer).
            self.vms.forget(name);
        }
        reply_of(reply?)
    }
}

/// How many of its latest sends an agent lists.
const SENT_KEPT: usize = 64;

/// Runs `agent` until `stop`, keeping its books every second.
pub fn run_until(agent: &Agent, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10 {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        agent.tick();
    }
}

/// A typed reply as the line's fields (the wire adds `ok`).
fn reply_of<T: serde::Serialize>(r: T) -> Result<Value, FleetError> {
    serde_json::to_value(r).map_err(|e| FleetError::Refused(format!("a reply not written: {e}")))
}
