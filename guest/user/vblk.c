/* vblk.c - the CPL3 virtio-blk driver (see vblk.h). */
#include "vblk.h"

/* virtio-mmio registers (virtio 1.x, 4.2.2). */
enum {
  R_MAGIC = 0x000, R_VERSION = 0x004, R_DEVICE_ID = 0x008, R_DEVICE_FEATURES = 0x010,
  R_DEVICE_FEATURES_SEL = 0x014, R_DRIVER_FEATURES = 0x020, R_DRIVER_FEATURES_SEL = 0x024,
  R_QUEUE_SEL = 0x030, R_QUEUE_NUM_MAX = 0x034, R_QUEUE_NUM = 0x038, R_QUEUE_READY = 0x044,
  R_QUEUE_NOTIFY = 0x050, R_STATUS = 0x070, R_QUEUE_DESC_LOW = 0x080, R_QUEUE_DESC_HIGH = 0x084,
  R_QUEUE_DRIVER_LOW = 0x090, R_QUEUE_DRIVER_HIGH = 0x094, R_QUEUE_DEVICE_LOW = 0x0a0,
  R_QUEUE_DEVICE_HIGH = 0x0a4, R_CONFIG = 0x100,
};
enum { S_ACK = 1, S_DRIVER = 2, S_DRIVER_OK = 4, S_FEATURES_OK = 8 };
#define F_FLUSH_BIT 9 /* VIRTIO_BLK_F_FLUSH */

static u32 rd(struct vblk *d, u32 off) { return d->regs[off / 4]; }
static void wr(struct vblk *d, u32 off, u32 v) { d->regs[off / 4] = v; }

int vblk_init(struct vblk *d, u64 base, u64 mem, u16 want_qsize) {
  d->regs = (volatile u32 *)base;
  if (rd(d, R_MAGIC) != 0x74726976) return -1;
  if (rd(d, R_VERSION) != 2) return -2;
  if (rd(d, R_DEVICE_ID) != 2) return -3;
  wr(d, R_STATUS, 0);
  wr(d, R_STATUS, S_ACK);
  wr(d, R_STATUS, S_ACK | S_DRIVER);
  wr(d, R_DEVICE_FEATURES_SEL, 1);
  if (!(rd(d, R_DEVICE_FEATURES) & 1)) return -4; /* VERSION_1 */
  wr(d, R_DEVICE_FEATURES_SEL, 0);
  u32 lo = rd(d, R_DEVICE_FEATURES) & (1u << F_FLUSH_BIT);
  wr(d, R_DRIVER_FEATURES_SEL, 0);
  wr(d, R_DRIVER_FEATURES, lo);
  wr(d, R_DRIVER_FEATURES_SEL, 1);
  wr(d, R_DRIVER_FEATURES, 1);
  wr(d, R_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
  if (!(rd(d, R_STATUS) & S_FEATURES_OK)) return -5;
  wr(d, R_QUEUE_SEL, 0);
  u32 max = rd(d, R_QUEUE_NUM_MAX);
  if (!max) return -6;
  u16 q = want_qsize;
  if (q > max) q = (u16)max;
  d->qsize = q;
  d->desc = (volatile struct vring_desc *)mem;
  d->avail = (volatile u16 *)(mem + PAGE_SIZE);
  d->used = (volatile u8 *)(mem + 2 * PAGE_SIZE);
  d->avail_idx = d->used_seen = 0;
  wr(d, R_QUEUE_NUM, q);
  wr(d, R_QUEUE_DESC_LOW, (u32)mem);
  wr(d, R_QUEUE_DESC_HIGH, (u32)(mem >> 32));
  wr(d, R_QUEUE_DRIVER_LOW, (u32)(mem + PAGE_SIZE));
  wr(d, R_QUEUE_DRIVER_HIGH, (u32)((mem + PAGE_SIZE) >> 32));
  wr(d, R_QUEUE_DEVICE_LOW, (u32)(mem + 2 * PAGE_SIZE));
  wr(d, R_QUEUE_DEVICE_HIGH, (u32)((mem + 2 * PAGE_SIZE) >> 32));
  wr(d, R_QUEUE_READY, 1);
  wr(d, R_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
  if (!(rd(d, R_STATUS) & S_DRIVER_OK)) return -7;
  d->capacity = ((u64)rd(d, R_CONFIG + 4) << 32 | rd(d, R_CONFIG)) * 512;
  return 0;
}

void vblk_push(struct vblk *d, u16 head) {
  d->avail[2 + d->avail_idx % d->qsize] = head;
  d->avail_idx++;
  __atomic_thread_fence(__ATOMIC_RELEASE); /* the entry before the index */
  d->avail[1] = d->avail_idx;
}

int vblk_kick(struct vblk *d) {
  /* The index store before the flags load (the device does the reverse:
   * clears NO_NOTIFY, fences, reads the index), so one side sees the other. */
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (*(volatile u16 *)d->used & VRING_USED_F_NO_NOTIFY) return 0; /* it is looking anyway */
  wr(d, R_QUEUE_NOTIFY, 0); /* an MMIO exit: the device takes what is available */
  return 1;
}

int vblk_reap(struct vblk *d, u16 *head) {
  u16 idx = *(volatile u16 *)(d->used + 2);
  if (idx == d->used_seen) return 0;
  __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the index before the entry */
  volatile u32 *e = (volatile u32 *)(d->used + 4 + 8 * (d->used_seen % d->qsize));
  *head = (u16)e[0];
  d->used_seen++;
  return 1;
}
