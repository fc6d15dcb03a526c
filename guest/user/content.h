/* content.h - page contents of known compressibility, for dirty and fill. */
#ifndef CONTENT_H
#define CONTENT_H

#include "lib.h"

#define TEXT_POOL_BYTES 8192

static inline void page_fill_word(u64 *page, u64 word) {
  for (int i = 0; i < 512; i++) page[i] = word;
}

static inline void page_fill_random(u64 *page, u64 *rng) {
  for (int i = 0; i < 512; i++) page[i] = rng_next(rng);
}

/* English-like words: compresses about like text does. */
static inline void text_pool_init(u64 *pool, u64 *rng) {
  static const char *const words[] = {
      "the ", "migration ", "of ", "memory ", "page ", "and ", "a ", "virtual ", "machine ",
      "host ", "to ", "is ", "dirty ", "in ", "round ", "copy ", "network ", "guest ", "with ",
      "time ", "downtime ", "for ", "each ", "kernel ", "request ", "server. ", "data\n",
  };
  char *p = (char *)pool;
  u64 n = 0;
  while (n < TEXT_POOL_BYTES) {
    const char *w = words[rng_next(rng) % (sizeof words / sizeof words[0])];
    while (*w && n < TEXT_POOL_BYTES) p[n++] = *w++;
  }
}

static inline void page_fill_text(u64 *page, const u64 *pool, u64 *rng) {
  const u64 *src = pool + rng_next(rng) % (TEXT_POOL_BYTES / 8 - 512);
  for (int i = 0; i < 512; i++) page[i] = src[i];
}

#endif
