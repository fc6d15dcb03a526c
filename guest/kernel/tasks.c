/* tasks.c - turns the workloads in the boot info into tasks: gives each its
 * share of the arena, a user stack and a context, and spreads them over vCPUs. */
#include "kernel.h"
#include "workload.h"

#define USTACK_SIZE 32768

static struct task tasks[FERRY_MAX_TASKS];
static struct task_ctx ctxs[FERRY_MAX_TASKS];
static u8 ustacks[FERRY_MAX_TASKS][USTACK_SIZE] __attribute__((aligned(16)));

/* Bump allocator over the RAM ranges above FERRY_ARENA_BASE. */
static u32 arena_range;
static u64 arena_next;

static void arena_bounds(u32 i, u64 *lo, u64 *hi) {
  *lo = boot->ram[i].base;
  *hi = boot->ram[i].base + boot->ram[i].size;
  if (*lo < FERRY_ARENA_BASE) *lo = FERRY_ARENA_BASE;
}

static struct mem_range arena_alloc(u64 bytes, const char *what) {
  bytes = (bytes + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1);
  for (; arena_range < boot->nranges; arena_range++, arena_next = 0) {
    u64 lo, hi;
    arena_bounds(arena_range, &lo, &hi);
    if (arena_next < lo) arena_next = lo;
    if (arena_next + bytes <= hi) {
      struct mem_range r = {arena_next, bytes};
      arena_next += bytes;
      return r;
    }
  }
  panic("out of guest memory: %s needs %lu KiB more", what, bytes >> 10);
}

/* Whatever is left of the current arena range (for fill with no size). */
static struct mem_range arena_rest(void) {
  struct mem_range r = {0, 0};
  while (arena_range < boot->nranges) {
    u64 lo, hi;
    arena_bounds(arena_range, &lo, &hi);
    if (arena_next < lo) arena_next = lo;
    if (arena_next < hi) {
      r = (struct mem_range){arena_next, hi - arena_next};
      arena_next = hi;
      return r;
    }
    arena_range++;
    arena_next = 0;
  }
  return r;
}

static u32 ntasks, next_cpu;

static struct task_ctx *task_new(u32 wl, u32 index, u32 count, task_fn fn) {
  if (ntasks == FERRY_MAX_TASKS) panic("more than %u tasks", FERRY_MAX_TASKS);
  u32 id = ntasks++;
  struct task *t = &tasks[id];
  struct task_ctx *x = &ctxs[id];
  t->id = id;
  t->workload = wl;
  t->m = &metrics->tasks[id];
  t->m->workload = wl;
  *x = (struct task_ctx){
      .id = id,
      .index = index,
      .count = count,
      .tsc_khz = boot->tsc_khz,
      .seed = rng_seed(boot->seed, id),
      .wl = &boot->workloads[wl],
      .m = t->m,
      .wm = &metrics->workloads[wl],
  };
  t->frame = (struct frame){
      .rip = (u64)user_trampoline,
      .cs = FERRY_SEL_UCODE,
      .rflags = 0x202,
      .rsp = (u64)&ustacks[id][USTACK_SIZE],
      .ss = FERRY_SEL_UDATA,
      .rdi = (u64)x,
      .rsi = (u64)fn,
  };
  x->cpu = next_cpu;
  sched_add(t, next_cpu);
  next_cpu = (next_cpu + 1) % boot->ncpus;
  return x;
}

static u64 max1(u64 v) { return v ? v : 1; }

void tasks_create(void) {
  for (u32 w = 0; w < boot->nworkloads; w++) {
    const struct ferry_workload *wl = &boot->workloads[w];
    struct ferry_workload_metrics *wm = &metrics->workloads[w];
    const u64 *p = (const u64 *)wl->p;
    u32 first = ntasks;
    wm->kind = wl->kind;
    switch (wl->kind) {
    case FERRY_WL_IDLE:
      break;
    case FERRY_WL_DIRTY: {
      u32 n = (u32)max1(p[4]);
      u64 slice = (p[1] / n) & ~(PAGE_SIZE - 1);
      for (u32 i = 0; i < n; i++) task_new(w, i, n, wl_dirty)->mem[0] = arena_alloc(slice, "dirty");
      break;
    }
    case FERRY_WL_MEMTOUCH: {
      u32 n = (u32)max1(p[0]);
      for (u32 i = 0; i < n; i++)
        task_new(w, i, n, wl_memtouch)->mem[0] = arena_alloc(p[1], "memtouch");
      break;
    }
    case FERRY_WL_COMPUTE: {
      u32 n = (u32)max1(p[0]);
      for (u32 i = 0; i < n; i++) task_new(w, i, n, wl_compute);
      break;
    }
    case FERRY_WL_SORT: {
      struct task_ctx *x = task_new(w, 0, 1, wl_sort);
      x->mem[0] = arena_alloc(p[0], "sort keys");
      x->mem[1] = arena_alloc(p[0], "sort buffer");
      break;
    }
    case FERRY_WL_FILL: {
      struct task_ctx *x = task_new(w, 0, 1, wl_fill);
      if (p[1]) {
        x->mem[0] = arena_alloc(p[1], "fill");
      } else {
        x->mem[0] = arena_rest();
        x->mem[1] = arena_rest();
      }
      break;
    }
    case FERRY_WL_KV: {
      u32 n = (u32)max1(p[0]);
      u64 entry = kv_entry_size(p[2]);
      struct mem_range table = arena_alloc(p[1] * entry, "kv table");
      for (u32 i = 0; i < n; i++) task_new(w, i, n, wl_kv)->mem[0] = table;
      break;
    }
    case FERRY_WL_DISK: {
      struct task_ctx *x = task_new(w, 0, 1, wl_disk);
      x->mem[0] = arena_alloc(disk_mem_size(p[1], p[2], p[3]), "disk");
      x->mem[1] = arena_alloc(2 * PAGE_SIZE, "disk state");
      break;
    }
    default:
      panic("unknown workload kind %u", wl->kind);
    }
    wm->tasks = ntasks - first;
  }
  metrics->ntasks = ntasks;
}
