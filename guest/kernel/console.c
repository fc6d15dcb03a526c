/* console.c - kernel console on the COM1 data port, and panics.
 * Each byte is one port write (one VM exit): keep messages short and rare. */
#include "kernel.h"

static volatile u32 console_lock;

static void lock(void) {
  while (__atomic_exchange_n(&console_lock, 1, __ATOMIC_ACQUIRE)) cpu_relax();
}
static void unlock(void) { __atomic_store_n(&console_lock, 0, __ATOMIC_RELEASE); }

void console_write(const char *s, u64 len) {
  lock();
  for (u64 i = 0; i < len; i++) outb(FERRY_PORT_SERIAL, (u8)s[i]);
  unlock();
}

void printk(const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  console_write(buf, n < (int)sizeof buf ? (u64)n : sizeof buf - 1);
}

/* Print what stopped the guest, mark the metrics page and ask the VMM to stop. */
void panic_frame(const struct frame *f, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  asm volatile("cli");
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  printk("PANIC cpu%lu: %s\n", this_cpu()->id, buf);
  if (f)
    printk("  rip=%lx cs=%lx rflags=%lx rsp=%lx vec=%lu err=%lx cr2=%lx\n"
           "  rax=%lx rbx=%lx rcx=%lx rdx=%lx rsi=%lx rdi=%lx rbp=%lx\n",
           f->rip, f->cs, f->rflags, f->rsp, f->vec, f->err, read_cr2(), f->rax, f->rbx, f->rcx,
           f->rdx, f->rsi, f->rdi, f->rbp);
  metrics->state = FERRY_STATE_PANIC;
  outl(FERRY_PORT_EXIT, FERRY_EXIT_PANIC);
  for (;;) asm volatile("cli; hlt");
}
