//! A store's owner secret (v9): 32 random bytes the party that opens a
//! VM's store first chooses; the server binds the store to it and serves
//! or changes the VM's pages only on connections that open with the same
//! secret. A VM id alone (the session id, which travels in clear) gives
//! nothing.

use serde::{Deserialize, Serialize};

/// 32 bytes that prove a connection speaks for a store's owner.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreSecret(pub [u8; 32]);

impl StoreSecret {
    /// A fresh secret from the kernel's random source.
    pub fn random() -> std::io::Result<Self> {
        let mut b = [0u8; 32];
        crate::random::fill(&mut b)?;
        Ok(StoreSecret(b))
    }

    /// `count` fresh secrets (one per memory server of a split VM: a server
    /// that learns its own secret cannot use it on another server).
    pub fn random_each(count: usize) -> std::io::Result<Vec<Self>> {
        (0..count).map(|_| Self::random()).collect()
    }

    /// Compares in time independent of where the bytes differ, so the
    /// server's answer time tells a guesser nothing.
    pub fn matches(&self, other: &StoreSecret) -> bool {
        let diff = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        // black_box keeps the compiler from turning the fold into an early
        // exit.
        std::hint::black_box(diff) == 0
    }
}

impl std::fmt::Debug for StoreSecret {
    /// Never printed: logs and errors show that a secret is there, not it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreSecret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_match_only_themselves_and_never_print() {
        let a = StoreSecret::random().unwrap();
        let b = StoreSecret::random().unwrap();
        assert!(a.matches(&a.clone()));
        assert!(!a.matches(&b));
        let mut c = a.clone();
        c.0[31] ^= 1;
        assert!(!a.matches(&c));
        assert_eq!(format!("{a:?}"), "StoreSecret(..)");
        assert_eq!(StoreSecret::random_each(3).unwrap().len(), 3);
    }
}
