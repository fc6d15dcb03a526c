//! How this process secures the TCP links it opens and accepts: mutual TLS
//! with the host's credentials, or plaintext when an operator said
//! `--insecure`. Chosen once, at start, for the whole process (a host has
//! one identity); Unix-socket links stay on the host and are not wrapped.

use std::sync::{Arc, RwLock};

use ferry_tls::{Credentials, TlsError};

/// What the TCP links of this process speak.
#[derive(Clone)]
pub enum Security {
    /// Mutual TLS: this host's certificate, the fleet CA's for peers.
    Tls(Arc<Credentials>),
    /// Plaintext, unauthenticated: only with `--insecure`.
    Insecure,
    /// No credentials were found and plaintext was not asked for: every
    /// TCP link fails with this (which says how to make them).
    Missing(Arc<TlsError>),
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Security::Tls(c) => write!(f, "Tls({})", c.dir().display()),
            Security::Insecure => f.write_str("Insecure"),
            Security::Missing(e) => write!(f, "Missing({e})"),
        }
    }
}

impl Security {
    /// TLS as the one host of a throwaway fleet made in `dir` (valid for
    /// 127.0.0.1 and localhost): for tests and demos on one machine.
    pub fn local_fleet(dir: &std::path::Path) -> Result<Security, TlsError> {
        let host = ferry_tls::pki::local_fleet(dir, "local-host")?;
        Ok(Security::Tls(Credentials::load(&host)?))
    }
}

static INSTALLED: RwLock<Option<Security>> = RwLock::new(None);

/// Chooses what every TCP link of this process speaks from now on.
pub fn install(s: Security) {
    if matches!(s, Security::Insecure) {
        tracing::warn!(
            "--insecure: migration and memory-server links of this process are PLAINTEXT and \
             UNAUTHENTICATED: anyone on the network can read the guest's memory, and anyone who \
             reaches a waiting port can push a VM into it"
        );
    }
    *INSTALLED.write().unwrap_or_else(|p| p.into_inner()) = Some(s);
}

/// What was installed; nothing installed is an error (a library user must
/// choose, as the CLI does).
pub(crate) fn installed() -> Result<Security, TlsError> {
    match INSTALLED.read().unwrap_or_else(|p| p.into_inner()).clone() {
        Some(Security::Missing(e)) => Err(clone_err(&e)),
        Some(s) => Ok(s),
        None => Err(TlsError::Config(
            "this process chose neither TLS credentials nor --insecure for its TCP links \
             (ferry_migration::transport::install)"
                .into(),
        )),
    }
}

/// The credentials in use, if any (for status and the registry client).
pub fn credentials() -> Option<Arc<Credentials>> {
    match INSTALLED.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
        Some(Security::Tls(c)) => Some(c.clone()),
        _ => None,
    }
}

/// What this process's TCP links speak, in the words of the flag that
/// chose it (`--tls-dir DIR` for credentials from DIR, whichever way DIR
/// was given; `--insecure`), or why they fail: `ferry status` shows it, and
/// a command that opens no link of its own names it when it refuses
/// `--tls-dir`.
pub fn describe() -> String {
    match INSTALLED.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
        Some(Security::Tls(c)) => format!("--tls-dir {}", c.dir().display()),
        Some(Security::Insecure) => "--insecure".into(),
        Some(Security::Missing(e)) => format!("no credentials: {e}"),
        None => "neither credentials nor --insecure".into(),
    }
}

fn clone_err(e: &TlsError) -> TlsError {
    match e {
        TlsError::Missing { dir } => TlsError::Missing { dir: dir.clone() },
        other => TlsError::Config(other.to_string()),
    }
}
