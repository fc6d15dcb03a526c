/* common.c - helpers shared by the workloads (CPL3). */
#include "syscall.h"
#include "workload.h"

void uprintf(const char *fmt, ...) {
  char buf[200];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  sys_write(buf, n < (int)sizeof buf ? (u64)n : sizeof buf - 1);
}
