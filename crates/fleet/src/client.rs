//! Calling an agent: connect (mutual TLS with this host's credentials,
//! unless the process runs `--insecure`), send one request, read progress
//! lines and the reply.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_tls::{Connection, Credentials};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::{HostInfo, Request, VmInfo, VmSpec, MAX_LINE};
use crate::reply::{
    InfoReply, RatesReply, ReadyReply, SendProgress, SendReply, StartReply, StopReply, StoreReply,
    UpgradeReply,
};
use crate::wire::{self, HANDSHAKE_WITHIN};
use crate::FleetError;

/// An agent's address and how to reach it.
#[derive(Clone)]
pub struct AgentClient {
    addr: SocketAddr,
    tls: Option<Arc<Credentials>>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("addr", &self.addr)
            .finish()
    }
}

/// How long a quick request (info, start, stop) may take in all.
const QUICK: Duration = Duration::from_secs(60);

impl AgentClient {
    /// The agent at `addr`, reached with `tls` (None: plaintext, for
    /// `--insecure` fleets only).
    pub fn new(addr: SocketAddr, tls: Option<Arc<Credentials>>) -> Self {
        AgentClient { addr, tls }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the agent says of its host.
    pub fn info(&self) -> Result<HostInfo, FleetError> {
        Ok(self.ask::<InfoReply>(&Request::Info, &mut |_| {})?.host)
    }

    /// How fast each running VM here dirties memory (bytes/s).
    pub fn dirty_rates(&self) -> Result<std::collections::BTreeMap<String, f64>, FleetError> {
        Ok(self
            .ask::<RatesReply>(&Request::DirtyRates, &mut |_| {})?
            .rates)
    }

    /// Starts VM `vm` here.
    pub fn start(&self, vm: VmSpec) -> Result<VmInfo, FleetError> {
        Ok(self
            .ask::<StartReply>(&Request::Start { vm }, &mut |_| {})?
            .vm)
    }

    /// Stops VM `name`'s VMM here, and its memory servers or standby.
    pub fn stop(&self, name: &str) -> Result<StopReply, FleetError> {
        self.ask(&Request::Stop { name: name.into() }, &mut |_| {})
    }

    /// Starts a memory server of `bytes` here for split VM `vm`'s pages.
    pub fn store(&self, vm: &str, bytes: u64) -> Result<StoreReply, FleetError> {
        let vm = vm.into();
        self.ask(&Request::Store { vm, bytes }, &mut |_| {})
    }

    /// Starts a postcopy standby here for VM `vm`'s move (at most `bytes`).
    pub fn standby(&self, vm: &str, bytes: u64) -> Result<StoreReply, FleetError> {
        let vm = vm.into();
        self.ask(&Request::Standby { vm, bytes }, &mut |_| {})
    }

    /// A waiting VMM for a VM on its way here (`Request::Receive`).
    pub fn receive(&self, req: &Request) -> Result<ReadyReply, FleetError> {
        self.expect(req, matches!(req, Request::Receive { .. }))?;
        self.ask(req, &mut |_| {})
    }

    /// Moves a VM (`Request::Send`), handing its progress to `progress`.
    pub fn send(
        &self,
        req: &Request,
        progress: &mut dyn FnMut(&SendProgress),
    ) -> Result<SendReply, FleetError> {
        self.expect(req, matches!(req, Request::Send { .. }))?;
        let agent = self.addr.to_string();
        self.ask(
            req,
            &mut |p| match serde_json::from_value::<SendProgress>(p.clone()) {
                Ok(p) => progress(&p),
                Err(e) => tracing::warn!("agent {agent}: a progress line that is not one: {e}"),
            },
        )
    }

    /// Hands VM `name` to a new VMM process here.
    pub fn upgrade(
        &self,
        name: &str,
        binary: Option<std::path::PathBuf>,
    ) -> Result<UpgradeReply, FleetError> {
        let req = Request::Upgrade {
            name: name.into(),
            binary,
        };
        self.ask(&req, &mut |_| {})
    }

    fn expect(&self, req: &Request, right: bool) -> Result<(), FleetError> {
        if right {
            Ok(())
        } else {
            Err(FleetError::Refused(format!(
                "a {} request where another was expected",
                req.op()
            )))
        }
    }

    /// Sends `req` and decodes its reply as `T`.
    fn ask<T: DeserializeOwned>(
        &self,
        req: &Request,
        progress: &mut dyn FnMut(&Value),
    ) -> Result<T, FleetError> {
        let v = self.call_with_progress(req, progress)?;
        serde_json::from_value(v).map_err(|e| FleetError::Link {
            agent: self.addr.to_string(),
            reason: format!("an answer to {} that is not one: {e}", req.op()),
        })
    }

    /// Sends `req`; its reply's fields (without `ok`).
    pub fn call(&self, req: &Request) -> Result<Value, FleetError> {
        self.call_with_progress(req, &mut |_| {})
    }

    /// Sends `req`, handing progress lines to `progress`; a move may take
    /// long (its VMM bounds each step), any other request a minute.
    pub fn call_with_progress(
        &self,
        req: &Request,
        progress: &mut dyn FnMut(&Value),
    ) -> Result<Value, FleetError> {
        let link = |reason: String| FleetError::Link {
            agent: self.addr.to_string(),
            reason,
        };
        let mut c = Connection::connect(self.addr, self.tls.as_deref(), HANDSHAKE_WITHIN)
            .map_err(|e| link(e.to_string()))?;
        let line = serde_json::to_value(req).map_err(|e| link(e.to_string()))?;
        wire::write_line(&mut c, &line).map_err(|e| link(e.to_string()))?;
        let long = matches!(req, Request::Send { .. } | Request::Upgrade { .. });
        let deadline = (!long).then(|| Instant::now() + QUICK);
        loop {
            let line = wire::read_line(&mut c, MAX_LINE, deadline)
                .map_err(|e| link(format!("reading its answer to {}: {e}", req.op())))?
                .ok_or_else(|| link(format!("closed without answering {}", req.op())))?;
            let mut v: Value = serde_json::from_str(&line)
                .map_err(|e| link(format!("an answer that is not JSON: {e}")))?;
            if let Some(p) = v.get("progress") {
                progress(p);
                continue;
            }
            let ok = v.get("ok").and_then(Value::as_bool);
            return match ok {
                Some(true) => {
                    if let Some(m) = v.as_object_mut() {
                        m.remove("ok");
                    }
                    Ok(v)
                }
                Some(false) => Err(FleetError::Agent {
                    agent: self.addr.to_string(),
                    op: req.op(),
                    error: v
                        .get("error")
                        .and_then(Value::as_str)
                        .unwrap_or("(no reason given)")
                        .to_string(),
                }),
                None => Err(link(format!("an answer without \"ok\": {line}"))),
            };
        }
    }
}
