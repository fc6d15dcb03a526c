/* svc.c - the kernel's part of the service device: parking idle workers and
 * waking one when the VMM signals a posted request. Workers spin on the ring at
 * CPL3 first and only park here when it stays empty: every kernel entry costs
 * tens of microseconds of emulated CPL0 code on PVM. */
#include "kernel.h"

static struct ferry_svc_header *const svc = (struct ferry_svc_header *)FERRY_SVC_GPA;

/* Park the calling worker unless a request is already waiting. The sleeper
 * count is raised before the ring is checked (and the VMM posts before it
 * reads the count), so a request can never be posted unseen. */
void svc_wait(struct percpu *c, struct frame *f) {
  __atomic_fetch_add(&svc->sleepers[c->id], 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&svc->posted, __ATOMIC_SEQ_CST) !=
      __atomic_load_n(&svc->taken, __ATOMIC_SEQ_CST)) {
    __atomic_fetch_sub(&svc->sleepers[c->id], 1, __ATOMIC_SEQ_CST);
    return;
  }
  sched_block_current(c, f, FERRY_TASK_SVC_WAIT);
}

/* A request was posted: wake one parked worker on this vCPU and run it now. */
void svc_interrupt(struct percpu *c, struct frame *f) {
  lapic_eoi();
  for (u32 i = 0; i < c->ntasks; i++) {
    struct task *t = c->tasks[i];
    if (t->state == FERRY_TASK_SVC_WAIT) {
      __atomic_fetch_sub(&svc->sleepers[c->id], 1, __ATOMIC_SEQ_CST);
      t->state = FERRY_TASK_RUNNABLE;
      t->m->state = FERRY_TASK_RUNNABLE;
      sched_switch(c, f, t);
      return;
    }
  }
}
