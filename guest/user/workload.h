/* workload.h - what the kernel hands a workload task, and the task entry points.
 * Everything here runs at CPL3, natively. */
#ifndef WORKLOAD_H
#define WORKLOAD_H

#include "ferry_abi.h"
#include "lib.h"

struct mem_range {
  u64 base, size;
};

/* Built by the kernel for each task; passed in rdi to the task's entry. */
struct task_ctx {
  u32 id;    /* global task index (metrics->tasks[id]) */
  u32 index; /* index within its workload */
  u32 count; /* tasks in its workload */
  u32 cpu;
  u64 tsc_khz;
  u64 seed;
  const struct ferry_workload *wl;
  volatile struct ferry_task_metrics *m;
  volatile struct ferry_workload_metrics *wm;
  struct mem_range mem[2]; /* memory this task owns (size 0 = none) */
};

typedef void (*task_fn)(struct task_ctx *);

void wl_dirty(struct task_ctx *t);
void wl_memtouch(struct task_ctx *t);
void wl_compute(struct task_ctx *t);
void wl_sort(struct task_ctx *t);
void wl_fill(struct task_ctx *t);
void wl_kv(struct task_ctx *t);
void wl_disk(struct task_ctx *t);

/* disk workload memory: virtqueue (3 pages), headers (1 page), qd buffers, a u32 per block. */
static inline u64 disk_mem_size(u64 bs, u64 qd, u64 bytes) {
  return 4 * PAGE_SIZE + qd * bs + (bytes / bs) * 4;
}

/* kv table entry: a lock word, the seed of the value's content, the value. */
static inline u64 kv_entry_size(u64 value_bytes) { return (16 + value_bytes + 7) & ~7UL; }

/* Shared by workloads: console output from CPL3 and guest time. */
void uprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline u64 tsc_to_ms(const struct task_ctx *t, u64 tsc) { return tsc / t->tsc_khz; }

#endif
