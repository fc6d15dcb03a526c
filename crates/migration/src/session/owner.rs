//! The destination's check of the source's ownership claim (v18;
//! docs/safety.md): both sides fence the VM through a registry, or neither
//! does. The take-over itself is the VMM's (`OwnerFence`), at Complete.

use crate::error::MigrationError;
use crate::protocol::Caps;

/// The largest ownership claim a source may send (the VMM's encoding of
/// the VM's name, epoch and holder is well under 1 KiB).
pub(crate) const MAX_CLAIM: usize = 4096;

/// Refuses a source whose fencing does not match this side's: a fenced
/// destination takes a VM only from a claim (an older source, or one run
/// without a registry, has none), and an unfenced one must not run a VM
/// that another process holds in a registry.
pub(crate) fn check_claim(
    claim: Option<&[u8]>,
    fenced: bool,
    caps: Caps,
) -> Result<(), MigrationError> {
    match (claim, fenced) {
        (Some(c), _) if c.len() > MAX_CLAIM => Err(MigrationError::Fence(format!(
            "the source's claim is {} bytes, over the limit of {MAX_CLAIM}",
            c.len()
        ))),
        (None, true) if !caps.owner() => Err(MigrationError::Fence(format!(
            "this destination fences its VM through a registry and the source speaks protocol v{}, \
             which carries no ownership claim: upgrade the source",
            caps.version()
        ))),
        (None, true) => Err(MigrationError::Fence(
            "this destination fences its VM through a registry and the source holds no claim: \
             run the source with a VM name and the same registry"
                .into(),
        )),
        (Some(_), false) => Err(MigrationError::Fence(
            "the source's VM is fenced through a registry and this destination is not: start it \
             with the same --registry (and no --vm-name: it takes the source's)"
                .into(),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{VERSION_DROP_AHEAD, VERSION_OWNER};

    #[test]
    fn a_destination_takes_a_vm_only_when_both_sides_fence_alike() {
        let (new, old) = (Caps::of(VERSION_OWNER), Caps::of(VERSION_DROP_AHEAD));
        let ok = |c: Option<&[u8]>, fenced, caps| check_claim(c, fenced, caps).is_ok();
        assert!(ok(Some(b"c"), true, new));
        assert!(ok(None, false, new));
        assert!(ok(None, false, old), "neither fences, an old source");
        assert!(
            !ok(None, true, new),
            "a fenced destination, an unfenced source"
        );
        assert!(
            !ok(None, true, old),
            "a fenced destination, a source too old to say"
        );
        assert!(
            !ok(Some(b"c"), false, new),
            "a fenced VM to an unfenced destination"
        );
        let big = vec![0u8; MAX_CLAIM + 1];
        assert!(!ok(Some(&big), true, new), "a claim over the limit");
    }
}
