//! Who the other end is, as its certificate (already verified against the
//! fleet CA) says: its names and addresses. `--from NAME` and a memory
//! server's owner checks compare against this.

use std::net::IpAddr;

use rustls_pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

/// The names and addresses in a certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The subject's common name, then each DNS name.
    pub names: Vec<String>,
    /// Each IP address.
    pub addresses: Vec<IpAddr>,
}

impl PeerIdentity {
    /// Reads a certificate's subject and alternative names.
    pub fn of(cert: &CertificateDer<'_>) -> Result<PeerIdentity, String> {
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
            .map_err(|e| format!("not an X.509 certificate: {e}"))?;
        let mut id = PeerIdentity::default();
        for cn in x.subject().iter_common_name() {
            if let Ok(s) = cn.as_str() {
                id.names.push(s.to_string());
            }
        }
        if let Ok(Some(san)) = x.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::DNSName(d) if !id.names.iter().any(|x| x == d) => {
                        id.names.push(d.to_string())
                    }
                    GeneralName::IPAddress(b) => {
                        if let Ok(v4) = <[u8; 4]>::try_from(*b) {
                            id.addresses.push(IpAddr::from(v4));
                        } else if let Ok(v6) = <[u8; 16]>::try_from(*b) {
                            id.addresses.push(IpAddr::from(v6));
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(id)
    }

    /// The name to show: the first one, or "(unnamed)".
    pub fn name(&self) -> &str {
        self.names
            .first()
            .map(String::as_str)
            .unwrap_or("(unnamed)")
    }

    /// True if the certificate names `name` (a host name, case aside, or
    /// an address).
    pub fn is(&self, name: &str) -> bool {
        match name.parse::<IpAddr>() {
            Ok(ip) => self.addresses.contains(&ip),
            Err(_) => self.names.iter().any(|n| n.eq_ignore_ascii_case(name)),
        }
    }
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
