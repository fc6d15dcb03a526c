/* compute.c - integer adds as fast as the vCPU runs them (degradation-analysis).
 * compute_kernel is also built for the host by tools/compute_host.c, so the
 * guest's ops/s can be compared with a host process running the same loop. */
#include "compute_kernel.h"
#include "workload.h"

void wl_compute(struct task_ctx *t) {
  u64 acc = t->seed;
  t->m->start_tsc = rdtsc();
  for (;;) {
    acc = compute_kernel(acc, COMPUTE_BATCH);
    t->m->progress += COMPUTE_BATCH;
  }
}
