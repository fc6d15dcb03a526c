/* kernel.h - types, CPU helpers and shared kernel declarations.
 *
 * On PVM-flavoured KVM every instruction the kernel runs at CPL0 is emulated
 * (~3,000 cycles each) while CPL3 runs natively, so kernel paths are kept short:
 * no busy loops, few instructions per interrupt, idle via hlt. */
#ifndef KERNEL_H
#define KERNEL_H

#include "ferry_abi.h"
#include "lib.h"

/* Register frame pushed by the interrupt/syscall entry (entry.S). Its layout is
 * what trap_return pops, so switching tasks is copying one frame over another. */
struct frame {
  u64 r15, r14, r13, r12, r11, r10, r9, r8, rbp, rdi, rsi, rdx, rcx, rbx, rax;
  u64 vec, err, rip, cs, rflags, rsp, ss;
};


/* KVM paravirt MSRs and x2APIC registers. */
#define MSR_APIC_BASE 0x1b
#define MSR_GS_BASE 0xc0000101
#define MSR_KVM_ASYNC_PF_EN 0x4b564d02
#define MSR_KVM_ASYNC_PF_INT 0x4b564d06
#define MSR_KVM_ASYNC_PF_ACK 0x4b564d07
#define X2APIC_EOI 0x80b
#define X2APIC_SVR 0x80f
#define X2APIC_LVT_TIMER 0x832
#define X2APIC_TIMER_INIT 0x838
#define X2APIC_TIMER_DIV 0x83e
#define LAPIC_HZ 1000000000ULL /* KVM's emulated APIC bus: 1 ns per cycle */

/* A task: a CPL3 thread of a workload, pinned to one vCPU. */
struct task {
  struct frame frame; /* saved user context while not running */
  u32 id, cpu, state, workload;
  u64 wake_tsc;  /* SLEEPING until this TSC */
  u32 apf_token; /* APF_WAIT on this token */
  struct ferry_task_metrics *m;
};

/* KVM's per-vCPU async page fault area (64-byte aligned, registered by MSR). */
struct apf_area {
  volatile u32 flags; /* 1 = 'page not present' pending, token in CR2 */
  volatile u32 token; /* 'page ready' token */
  u8 pad[56];
};

/* Per-vCPU state, reached through the GS base (this_cpu reads `self`). */
struct percpu {
  u64 kstack_top; /* stack for traps from CPL3 (TSS rsp0) */
  u64 reserved;
  struct percpu *self; /* offset 16 */
  u64 id;
  struct task *cur; /* NULL while idle */
  struct task *tasks[FERRY_MAX_TASKS];
  u32 ntasks;
  u32 rr;
  u64 idle_since;
  struct frame idle_frame;
  struct ferry_cpu_metrics *m;
  /* The current task's access the vCPU retries while KVM fetches its page
   * (see apf_not_present); NULL when none. */
  struct task *inline_task;
  u32 inline_token;
  struct apf_area apf __attribute__((aligned(64)));
} __attribute__((aligned(64)));

static inline struct percpu *this_cpu(void) {
  struct percpu *p;
  asm volatile("mov %%gs:16, %0" : "=r"(p));
  return p;
}

static inline void outb(u16 port, u8 v) { asm volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { asm volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }
static inline u64 rdmsr(u32 m) {
  u32 lo, hi;
  asm volatile("rdmsr" : "=a"(lo), "=d"(hi) : "c"(m));
  return ((u64)hi << 32) | lo;
}
static inline void wrmsr(u32 m, u64 v) {
  asm volatile("wrmsr" ::"c"(m), "a"((u32)v), "d"((u32)(v >> 32)) : "memory");
}
static inline u64 read_cr2(void) {
  u64 v;
  asm volatile("mov %%cr2, %0" : "=r"(v));
  return v;
}
static inline void cpu_relax(void) { asm volatile("pause" ::: "memory"); }
static inline void lapic_eoi(void) { wrmsr(X2APIC_EOI, 0); }

extern struct ferry_boot_info *const boot;
extern struct ferry_metrics *const metrics;
extern struct percpu percpus[FERRY_MAX_CPUS];

/* entry.S */
void enter_frame(struct frame *f) __attribute__((noreturn));
void user_trampoline(void);
void idle_loop(void);
extern char isr_stubs[];

/* console.c */
void printk(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void console_write(const char *s, u64 len);
void panic_frame(const struct frame *f, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 2, 3)));
#define panic(...) panic_frame(0, __VA_ARGS__)

/* trap.c */
void idt_init(void);
void idt_load(void);
void trap_dispatch(struct frame *f);

/* sched.c */
void sched_add(struct task *t, u32 cpu);
void sched_switch(struct percpu *c, struct frame *f, struct task *next);
struct task *sched_pick(struct percpu *c);
void sched_tick(struct percpu *c, struct frame *f);
void sched_start(struct percpu *c) __attribute__((noreturn));
void sched_block_current(struct percpu *c, struct frame *f, u32 state);
void syscall_dispatch(struct percpu *c, struct frame *f);

/* apf.c */
void apf_enable(struct percpu *c);
int apf_not_present(struct percpu *c, struct frame *f);
void apf_page_ready(struct percpu *c, struct frame *f);

/* svc.c */
void svc_wait(struct percpu *c, struct frame *f);
void svc_interrupt(struct percpu *c, struct frame *f);

/* tasks.c */
void tasks_create(void);

#endif
