/* sched.c - per-vCPU round-robin scheduler: picking, switching, blocking.
 *
 * Tasks never move between vCPUs, so a vCPU's run queue is only touched by that
 * vCPU with interrupts off: no locks. A switch copies the interrupted frame into
 * the task and the next task's frame over it; trap_return then resumes it. */
#include "kernel.h"

static void set_state(struct task *t, u32 state) {
  t->state = state;
  t->m->state = state;
}

void sched_add(struct task *t, u32 cpu) {
  struct percpu *c = &percpus[cpu];
  t->cpu = cpu;
  t->m->cpu = cpu;
  set_state(t, FERRY_TASK_RUNNABLE);
  c->tasks[c->ntasks++] = t;
}

/* Next runnable task after the current one in round-robin order; NULL = idle. */
struct task *sched_pick(struct percpu *c) {
  for (u32 i = 1; i <= c->ntasks; i++) {
    u32 k = (c->rr + i) % c->ntasks;
    if (c->tasks[k]->state == FERRY_TASK_RUNNABLE) {
      c->rr = k;
      return c->tasks[k];
    }
  }
  return NULL;
}

/* Make `next` (NULL = idle) the context that *f resumes. */
void sched_switch(struct percpu *c, struct frame *f, struct task *next) {
  if (next == c->cur) return;
  u64 now = rdtsc();
  if (c->cur)
    c->cur->frame = *f;
  else
    c->m->idle_tsc += now - c->idle_since;
  if (next) {
    *f = next->frame;
  } else {
    c->idle_since = now;
    *f = c->idle_frame;
  }
  c->cur = next;
  c->m->context_switches++;
}

/* Park the current task in `state` and run something else. */
void sched_block_current(struct percpu *c, struct frame *f, u32 state) {
  set_state(c->cur, state);
  sched_switch(c, f, sched_pick(c));
}

void sched_tick(struct percpu *c, struct frame *f) {
  u64 now = rdtsc();
  c->m->ticks++;
  if (c->id == 0) metrics->guest_tsc = now;
  if (!c->cur) { /* account idle time even when nothing ever wakes up */
    c->m->idle_tsc += now - c->idle_since;
    c->idle_since = now;
  }
  for (u32 i = 0; i < c->ntasks; i++) {
    struct task *t = c->tasks[i];
    if (t->state == FERRY_TASK_SLEEPING && (i64)(now - t->wake_tsc) >= 0)
      set_state(t, FERRY_TASK_RUNNABLE);
  }
  struct task *next = sched_pick(c);
  if (next) sched_switch(c, f, next);
}

/* Enter the scheduler on this vCPU for the first time: run a task or idle. */
void sched_start(struct percpu *c) {
  struct frame *f = (struct frame *)(c->kstack_top - sizeof(struct frame));
  c->cur = NULL;
  c->idle_since = rdtsc();
  *f = c->idle_frame;
  struct task *next = sched_pick(c);
  if (next) sched_switch(c, f, next);
  enter_frame(f);
}
