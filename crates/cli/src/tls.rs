//! Where the CLI finds this host's TLS credentials for an `etcds://`
//! registry: `$FERRY_TLS_DIR`, else ferry-tls's default directory. This
//! stands in for the shared `--tls-dir` flag, which will replace it; every
//! registry the CLI opens gets its credentials here, so the change is one
//! function.

use std::sync::Arc;

use anyhow::{Context, Result};
use ferry_tls::Credentials;

/// The credentials an `etcds://` registry needs, or `None` for any other
/// registry (nothing is read then).
pub fn credentials_for_registry(addr: Option<&str>) -> Result<Option<Arc<Credentials>>> {
    let Some(addr) = addr.filter(|a| a.starts_with("etcds://")) else {
        return Ok(None);
    };
    let dir = std::env::var_os(ferry_tls::TLS_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map_or_else(ferry_tls::default_dir, Into::into);
    let credentials = Credentials::load(&dir).with_context(|| {
        format!(
            "registry {addr} speaks TLS and needs this host's credentials; looked in {} \
             (${} if set, else {})",
            dir.display(),
            ferry_tls::TLS_DIR_ENV,
            ferry_tls::default_dir().display()
        )
    })?;
    Ok(Some(credentials))
}
