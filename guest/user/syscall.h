/* syscall.h - the task <-> kernel call numbers and their user-side wrappers.
 * Tasks enter the kernel with `ud2` (rax = number, args in rdi, rsi; see
 * kernel/trap.c for why not `syscall`); the result comes back in rax. */
#ifndef SYSCALL_H
#define SYSCALL_H

#include "lib.h"

enum {
  SYS_EXIT = 0,  /* task finished */
  SYS_YIELD = 1, /* give the vCPU to another runnable task */
  SYS_SLEEP = 2, /* rdi = nanoseconds */
  SYS_WRITE = 3, /* rdi = buffer, rsi = length: console output */
  SYS_FAIL = 4,  /* rdi = message: a workload check failed, stop the VM */
  SYS_SVC_WAIT = 5, /* block until the service device posts a request */
};

static inline u64 syscall2(u64 nr, u64 a, u64 b) {
  u64 ret;
  asm volatile("ud2" : "=a"(ret) : "a"(nr), "D"(a), "S"(b) : "memory");
  return ret;
}

static inline void sys_yield(void) { syscall2(SYS_YIELD, 0, 0); }
static inline void sys_sleep_ns(u64 ns) { syscall2(SYS_SLEEP, ns, 0); }
static inline void sys_write(const char *s, u64 len) { syscall2(SYS_WRITE, (u64)s, len); }
static inline void sys_fail(const char *msg) { syscall2(SYS_FAIL, (u64)msg, 0); }
static inline void sys_svc_wait(void) { syscall2(SYS_SVC_WAIT, 0, 0); }

#endif
