//! The fuzzer's bytes read as structured values: each read takes what it
//! needs from the front and yields zeros once the bytes run out, so every
//! input means something and short inputs mean small values.

/// A cursor over the fuzzer's bytes.
pub struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads from the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Input { bytes }
    }

    /// True when every byte was taken.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes left.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.bytes.split_at(n.min(self.bytes.len()));
        self.bytes = tail;
        head
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.bytes.len())
    }

    /// One byte (0 at the end).
    pub fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    /// A little-endian u16 (missing bytes are 0).
    pub fn u16(&mut self) -> u16 {
        let mut b = [0u8; 2];
        let got = self.bytes(2);
        b[..got.len()].copy_from_slice(got);
        u16::from_le_bytes(b)
    }

    /// A little-endian u32 (missing bytes are 0).
    pub fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        let got = self.bytes(4);
        b[..got.len()].copy_from_slice(got);
        u32::from_le_bytes(b)
    }

    /// A little-endian u64 (missing bytes are 0).
    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        let got = self.bytes(8);
        b[..got.len()].copy_from_slice(got);
        u64::from_le_bytes(b)
    }

    /// A bool from one byte's low bit.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A length-prefixed chunk: a u16 length, then up to that many bytes.
    pub fn chunk(&mut self) -> &'a [u8] {
        let n = self.u16() as usize;
        self.bytes(n)
    }

    /// A page of 4096 bytes drawn from a few bytes of input: mostly zero,
    /// a filled stretch and a few scattered bytes, so the codecs see the
    /// shapes real memory has (zero, runs, small changes).
    pub fn page(&mut self) -> Vec<u8> {
        let mut p = vec![0u8; 4096];
        let shape = self.u8();
        let fill = self.u8();
        if shape & 1 == 1 {
            let at = self.u16() as usize % 4096;
            let len = (self.u16() as usize % 4096).min(4096 - at);
            p[at..at + len].fill(fill);
        }
        if shape & 2 == 2 {
            // A counter pattern: every byte differs from its neighbour.
            for (i, b) in p.iter_mut().enumerate() {
                *b = b.wrapping_add((i as u8).wrapping_mul(fill | 1));
            }
        }
        for _ in 0..(shape >> 4) {
            let at = self.u16() as usize % 4096;
            p[at] = self.u8();
        }
        p
    }
}
