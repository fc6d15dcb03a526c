/* dirty.c - dirties pages at a requested rate, paced by guest time (TSC) so the
 * rate does not depend on CPU speed. Parameters: see FERRY_WL_DIRTY. Progress
 * counts whole pages rewritten (a page rewritten twice counts twice). */
#include "content.h"
#include "syscall.h"
#include "workload.h"

#define BATCH_PAGES 16

static u64 pick_page(u64 pattern, u64 pages, u64 *cursor, u64 *rng) {
  switch (pattern) {
  case FERRY_PAT_RANDOM:
    return rng_next(rng) % pages;
  case FERRY_PAT_HOTCOLD: { /* 80% of writes go to the hottest 20% of pages */
    u64 hot = pages / 5 ? pages / 5 : 1;
    u64 r = rng_next(rng);
    if (r % 10 < 8 || hot == pages) return (r >> 8) % hot;
    return hot + (r >> 8) % (pages - hot);
  }
  default:
    return (*cursor)++ % pages;
  }
}

void wl_dirty(struct task_ctx *t) {
  const ferry_u64 *p = t->wl->p;
  u64 rate = p[0] / t->count; /* bytes per second for this task; 0 = as fast as possible */
  u64 pattern = p[2], content = p[3];
  u64 pages = t->mem[0].size / PAGE_SIZE;
  u8 *base = (u8 *)t->mem[0].base;
  u64 rng = t->seed, cursor = 0, written = 0;
  u64 pool[TEXT_POOL_BYTES / 8];
  u64 tsc_hz = t->tsc_khz * 1000;
  const u64 batch_bytes = BATCH_PAGES * PAGE_SIZE;
  /* Token bucket: at most 50 ms of credit, so a pause is not followed by a burst. */
  u64 burst = rate / 20 > batch_bytes ? rate / 20 : batch_bytes;
  u64 tokens = 0, last = rdtsc();

  if (!pages) return;
  text_pool_init(pool, &rng);
  /* Touch the working set once first: a page's first touch costs a host fault
   * (~10 us here), which would otherwise cap the rate of the first pass. */
  for (u64 i = 0; i < pages; i++) *(volatile u64 *)(base + i * PAGE_SIZE) = 0;
  last = rdtsc();
  t->m->start_tsc = last;
  for (;;) {
    if (rate) {
      u64 now = rdtsc();
      tokens += muldiv(now - last, rate, tsc_hz);
      last = now;
      if (tokens > burst) tokens = burst;
      if (tokens < batch_bytes) {
        sys_sleep_ns(muldiv(batch_bytes - tokens, 1000000000ULL, rate));
        continue;
      }
      tokens -= batch_bytes;
    }
    for (int b = 0; b < BATCH_PAGES; b++) {
      u64 *page = (u64 *)(base + pick_page(pattern, pages, &cursor, &rng) * PAGE_SIZE);
      if (content == FERRY_CONTENT_ZERO)
        page_fill_word(page, 0);
      else if (content == FERRY_CONTENT_TEXT)
        page_fill_text(page, pool, &rng);
      else
        page_fill_random(page, &rng);
    }
    written += batch_bytes;
    t->m->progress = written;
  }
}
