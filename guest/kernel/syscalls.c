/* syscalls.c - what each CPL3 syscall does: the table trap.c dispatches to.
 * Kept apart from the scheduler so that the scheduler calls nothing above it
 * (the service device's wait and the console sit on top of it, not beside). */
#include "kernel.h"
#include "syscall.h"

static u64 ns_to_tsc(u64 ns) { return muldiv(ns, boot->tsc_khz, 1000000); }

static void task_exit(struct percpu *c, struct frame *f) {
  struct task *t = c->cur;
  t->m->end_tsc = rdtsc();
  __atomic_fetch_add(&metrics->workloads[t->workload].tasks_done, 1, __ATOMIC_RELAXED);
  sched_block_current(c, f, FERRY_TASK_DONE);
}

void syscall_dispatch(struct percpu *c, struct frame *f) {
  u64 nr = f->rax;
  c->m->syscalls++;
  f->rax = 0;
  switch (nr) {
  case SYS_EXIT:
    task_exit(c, f);
    return;
  case SYS_YIELD: {
    struct task *next = sched_pick(c);
    if (next) sched_switch(c, f, next);
    return;
  }
  case SYS_SLEEP:
    c->cur->wake_tsc = rdtsc() + ns_to_tsc(f->rdi);
    sched_block_current(c, f, FERRY_TASK_SLEEPING);
    return;
  case SYS_WRITE:
    console_write((const char *)f->rdi, f->rsi < 1024 ? f->rsi : 1024);
    return;
  case SYS_SVC_WAIT:
    svc_wait(c, f);
    return;
  case SYS_FAIL:
    panic_frame(f, "task %u failed: %s", c->cur->id, (const char *)f->rdi);
  default:
    f->rax = (u64)-1;
    return;
  }
}
