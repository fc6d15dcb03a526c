/* kv.c - a key-value server in the guest, like a prefork web server: G worker
 * tasks serve GET/SET on K values of B bytes from the service ring. Each value
 * carries the seed of its content so clients can check every byte
 * (ferry_value, ferry_csum in ferry_abi.h). */
#include "syscall.h"
#include "workload.h"

#define SPIN_US 500 /* poll the ring this long before parking in the kernel */

static struct ferry_svc_header *const svc = (struct ferry_svc_header *)FERRY_SVC_GPA;

static struct ferry_svc_slot *slot_at(u32 i) {
  return (struct ferry_svc_slot *)(FERRY_SVC_GPA + FERRY_SVC_HEADER_SIZE + i * FERRY_SVC_SLOT_SIZE);
}

struct kv_entry {
  volatile u32 lock;
  u32 pad;
  u64 seed;
  u8 value[];
};

static struct kv_entry *entry(const struct task_ctx *t, u64 key) {
  return (struct kv_entry *)(t->mem[0].base + key * kv_entry_size(t->wl->p[2]));
}

static void lock(struct kv_entry *e) {
  while (__atomic_exchange_n(&e->lock, 1, __ATOMIC_ACQUIRE)) asm volatile("pause");
}
static void unlock(struct kv_entry *e) { __atomic_store_n(&e->lock, 0, __ATOMIC_RELEASE); }

static void copy_words(u8 *d, const u8 *s, u64 n) {
  u64 i = 0;
  for (; i + 8 <= n; i += 8) *(ferry_u64_unaligned *)(d + i) = *(const ferry_u64_unaligned *)(s + i);
  for (; i < n; i++) d[i] = s[i];
}

/* Claims a POSTED slot, starting after the last one this worker took. */
static struct ferry_svc_slot *claim(u32 *cursor, u32 *index) {
  for (u32 n = 0; n < FERRY_SVC_SLOTS; n++) {
    u32 i = (*cursor + n) % FERRY_SVC_SLOTS;
    struct ferry_svc_slot *s = slot_at(i);
    u32 expect = FERRY_SLOT_POSTED;
    if (s->state == FERRY_SLOT_POSTED &&
        __atomic_compare_exchange_n(&s->state, &expect, FERRY_SLOT_TAKEN, 0, __ATOMIC_ACQUIRE,
                                    __ATOMIC_RELAXED)) {
      __atomic_fetch_add(&svc->taken, 1, __ATOMIC_SEQ_CST);
      *cursor = i + 1;
      *index = i;
      return s;
    }
  }
  return NULL;
}

/* Answers the request in slot s, in place. Returns the response length. */
static u32 serve(struct task_ctx *t, struct ferry_svc_slot *s) {
  u64 keys = t->wl->p[1], vbytes = t->wl->p[2];
  struct ferry_svc_request rq;
  struct ferry_svc_response *rs = (struct ferry_svc_response *)s->data;
  u8 *rvalue = s->data + sizeof *rs;
  u32 len = s->len;
  if (len < sizeof rq) {
    *rs = (struct ferry_svc_response){.status = FERRY_ST_BAD_REQUEST};
    return sizeof *rs;
  }
  copy_words((u8 *)&rq, s->data, sizeof rq);
  struct ferry_svc_response r = {.op = rq.op, .id = rq.id, .key = rq.key, .seed = rq.seed};
  switch (rq.op) {
  case FERRY_OP_GET:
  case FERRY_OP_SET: {
    if (rq.key >= keys) {
      r.status = FERRY_ST_BAD_KEY;
      break;
    }
    struct kv_entry *e = entry(t, rq.key);
    if (rq.op == FERRY_OP_SET) {
      if (rq.value_len != vbytes || len != sizeof rq + vbytes) {
        r.status = FERRY_ST_BAD_VALUE;
        break;
      }
      lock(e);
      copy_words(e->value, s->data + sizeof rq, vbytes);
      e->seed = rq.seed;
      r.checksum = ferry_csum(e->value, vbytes);
      unlock(e);
    } else {
      lock(e);
      copy_words(rvalue, e->value, vbytes);
      r.seed = e->seed;
      unlock(e);
      r.checksum = ferry_csum(rvalue, vbytes);
      r.value_len = (u32)vbytes;
    }
    break;
  }
  case FERRY_OP_INFO:
    r.key = keys;
    r.seed = vbytes;
    break;
  case FERRY_OP_NOP:
    break;
  case FERRY_OP_SLOW: {
    u64 ms = rq.seed < 10000 ? rq.seed : 10000;
    u64 until = rdtsc() + ms * t->tsc_khz;
    while (rdtsc() < until) asm volatile("pause");
    break;
  }
  default:
    r.status = FERRY_ST_BAD_REQUEST;
    break;
  }
  copy_words((u8 *)rs, (const u8 *)&r, sizeof r);
  return sizeof r + r.value_len;
}

static void init_share(struct task_ctx *t) {
  u64 keys = t->wl->p[1], vbytes = t->wl->p[2];
  u64 lo = keys * t->index / t->count, hi = keys * (t->index + 1) / t->count;
  for (u64 k = lo; k < hi; k++) {
    struct kv_entry *e = entry(t, k);
    e->lock = 0;
    e->seed = 0;
    ferry_value(e->value, vbytes, k, 0);
  }
  /* workloads[].reserved[0] counts workers done initialising. */
  if (__atomic_add_fetch(&t->wm->reserved[0], 1, __ATOMIC_SEQ_CST) == t->count) {
    svc->keys = keys;
    svc->value_size = vbytes;
    svc->version = FERRY_ABI_VERSION;
    svc->magic = FERRY_SVC_MAGIC;
    __atomic_store_n(&svc->ready, 1, __ATOMIC_RELEASE);
    uprintf("kv: %lu keys of %lu bytes ready, %u workers\n", keys, vbytes, t->count);
  }
}

/* At most one worker polls the ring at a time (the "spinner"); the others
 * park in the kernel until the VMM interrupts them. One polling vCPU keeps
 * single-client latency low without taking every host core away from the
 * VMM's own threads. */
static int become_spinner(struct task_ctx *t) {
  ferry_u64 none = 0;
  return __atomic_compare_exchange_n(&svc->spinner, &none, (ferry_u64)t->id + 1, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_RELAXED);
}
static void stop_spinning(void) { __atomic_store_n(&svc->spinner, 0, __ATOMIC_SEQ_CST); }

void wl_kv(struct task_ctx *t) {
  u64 spin = t->tsc_khz * SPIN_US / 1000;
  u32 cursor = t->index * (FERRY_SVC_SLOTS / t->count), index = 0;
  t->m->start_tsc = rdtsc();
  init_share(t);
  while (!__atomic_load_n(&svc->ready, __ATOMIC_ACQUIRE)) sys_yield();
  for (;;) {
    struct ferry_svc_slot *s = claim(&cursor, &index);
    if (!s && become_spinner(t)) {
      u64 until = rdtsc() + spin;
      while (!(s = claim(&cursor, &index)) && rdtsc() < until) asm volatile("pause");
      stop_spinning(); /* before serving, so another worker can poll meanwhile */
    }
    if (!s) {
      sys_svc_wait();
      continue;
    }
    s->len = serve(t, s);
    s->done_tsc = rdtsc();
    __atomic_store_n(&s->state, FERRY_SLOT_DONE, __ATOMIC_RELEASE);
    __atomic_fetch_add(&svc->completed, 1, __ATOMIC_RELAXED);
    t->m->progress++;
    *(volatile u32 *)FERRY_SVC_DOORBELL_GPA = index; /* MMIO exit to the VMM */
  }
}
