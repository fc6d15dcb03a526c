/* lib.c - string and formatting helpers (see lib.h). */
#include "lib.h"

void *memset(void *d, int c, u64 n) {
  u8 *p = d;
  while (n--) *p++ = (u8)c;
  return d;
}

void *memcpy(void *d, const void *s, u64 n) {
  u8 *a = d;
  const u8 *b = s;
  while (n--) *a++ = *b++;
  return d;
}

u64 strlen(const char *s) {
  u64 n = 0;
  while (s[n]) n++;
  return n;
}

struct out {
  char *buf;
  u64 size, len;
};

static void put(struct out *o, char c) {
  if (o->len + 1 < o->size) o->buf[o->len] = c;
  o->len++;
}

static void put_num(struct out *o, u64 v, unsigned base, int neg, int width, char pad) {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = "0123456789abcdef"[v % base];
    v /= base;
  } while (v);
  if (neg) tmp[n++] = '-';
  while (width-- > n) put(o, pad);
  while (n) put(o, tmp[--n]);
}

/* Supports %s %c %d %u %x %p with l/ll/z length modifiers and a zero-padded width. */
int vsnprintf(char *buf, u64 size, const char *fmt, va_list ap) {
  struct out o = {buf, size, 0};
  for (; *fmt; fmt++) {
    if (*fmt != '%') {
      put(&o, *fmt);
      continue;
    }
    fmt++;
    char pad = ' ';
    int width = 0, longs = 0;
    if (*fmt == '0') pad = '0';
    while (*fmt >= '0' && *fmt <= '9') width = width * 10 + (*fmt++ - '0');
    while (*fmt == 'l' || *fmt == 'z') longs++, fmt++;
    switch (*fmt) {
    case 's': {
      const char *s = va_arg(ap, const char *);
      if (!s) s = "(null)";
      while (*s) put(&o, *s++);
      break;
    }
    case 'c': put(&o, (char)va_arg(ap, int)); break;
    case 'd': {
      i64 v = longs ? va_arg(ap, i64) : va_arg(ap, int);
      put_num(&o, v < 0 ? (u64)-v : (u64)v, 10, v < 0, width, pad);
      break;
    }
    case 'u': put_num(&o, longs ? va_arg(ap, u64) : va_arg(ap, u32), 10, 0, width, pad); break;
    case 'x': put_num(&o, longs ? va_arg(ap, u64) : va_arg(ap, u32), 16, 0, width, pad); break;
    case 'p':
      put(&o, '0');
      put(&o, 'x');
      put_num(&o, (u64)va_arg(ap, void *), 16, 0, 0, ' ');
      break;
    case '%': put(&o, '%'); break;
    default: put(&o, '?'); break;
    }
  }
  if (o.size) o.buf[o.len < o.size ? o.len : o.size - 1] = 0;
  return (int)o.len;
}

int snprintf(char *buf, u64 size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, size, fmt, ap);
  va_end(ap);
  return n;
}
