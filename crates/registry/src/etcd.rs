//! The registry in a real etcd (v3), through its JSON gateway (`/v3/...`
//! over HTTP; keys and values base64). Each host's key sits under a lease
//! of its own: renewing is a lease keep-alive, and a host that dies stops
//! renewing, so etcd deletes its key when the lease runs out.
//!
//! `etcds://HOST:PORT` speaks TLS with this host's fleet certificate as
//! the client certificate (etcd started with `--client-cert-auth` and the
//! fleet CA as `--trusted-ca-file`), and checks etcd's certificate against
//! the fleet CA; `etcd://HOST:PORT` is plaintext, and warns.
//!
//! Why a hand-written gateway client and not the maintained `etcd-client`
//! crate: etcd-client speaks gRPC through tonic, so it brings tokio, hyper,
//! h2, tower and prost (about 100 crates where this client adds none but
//! rustls, which ferry-tls already builds), compiles etcd's .proto files at
//! build time (so every build machine needs `protoc`), and is async: each
//! call from ferry's threads would go through a tokio runtime kept for it.
//! The registry needs five calls (lease grant, keep-alive and revoke, put,
//! range, delete), a few times a minute, which one HTTP/1.0 POST each does
//! (`http.rs`, ~150 lines, every size capped). ureq, used before,
//! could not take the fleet's rustls `ClientConfig` (its TLS settings take
//! PEM roots and a client key, not a config, so the TLS 1.3-only policy
//! and the reload on rotation of `ferry_tls::Credentials` would be lost),
//! so it is gone too: the same code speaks plaintext TCP or rustls
//! (`link.rs`), and the registry is sync, as ferry is.
//!
//! Keys: `/ferry/hosts/<name>`, value the [`HostEntry`] as JSON.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use ferry_tls::Credentials;
use serde_json::{json, Value};

use crate::http::shown;
use crate::link::Link;
use crate::{HostEntry, Registry, RegistryError};

const PREFIX: &str = "/ferry/hosts/";
/// Where the fleet's records (no lease) are kept.
const RECORDS: &str = "/ferry/records/";

/// A connection to etcd's gateway.
pub struct Etcd {
    /// The address as given (`etcd://…` or `etcds://…`), for messages.
    addr: String,
    link: Link,
    /// The lease under each name this process advertised.
    leases: Mutex<HashMap<String, String>>,
}

impl Etcd {
    /// `etcds://HOST:PORT` (TLS with `tls`'s client certificate) or
    /// `etcd://HOST:PORT` (plaintext; `tls` is not used): etcd's client
    /// port, 2379 by default.
    pub fn new(addr: &str, tls: Option<Arc<Credentials>>) -> Result<Self, RegistryError> {
        let bad = || RegistryError::BadAddress(addr.into());
        let (secure, hostport) = if let Some(h) = addr.strip_prefix("etcds://") {
            (true, h)
        } else if let Some(h) = addr.strip_prefix("etcd://") {
            (false, h)
        } else {
            return Err(bad());
        };
        match hostport.rsplit_once(':') {
            Some((host, port))
                if !host.is_empty() && !host.contains('/') && port.parse::<u16>().is_ok() => {}
            _ => return Err(bad()),
        }
        let link = match (secure, tls) {
            (true, Some(c)) => Link::tls(hostport, c).map_err(|reason| RegistryError::Etcd {
                endpoint: addr.into(),
                reason,
            })?,
            (true, None) => return Err(RegistryError::NoCredentials(addr.into())),
            (false, _) => {
                tracing::warn!(
                    "the registry link to {addr} is not encrypted: anyone on the path can read \
                     and forge host advertisements; use etcds://{hostport} with client \
                     certificates"
                );
                Link::plain(hostport)
            }
        };
        Ok(Etcd {
            addr: addr.into(),
            link,
            leases: Mutex::new(HashMap::new()),
        })
    }

    fn err(&self, reason: impl std::fmt::Display) -> RegistryError {
        RegistryError::Etcd {
            endpoint: self.addr.clone(),
            reason: reason.to_string(),
        }
    }

    /// One gateway call: POST a JSON body, get a JSON answer.
    fn call(&self, path: &str, body: Value) -> Result<Value, RegistryError> {
        let body = serde_json::to_vec(&body).map_err(|e| self.err(e))?;
        let answer = self
            .link
            .call(path, &body)
            .map_err(|e| self.err(format!("{path}: {e}")))?;
        let status = answer.status;
        let v: Value = serde_json::from_slice(&answer.body).map_err(|e| {
            self.err(format!(
                "{path}: HTTP {status}, and the answer is not JSON ({e}): {}",
                shown(&answer.body)
            ))
        })?;
        if !(200..300).contains(&status) || v.get("error").is_some() {
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
        self.addr.clone()
    }

    fn put_record(&self, key: &str, value: &[u8]) -> Result<(), RegistryError> {
        crate::check_key(key)?;
        if value.len() > crate::MAX_RECORD {
            return Err(RegistryError::BadKey(key.into()));
        }
        self.call(
            "/v3/kv/put",
            json!({"key": B64.encode(format!("{RECORDS}{key}")), "value": B64.encode(value)}),
        )
        .map(|_| ())
    }

    fn get_record(&self, key: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        crate::check_key(key)?;
        let v = self.call(
            "/v3/kv/range",
            json!({"key": B64.encode(format!("{RECORDS}{key}"))}),
        )?;
        Ok(records_of_range(&v)?.into_iter().next().map(|(_, v)| v))
    }

    fn delete_record(&self, key: &str) -> Result<(), RegistryError> {
        crate::check_key(key)?;
        self.call(
            "/v3/kv/deleterange",
            json!({"key": B64.encode(format!("{RECORDS}{key}"))}),
        )
        .map(|_| ())
    }

    fn records(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
        let from = format!("{RECORDS}{prefix}");
        // Every key from `from` up to the next key after all its
        // extensions: `from` with its last byte incremented.
        let mut end = from.clone().into_bytes();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let v = self.call(
            "/v3/kv/range",
            json!({"key": B64.encode(&from), "range_end": B64.encode(end)}),
        )?;
        records_of_range(&v)
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, u64)>, RegistryError> {
        crate::check_key(key)?;
        let v = self.call(
            "/v3/kv/range",
            json!({"key": B64.encode(format!("{RECORDS}{key}"))}),
        )?;
        let Some(kv) = v["kvs"].as_array().and_then(|a| a.first()) else {
            return Ok(None);
        };
        let value = records_of_range(&v)?
            .into_iter()
            .next()
            .map(|(_, v)| v)
            .unwrap_or_default();
        // etcd's revision of the key's last change: never 0 for a key that
        // exists (the gateway writes 64-bit numbers as strings).
        let rev = number(&kv["mod_revision"])
            .filter(|r| *r > 0)
            .ok_or_else(|| self.err(format!("record {key} came without its revision")))?;
        Ok(Some((value, rev)))
    }

    fn put_if_version(&self, key: &str, value: &[u8], version: u64) -> Result<bool, RegistryError> {
        crate::check_key(key)?;
        if value.len() > crate::MAX_RECORD {
            return Err(RegistryError::BadKey(key.into()));
        }
        let k = B64.encode(format!("{RECORDS}{key}"));
        // A key that does not exist compares with mod_revision 0.
        let v = self.call(
            "/v3/kv/txn",
            json!({
                "compare": [{"key": k, "target": "MOD", "result": "EQUAL",
                             "mod_revision": version.to_string()}],
                "success": [{"request_put": {"key": k, "value": B64.encode(value)}}],
            }),
        )?;
        // The gateway leaves false out of its answer.
        Ok(v["succeeded"].as_bool().unwrap_or(false))
    }
}

/// A 64-bit number as etcd's gateway writes it (a string, or a number).
fn number(v: &Value) -> Option<u64> {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| v.as_u64())
}

/// The records in a `/v3/kv/range` answer: (key without the records'
/// prefix, value), each value at most [`MAX_RECORD`](crate::MAX_RECORD).
fn records_of_range(v: &Value) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
    let mut out = Vec::new();
    for kv in v["kvs"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let key = B64
            .decode(kv["key"].as_str().unwrap_or(""))
            .ok()
            .and_then(|k| String::from_utf8(k).ok())
            .unwrap_or_default();
        let Some(key) = key.strip_prefix(RECORDS) else {
            continue;
        };
        let value = B64
            .decode(kv["value"].as_str().unwrap_or(""))
            .map_err(|e| RegistryError::BadEntry {
                key: key.into(),
                reason: e.to_string(),
            })?;
        if value.len() > crate::MAX_RECORD {
            return Err(RegistryError::BadKey(key.into()));
        }
        out.push((key.to_string(), value));
    }
    out.sort();
    Ok(out)
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
        assert!(Etcd::new("etcd://127.0.0.1:2379", None).is_ok());
        assert!(Etcd::new("etcd://etcd1:2379", None).is_ok());
        assert!(Etcd::new("etcd://[::1]:2379", None).is_ok());
        for bad in [
            "etcd://",
            "http://127.0.0.1:2379",
            "etcd://h:1/x",
            "etcd://h",
            "etcd://:2379",
            "etcd://h:port",
            "etcds://h:99999",
        ] {
            assert!(
                matches!(Etcd::new(bad, None), Err(RegistryError::BadAddress(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_tls_address_without_credentials_is_a_clear_error() {
        let err = Etcd::new("etcds://127.0.0.1:2379", None).err().unwrap();
        assert!(matches!(err, RegistryError::NoCredentials(_)), "{err}");
        assert!(err.to_string().contains("etcds://127.0.0.1:2379"), "{err}");
    }

    #[test]
    fn an_etcd_that_is_not_there_is_a_clear_error() {
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = Etcd::new(&format!("etcd://127.0.0.1:{port}"), None).unwrap();
        let err = e.hosts().unwrap_err().to_string();
        assert!(err.contains("etcd at etcd://127.0.0.1"), "{err}");
        assert!(err.contains("cannot connect"), "{err}");
    }
}
