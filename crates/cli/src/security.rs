//! What this process's TCP links speak, chosen once at start from the
//! global flags: mutual TLS with the host's credentials (`--tls-dir`, else
//! `FERRY_TLS_DIR`, else `/etc/ferry/tls`), or plaintext with `--insecure`
//! (or `FERRY_INSECURE=1`). The choice is written back into the
//! environment so that a VMM this process starts (a handover's new
//! process) makes the same one.

use std::path::{Path, PathBuf};

use ferry_migration::transport::{self, Security};
use ferry_tls::{Credentials, TLS_DIR_ENV};

/// The environment variable that means `--insecure`.
pub const INSECURE_ENV: &str = "FERRY_INSECURE";

/// Where this host's credentials are: the flag, the environment, the
/// default.
pub fn tls_dir(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os(TLS_DIR_ENV).map(PathBuf::from))
        .unwrap_or_else(ferry_tls::default_dir)
}

/// Installs the process's security. Missing credentials are not an error
/// here: a VM that never migrates needs none, and the first TCP link says
/// what is missing and how to make it.
pub fn install(flag: Option<PathBuf>, insecure: bool) {
    let insecure = insecure || std::env::var(INSECURE_ENV).is_ok_and(|v| v == "1");
    if insecure {
        // Called before any thread starts (first thing in main).
        std::env::set_var(INSECURE_ENV, "1");
        transport::install(Security::Insecure);
        return;
    }
    let dir = tls_dir(flag);
    std::env::set_var(TLS_DIR_ENV, &dir);
    match Credentials::load(&dir) {
        Ok(c) => transport::install(Security::Tls(c)),
        Err(e) => transport::install(Security::Missing(std::sync::Arc::new(e))),
    }
}

/// The credentials an `etcds://` registry needs (this process's, the ones
/// `--tls-dir` chose), or `None` for any other registry.
pub fn credentials_for_registry(
    addr: Option<&str>,
) -> anyhow::Result<Option<std::sync::Arc<Credentials>>> {
    use anyhow::Context;
    let Some(addr) = addr.filter(|a| a.starts_with("etcds://")) else {
        return Ok(None);
    };
    if let Some(c) = transport::credentials() {
        return Ok(Some(c));
    }
    let dir = tls_dir(None);
    let c = Credentials::load(&dir).with_context(|| {
        format!(
            "registry {addr} speaks TLS and needs this host's credentials; looked in {} \
             (--tls-dir, else ${TLS_DIR_ENV}, else {})",
            dir.display(),
            ferry_tls::default_dir().display()
        )
    })?;
    Ok(Some(c))
}

/// The credentials this host speaks to the fleet's agents with (and serves
/// as an agent with): its own, or None with `--insecure`; an error that
/// says where they were looked for if it has none.
pub fn fleet_credentials() -> anyhow::Result<Option<std::sync::Arc<Credentials>>> {
    if let Some(c) = transport::credentials() {
        return Ok(Some(c));
    }
    if insecure_chosen() {
        return Ok(None);
    }
    let dir = tls_dir(None);
    match Credentials::load(&dir) {
        Ok(c) => Ok(Some(c)),
        Err(e) => Err(anyhow::anyhow!(
            "the fleet's agents speak mutual TLS and this host has no credentials: {e}"
        )),
    }
}

/// Why `--tls-dir` would change nothing on a command.
pub enum NoLink<'a> {
    /// It only talks to the VMM at this control socket, which opens every
    /// link itself, with the credentials it was started with.
    Vmm(&'a Path),
    /// It opens no TLS link at all: what it does instead.
    Plain(&'static str),
}

/// The refusal of `--tls-dir` on `ferry NAME` (a flag that changes
/// nothing must not look as if it did): why, with what the VMM speaks
/// instead (its status says), and what to do.
pub fn tls_dir_refusal(name: &str, why: NoLink) -> String {
    refusal(
        "--tls-dir",
        &format!("--tls-dir (or {TLS_DIR_ENV})"),
        name,
        why,
    )
}

/// The same for `--insecure` given on the command line (FERRY_INSECURE=1
/// in the environment is for every command, and not refused).
pub fn insecure_refusal(name: &str, why: NoLink) -> String {
    refusal("--insecure", "--insecure", name, why)
}

fn refusal(flag: &str, give: &str, name: &str, why: NoLink) -> String {
    match why {
        NoLink::Vmm(socket) => {
            let started = match vmm_links(socket) {
                Ok(l) => format!("started with {l}"),
                Err(e) => format!("which ones it could not be asked: {e:#}"),
            };
            format!(
                "{flag} has no effect on `ferry {name}`: the VMM at {} connects with its own \
                 credentials ({started}); give {give} to the `ferry run` that starts a VMM, and \
                 drop it here",
                socket.display()
            )
        }
        NoLink::Plain(what) => {
            format!("{flag} has no effect on `ferry {name}`: {what}; drop it")
        }
    }
}

/// What the VMM at `socket` says its links speak.
fn vmm_links(socket: &Path) -> anyhow::Result<String> {
    use ferry_vmm::control::{ControlClient, Request};
    let s = ControlClient::connect(socket)?.call(&Request::Status)?;
    Ok(s["links"]
        .as_str()
        .unwrap_or("settings it does not show (an older ferry)")
        .to_string())
}

/// True if this process was started with `--insecure` (or its variable).
fn insecure_chosen() -> bool {
    std::env::var(INSECURE_ENV).is_ok_and(|v| v == "1")
}

/// The credentials a metrics endpoint at `at` serves with: none on a
/// loopback address (only this host reaches it); on any other, this host's,
/// so that only fleet scrapers read the VM's figures; plaintext there only
/// with `--insecure`, which warns.
pub fn credentials_for_metrics(
    at: std::net::SocketAddr,
) -> anyhow::Result<Option<std::sync::Arc<Credentials>>> {
    metrics_tls(at, transport::credentials(), insecure_chosen())
}

fn metrics_tls(
    at: std::net::SocketAddr,
    creds: Option<std::sync::Arc<Credentials>>,
    insecure: bool,
) -> anyhow::Result<Option<std::sync::Arc<Credentials>>> {
    if at.ip().is_loopback() {
        return Ok(None);
    }
    if let Some(c) = creds {
        return Ok(Some(c));
    }
    if insecure {
        tracing::warn!(
            "--insecure: the metrics endpoint on {at} is PLAINTEXT HTTP: anyone who reaches it \
             reads the VM's figures"
        );
        return Ok(None);
    }
    anyhow::bail!(
        "metrics on {at}, not a loopback address, are served over mutual TLS with this host's \
         fleet certificate, and none was found in {} (ferry pki issue; --tls-dir); bind them to \
         127.0.0.1, or run with --insecure for plaintext",
        tls_dir(None).display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_speak_tls_off_loopback_and_plaintext_there_only_with_insecure() {
        let local = "127.0.0.1:9100".parse().unwrap();
        let wide = "10.77.0.1:9100".parse().unwrap();
        let dir = std::env::temp_dir().join(format!("ferry-metrics-tls-{}", std::process::id()));
        let host = ferry_tls::pki::local_fleet(&dir, "h").unwrap();
        let creds = Credentials::load(&host).unwrap();
        assert!(metrics_tls(local, Some(creds.clone()), false)
            .unwrap()
            .is_none());
        assert!(metrics_tls(local, None, false).unwrap().is_none());
        assert!(metrics_tls(wide, Some(creds), false).unwrap().is_some());
        assert!(metrics_tls(wide, None, true).unwrap().is_none());
        let Err(e) = metrics_tls(wide, None, false) else {
            panic!("plaintext metrics off loopback without --insecure")
        };
        let e = e.to_string();
        assert!(e.contains("127.0.0.1") && e.contains("--insecure"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
