//! What can go wrong with a fleet's certificates and handshakes.

use std::path::PathBuf;

/// A TLS or certificate failure, with the file or peer it concerns.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A credentials file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// No credentials where they were looked for.
    #[error(
        "no TLS credentials in {dir} (it needs ca.pem, cert.pem and key.pem): make them with \
         `ferry pki issue NAME --dir CA --out {dir}`, point --tls-dir or FERRY_TLS_DIR at them, \
         or pass --insecure to use plaintext"
    )]
    Missing {
        /// The directory looked in.
        dir: PathBuf,
    },
    /// A file holds no usable certificate or key.
    #[error("{path}: {reason}")]
    Bad {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Making a certificate failed.
    #[error("cannot make the certificate: {0}")]
    Generate(String),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
    /// The handshake failed: the peer's certificate, or ours, was refused,
    /// or the peer does not speak TLS.
    #[error("TLS handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer's address.
        peer: String,
        /// Why, in words.
        reason: String,
    },
    /// The peer could not be reached at all.
    #[error("cannot connect to {peer}: {error}")]
    Connect {
        /// The peer's address.
        peer: String,
        /// Why.
        error: std::io::Error,
    },
    /// The peer closed the connection before sending a byte: a port probe
    /// or a health check, not worth a warning.
    #[error("{peer} closed the connection without a word")]
    Silent {
        /// The peer's address.
        peer: String,
    },
    /// The handshake did not finish in time.
    #[error("TLS handshake with {peer} did not finish within {secs} s")]
    HandshakeTimeout {
        /// The peer's address.
        peer: String,
        /// The limit.
        secs: u64,
    },
}

impl TlsError {
    /// True if `e` (as the transport passes it on) is [`TlsError::Silent`].
    pub fn is_silent(e: &std::io::Error) -> bool {
        e.get_ref()
            .and_then(|i| i.downcast_ref::<TlsError>())
            .is_some_and(|t| matches!(t, TlsError::Silent { .. }))
    }
}

/// Why a peer hangs up mid-handshake, as far as this end can tell.
pub(crate) const CLOSED_IN_HANDSHAKE: &str =
    "the peer closed the connection during the handshake (it may \
     have refused this host's certificate, or it does not speak TLS)";

/// A rustls error in words an operator can act on.
pub(crate) fn explain(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(C::Expired) | E::InvalidCertificate(C::ExpiredContext { .. }) => {
            "the peer's certificate has expired".into()
        }
        E::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            "the peer's certificate is not from this fleet's CA".into()
        }
        E::InvalidCertificate(C::NotValidForName)
        | E::InvalidCertificate(C::NotValidForNameContext { .. }) => {
            "the peer's certificate does not name the address connected to".into()
        }
        E::InvalidCertificate(c) => format!("the peer's certificate was refused: {c:?}"),
        E::NoCertificatesPresented => "the peer presented no certificate".into(),
        E::AlertReceived(A::CertificateExpired) => {
            "the peer refused this host's certificate: it has expired".into()
        }
        E::AlertReceived(A::UnknownCA) => {
            "the peer refused this host's certificate: not from its fleet's CA".into()
        }
        E::AlertReceived(A::BadCertificate | A::CertificateRequired | A::CertificateUnknown) => {
            "the peer refused this host's certificate".into()
        }
        // What rustls answers a signature that does not verify: the two
        // ends' CAs differ.
        E::AlertReceived(A::DecryptError) => {
            "the peer refused this host's certificate (a signature did not verify: are both \
             hosts' certificates from the same fleet CA?)"
                .into()
        }
        E::DecryptError => {
            "cannot decrypt a record: it was corrupted or tampered with on the way".into()
        }
        E::InvalidMessage(_) => {
            "the peer does not speak TLS (is it running with --insecure?)".into()
        }
        other => other.to_string(),
    }
}
