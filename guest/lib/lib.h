/* lib.h - freestanding helpers shared by the kernel (CPL0) and workloads (CPL3).
 * Pure code only: nothing here touches privileged state. */
#ifndef LIB_H
#define LIB_H

typedef unsigned long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long i64;
typedef __builtin_va_list va_list;
#define va_start(v, l) __builtin_va_start(v, l)
#define va_end(v) __builtin_va_end(v)
#define va_arg(v, l) __builtin_va_arg(v, l)
#define NULL ((void *)0)
#define PAGE_SIZE 4096UL

void *memset(void *d, int c, u64 n);
void *memcpy(void *d, const void *s, u64 n);
u64 strlen(const char *s);
int vsnprintf(char *buf, u64 size, const char *fmt, va_list ap);
int snprintf(char *buf, u64 size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static inline u64 rdtsc(void) {
  u32 lo, hi;
  asm volatile("rdtsc" : "=a"(lo), "=d"(hi));
  return ((u64)hi << 32) | lo;
}

/* xorshift64*: fast, good enough for keys, page choice and random content. */
static inline u64 rng_next(u64 *s) {
  u64 x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1DULL;
}
static inline u64 rng_seed(u64 seed, u64 stream) {
  u64 s = seed ^ (0x9E3779B97F4A7C15ULL * (stream + 1));
  return s ? s : 1;
}

/* a*b/c with a 128-bit intermediate (mul, then div); saturates instead of
 * raising #DE when the quotient does not fit in 64 bits. */
static inline u64 muldiv(u64 a, u64 b, u64 c) {
  u64 hi, lo, q, r;
  asm("mulq %3" : "=a"(lo), "=d"(hi) : "a"(a), "rm"(b));
  if (hi >= c) return ~0ULL;
  asm("divq %4" : "=a"(q), "=d"(r) : "a"(lo), "d"(hi), "rm"(c));
  (void)r;
  return q;
}

#endif
