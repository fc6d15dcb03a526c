/* memtouch.c - each task touches every page of its own region once and
 * records how long that took (postcopy-paravirt-page-fault-yabusame, sec. 4.1).
 *
 * after=start (p2 = FERRY_AFTER_START): write one byte per page of fresh
 * memory at once, timed from the task's start.
 *
 * after=migrate: fill the region with random data first (pages the source
 * must send: neither zero nor compressible), count the task in the
 * workload's `ready`, then sleep-poll the host info page's `migrations` until
 * it changes (a destination VMM counted the move before starting the vCPUs:
 * the VM now runs on the new host; the poll sees it within one timer tick). The first task to see
 * the move records the TSC in the workload's `signal_tsc`; every task's
 * start_tsc is that moment, so its time is "finished this long after the
 * switch", whichever task the scheduler ran first. Then one read-modify-write
 * per page. */
#include "content.h"
#include "syscall.h"
#include "workload.h"

static const volatile struct ferry_host_info *const host_info =
    (const volatile struct ferry_host_info *)FERRY_HOST_INFO_GPA;

#define POLL_NS 1000000ULL /* sleep between looks: ends at the next timer tick */

static u64 migrations(void) { return __atomic_load_n(&host_info->migrations, __ATOMIC_ACQUIRE); }

/* Fills the region, reports ready, waits for the move; returns its TSC. */
static u64 wait_for_move(struct task_ctx *t, volatile u8 *base, u64 pages) {
  u64 rng = t->seed;
  u64 seen = migrations();
  for (u64 i = 0; i < pages; i++) page_fill_random((u64 *)(base + i * PAGE_SIZE), &rng);
  __atomic_fetch_add(&t->wm->ready, 1, __ATOMIC_RELEASE);
  while (migrations() == seen) sys_sleep_ns(POLL_NS);
  ferry_u64 first = 0, now = rdtsc();
  if (__atomic_compare_exchange_n(&t->wm->signal_tsc, &first, now, 0, __ATOMIC_ACQ_REL,
                                  __ATOMIC_ACQUIRE))
    return now;
  return first;
}

void wl_memtouch(struct task_ctx *t) {
  volatile u8 *base = (volatile u8 *)t->mem[0].base;
  u64 pages = t->mem[0].size / PAGE_SIZE;
  int after_move = t->wl->p[2] == FERRY_AFTER_MIGRATE;
  u64 start = after_move ? wait_for_move(t, base, pages) : rdtsc();
  t->m->start_tsc = start;
  for (u64 i = 0; i < pages; i++) {
    volatile u64 *w = (volatile u64 *)(base + i * PAGE_SIZE);
    if (after_move)
      *w = *w + 1; /* read and write: the page's data must be there */
    else
      *(volatile u8 *)w = (u8)(i | 1);
    t->m->progress = (i + 1) * PAGE_SIZE;
  }
  u64 ms = tsc_to_ms(t, rdtsc() - start);
  uprintf("memtouch task %u: %lu MiB in %lu ms%s\n", t->index, t->mem[0].size >> 20, ms,
          after_move ? " after the move" : "");
}
