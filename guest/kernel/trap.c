/* trap.c - the IDT and the single dispatcher every interrupt, exception and
 * syscall goes through. Hot cases (syscall, timer, APF) come first.
 *
 * Syscalls are `ud2` executed at CPL3 (#UD, vector 6). Under PVM the `syscall`
 * instruction lands at LSTAR still in user mode (CS 0x33), and `int n` raises
 * #UD, so an exception is the one reliable way into CPL0. */
#include "kernel.h"

struct idt_entry {
  u16 off_lo, sel;
  u8 ist, type;
  u16 off_mid;
  u32 off_hi, zero;
} __attribute__((packed));

static struct idt_entry idt[256] __attribute__((aligned(16)));

static const char *const exception_names[32] = {
    "divide error", "debug", "NMI", "breakpoint", "overflow", "bound range", "invalid opcode",
    "device not available", "double fault", "coprocessor overrun", "invalid TSS",
    "segment not present", "stack fault", "general protection", "page fault", "reserved",
    "x87 error", "alignment check", "machine check", "SIMD error", "virtualization",
    "control protection",
};

void idt_init(void) {
  for (int i = 0; i < 256; i++) {
    u64 a = (u64)isr_stubs + (u64)i * 16;
    idt[i] = (struct idt_entry){
        .off_lo = (u16)a,
        .sel = FERRY_SEL_KCODE,
        .type = 0x8e, /* present, DPL0, interrupt gate: IF cleared on entry */
        .off_mid = (u16)(a >> 16),
        .off_hi = (u32)(a >> 32),
    };
  }
}

void idt_load(void) {
  struct {
    u16 limit;
    u64 base;
  } __attribute__((packed)) d = {sizeof(idt) - 1, (u64)idt};
  asm volatile("lidt %0" ::"m"(d));
}

void trap_dispatch(struct frame *f) {
  struct percpu *c = this_cpu();
  switch (f->vec) {
  case 6:
    if ((f->cs & 3) == 3 && *(const u16 *)f->rip == 0x0b0f) { /* ud2 from a task */
      f->rip += 2;
      syscall_dispatch(c, f);
      return;
    }
    break;
  case FERRY_VEC_TIMER:
    sched_tick(c, f);
    lapic_eoi();
    return;
  case FERRY_VEC_APF_READY:
    apf_page_ready(c, f);
    return;
  case FERRY_VEC_SVC:
    svc_interrupt(c, f);
    return;
  case 14:
    if (apf_not_present(c, f)) return;
    break;
  case FERRY_VEC_SPURIOUS:
    return;
  }
  if (f->vec < 32) {
    const char *name = exception_names[f->vec] ? exception_names[f->vec] : "exception";
    if ((f->cs & 3) == 3 && c->cur)
      panic_frame(f, "%s in task %u at CPL3", name, c->cur->id);
    panic_frame(f, "%s in the kernel", name);
  }
  panic_frame(f, "unexpected interrupt vector %lu", f->vec);
}
