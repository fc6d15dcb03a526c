//! One host's credentials: a directory with the fleet's `ca.pem`, the
//! host's `cert.pem` and its `key.pem`, and the rustls configs made from
//! them. Every link asks for a config when it opens, and a config is
//! rebuilt when a file has changed (checked at most once a second), so a
//! rotated certificate takes effect on the next link without restarting
//! anything; links already open keep the one they began with.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::{PeerIdentity, TlsError};

/// The fleet CA's certificate, in a host directory.
pub const CA_FILE: &str = "ca.pem";
/// The host's certificate (chain), in a host directory.
pub const CERT_FILE: &str = "cert.pem";
/// The host's private key, in a host directory.
pub const KEY_FILE: &str = "key.pem";
/// The environment variable naming a host directory.
pub const TLS_DIR_ENV: &str = "FERRY_TLS_DIR";

/// Where a host's credentials are when neither `--tls-dir` nor
/// `FERRY_TLS_DIR` says: `/etc/ferry/tls` (`ip netns exec` shows a lab
/// host its own `/etc/netns/HOST/ferry` there).
pub fn default_dir() -> PathBuf {
    PathBuf::from("/etc/ferry/tls")
}

/// A host's credentials and the configs made from them, rebuilt when the
/// files change.
pub struct Credentials {
    dir: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
}

struct Loaded {
    stamp: Stamp,
    checked: Instant,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    me: PeerIdentity,
}

/// What identifies the files' contents cheaply: inode, size and mtime of
/// each (a rename over a file changes the inode).
type Stamp = [(u64, u64, i64, i64); 3];

impl Credentials {
    /// Loads the credentials in `dir` (see [`default_dir`]).
    pub fn load(dir: &Path) -> Result<Arc<Credentials>, TlsError> {
        Self::load_with(dir, Arc::new(provider()))
    }

    /// [`load`](Self::load) with a crypto provider of the caller's (tests
    /// shrink a cipher's record limit to see keys renewed).
    #[doc(hidden)]
    pub fn load_with(
        dir: &Path,
        provider: Arc<CryptoProvider>,
    ) -> Result<Arc<Credentials>, TlsError> {
        let files = [CA_FILE, CERT_FILE, KEY_FILE].map(|f| dir.join(f));
        if files.iter().all(|f| !f.exists()) {
            return Err(TlsError::Missing { dir: dir.into() });
        }
        let loaded = build(dir, &provider)?;
        Ok(Arc::new(Credentials {
            dir: dir.into(),
            provider,
            loaded: Mutex::new(loaded),
        }))
    }

    /// The directory they come from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// This host as its certificate names it.
    pub fn me(&self) -> PeerIdentity {
        self.current().me.clone()
    }

    /// The config a listening side handshakes with (peers must present a
    /// certificate that chains to the fleet CA).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.current().server.clone()
    }

    /// The config a connecting side handshakes with (it presents this
    /// host's certificate and checks the peer's against the fleet CA).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.current().client.clone()
    }

    /// The configs, rebuilt first if a file changed since the last look
    /// (a broken new file keeps the old configs, and says so).
    fn current(&self) -> std::sync::MutexGuard<'_, Loaded> {
        let mut l = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if l.checked.elapsed() >= Duration::from_secs(1) {
            l.checked = Instant::now();
            if stamp(&self.dir) != l.stamp {
                match build(&self.dir, &self.provider) {
                    Ok(new) => {
                        tracing::info!(dir = %self.dir.display(), "TLS credentials changed on disk; reloaded");
                        *l = new;
                    }
                    Err(e) => tracing::warn!(
                        "TLS credentials in {} changed but cannot be loaded; keeping the old ones: {e}",
                        self.dir.display()
                    ),
                }
            }
        }
        l
    }
}

/// ring's ciphers, AES-128-GCM first: ten AES rounds to AES-256's
/// fourteen, a quarter less of the cost TLS adds to a migration (the
/// cipher is most of it once records are not copied around), and still
/// 128-bit security.
pub fn provider() -> CryptoProvider {
    use rustls::crypto::ring::{cipher_suite as cs, default_provider};
    CryptoProvider {
        cipher_suites: vec![
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..default_provider()
    }
}

fn build(dir: &Path, provider: &Arc<CryptoProvider>) -> Result<Loaded, TlsError> {
    let stamp = stamp(dir);
    let roots = {
        let path = dir.join(CA_FILE);
        let mut store = RootCertStore::empty();
        for c in certs(&path)? {
            store.add(c).map_err(|e| TlsError::Bad {
                path: path.clone(),
                reason: format!("not a usable CA certificate: {e}"),
            })?;
        }
        Arc::new(store)
    };
    let cert_path = dir.join(CERT_FILE);
    let chain = certs(&cert_path)?;
    let me = PeerIdentity::of(&chain[0]).map_err(|reason| TlsError::Bad {
        path: cert_path.clone(),
        reason,
    })?;
    let key_path = dir.join(KEY_FILE);
    let key = PrivateKeyDer::from_pem_slice(&read(&key_path)?).map_err(|e| TlsError::Bad {
        path: key_path.clone(),
        reason: format!("no private key: {e}"),
    })?;
    let config = |e: rustls::Error| TlsError::Config(e.to_string());
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| TlsError::Bad {
            path: key_path.clone(),
            reason: format!("does not match {}: {e}", cert_path.display()),
        })?;
    // No session tickets: ferry never resumes a session, and a ticket is
    // bytes the client never reads on a send-only link (a bulk stream),
    // which turns its close into a reset at the other end.
    server.send_tls13_tickets = 0;
    // The keys go to ferry's own record layer after the handshake (see
    // `record`): rustls hands them over only when allowed to.
    server.enable_secret_extraction = true;
    let mut client = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| TlsError::Bad {
            path: key_path,
            reason: format!("does not match {}: {e}", cert_path.display()),
        })?;
    client.enable_secret_extraction = true;
    // ferry never resumes a session: nothing to remember.
    client.resumption = rustls::client::Resumption::disabled();
    Ok(Loaded {
        stamp,
        checked: Instant::now(),
        server: Arc::new(server),
        client: Arc::new(client),
        me,
    })
}

fn stamp(dir: &Path) -> Stamp {
    [CA_FILE, CERT_FILE, KEY_FILE].map(|f| {
        std::fs::metadata(dir.join(f))
            .map(|m| (m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
            .unwrap_or_default()
    })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.into(),
        source,
    })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Bad {
            path: path.into(),
            reason: format!("not PEM certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Bad {
            path: path.into(),
            reason: "holds no certificate".into(),
        });
    }
    Ok(certs)
}
