//! What the integration tests share: scratch directories, a fleet made
//! with `pki`, and data to send.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use ferry_tls::pki::{self, Validity};

pub fn scratch(what: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "ferry-tls-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A CA and one host certificate for `name` at 127.0.0.1.
pub fn fleet(name: &str, validity: Validity) -> (PathBuf, PathBuf) {
    let ca = scratch("ca");
    pki::init_ca(&ca, "test fleet", Validity::days(1)).unwrap();
    let host = scratch(name);
    pki::issue(&ca, name, &host, &["127.0.0.1".into()], validity).unwrap();
    (ca, host)
}

pub fn issue(ca: &Path, name: &str, validity: Validity) -> PathBuf {
    let host = scratch(name);
    pki::issue(ca, name, &host, &["127.0.0.1".into()], validity).unwrap();
    host
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// rustls's ring provider with only `suite`, limited to `limit` records
/// per key (so keys are renewed every few dozen records).
pub fn limited(
    suite: rustls::SupportedCipherSuite,
    limit: u64,
) -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    // (Without TLS 1.2 compiled in, every suite is a TLS 1.3 one.)
    let rustls::SupportedCipherSuite::Tls13(base) = suite;
    let small = rustls::Tls13CipherSuite {
        common: rustls::crypto::CipherSuiteCommon {
            confidentiality_limit: limit,
            ..base.common
        },
        ..*base
    };
    let small: &'static rustls::Tls13CipherSuite = Box::leak(Box::new(small));
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::SupportedCipherSuite::Tls13(small)];
    std::sync::Arc::new(p)
}
