//! A fleet's certificate authority and its host certificates, made with
//! rcgen: `ferry pki init` and `ferry pki issue`.
//!
//! A CA directory holds `ca.pem` and `ca-key.pem` (owner-only). A host
//! directory holds the fleet's `ca.pem`, the host's `cert.pem` and its
//! `key.pem` (owner-only). A host certificate names the host (its DNS SAN
//! and common name) and its addresses (IP SANs); it serves both as a TLS
//! server and as a TLS client, since every host is both.

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

use crate::{TlsError, CA_FILE, CERT_FILE, KEY_FILE};

/// The CA's private key, beside its certificate.
pub const CA_KEY_FILE: &str = "ca-key.pem";

/// When a certificate starts and stops being valid.
#[derive(Clone, Copy, Debug)]
pub struct Validity {
    /// Valid from.
    pub not_before: OffsetDateTime,
    /// Valid until.
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// From an hour ago (clocks differ) for `days` days.
    pub fn days(days: u32) -> Validity {
        let now = OffsetDateTime::now_utc();
        Validity {
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(i64::from(days)),
        }
    }

    /// Until `not_after` (which may be past: an expired certificate, for
    /// tests and drills), from a day before it or an hour ago, the earlier.
    pub fn until(not_after: OffsetDateTime) -> Validity {
        let hour_ago = OffsetDateTime::now_utc() - Duration::hours(1);
        Validity {
            not_before: hour_ago.min(not_after - Duration::days(1)),
            not_after,
        }
    }
}

/// What `init` and `issue` wrote.
#[derive(Clone, Debug)]
pub struct Written {
    /// The certificate's subject.
    pub name: String,
    /// The files, certificate first.
    pub files: Vec<PathBuf>,
    /// Its subject alternative names.
    pub sans: Vec<String>,
    /// Valid until (RFC 3339).
    pub not_after: String,
}

/// Makes a fleet CA in `dir`: refuses to overwrite one (every host
/// certificate of the fleet chains to it).
pub fn init_ca(dir: &Path, name: &str, validity: Validity) -> Result<Written, TlsError> {
    let key_path = dir.join(CA_KEY_FILE);
    if key_path.exists() {
        return Err(TlsError::Bad {
            path: key_path,
            reason: "a fleet CA is already here; remove it first to make a new one (every host \
                     certificate issued by it stops being trusted)"
                .into(),
        });
    }
    create_dir(dir)?;
    let key = KeyPair::generate().map_err(gen)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    let cert = params.self_signed(&key).map_err(gen)?;
    let ca = dir.join(CA_FILE);
    write_file(&key_path, key.serialize_pem().as_bytes(), true)?;
    write_file(&ca, cert.pem().as_bytes(), false)?;
    Ok(Written {
        name: name.into(),
        files: vec![ca, key_path],
        sans: vec![],
        not_after: rfc3339(validity.not_after),
    })
}

/// Issues a certificate for host `name` from the CA in `ca_dir` into
/// `out` (`cert.pem`, `key.pem`, and the CA's `ca.pem`). `sans` adds names
/// and addresses (an entry that parses as an IP is an address); the host's
/// own name is always one.
pub fn issue(
    ca_dir: &Path,
    name: &str,
    out: &Path,
    sans: &[String],
    validity: Validity,
) -> Result<Written, TlsError> {
    let ca_pem = read(&ca_dir.join(CA_FILE))?;
    let ca_key_pem = read(&ca_dir.join(CA_KEY_FILE))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| TlsError::Bad {
        path: ca_dir.join(CA_KEY_FILE),
        reason: format!("not a private key: {e}"),
    })?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| TlsError::Bad {
        path: ca_dir.join(CA_FILE),
        reason: format!("not a CA certificate: {e}"),
    })?;
    let mut all: Vec<String> = vec![name.to_string()];
    for s in sans {
        if !all.contains(s) {
            all.push(s.clone());
        }
    }
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(name);
    params.subject_alt_names = all
        .iter()
        .map(|s| match s.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => s
                .clone()
                .try_into()
                .map(SanType::DnsName)
                .map_err(|e| TlsError::Generate(format!("'{s}' is not a DNS name: {e}"))),
        })
        .collect::<Result<_, _>>()?;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
    let key = KeyPair::generate().map_err(gen)?;
    let cert = params.signed_by(&key, &issuer).map_err(gen)?;
    create_dir(out)?;
    let (c, k, a) = (out.join(CERT_FILE), out.join(KEY_FILE), out.join(CA_FILE));
    // The key first and the certificate last: a host reloading its
    // credentials as they change sees a matching pair once cert.pem moves.
    write_file(&a, ca_pem.as_bytes(), false)?;
    write_file(&k, key.serialize_pem().as_bytes(), true)?;
    write_file(&c, cert.pem().as_bytes(), false)?;
    Ok(Written {
        name: name.into(),
        files: vec![c, k, a],
        sans: all,
        not_after: rfc3339(validity.not_after),
    })
}

fn dn(name: &str) -> DistinguishedName {
    let mut d = DistinguishedName::new();
    d.push(DnType::CommonName, name);
    d
}

fn gen(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

fn read(p: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(p).map_err(|source| TlsError::Read {
        path: p.into(),
        source,
    })
}

fn create_dir(d: &Path) -> Result<(), TlsError> {
    std::fs::create_dir_all(d).map_err(|source| TlsError::Write {
        path: d.into(),
        source,
    })
}

/// Writes `p` whole or not at all (a temporary file renamed over it), mode
/// 0600 for secrets whatever the umask.
fn write_file(p: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    let err = |source| TlsError::Write {
        path: p.into(),
        source,
    };
    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(err)?;
    if secret {
        // The mode above is masked by the umask; this is not.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(err)?;
    }
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(err)?;
    std::fs::rename(&tmp, p).map_err(err)
}

/// A fleet of one host for tests and demos on one machine: a CA in
/// `dir/ca` and host `name`'s credentials in `dir/name`, valid for
/// 127.0.0.1, ::1 and localhost. Returns the host's directory.
pub fn local_fleet(dir: &Path, name: &str) -> Result<PathBuf, TlsError> {
    let ca = dir.join("ca");
    let host = dir.join(name);
    let _ = std::fs::remove_dir_all(&ca);
    init_ca(&ca, "ferry local CA", Validity::days(7))?;
    let sans = ["127.0.0.1", "::1", "localhost"].map(String::from);
    issue(&ca, name, &host, &sans, Validity::days(7))?;
    Ok(host)
}
