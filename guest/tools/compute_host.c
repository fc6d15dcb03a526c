/* compute_host.c - the compute workload's loop (user/compute_kernel.h) as a host
 * process, so the guest's ops/s can be compared with native speed.
 * Build: gcc -O2 -Iuser tools/compute_host.c -o compute_host; run: ./compute_host [seconds] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "compute_kernel.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  double secs = argc > 1 ? atof(argv[1]) : 2.0;
  unsigned long acc = 1, ops = 0;
  double t0 = now(), t;
  do {
    acc = compute_kernel(acc, COMPUTE_BATCH);
    ops += COMPUTE_BATCH;
  } while ((t = now()) - t0 < secs);
  printf("{\"ops_per_s\": %.0f, \"seconds\": %.3f, \"acc\": %lu}\n", ops / (t - t0), t - t0, acc);
  return 0;
}
