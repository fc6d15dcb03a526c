/* disk.c - a disk workload that checks itself. It drives a virtio-blk disk
 * from CPL3 (vblk.c) with up to qd requests in flight, stamps every block it
 * writes with (tag, lba, generation, checksum) and checks every block it reads
 * against the generation it last wrote there, kept in a table in guest RAM
 * (so the expectation moves with the VM's memory). A block that is not what
 * was written is counted bad by kind (struct ferry_disk_metrics), never hidden
 * and never fatal: the host decides what a bad block means.
 *
 * Memory (mem[0]): 3 pages of virtqueue, 1 page of request headers and status
 * bytes, qd data buffers of bs bytes, then one u32 per block: its generation
 * (0 = never written), with IN_FLIGHT set while a request on it is out. */
#include "syscall.h"
#include "vblk.h"
#include "workload.h"

#define QSIZE 256
#define MAX_QD 64
#define IN_FLIGHT 0x80000000u
#define GEN_MASK 0x7fffffffu

struct slot {
  u64 lba;
  u64 start;
  u32 gen; /* the generation written (writes) */
  u8 write, busy;
};

struct disk {
  struct vblk dev;
  volatile struct ferry_disk_metrics *m;
  struct task_ctx *t;
  u64 bs, qd, blocks, tag, rng;
  u8 *bufs;
  volatile struct vblk_req_header *hdr;
  volatile u8 *st;
  u32 *gen;
  struct slot slots[MAX_QD];
  u64 inflight;
  u64 bytes;
};

static volatile struct ferry_disk_metrics *const dm =
    (volatile struct ferry_disk_metrics *)FERRY_DISK_METRICS_GPA;

static u8 *buf_of(struct disk *k, u64 i) { return k->bufs + i * k->bs; }

static void stamp(struct disk *k, u8 *b, u64 lba, u64 gen) {
  struct ferry_blk_stamp *s = (struct ferry_blk_stamp *)b;
  ferry_value(b + sizeof *s, k->bs - sizeof *s, lba, gen ^ k->tag);
  s->magic = FERRY_BLK_STAMP_MAGIC;
  s->tag = k->tag;
  s->lba = lba;
  s->generation = gen;
  s->checksum = ferry_blk_checksum(b, k->bs, k->tag, lba, gen);
}

static void bad(struct disk *k, u64 lba, volatile ferry_u64 *kind, const char *what, u64 got,
                u64 want) {
  (*kind)++;
  k->m->bad_blocks++;
  if (!k->m->first_bad_lba) k->m->first_bad_lba = lba + 1;
  if (k->m->bad_blocks <= 8)
    uprintf("disk: BAD block %lu (%s): found %#lx, expected %#lx\n", lba, what, got, want);
}

/* Checks a block read back against generation `want` (not 0). */
static void check(struct disk *k, const u8 *b, u64 lba, u64 want) {
  const struct ferry_blk_stamp *s = (const struct ferry_blk_stamp *)b;
  volatile struct ferry_disk_metrics *m = k->m;
  m->blocks_checked++;
  if (s->magic != FERRY_BLK_STAMP_MAGIC) return bad(k, lba, &m->bad_lost, "no stamp", s->magic, want);
  if (s->tag != k->tag) return bad(k, lba, &m->bad_foreign, "another disk's", s->tag, k->tag);
  if (s->lba != lba) return bad(k, lba, &m->bad_foreign, "another block's", s->lba, lba);
  if (s->generation < want) return bad(k, lba, &m->bad_stale, "stale", s->generation, want);
  if (s->generation > want) return bad(k, lba, &m->bad_foreign, "unknown generation", s->generation, want);
  u64 sum = ferry_blk_checksum(b, k->bs, k->tag, lba, want);
  if (s->checksum != sum) return bad(k, lba, &m->bad_torn, "torn", s->checksum, sum);
}

/* Puts request i (lba, write?) on the ring. */
static void submit(struct disk *k, u64 i, u64 lba, int write) {
  struct slot *s = &k->slots[i];
  u32 g = k->gen[lba] & GEN_MASK;
  s->lba = lba;
  s->write = (u8)write;
  s->busy = 1;
  s->gen = g + 1;
  k->gen[lba] |= IN_FLIGHT;
  if (write) stamp(k, buf_of(k, i), lba, s->gen);
  k->hdr[i] = (struct vblk_req_header){.type = write ? VBLK_T_OUT : VBLK_T_IN,
                                       .sector = lba * (k->bs / 512)};
  k->st[i] = 0xff;
  u16 d0 = (u16)(3 * i);
  volatile struct vring_desc *d = k->dev.desc;
  d[d0] = (struct vring_desc){(u64)&k->hdr[i], 16, VRING_DESC_F_NEXT, (u16)(d0 + 1)};
  d[d0 + 1] = (struct vring_desc){(u64)buf_of(k, i), (u32)k->bs,
                                  (u16)(VRING_DESC_F_NEXT | (write ? 0 : VRING_DESC_F_WRITE)),
                                  (u16)(d0 + 2)};
  d[d0 + 2] = (struct vring_desc){(u64)&k->st[i], 1, VRING_DESC_F_WRITE, 0};
  s->start = rdtsc();
  vblk_push(&k->dev, d0);
  k->inflight++;
}

static void complete(struct disk *k, u64 i) {
  struct slot *s = &k->slots[i];
  volatile struct ferry_disk_metrics *m = k->m;
  u64 lat = rdtsc() - s->start;
  m->ops++;
  m->lat_tsc_sum += lat;
  if (lat > m->lat_tsc_max) m->lat_tsc_max = lat;
  u32 want = k->gen[s->lba] & GEN_MASK;
  if (k->st[i] != VBLK_S_OK) {
    m->io_errors++;
    /* A failed write leaves the block undefined: stop checking it until rewritten. */
    k->gen[s->lba] = s->write ? 0 : want;
  } else if (s->write) {
    k->gen[s->lba] = s->gen;
    m->blocks_written++;
    k->bytes += k->bs;
  } else {
    k->gen[s->lba] = want;
    m->blocks_read++;
    k->bytes += k->bs;
    if (want) check(k, buf_of(k, i), s->lba, want);
  }
  s->busy = 0;
  k->inflight--;
  k->t->m->progress = k->bytes;
}

/* Reaps every completion there is; returns how many. */
static u64 reap(struct disk *k) {
  u64 n = 0;
  u16 head;
  while (vblk_reap(&k->dev, &head)) {
    complete(k, head / 3);
    n++;
  }
  return n;
}

static void wait_one(struct disk *k) {
  while (!reap(k)) asm volatile("pause");
}

static void drain(struct disk *k) {
  while (k->inflight) wait_one(k);
}

/* A block no request is on, near a random one. */
static u64 pick_random(struct disk *k) {
  u64 lba = rng_next(&k->rng) % k->blocks;
  while (k->gen[lba] & IN_FLIGHT) lba = (lba + 1) % k->blocks;
  return lba;
}

void wl_disk(struct task_ctx *t) {
  const ferry_u64 *p = t->wl->p;
  struct disk *k = (struct disk *)t->mem[1].base;
  u64 mem = t->mem[0].base;
  *k = (struct disk){.m = dm, .t = t, .bs = p[1], .qd = p[2], .rng = t->seed};
  u64 mode = p[0], bytes = p[3], rate = p[4];
  if (k->qd > MAX_QD) k->qd = MAX_QD;
  k->blocks = bytes / k->bs;
  k->tag = rng_seed(t->seed, 0xd15c) | 1;
  k->hdr = (volatile struct vblk_req_header *)(mem + 3 * PAGE_SIZE);
  k->st = (volatile u8 *)(mem + 3 * PAGE_SIZE + 16 * MAX_QD);
  k->bufs = (u8 *)(mem + 4 * PAGE_SIZE);
  k->gen = (u32 *)(mem + 4 * PAGE_SIZE + k->qd * k->bs);
  dm->tag = k->tag;
  dm->block_bytes = k->bs;
  dm->blocks = k->blocks;
  int r = vblk_init(&k->dev, FERRY_BLK_MMIO_GPA + p[5] * FERRY_BLK_MMIO_STRIDE, mem, QSIZE);
  if (r) {
    uprintf("disk: virtio-blk set-up failed at step %d\n", -r);
    sys_fail("disk: no usable virtio-blk device");
  }
  dm->capacity = k->dev.capacity;
  if (k->dev.capacity < bytes) sys_fail("disk: the disk is smaller than the workload's mib");
  dm->magic = FERRY_DISK_MAGIC;
  uprintf("disk: %lu blocks of %lu bytes, qd %lu, disk %lu MiB\n", k->blocks, k->bs, k->qd,
          k->dev.capacity >> 20);

  u64 tsc_hz = t->tsc_khz * 1000, tokens = 0, last = rdtsc();
  u64 burst = rate / 20 > k->bs ? rate / 20 : k->bs;
  u64 cursor = 0;
  u64 phase = mode == FERRY_DISK_RANDWRITE ? FERRY_DISK_RUN : FERRY_DISK_FILL;
  dm->phase = phase;
  t->m->start_tsc = rdtsc();
  for (;;) {
    /* Sequential phases end once every block went and came back. */
    if ((phase == FERRY_DISK_FILL || phase == FERRY_DISK_VERIFY) && cursor == k->blocks) {
      drain(k);
      cursor = 0;
      if (phase == FERRY_DISK_VERIFY) break;
      phase = mode == FERRY_DISK_SEQWRITE ? FERRY_DISK_VERIFY : FERRY_DISK_RUN;
      dm->phase = phase;
    }
    u64 pushed = 0;
    while (k->inflight < k->qd) {
      if ((phase == FERRY_DISK_FILL || phase == FERRY_DISK_VERIFY) && cursor == k->blocks) break;
      if (rate) {
        u64 now = rdtsc();
        tokens += muldiv(now - last, rate, tsc_hz);
        last = now;
        if (tokens > burst) tokens = burst;
        if (tokens < k->bs) break;
        tokens -= k->bs;
      }
      u64 i = 0;
      while (k->slots[i].busy) i++;
      switch (phase) {
      case FERRY_DISK_FILL: submit(k, i, cursor++, 1); break;
      case FERRY_DISK_VERIFY: submit(k, i, cursor++, 0); break;
      default: {
        int write = mode == FERRY_DISK_RANDWRITE ||
                    (mode == FERRY_DISK_MIXED && (rng_next(&k->rng) & 1));
        submit(k, i, pick_random(k), write);
      }
      }
      pushed++;
    }
    if (pushed) vblk_kick(&k->dev);
    if (k->inflight) {
      wait_one(k);
    } else if (rate) {
      sys_sleep_ns(muldiv(k->bs - (tokens < k->bs ? tokens : 0), 1000000000ULL, rate));
    }
  }
  dm->phase = FERRY_DISK_DONE;
  t->wm->result = dm->bad_blocks ? 2 : 1;
  uprintf("disk: done: %lu blocks written, %lu checked, %lu bad\n", (u64)dm->blocks_written,
          (u64)dm->blocks_checked, (u64)dm->bad_blocks);
}
