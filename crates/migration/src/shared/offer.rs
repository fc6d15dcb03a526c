//! The offer: the keys of the pages a destination's host already holds,
//! sent at the opening, and the source's test of each page against it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use super::{KEYS_PER_FRAME, MAX_OFFER_KEYS};
use crate::protocol::{Kind, ProtocolError, SharedOffer};
use crate::ranges::GpaPages;
use crate::transport::Conn;

/// What the destination offered: a seed and the keys under it, ascending;
/// and the pages whose reference missed, which go as data from then on.
#[derive(Debug, Default)]
pub(crate) struct Offer {
    seed: u64,
    keys: Vec<u64>,
    withdrawn: RwLock<HashSet<u64>>,
    /// Any page withdrawn (spares the lock on every page until then).
    any_withdrawn: AtomicBool,
}

impl Offer {
    /// The key under which the offer holds `page`, at `gpa`, if it does and
    /// the page's reference never missed.
    pub(crate) fn holds(&self, gpa: u64, page: &[u8]) -> Option<u64> {
        let k = super::key(page, self.seed);
        if self.keys.binary_search(&k).is_err() {
            return None;
        }
        if self.any_withdrawn.load(Ordering::Acquire)
            && self
                .withdrawn
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&gpa)
        {
            return None;
        }
        Some(k)
    }

    /// The pages of `runs` missed as references: they go as data from now
    /// on (the destination's copy changed, and may change again).
    pub(crate) fn withdraw(&self, runs: &[GpaPages]) {
        let mut w = self.withdrawn.write().unwrap_or_else(|e| e.into_inner());
        for r in runs {
            w.extend(r.page_addrs());
        }
        self.any_withdrawn.store(!w.is_empty(), Ordering::Release);
    }

    /// Keys offered.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

/// Sends `keys` (ascending, without repeats) under `seed`, in frames.
pub(crate) fn send_offer(ctl: &mut Conn, seed: u64, keys: &[u64]) -> Result<(), ProtocolError> {
    let n = keys.len().div_ceil(KEYS_PER_FRAME).max(1);
    for i in 0..n {
        let from = (i * KEYS_PER_FRAME).min(keys.len());
        let to = ((i + 1) * KEYS_PER_FRAME).min(keys.len());
        let part = SharedOffer {
            seed,
            keys: keys[from..to].to_vec(),
            last: i == n - 1,
        };
        ctl.send(Kind::SharedOffer, &part)?;
    }
    Ok(())
}

/// Reads an offer, frame by frame: each within its frame cap, ascending
/// across frames, one seed, at most [`MAX_OFFER_KEYS`] in all.
pub(crate) fn recv_offer(ctl: &mut Conn) -> Result<Offer, ProtocolError> {
    let bad = |reason: &str| ProtocolError::Malformed {
        kind: Kind::SharedOffer,
        reason: reason.into(),
    };
    let mut offer: Option<Offer> = None;
    loop {
        let part: SharedOffer = ctl.recv(Kind::SharedOffer)?;
        let o = offer.get_or_insert_with(|| Offer {
            seed: part.seed,
            ..Default::default()
        });
        if part.seed != o.seed {
            return Err(bad("the seed changed between frames"));
        }
        if part.keys.len() > KEYS_PER_FRAME || o.keys.len() + part.keys.len() > MAX_OFFER_KEYS {
            return Err(bad("more keys than an offer may hold"));
        }
        let mut prev = o.keys.last().copied();
        let ascending = part.keys.iter().all(|&k| {
            let up = prev.is_none_or(|p| p < k);
            prev = Some(k);
            up
        });
        if !ascending {
            return Err(bad("keys not in ascending order"));
        }
        o.keys.extend_from_slice(&part.keys);
        if part.last {
            return Ok(offer.unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Stream;

    fn pair() -> (Conn, Conn) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = Some(std::time::Duration::from_secs(5));
        (
            Conn::new(Stream::unix(a), t).unwrap(),
            Conn::new(Stream::unix(b), t).unwrap(),
        )
    }

    #[test]
    fn an_offer_reads_back_across_frames_and_finds_its_pages() {
        let (mut a, mut b) = pair();
        let pages: Vec<Vec<u8>> = (0..3u8)
            .map(|i| vec![i + 1; crate::protocol::PAGE])
            .collect();
        let mut keys: Vec<u64> = pages.iter().map(|p| super::super::key(p, 99)).collect();
        keys.extend((0..KEYS_PER_FRAME as u64 + 5).map(|k| k * 3 + 1));
        keys.sort_unstable();
        keys.dedup();
        let sent = keys.clone();
        let t = std::thread::spawn(move || send_offer(&mut a, 99, &sent).unwrap());
        let offer = recv_offer(&mut b).unwrap();
        t.join().unwrap();
        assert_eq!(offer.len(), keys.len());
        for p in &pages {
            assert!(offer.holds(0x1000, p).is_some());
        }
        assert!(offer.holds(0x1000, &[9u8; crate::protocol::PAGE]).is_none());
        // A page whose reference missed goes as data from then on.
        offer.withdraw(&[GpaPages::new(0x1000, 1)]);
        assert!(offer.holds(0x1000, &pages[0]).is_none());
        assert!(offer.holds(0x2000, &pages[0]).is_some());
    }

    #[test]
    fn a_hostile_offer_is_refused() {
        let send_parts = |parts: Vec<SharedOffer>| {
            let (mut a, mut b) = pair();
            let t = std::thread::spawn(move || {
                for p in parts {
                    let _ = a.send(Kind::SharedOffer, &p);
                }
            });
            let r = recv_offer(&mut b);
            t.join().unwrap();
            r
        };
        let part = |seed, keys: Vec<u64>, last| SharedOffer { seed, keys, last };
        // Out of order, within a frame and across frames.
        assert!(send_parts(vec![part(1, vec![5, 4], true)]).is_err());
        assert!(send_parts(vec![part(1, vec![5], false), part(1, vec![5], true)]).is_err());
        // The seed changes.
        assert!(send_parts(vec![part(1, vec![1], false), part(2, vec![3], true)]).is_err());
        // An over-long frame.
        let long: Vec<u64> = (0..KEYS_PER_FRAME as u64 + 1).collect();
        assert!(send_parts(vec![part(1, long, true)]).is_err());
        // An empty offer is fine.
        assert_eq!(send_parts(vec![part(1, vec![], true)]).unwrap().len(), 0);
    }
}
