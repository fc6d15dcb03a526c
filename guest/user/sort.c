/* sort.c - sorts random 64-bit keys (LSD radix sort, 8 passes of 8 bits), then
 * checks the result itself: order, count and checksum of the keys. */
#include "syscall.h"
#include "workload.h"

void wl_sort(struct task_ctx *t) {
  u64 n = t->mem[0].size / 8;
  u64 *a = (u64 *)t->mem[0].base, *b = (u64 *)t->mem[1].base;
  u64 rng = t->seed, sum_before = 0, xor_before = 0;
  u64 start = rdtsc();
  t->m->start_tsc = start;
  for (u64 i = 0; i < n; i++) {
    a[i] = rng_next(&rng);
    sum_before += a[i];
    xor_before ^= a[i];
  }
  for (int pass = 0; pass < 8; pass++) {
    u64 count[256] = {0};
    int shift = pass * 8;
    for (u64 i = 0; i < n; i++) count[(a[i] >> shift) & 0xff]++;
    u64 off = 0;
    for (int d = 0; d < 256; d++) {
      u64 c = count[d];
      count[d] = off;
      off += c;
    }
    for (u64 i = 0; i < n; i++) {
      b[count[(a[i] >> shift) & 0xff]++] = a[i];
      if ((i & 0xffff) == 0) t->m->progress = pass * n + i;
    }
    u64 *s = a;
    a = b;
    b = s;
    t->m->progress = (pass + 1) * n;
  }
  u64 sum = 0, x = 0, ordered = 1;
  for (u64 i = 0; i < n; i++) {
    sum += a[i];
    x ^= a[i];
    if (i && a[i - 1] > a[i]) ordered = 0;
  }
  int ok = ordered && sum == sum_before && x == xor_before;
  t->wm->result = ok ? 1 : 2;
  uprintf("sort: %lu keys (%lu MiB) in %lu ms: %s\n", n, (n * 8) >> 20,
          tsc_to_ms(t, rdtsc() - start), ok ? "sorted, checksums match" : "NOT SORTED");
  if (!ok) sys_fail("sort produced a wrong result");
}
