/* apf.c - KVM asynchronous page faults, as Linux guests use them.
 *
 * When the host must fetch a page the guest touched (userfaultfd, swap), KVM can
 * tell the guest instead of stopping the vCPU: a #PF with apf.flags = 1 and a
 * token in CR2 means 'page not present' -- block only the faulting task and run
 * another; interrupt FERRY_VEC_APF_READY with apf.token means 'page ready' --
 * wake the task waiting on that token. KVM delivers these only for faults taken
 * at CPL3. If the same page faults again while in flight (another task touches
 * it), KVM halts the vCPU until it arrives: the paper's 'double fault'.
 *
 * Only vCPUs with two tasks or more turn APF on (cpu_init): with one, there is
 * nothing to run while a page arrives, and each fault would cost two guest
 * traps, whose CPL0 code PVM emulates an instruction at a time. */
#include "kernel.h"

#define APF_EN_ENABLED (1ULL << 0)
#define APF_EN_SEND_ALWAYS (1ULL << 1)
#define APF_EN_DELIVERY_AS_INT (1ULL << 3)
#define APF_PAGE_NOT_PRESENT 1
#define APF_WAKE_ALL 0xffffffffu

void apf_enable(struct percpu *c) {
  wrmsr(MSR_KVM_ASYNC_PF_INT, FERRY_VEC_APF_READY);
  wrmsr(MSR_KVM_ASYNC_PF_EN,
        (u64)&c->apf | APF_EN_ENABLED | APF_EN_SEND_ALWAYS | APF_EN_DELIVERY_AS_INT);
}

static int other_task_runnable(struct percpu *c) {
  for (u32 i = 0; i < c->ntasks; i++)
    if (c->tasks[i] != c->cur && c->tasks[i]->state == FERRY_TASK_RUNNABLE) return 1;
  return 0;
}

/* Parks the current task until 'page ready' for `token`, and runs another. */
static void park_current(struct percpu *c, struct frame *f, u32 token) {
  c->cur->apf_token = token;
  c->m->apf_waiting++;
  sched_block_current(c, f, FERRY_TASK_APF_WAIT);
}

/* Returns 1 if this #PF was an APF 'page not present' and has been handled.
 *
 * Returning without blocking retries the access, and KVM halts the vCPU until
 * the page arrives. That is the answer when no other task could use the vCPU:
 * a switch to idle and back costs hundreds of CPL0 instructions, each emulated
 * under PVM (~1 us), about what the page itself takes to arrive. A task woken
 * meanwhile takes the vCPU from it (apf_page_ready). */
int apf_not_present(struct percpu *c, struct frame *f) {
  if (!(c->apf.flags & APF_PAGE_NOT_PRESENT)) return 0;
  u32 token = (u32)read_cr2();
  c->apf.flags = 0;
  c->m->apf_not_present++;
  if (!c->cur || (f->cs & 3) != 3) return 1; /* idle or kernel: nothing to block */
  if (!other_task_runnable(c)) {
    c->inline_task = c->cur;
    c->inline_token = token;
    c->m->apf_inline++;
    return 1;
  }
  for (u32 i = 0; i < c->ntasks; i++)
    if (c->tasks[i]->state == FERRY_TASK_APF_WAIT && c->tasks[i]->apf_token == token)
      c->m->apf_double++;
  park_current(c, f, token);
  return 1;
}

void apf_page_ready(struct percpu *c, struct frame *f) {
  u32 token = c->apf.token;
  c->apf.token = 0;
  wrmsr(MSR_KVM_ASYNC_PF_ACK, 1);
  lapic_eoi();
  c->m->apf_ready++;
  if (token == APF_WAKE_ALL) c->m->apf_wake_all++;
  if (c->inline_task && (token == APF_WAKE_ALL || token == c->inline_token)) {
    c->inline_task = NULL; /* its access went through, or will on retry */
    if (token != APF_WAKE_ALL) return;
  }
  int woke = 0;
  for (u32 i = 0; i < c->ntasks; i++) {
    struct task *t = c->tasks[i];
    if (t->state == FERRY_TASK_APF_WAIT && (token == APF_WAKE_ALL || t->apf_token == token)) {
      t->state = FERRY_TASK_RUNNABLE;
      t->m->state = FERRY_TASK_RUNNABLE;
      c->m->apf_waiting--;
      woke++;
    }
  }
  if (!woke) {
    if (token != APF_WAKE_ALL) c->m->apf_early_ready++; /* a retried access's, say */
    return;
  }
  if (!c->cur) {
    sched_switch(c, f, sched_pick(c)); /* the vCPU was idle: run it now */
  } else if (c->cur == c->inline_task) {
    /* The current task still waits in KVM for its page: park it on that
     * token instead, so the woken task runs now, not at the next tick. */
    c->inline_task = NULL;
    park_current(c, f, c->inline_token);
  }
  /* Else the woken task runs at the next tick. */
}
