//! The registry in a real etcd (v3), through its JSON gateway (`/v3/...`
//! over HTTP; keys and values base64). Each host's key sits under a lease
//! of its own: renewing is a lease keep-alive, and a host that dies stops
//! renewing, so etcd deletes its key when the lease runs out.
//!
//! Keys: `/ferry/hosts/<name>`, value the [`HostEntry`] as JSON.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

use crate::{HostEntry, Registry, RegistryError};

const PREFIX: &str = "/ferry/hosts/";

/// A connection to etcd's gateway.
pub struct Etcd {
    endpoint: String,
    agent: ureq::Agent,
    /// The lease under each name this process advertised.
    leases: Mutex<HashMap<String, String>>,
}

impl Etcd {
    /// `etcd://HOST:PORT` (the client port, 2379 by default).
    pub fn new(addr: &str) -> Result<Self, RegistryError> {
        let hostport = addr
            .strip_prefix("etcd://")
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .ok_or_else(|| RegistryError::BadAddress(addr.into()))?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(3)))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Etcd {
            endpoint: format!("http://{hostport}"),
            agent,
            leases: Mutex::new(HashMap::new()),
        })
    }

    fn err(&self, reason: impl std::fmt::Display) -> RegistryError {
        RegistryError::Etcd {
            endpoint: self.endpoint.clone(),
            reason: reason.to_string(),
        }
    }

    /// One gateway call: POST a JSON body, get a JSON answer.
    fn call(&self, path: &str, body: Value) -> Result<Value, RegistryError> {
        let mut resp = self
            .agent
            .post(format!("{}{path}", self.endpoint))
            .send_json(&body)
            .map_err(|e| self.err(e))?;
        let status = resp.status();
        let v: Value = resp
            .body_mut()
            .read_json()
            .map_err(|e| self.err(format!("{path}: answer is not JSON: {e}")))?;
        if !status.is_success() || v.get("error").is_some() {
            let msg = v["message"].as_str().or(v["error"].as_str()).unwrap_or("");
            return Err(self.err(format!("{path}: HTTP {status}: {msg}")));
        }
        Ok(v)
    }

    fn lease_of(&self, name: &str) -> Option<String> {
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }
}

fn key(name: &str) -> String {
    B64.encode(format!("{PREFIX}{name}"))
}

impl Registry for Etcd {
    fn advertise(&self, entry: &HostEntry, ttl: Duration) -> Result<(), RegistryError> {
        let lease = match self.lease_of(&entry.name) {
            Some(l) => l,
            None => {
                let v = self.call("/v3/lease/grant", json!({"TTL": ttl.as_secs().max(1)}))?;
                let id = v["ID"]
                    .as_str()
                    .map(String::from)
                    .or_else(|| v["ID"].as_i64().map(|i| i.to_string()))
                    .ok_or_else(|| self.err("lease grant gave no ID"))?;
                self.leases
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(entry.name.clone(), id.clone());
                id
            }
        };
        let value = serde_json::to_vec(entry).map_err(|e| self.err(e))?;
        let r = self.call(
            "/v3/kv/put",
            json!({"key": key(&entry.name), "value": B64.encode(value), "lease": lease}),
        );
        if r.is_err() {
            // The lease may have expired: the next try takes a new one.
            self.leases
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&entry.name);
        }
        r.map(|_| ())
    }

    fn refresh(&self, name: &str, _ttl: Duration) -> Result<(), RegistryError> {
        let lease = self
            .lease_of(name)
            .ok_or_else(|| self.err(format!("{name} holds no lease here")))?;
        let v = self.call("/v3/lease/keepalive", json!({"ID": lease}))?;
        // An expired lease answers with TTL 0 or none: the key is gone.
        let ttl = v["result"]["TTL"]
            .as_str()
            .and_then(|s| s.parse::<i64>().ok())
            .or_else(|| v["result"]["TTL"].as_i64())
            .unwrap_or(0);
        if ttl <= 0 {
            self.leases
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(name);
            return Err(self.err(format!("the lease of {name} expired")));
        }
        Ok(())
    }

    fn withdraw(&self, name: &str) -> Result<(), RegistryError> {
        let lease = self
            .leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        self.call("/v3/kv/deleterange", json!({"key": key(name)}))?;
        if let Some(id) = lease {
            // Revoking deletes nothing more; it only frees the lease.
            let _ = self.call("/v3/lease/revoke", json!({"ID": id}));
        }
        Ok(())
    }

    fn hosts(&self) -> Result<Vec<HostEntry>, RegistryError> {
        // Every key with the prefix: range_end is the prefix with its last
        // byte incremented ('/' + 1 = '0').
        let end = format!("{}0", PREFIX.trim_end_matches('/'));
        let v = self.call(
            "/v3/kv/range",
            json!({"key": B64.encode(PREFIX), "range_end": B64.encode(end)}),
        )?;
        entries_of_range(&v)
    }

    fn describe(&self) -> String {
        self.endpoint.replace("http://", "etcd://")
    }
}

/// The hosts in a `/v3/kv/range` answer (base64 values of [`HostEntry`]
/// JSON), sorted by name; an entry that does not parse is skipped with a
/// warning. Public for the fuzz targets (fuzz/, docs/fuzzing.md).
#[doc(hidden)]
pub fn entries_of_range(v: &Value) -> Result<Vec<HostEntry>, RegistryError> {
    let mut out = Vec::new();
    for kv in v["kvs"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let k = kv["key"].as_str().unwrap_or("");
        let bad = |reason: String| RegistryError::BadEntry {
            key: String::from_utf8_lossy(&B64.decode(k).unwrap_or_default()).into(),
            reason,
        };
        let raw = B64
            .decode(kv["value"].as_str().unwrap_or(""))
            .map_err(|e| bad(e.to_string()))?;
        match serde_json::from_slice::<HostEntry>(&raw) {
            Ok(e) => out.push(e),
            Err(e) => tracing::warn!("{}", bad(e.to_string())),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked() {
        assert!(Etcd::new("etcd://127.0.0.1:2379").is_ok());
        assert!(Etcd::new("etcd://").is_err());
        assert!(Etcd::new("http://127.0.0.1:2379").is_err());
        assert!(Etcd::new("etcd://h:1/x").is_err());
    }

    #[test]
    fn an_etcd_that_is_not_there_is_a_clear_error() {
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = Etcd::new(&format!("etcd://127.0.0.1:{port}")).unwrap();
        let err = e.hosts().unwrap_err().to_string();
        assert!(err.contains("etcd at http://127.0.0.1"), "{err}");
    }
}
