/* vblk.h - a virtio-blk driver a CPL3 task drives directly (virtio 1.x over
 * virtio-mmio, one split virtqueue). The register window is MMIO in the 32-bit
 * hole, mapped user-accessible, so every register access is one exit to the
 * VMM and no kernel entry: the queue lives in the task's own memory, requests
 * go on the available ring, a QueueNotify store rings the device, and the task
 * polls the used ring for completions (no interrupt). */
#ifndef VBLK_H
#define VBLK_H

#include "lib.h"

#define VBLK_T_IN 0
#define VBLK_T_OUT 1
#define VBLK_T_FLUSH 4
#define VBLK_T_GET_ID 8
#define VBLK_S_OK 0

#define VRING_DESC_F_NEXT 1
#define VRING_DESC_F_WRITE 2
#define VRING_USED_F_NO_NOTIFY 1

struct vring_desc {
  u64 addr;
  u32 len;
  u16 flags, next;
};
struct vblk_req_header {
  u32 type, reserved;
  u64 sector;
};

struct vblk {
  volatile u32 *regs;
  u16 qsize;
  u16 avail_idx; /* next free slot in the available ring (free-running) */
  u16 used_seen; /* used ring entries consumed (free-running) */
  volatile struct vring_desc *desc;
  volatile u16 *avail; /* flags, idx, ring[qsize] */
  volatile u8 *used;   /* flags u16, idx u16, ring[qsize] of {id u32, len u32} */
  u64 capacity;        /* bytes */
};

/* Resets and sets up the device at `base` with its queue in `mem` (3 pages,
 * zeroed). Returns 0, or a negative step number that failed. */
int vblk_init(struct vblk *d, u64 base, u64 mem, u16 want_qsize);
/* Makes descriptor chain `head` available (no notify yet). */
void vblk_push(struct vblk *d, u16 head);
/* Tells the device to look at the available ring, unless it said it looks
 * anyway (VRING_USED_F_NO_NOTIFY while it has requests in flight). Returns 1
 * if it rang the doorbell. */
int vblk_kick(struct vblk *d);
/* Takes one completed chain: 1 and its head in *head, or 0 if none. */
int vblk_reap(struct vblk *d, u16 *head);

#endif
