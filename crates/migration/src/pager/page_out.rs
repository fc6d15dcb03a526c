//! Page-out: keeps the main host within its budget. After a page-in over
//! budget the fault that crossed it pays for paging out the coldest chunk
//! (the hard limit); once paging has begun, the idle loop pages out ahead
//! down to a low watermark, so a page-in seldom waits for a page-out. A
//! chunk goes to its home server (and mirror) under write-protection:
//! writers wait, the chunk is read through the memfd (never the guest
//! mapping, where this thread could fault on itself), its non-zero pages
//! sent and synced, punched out of the memfd, and unprotected; the writers
//! then fault MISSING and page it back in. Which chunk goes is
//! [`super::clock`]'s choice.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::error::MigrationError;
use crate::options::Rank;
use crate::ranges::{GpaPages, PAGE};

use super::clock::fallback_victim;
use super::page_in::runs_of;
use super::sampling::drop_ptes;
use super::worker::Worker;
use super::{bad_gpa, host_of, uffd_err};

/// Chunks the idle loop keeps free below the budget (so a page-in seldom
/// waits for a page-out): this share of the budget, within the bounds.
const RESERVE_SHARE: u64 = 32;
const RESERVE_MIN: u64 = 1;
const RESERVE_MAX: u64 = 16;

/// Chunks the idle loop keeps free below a budget of `budget`.
fn reserve(budget: u64) -> u64 {
    (budget / RESERVE_SHARE).clamp(RESERVE_MIN, RESERVE_MAX)
}

impl Worker {
    /// Pages out the coldest chunks until the main host is within budget
    /// (never `keep`, just paged in): the hard limit, paid by the fault
    /// that crossed it. The idle loop keeps a reserve below it, so this
    /// seldom has work.
    pub(super) fn keep_budget(&mut self, keep: usize) -> Result<(), MigrationError> {
        // (A gather pages nothing out: checked each time round, since
        // one may begin between two page-outs.)
        while !self.shared.gathering.load(Ordering::SeqCst)
            && self.shared.counters.resident.load(Ordering::Relaxed) > self.budget
        {
            if !self.evict_one(Some(keep))? {
                return Ok(());
            }
            // Paging has begun: the idle loop keeps a reserve from now on.
            self.pressed = true;
        }
        Ok(())
    }

    /// True when the main host holds more than its low watermark (the
    /// budget less a reserve for the next page-ins) and may page out.
    pub(super) fn below_watermark_needed(&self) -> bool {
        let reserve = reserve(self.budget);
        self.pressed
            && !self.shared.gathering.load(Ordering::SeqCst)
            && self.budget > reserve
            && self.shared.counters.resident.load(Ordering::Relaxed) > self.budget - reserve
            && self.failure_free()
    }

    fn failure_free(&self) -> bool {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
            && !self.dead.iter().all(|&d| d)
    }

    /// Pages out the coldest chunk held here other than `keep`; false when
    /// there is none to page out.
    pub(super) fn evict_one(&mut self, keep: Option<usize>) -> Result<bool, MigrationError> {
        let clock = self.rank == Rank::Clock && self.sampling;
        let keep = keep.unwrap_or(usize::MAX);
        let places = self.shared.places();
        let cold = if clock {
            self.clock
                .victim(&places, keep, &self.last_use, Instant::now())
        } else {
            None
        };
        let victim = cold
            .map(|(c, _)| c)
            .or_else(|| fallback_victim(&places, keep, self.rank, &self.aging, &self.last_use));
        let Some(victim) = victim else {
            return Ok(false);
        };
        let live: Vec<usize> = self
            .copies(victim)
            .into_iter()
            .filter(|&s| !self.dead[s])
            .collect();
        if live.is_empty() {
            // Not fatal: the VM runs on, over budget.
            tracing::warn!("every memory server of a chunk to page out was lost; the main host stays over budget");
            return Ok(false);
        }
        self.page_out(victim, &live)?;
        let outs = self.shared.counters.page_outs.load(Ordering::Relaxed);
        self.clock
            .paged_out(victim, outs, cold.is_some_and(|(_, last)| last));
        if let Some((_, last)) = cold {
            let k = &self.shared.counters;
            k.cold_victims.fetch_add(1, Ordering::Relaxed);
            k.loop_victims.fetch_add(u64::from(last), Ordering::Relaxed);
        }
        if clock {
            let (map, regions) = (&self.map, &self.regions);
            self.clock.arm(&places, keep, victim, Instant::now(), |c| {
                drop_ptes(map, regions, c)
            });
        }
        Ok(true)
    }

    /// Moves chunk `c` to `servers` (its home, and its mirror): write-
    /// protect, read, send, sync, punch, unprotect (writers blocked
    /// meanwhile fault MISSING next). A server that fails is lost; the
    /// chunk moves if one copy landed.
    fn page_out(&mut self, c: usize, servers: &[usize]) -> Result<(), MigrationError> {
        let shared = self.shared.clone();
        let _out = shared.paging_out.lock().unwrap_or_else(|e| e.into_inner());
        if shared.gathering.load(Ordering::SeqCst) {
            return Ok(());
        }
        if self.clean[c] {
            return self.drop_clean(c);
        }
        let run = self.map.run(c);
        let host = host_of(&self.regions, run.gpa).ok_or_else(|| bad_gpa(run.gpa))?;
        let len = run.bytes();
        let (ri, view) = crate::memory::region_of(&self.regions, run.gpa)
            .map(|(i, r)| (i, *r))
            .ok_or_else(|| bad_gpa(run.gpa))?;
        self.uffd
            .write_protect(host, len, true)
            .map_err(|e| uffd_err("write-protect", e))?;
        // One buffer for every page-out: a fresh one costs a page fault
        // and a clear per page before the read even starts.
        let mut bytes = std::mem::take(&mut self.chunk_buf);
        bytes.resize(len as usize, 0);
        let result = (|| -> Result<u64, MigrationError> {
            // Read through the memfd: a hole reads as zeros there, and
            // nothing this thread does can raise a fault it would have to
            // serve itself. Writers wait on the protection meanwhile.
            std::os::unix::fs::FileExt::read_exact_at(
                &self.files[ri],
                &mut bytes,
                run.gpa - view.gpa(),
            )
            .map_err(|e| MigrationError::vm("read a chunk to page out")(e.to_string()))?;
            // The non-zero pages, moved to the front in place (nothing
            // moves while none is zero).
            let p = PAGE as usize;
            let mut gpas = Vec::new();
            let mut zero = vec![false; run.pages as usize];
            for i in 0..run.pages as usize {
                if crate::memory::is_zero(&bytes[i * p..][..p]) {
                    zero[i] = true;
                } else {
                    let to = gpas.len();
                    if to != i {
                        bytes.copy_within(i * p..(i + 1) * p, to * p);
                    }
                    gpas.push(run.gpa + i as u64 * PAGE);
                }
            }
            let data = &bytes[..gpas.len() * p];
            // Servers that kept an older copy at the page-in: pages zero
            // now must not read back as its old bytes (absent means zero
            // there). The rest are overwritten in place.
            let zero_runs: Vec<GpaPages> = if self.kept[c] {
                runs_of(&zero)
                    .into_iter()
                    .map(|(i, n)| GpaPages::new(run.gpa + i as u64 * PAGE, n as u64))
                    .collect()
            } else {
                Vec::new()
            };
            let mut landed = 0;
            for (k, &server) in servers.iter().enumerate() {
                // Dropping and putting again is the same as once: a send
                // cut short is sent again whole once the server answers.
                let send = |store: &mut crate::memserver::StoreClient| {
                    if !zero_runs.is_empty() {
                        store.drop_runs(&zero_runs)?;
                    }
                    store.put(&gpas, data)?;
                    store.sync()
                };
                match send(&mut self.stores[server]) {
                    Ok(_) => landed += 1,
                    Err(e) => {
                        let mirrored =
                            landed > 0 || servers[k + 1..].iter().any(|&s| !self.dead[s]);
                        if self.recover(server, &e, mirrored) {
                            match send(&mut self.stores[server]) {
                                Ok(_) => landed += 1,
                                Err(e) => self.lose(server, &e.to_string()),
                            }
                        }
                    }
                }
            }
            if landed == 0 {
                let names: Vec<String> = servers
                    .iter()
                    .map(|&i| self.servers[i].to_string())
                    .collect();
                return Err(MigrationError::Unsupported(format!(
                    "every memory server of a chunk failed while paging it out ({})",
                    names.join(", ")
                )));
            }
            // SAFETY: as above; the chunk's data is on its server now.
            unsafe { ferry_memory::mapping::remove_range(host, len) }
                .map_err(|e| MigrationError::vm("punch a paged-out chunk")(e.to_string()))?;
            Ok(gpas.len() as u64)
        })();
        self.chunk_buf = bytes;
        self.uffd
            .write_protect(host, len, false)
            .map_err(|e| uffd_err("unprotect", e))?;
        self.placer.wake(run);
        let pages = result?;
        self.paged_out(c);
        self.shared
            .counters
            .pages_out
            .fetch_add(pages, Ordering::Relaxed);
        Ok(())
    }

    /// Chunk `c` is gone from here: its servers hold its current bytes.
    pub(super) fn paged_out(&mut self, c: usize) {
        self.kept[c] = false;
        self.set_place(c, self.homes[c]);
        self.clock.disarm(c);
        let k = &self.shared.counters;
        k.resident.fetch_sub(1, Ordering::Relaxed);
        k.page_outs.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_share_of_the_budget_within_bounds() {
        assert_eq!(reserve(0), RESERVE_MIN);
        assert_eq!(reserve(40), 1);
        assert_eq!(reserve(320), 10);
        assert_eq!(reserve(1 << 20), RESERVE_MAX);
    }
}
