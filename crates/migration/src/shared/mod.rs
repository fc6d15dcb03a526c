//! Pages another VM on the destination's host already holds travel as
//! references (protocol v14): a drain that moves several VMs holding the
//! same data to one host sends that data once.
//!
//! ```text
//! source                                      destination (--share-pages)
//!  ShareAsk(true)                        ──▶  hashes its host's other VMs' pages
//!                                       ◀──  SharedOffer{seed, keys, last}…
//!  per page of a round (not the last):
//!    key = xxh3(page, seed) in the offer?
//!      yes: SharedPages{gpa, key, id}    ──▶  copies the page its key names
//!                                             from the other VM, lands it if
//!                                             its BLAKE3 id matches
//!      no:  Pages / Encoded as always
//!  RoundDone                             ──▶
//!                                       ◀──  SharedMissed(runs)…  RoundAck
//!  the missed pages go again next round, as data
//! ```
//!
//! - The offer is 8 bytes per page, keyed by a seed the destination draws
//!   for this migration; a key match only makes the source send a
//!   reference. What lands is checked by the page's BLAKE3 hash (128 bits,
//!   what no guest can craft a collision for), taken by the source from
//!   the page it would have sent and by the destination from the page it
//!   copied. The other VM runs on and may have changed the page since it
//!   was hashed: such a page is missed and sent again in the next round.
//! - The last round (in the pause) never sends references, so a miss never
//!   reaches the pause.
//! - What the source learns: whether pages it holds itself exist on the
//!   destination's host (docs/security.md).

mod index;
mod offer;
mod refs;

pub use index::SiblingIndex;
pub(crate) use offer::{recv_offer, send_offer, Offer};
pub(crate) use refs::{land_refs, write_refs, SharedRef};

use crate::protocol::PAGE;

/// At most this many keys are offered (64 GiB of other VMs' pages); a
/// source refuses a longer offer.
pub const MAX_OFFER_KEYS: usize = 1 << 24;
/// Keys per SharedOffer frame (1 MiB of body).
pub(crate) const KEYS_PER_FRAME: usize = 1 << 17;

/// A page's key in an offer: its xxh3 hash under the offer's seed.
pub(crate) fn key(page: &[u8], seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(page, seed)
}

/// A page's identity: the first 128 bits of its BLAKE3 hash.
pub(crate) fn page_id(page: &[u8]) -> [u8; 16] {
    debug_assert_eq!(page.len(), PAGE);
    let h = blake3::hash(page);
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.as_bytes()[..16]);
    id
}
