/* compute_kernel.h - the compute workload's inner loop: n dependent integer adds. */
#ifndef COMPUTE_KERNEL_H
#define COMPUTE_KERNEL_H

#define COMPUTE_BATCH (1ULL << 20)

static inline unsigned long compute_kernel(unsigned long acc, unsigned long n) {
  for (unsigned long i = 0; i < n; i++) {
    acc += i;
    asm volatile("" : "+r"(acc)); /* keep every add: no vectorising, no closed form */
  }
  return acc;
}

#endif
