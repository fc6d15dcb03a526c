//! One batch of guest pages on its way to the wire, for every sender: the
//! precopy rounds ([`crate::sender`]), postcopy's pusher and demand answers
//! (`postcopy/source.rs`) and the memory-server puts
//! ([`crate::memserver::StoreClient`], split's rounds).
//!
//! [`PageBatch::fill`] copies each page out of guest RAM once, straight
//! into the batch; a zero page becomes a run instead, and the page data's
//! checksum is computed while each page is hot in cache (batches of 1 GiB,
//! two thirds data, fill in about 0.08 s on the 2-core dev machine; a raw
//! round of it over a Unix socket takes about 0.1 s on two streams). The
//! writers then send the Pages frame from the batch's own buffers (no
//! gathering copy) and the ZeroRanges frame, and say how many bytes went
//! on the wire. The three senders used to build these frames each their
//! own way; here the frame layout, the checksum and the byte counts live
//! in one place.

use std::io::{self, Write};

use crate::checksum;
use crate::memory::{is_zero, region_of, RegionView};
use crate::protocol::{self, Kind, ProtocolError, HEADER, PAGE};
use crate::ranges::{push_page, total_pages, GpaPages};

/// How [`PageBatch::fill`] treats the pages it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fill {
    /// A page that reads as zero becomes a run in [`PageBatch::zeros`]
    /// instead of data.
    pub(crate) zero_runs: bool,
    /// Checksum the page data as it is copied, so writing the frame only
    /// checksums its head.
    pub(crate) crc: bool,
}

impl Fill {
    /// Raw Pages frames: zero pages as runs, data checksummed at fill.
    pub(crate) const RAW: Fill = Fill {
        zero_runs: true,
        crc: true,
    };
    /// Pages for a sealed frame (the link checks every byte): zero pages as
    /// runs, no checksum.
    pub(crate) const SEALED: Fill = Fill {
        zero_runs: true,
        crc: false,
    };
    /// Pages an encoder will likely rewrite: zero pages as runs, no
    /// checksum yet (a batch sent raw after all is checksummed at write).
    pub(crate) const ENCODE: Fill = Fill {
        zero_runs: true,
        crc: false,
    };
    /// Every page as data, zero or not (postcopy's demand answers: each
    /// page asked for arrives in a Pages frame).
    pub(crate) const EVERY_PAGE: Fill = Fill {
        zero_runs: false,
        crc: true,
    };
}

/// Pages read from guest RAM: those with data (addresses, bytes, the
/// data's CRC-32C when filled with [`Fill::crc`]) and the zero runs.
/// Reused batch after batch: filling clears it but keeps its buffers.
#[derive(Debug, Default)]
pub(crate) struct PageBatch {
    gpas: Vec<u64>,
    /// `gpas` as the wire has them (little-endian u64s).
    addrs: Vec<u8>,
    /// 4096 bytes per page of `gpas`.
    data: Vec<u8>,
    /// Pages that read as zero, as runs (sorted runs give sorted runs).
    zeros: Vec<GpaPages>,
    /// CRC-32C of `data`, when computed at fill.
    crc: Option<u32>,
    /// `data` was sealed in place by the link it went on (it holds
    /// ciphertext until the next fill).
    spent: bool,
    /// Hash each page with data as it is copied (a verified migration).
    hashing: bool,
    /// Those hashes, in the order of `gpas`.
    hashes: Vec<u64>,
    /// Send a page the destination's host holds by reference (v14).
    sharing: Option<std::sync::Arc<crate::shared::Offer>>,
    /// Those pages, and their hashes (with `hashing`) in the same order.
    refs: Vec<crate::shared::SharedRef>,
    ref_hashes: Vec<u64>,
    /// Leave out a page whose bytes are those last sent there (precopy's
    /// rounds), and note what each page goes as.
    sent: Option<std::sync::Arc<crate::unchanged::SentContent>>,
    /// Pages left out so, in this fill.
    unchanged: u64,
}

impl PageBatch {
    /// Empties the batch (its buffers stay allocated).
    pub(crate) fn clear(&mut self) {
        self.gpas.clear();
        self.addrs.clear();
        self.data.clear();
        self.zeros.clear();
        self.crc = None;
        self.spent = false;
        self.hashes.clear();
        self.refs.clear();
        self.ref_hashes.clear();
        self.unchanged = 0;
    }

    /// From the next fill on, leaves out each page whose bytes `sent` says
    /// the destination holds, and records what the others go as; None:
    /// every page goes.
    pub(crate) fn skip_unchanged(
        &mut self,
        sent: Option<&std::sync::Arc<crate::unchanged::SentContent>>,
    ) {
        self.sent = sent.cloned();
    }

    /// Pages the last fill left out as unchanged.
    pub(crate) fn unchanged_pages(&self) -> u64 {
        self.unchanged
    }

    /// From the next fill on, a page `offer` holds becomes a reference
    /// ([`Self::refs`]) instead of data; None: every page is data.
    pub(crate) fn share_with(&mut self, offer: Option<&std::sync::Arc<crate::shared::Offer>>) {
        self.sharing = offer.cloned();
    }

    /// The pages sent by reference, and their hashes (with
    /// [`Self::hash_pages`]) in the same order.
    pub(crate) fn refs(&self) -> (&[crate::shared::SharedRef], &[u64]) {
        (&self.refs, &self.ref_hashes)
    }

    /// From the next fill on, hashes each page with data as it is copied
    /// ([`Self::hashes`]).
    pub(crate) fn hash_pages(&mut self, on: bool) {
        self.hashing = on;
    }

    /// The pages' hashes (with [`Self::hash_pages`]), in the order of
    /// [`Self::gpas`].
    pub(crate) fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// Refills the batch with the pages at `gpas`, in that order; a page
    /// outside every region is skipped.
    pub(crate) fn fill(
        &mut self,
        regions: &[RegionView],
        gpas: impl IntoIterator<Item = u64>,
        how: Fill,
    ) {
        self.fill_upto(regions, gpas, how, usize::MAX);
    }

    /// Refills the batch with every page of `runs`.
    pub(crate) fn fill_from(&mut self, regions: &[RegionView], runs: &[GpaPages], how: Fill) {
        self.fill(regions, runs.iter().flat_map(|r| r.page_addrs()), how);
    }

    /// Refills the batch from `gpas` until it holds `max` pages of data
    /// (zero pages do not count); true if it stopped there, so `gpas` (pass
    /// `&mut iter`) may have more for the next batch.
    pub(crate) fn fill_upto(
        &mut self,
        regions: &[RegionView],
        gpas: impl IntoIterator<Item = u64>,
        how: Fill,
        max: usize,
    ) -> bool {
        self.clear();
        let mut crc = 0u32;
        let mut full = false;
        for gpa in gpas {
            let Some((_, r)) = region_of(regions, gpa) else {
                continue;
            };
            // Copy first, then look: the copy is what gets sent, and no Rust
            // reference ever points into memory the guest writes.
            let at = self.data.len();
            r.copy_page((gpa - r.gpa()) / PAGE as u64, &mut self.data);
            let zero = how.zero_runs && is_zero(&self.data[at..]);
            // The page's hash, once, for whoever needs it.
            let hash = (self.sent.is_some() || self.hashing).then(|| {
                if zero {
                    crate::verify::zero_hash()
                } else {
                    protocol::page_hash(&self.data[at..])
                }
            });
            if let (Some(sent), Some(h)) = (&self.sent, hash) {
                if sent.holds(gpa, h) {
                    self.data.truncate(at);
                    self.unchanged += 1;
                    continue;
                }
            }
            if zero {
                self.data.truncate(at);
                push_page(&mut self.zeros, gpa);
                if let (Some(sent), Some(h)) = (&self.sent, hash) {
                    sent.record(gpa, h);
                }
                continue;
            }
            if let Some(key) = self
                .sharing
                .as_ref()
                .and_then(|o| o.holds(gpa, &self.data[at..]))
            {
                let page = &self.data[at..];
                self.refs.push(crate::shared::SharedRef {
                    gpa,
                    key,
                    id: crate::shared::page_id(page),
                });
                if self.hashing {
                    self.ref_hashes.push(hash.unwrap_or_default());
                }
                // A reference may miss at the destination (it is then sent
                // again as data): what lands there is not known yet.
                if let Some(sent) = &self.sent {
                    sent.forget(gpa);
                }
                self.data.truncate(at);
                continue;
            }
            self.gpas.push(gpa);
            self.addrs.extend_from_slice(&gpa.to_le_bytes());
            if how.crc {
                // While the page is hot in cache.
                crc = checksum::append(crc, &self.data[at..]);
            }
            if let Some(h) = hash {
                if self.hashing {
                    self.hashes.push(h);
                }
                if let Some(sent) = &self.sent {
                    sent.record(gpa, h);
                }
            }
            if self.gpas.len() >= max {
                full = true;
                break;
            }
        }
        self.crc = how.crc.then_some(crc);
        full
    }

    /// Addresses of the pages with data.
    pub(crate) fn gpas(&self) -> &[u64] {
        &self.gpas
    }

    /// The pages' data, 4096 bytes each, in the order of [`Self::gpas`].
    pub(crate) fn data(&self) -> &[u8] {
        debug_assert!(!self.spent, "the batch's pages were sealed in place");
        &self.data
    }

    /// The pages that read as zero, as runs.
    pub(crate) fn zeros(&self) -> &[GpaPages] {
        &self.zeros
    }

    /// Pages with data.
    pub(crate) fn pages(&self) -> u64 {
        self.gpas.len() as u64
    }

    /// Pages that read as zero.
    pub(crate) fn zero_pages(&self) -> u64 {
        total_pages(&self.zeros)
    }

    /// Writes the pages with data as one Pages frame (nothing if there are
    /// none), [`sealed`](protocol::SEALED) if `sealed` (the link seals every
    /// byte) and else with its checksum; returns its wire bytes.
    pub(crate) fn write_pages(&self, w: &mut impl Write, sealed: bool) -> io::Result<u64> {
        if self.gpas.is_empty() {
            return Ok(0);
        }
        let check = match (sealed, self.crc) {
            (true, _) => PageCheck::Sealed,
            (false, Some(crc)) => PageCheck::Known(crc),
            (false, None) => PageCheck::Compute,
        };
        write_pages_frame(w, &self.addrs, &self.data, check)
    }

    /// [`Self::write_pages`] by a sender done with the batch's page data:
    /// over a link that seals, the pages are sealed where they lie (one
    /// copy less per byte), and the data is spent until the next fill.
    pub(crate) fn write_pages_spending(
        &mut self,
        w: &mut impl protocol::SpendingWrite,
        sealed: bool,
    ) -> io::Result<u64> {
        if !sealed || self.gpas.is_empty() {
            return self.write_pages(w, sealed);
        }
        let count = (self.gpas.len() as u32).to_le_bytes();
        protocol::write_sealed_pages_frame_spending(w, &count, &self.addrs, &mut self.data)?;
        self.spent = true;
        Ok((HEADER + count.len() + self.addrs.len() + self.data.len()) as u64)
    }

    /// Writes the pages sent by reference as one SharedPages frame (nothing
    /// if there are none); returns its wire bytes.
    pub(crate) fn write_refs(&self, w: &mut impl Write) -> Result<u64, ProtocolError> {
        crate::shared::write_refs(w, &self.refs)
    }

    /// Writes the zero runs as one ZeroRanges frame (nothing if there are
    /// none); returns its wire bytes.
    pub(crate) fn write_zeros(&self, w: &mut impl Write) -> Result<u64, ProtocolError> {
        if self.zeros.is_empty() {
            return Ok(0);
        }
        protocol::write_zero_ranges(w, &self.zeros)
    }
}

/// How a Pages frame's body is checked.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PageCheck {
    /// CRC-32C, of which the page data's part is known (computed at fill).
    Known(u32),
    /// CRC-32C, computed as the frame is written.
    Compute,
    /// None: the link seals every byte ([`protocol::SEALED`]).
    Sealed,
}

/// Writes one Pages frame of the pages at `addrs` (little-endian u64s) with
/// their `data`, without gathering them, checked as `check` says. Returns
/// the frame's wire bytes.
pub(crate) fn write_pages_frame(
    w: &mut impl Write,
    addrs: &[u8],
    data: &[u8],
    check: PageCheck,
) -> io::Result<u64> {
    debug_assert_eq!(data.len() / PAGE, addrs.len() / 8);
    let count = ((addrs.len() / 8) as u32).to_le_bytes();
    match check {
        PageCheck::Known(crc) => protocol::write_pages_frame(w, &count, addrs, data, crc)?,
        PageCheck::Compute => protocol::write_frame_parts(w, Kind::Pages, &[&count, addrs, data])?,
        PageCheck::Sealed => protocol::write_sealed_pages_frame(w, &count, addrs, data)?,
    }
    Ok((HEADER + count.len() + addrs.len() + data.len()) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, decode_pages, read_frame};

    const P: u64 = PAGE as u64;

    /// Guest memory: each region's pages hold a pattern of their address,
    /// except the pages listed as zero.
    struct Guest {
        mem: Vec<Vec<u8>>,
        layout: Vec<(u64, u64)>,
    }

    impl Guest {
        fn new(layout: &[(u64, u64)], zero: &[u64]) -> Guest {
            let mem = layout
                .iter()
                .map(|&(gpa, pages)| {
                    let mut v = vec![0u8; (pages * P) as usize];
                    for (i, page) in v.chunks_exact_mut(PAGE).enumerate() {
                        let g = gpa + i as u64 * P;
                        if !zero.contains(&g) {
                            page_of(g, page);
                        }
                    }
                    v
                })
                .collect();
            Guest {
                mem,
                layout: layout.to_vec(),
            }
        }

        fn regions(&mut self) -> Vec<RegionView> {
            self.layout
                .iter()
                .zip(self.mem.iter_mut())
                // SAFETY: the vectors live as long as the Guest and are
                // never resized; the views do not outlive a test.
                .map(|(&(gpa, pages), m)| unsafe {
                    RegionView::new(gpa, pages * P, m.as_mut_ptr())
                })
                .collect()
        }
    }

    /// The content of the page at `gpa` (never all zero).
    fn page_of(gpa: u64, out: &mut [u8]) {
        for (i, b) in out.iter_mut().enumerate() {
            *b = ((gpa / P) as usize * 7 + i * 13 + 1) as u8 | 1;
        }
    }

    fn want_data(gpas: &[u64]) -> Vec<u8> {
        let mut v = vec![0u8; gpas.len() * PAGE];
        for (g, page) in gpas.iter().zip(v.chunks_exact_mut(PAGE)) {
            page_of(*g, page);
        }
        v
    }

    #[test]
    fn zero_pages_become_runs_and_the_rest_data() {
        let zero = [2 * P, 3 * P, 4 * P, 7 * P];
        let mut g = Guest::new(&[(0, 10)], &zero);
        let regions = g.regions();
        let mut b = PageBatch::default();
        b.fill_from(&regions, &[GpaPages::new(0, 10)], Fill::RAW);
        let data = [0, P, 5 * P, 6 * P, 8 * P, 9 * P];
        assert_eq!(b.gpas(), data);
        assert_eq!(b.data(), want_data(&data));
        assert_eq!(
            b.zeros(),
            [GpaPages::new(2 * P, 3), GpaPages::new(7 * P, 1)]
        );
        assert_eq!((b.pages(), b.zero_pages()), (6, 4));
        // Every page as data: the zero pages stay in the frame, as zeros.
        b.fill_from(&regions, &[GpaPages::new(P, 3)], Fill::EVERY_PAGE);
        assert_eq!(b.gpas(), [P, 2 * P, 3 * P]);
        assert!(b.zeros().is_empty());
        assert_eq!(&b.data()[..PAGE], &want_data(&[P])[..]);
        assert!(b.data()[PAGE..].iter().all(|&x| x == 0));
    }

    #[test]
    fn runs_cross_region_boundaries_and_skip_what_no_region_holds() {
        // Two adjacent regions (0..4 and 4..8 in pages), then a gap, then
        // a third at page 20; pages 3 and 4 (both sides of the boundary)
        // and 20 are zero.
        let mut g = Guest::new(&[(0, 4), (4 * P, 4), (20 * P, 2)], &[3 * P, 4 * P, 20 * P]);
        let regions = g.regions();
        let mut b = PageBatch::default();
        b.fill_from(&regions, &[GpaPages::new(2 * P, 20)], Fill::RAW);
        let data = [2 * P, 5 * P, 6 * P, 7 * P, 21 * P];
        assert_eq!(b.gpas(), data);
        assert_eq!(b.data(), want_data(&data));
        // One zero run over the boundary, pages 8..20 skipped (no region).
        assert_eq!(
            b.zeros(),
            [GpaPages::new(3 * P, 2), GpaPages::new(20 * P, 1)]
        );
        assert_eq!((b.pages(), b.zero_pages()), (5, 3));
    }

    #[test]
    fn the_frames_decode_back_and_count_their_bytes() {
        let mut g = Guest::new(&[(0x10_0000, 8)], &[0x10_0000 + 3 * P]);
        let regions = g.regions();
        let mut b = PageBatch::default();
        b.fill_from(&regions, &[GpaPages::new(0x10_0000, 8)], Fill::RAW);
        let mut wire = Vec::new();
        let zb = b.write_zeros(&mut wire).unwrap();
        let pb = b.write_pages(&mut wire, false).unwrap();
        assert_eq!(zb + pb, wire.len() as u64);
        assert_eq!(pb, (HEADER + 4 + 7 * (8 + PAGE)) as u64);
        let mut r = &wire[..];
        // read_frame checks the frame's CRC-32C.
        let f = read_frame(&mut r).unwrap();
        let runs: Vec<GpaPages> = decode(&f, Kind::ZeroRanges).unwrap();
        assert_eq!(runs, b.zeros());
        let f = read_frame(&mut r).unwrap();
        assert_eq!(f.kind, Kind::Pages);
        let (gpas, data) = decode_pages(&f.body).unwrap();
        assert_eq!(gpas, b.gpas());
        assert_eq!(data, want_data(&gpas));
        assert!(r.is_empty());
    }

    #[test]
    fn the_checksum_at_fill_or_at_write_makes_the_same_frame() {
        let mut g = Guest::new(&[(0, 40)], &[5 * P, 6 * P]);
        let regions = g.regions();
        let runs = [GpaPages::new(0, 40)];
        let (mut at_fill, mut at_write) = (PageBatch::default(), PageBatch::default());
        at_fill.fill_from(&regions, &runs, Fill::RAW);
        at_write.fill_from(&regions, &runs, Fill::ENCODE);
        let (mut a, mut w) = (Vec::new(), Vec::new());
        at_fill.write_pages(&mut a, false).unwrap();
        at_write.write_pages(&mut w, false).unwrap();
        assert_eq!(a, w);
        // And the same as the whole body encoded and framed at once.
        let mut whole = Vec::new();
        let body = protocol::encode_pages(at_fill.gpas(), at_fill.data());
        protocol::write_frame(&mut whole, Kind::Pages, &body).unwrap();
        assert_eq!(a, whole);
    }

    #[test]
    fn fill_upto_stops_at_max_data_pages_and_goes_on_from_there() {
        // Pages 1 and 2 zero: they do not count towards the limit.
        let mut g = Guest::new(&[(0, 7)], &[P, 2 * P]);
        let regions = g.regions();
        let mut b = PageBatch::default();
        let mut it = GpaPages::new(0, 7).page_addrs();
        assert!(b.fill_upto(&regions, &mut it, Fill::RAW, 3));
        assert_eq!(b.gpas(), [0, 3 * P, 4 * P]);
        assert_eq!(b.zeros(), [GpaPages::new(P, 2)]);
        // Exactly the limit left: full again, then an empty last batch.
        assert!(b.fill_upto(&regions, &mut it, Fill::RAW, 2));
        assert_eq!(b.gpas(), [5 * P, 6 * P]);
        assert!(b.zeros().is_empty());
        assert!(!b.fill_upto(&regions, &mut it, Fill::RAW, 2));
        assert_eq!((b.pages(), b.zero_pages()), (0, 0));
    }

    #[test]
    fn an_empty_batch_writes_nothing() {
        let mut g = Guest::new(&[(0, 2)], &[0, P]);
        let regions = g.regions();
        let mut b = PageBatch::default();
        b.fill_from(&regions, &[GpaPages::new(0, 2)], Fill::RAW);
        let mut wire = Vec::new();
        assert_eq!(b.write_pages(&mut wire, false).unwrap(), 0);
        assert!(wire.is_empty());
        b.fill_from(&regions, &[], Fill::RAW);
        assert_eq!(b.write_zeros(&mut wire).unwrap(), 0);
        assert!(wire.is_empty());
    }

    #[test]
    fn a_frame_of_given_pages_is_the_encoded_body_framed() {
        let gpas = [0x3000u64, 0x1000, 0x7000];
        let data = want_data(&gpas);
        let addrs: Vec<u8> = gpas.iter().flat_map(|g| g.to_le_bytes()).collect();
        let mut wire = Vec::new();
        let n = write_pages_frame(&mut wire, &addrs, &data, PageCheck::Compute).unwrap();
        assert_eq!(n, wire.len() as u64);
        let mut want = Vec::new();
        protocol::write_frame(
            &mut want,
            Kind::Pages,
            &protocol::encode_pages(&gpas, &data),
        )
        .unwrap();
        assert_eq!(wire, want);
        let mut with_crc = Vec::new();
        write_pages_frame(
            &mut with_crc,
            &addrs,
            &data,
            PageCheck::Known(checksum::crc32c(&data)),
        )
        .unwrap();
        assert_eq!(with_crc, want);
    }
}
