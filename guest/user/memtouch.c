/* memtouch.c - each task writes one byte in every page of its own region and
 * records how long that took (postcopy-paravirt-page-fault-yabusame, sec. 4.1). */
#include "workload.h"

void wl_memtouch(struct task_ctx *t) {
  volatile u8 *base = (volatile u8 *)t->mem[0].base;
  u64 pages = t->mem[0].size / PAGE_SIZE;
  u64 start = rdtsc();
  t->m->start_tsc = start;
  for (u64 i = 0; i < pages; i++) {
    base[i * PAGE_SIZE] = (u8)(i | 1);
    t->m->progress = (i + 1) * PAGE_SIZE;
  }
  u64 ms = tsc_to_ms(t, rdtsc() - start);
  uprintf("memtouch task %u: %lu MiB in %lu ms\n", t->index, t->mem[0].size >> 20, ms);
}
