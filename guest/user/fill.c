/* fill.c - fills memory with content of known compressibility, then stays
 * resident (gmigrate's best/worst/mixed cases):
 *   best:  each page one repeated non-zero byte (compresses to almost nothing)
 *   worst: random bytes (incompressible)
 *   mixed: a quarter each of zero, text, random and sparse pages */
#include "content.h"
#include "workload.h"

static void fill_page(u64 *page, u64 index, u64 mode, const u64 *pool, u64 *rng) {
  if (mode == FERRY_FILL_BEST) {
    page_fill_word(page, ((index & 0xff) | 1) * 0x0101010101010101ULL);
  } else if (mode == FERRY_FILL_WORST) {
    page_fill_random(page, rng);
  } else {
    switch (index % 4) {
    case 0: break; /* zero page: left untouched */
    case 1: page_fill_text(page, pool, rng); break;
    case 2: page_fill_random(page, rng); break;
    default:
      for (int i = 0; i < 512; i += 64) page[i] = rng_next(rng);
      break;
    }
  }
}

void wl_fill(struct task_ctx *t) {
  u64 mode = t->wl->p[0], rng = t->seed, done = 0, index = 0;
  u64 pool[TEXT_POOL_BYTES / 8];
  u64 start = rdtsc();
  t->m->start_tsc = start;
  text_pool_init(pool, &rng);
  for (int r = 0; r < 2; r++) {
    for (u64 off = 0; off < t->mem[r].size; off += PAGE_SIZE, index++) {
      fill_page((u64 *)(t->mem[r].base + off), index, mode, pool, &rng);
      done += PAGE_SIZE;
      t->m->progress = done;
    }
  }
  static const char *const names[] = {"best", "worst", "mixed"};
  uprintf("fill: %lu MiB (%s) in %lu ms\n", done >> 20, names[mode < 3 ? mode : 2],
          tsc_to_ms(t, rdtsc() - start));
}
