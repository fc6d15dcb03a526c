//! Guest memory cut into chunks, the unit of a split VM's placement and of
//! remote paging: which chunk a page is in, and each chunk's pages. Shared
//! by the split source (routing), the main host (its plan) and the pager.

use crate::memory::RegionView;
use crate::ranges::{GpaPages, PAGE};

/// A chunk's place in a split plan: on the main host (memory server k is
/// place k + 1).
pub const ON_MAIN: u16 = 0;

/// Guest memory cut into chunks of `chunk_pages` pages, numbered in guest
/// address order over all regions (a region's last chunk may be short).
#[derive(Clone, Debug)]
pub struct ChunkMap {
    /// Per region: (first gpa, pages, first chunk number, first page number).
    pub(crate) regions: Vec<(u64, u64, usize, u64)>,
    pub(crate) chunk_pages: u64,
    chunks: usize,
}

impl ChunkMap {
    /// The chunks of `regions`.
    pub fn new(regions: &[RegionView], chunk_pages: u32) -> Self {
        let chunk_pages = u64::from(chunk_pages.max(1));
        let (mut chunks, mut pages, mut out) = (0usize, 0u64, Vec::new());
        for r in regions {
            out.push((r.gpa(), r.pages(), chunks, pages));
            chunks += r.pages().div_ceil(chunk_pages) as usize;
            pages += r.pages();
        }
        ChunkMap {
            regions: out,
            chunk_pages,
            chunks,
        }
    }

    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Pages per (whole) chunk.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk_pages
    }

    /// The chunk holding `gpa`.
    pub fn chunk_of(&self, gpa: u64) -> Option<usize> {
        self.regions.iter().find_map(|&(base, pages, first, _)| {
            let off = gpa.checked_sub(base)? / PAGE;
            (off < pages).then(|| first + (off / self.chunk_pages) as usize)
        })
    }

    /// The page number of `gpa` over all regions (the index of its hash).
    pub fn page_index(&self, gpa: u64) -> Option<u64> {
        self.regions.iter().find_map(|&(base, pages, _, first)| {
            let off = gpa.checked_sub(base)? / PAGE;
            (off < pages).then_some(first + off)
        })
    }

    /// The pages of chunk `c`.
    pub fn run(&self, c: usize) -> GpaPages {
        let &(base, pages, first, _) = self
            .regions
            .iter()
            .rev()
            .find(|r| r.2 <= c)
            .expect("chunk numbers start at 0");
        let start = (c - first) as u64 * self.chunk_pages;
        GpaPages::new(
            base + start * PAGE,
            self.chunk_pages.min(pages.saturating_sub(start)),
        )
    }

    /// How many pages of `runs` fall in each chunk.
    pub fn pages_per_chunk(&self, runs: &[GpaPages]) -> Vec<u64> {
        let mut out = vec![0u64; self.chunks];
        self.each_piece(runs, |c, piece| out[c] += piece.pages);
        out
    }

    /// Calls `f(chunk, piece)` for the pieces of `runs` cut at chunk borders.
    fn each_piece(&self, runs: &[GpaPages], mut f: impl FnMut(usize, GpaPages)) {
        for run in runs {
            let mut gpa = run.gpa;
            while gpa < run.end() {
                let Some(c) = self.chunk_of(gpa) else { break };
                let end = self.run(c).end().min(run.end());
                f(c, GpaPages::new(gpa, (end - gpa) / PAGE));
                gpa = end;
            }
        }
    }

    /// All memory sorted by the place of its chunk: `out[p]` holds the
    /// runs of the chunks whose place is `p` (neighbours merged), for
    /// places `0..places_n`.
    pub fn runs_by_place(&self, places: &[u16], places_n: usize) -> Vec<Vec<GpaPages>> {
        let all: Vec<GpaPages> = (0..self.chunks).map(|c| self.run(c)).collect();
        let mut out = vec![Vec::new(); places_n];
        self.route(&all, places, &mut out);
        out
    }

    /// Cuts `runs` at chunk borders and sorts the pieces by the place of
    /// their chunk: `out[p]` gets the pieces whose chunk's place is `p`.
    pub fn route(&self, runs: &[GpaPages], places: &[u16], out: &mut [Vec<GpaPages>]) {
        self.each_piece(runs, |c, piece| {
            if let Some(v) = out.get_mut(usize::from(places[c])) {
                match v.last_mut() {
                    Some(last) if last.end() == piece.gpa => last.pages += piece.pages,
                    _ => v.push(piece),
                }
            }
        });
    }
}
