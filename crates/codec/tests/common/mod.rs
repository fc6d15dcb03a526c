//! Page generators shared by the integration tests.
#![allow(dead_code)]

use ferry_codec::PAGE;

/// splitmix64: a tiny deterministic generator, enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

/// Kinds of page content the tests draw from.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Random,
    Zero,
    Sparse,
    Text,
    Constant,
    SmallInts,
    /// The previous content of the same page index with a few bytes changed
    /// (xbzrle hits), or a copy of another page's chunks (dedup hits).
    Modified,
}

pub const KINDS: [Kind; 7] = [
    Kind::Random,
    Kind::Zero,
    Kind::Sparse,
    Kind::Text,
    Kind::Constant,
    Kind::SmallInts,
    Kind::Modified,
];

/// A page of `kind` from `seed`; `prev` is the last content sent for the same index.
pub fn make_page(kind: Kind, seed: u64, prev: Option<&[u8]>) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut page = vec![0u8; PAGE];
    match kind {
        Kind::Random => rng.fill(&mut page),
        Kind::Zero => {}
        Kind::Sparse => {
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(PAGE as u64) as usize;
                page[at] = rng.next() as u8 | 1;
            }
        }
        Kind::Text => {
            const WORDS: [&str; 8] = [
                "the ", "page ", "migrate ", "ferry ", "of ", "a ", "dirty ", "log\n",
            ];
            let mut at = 0;
            while at < PAGE {
                let w = WORDS[rng.below(8) as usize].as_bytes();
                let n = w.len().min(PAGE - at);
                page[at..at + n].copy_from_slice(&w[..n]);
                at += n;
            }
        }
        Kind::Constant => page.fill(rng.next() as u8 | 1),
        Kind::SmallInts => {
            for w in page.chunks_exact_mut(4) {
                w.copy_from_slice(&(rng.below(1000) as u32).to_le_bytes());
            }
        }
        Kind::Modified => {
            match prev {
                Some(p) => page.copy_from_slice(p),
                None => page.fill(0x5a),
            }
            for _ in 0..1 + rng.below(6) {
                let at = rng.below(PAGE as u64) as usize;
                page[at] = page[at].wrapping_add(1 + rng.below(255) as u8);
            }
        }
    }
    page
}
