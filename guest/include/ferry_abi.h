/* ferry_abi.h - the contract between the ferry VMM and its test guest.
 *
 * Mirrored in Rust by crates/vmm/src/guest_abi.rs; a test in that crate compiles
 * this header and checks every offset and constant. Change both together and bump
 * FERRY_ABI_VERSION.
 *
 * Guest physical layout (all addresses are identity-mapped by the VMM's page tables):
 *
 *   0x0000_0000  null page (left unused)
 *   0x0000_1000  boot info (VMM -> guest, struct ferry_boot_info)
 *   0x0000_2000  GDT (null, kcode 0x08, kdata 0x10, ucode 0x18|3, udata 0x20|3, TSS 0x28 + 16*cpu)
 *   0x0000_3000  TSS array (FERRY_TSS_STRIDE bytes per vCPU)
 *   0x0000_4000  metrics page (guest -> VMM, struct ferry_metrics), 16 KiB
 *   0x0000_8000  per-vCPU boot stacks (4 KiB each, top = 0x9000 + cpu*0x1000)
 *   0x0001_0000  page tables (PML4, PDPT, PDs), built by the VMM
 *   0x0010_0000  kernel image (ELF, physical = virtual)
 *   ...          kernel pool: task structs and stacks
 *   0x0080_0000  service ring (struct ferry_svc_header + slots), 4 MiB
 *   0x0100_0000  workload arena: memory the workloads touch, up to the end of RAM
 *                (RAM above 3 GiB continues at 4 GiB, see boot info ram[])
 *   0xD000_0000  service doorbell (MMIO, no memory behind it)
 *   0xD000_1000  host info page (VMM -> guest, struct ferry_host_info): VMM memory,
 *                not RAM; shares the doorbell's 2 MiB mapping (user, uncached)
 *   0xD000_2000  virtio-mmio register windows of the disks, 4 KiB each (MMIO, no memory
 *                behind them; same 2 MiB mapping, so CPL3 drivers reach them)
 */
#ifndef FERRY_ABI_H
#define FERRY_ABI_H

#define FERRY_ABI_VERSION 3

#define FERRY_BOOT_INFO_GPA 0x1000UL
#define FERRY_GDT_GPA 0x2000UL
#define FERRY_TSS_GPA 0x3000UL
#define FERRY_TSS_STRIDE 0x80UL
#define FERRY_METRICS_GPA 0x4000UL
#define FERRY_METRICS_SIZE 0x4000UL
#define FERRY_BOOT_STACKS_GPA 0x8000UL
#define FERRY_PAGE_TABLES_GPA 0x10000UL
#define FERRY_KERNEL_GPA 0x100000UL
#define FERRY_SVC_GPA 0x800000UL
#define FERRY_SVC_SIZE 0x400000UL
#define FERRY_ARENA_BASE 0x1000000UL
/* Service doorbell: a 32-bit store of a slot index from a task (MMIO, in the
 * 32-bit hole, mapped user-accessible by the VMM). Port I/O is not an option:
 * PVM ignores IOPL for CPL3 code. */
#define FERRY_SVC_DOORBELL_GPA 0xD0000000UL
#define FERRY_HOST_INFO_GPA 0xD0001000UL
/* Disk i's virtio-mmio window (virtio 1.x, docs/disks.md). */
#define FERRY_BLK_MMIO_GPA 0xD0002000UL
#define FERRY_BLK_MMIO_STRIDE 0x1000UL
/* The disk workload's counters (struct ferry_disk_metrics), in the metrics
 * area after struct ferry_metrics. */
#define FERRY_DISK_METRICS_GPA (FERRY_METRICS_GPA + 0x2000UL)
#define FERRY_LOW_RAM_MAX 0xC0000000UL /* RAM above this continues at 4 GiB */
#define FERRY_HIGH_RAM_BASE 0x100000000UL

#define FERRY_SEL_KCODE 0x08
#define FERRY_SEL_KDATA 0x10
#define FERRY_SEL_UCODE 0x1b
#define FERRY_SEL_UDATA 0x23
#define FERRY_SEL_TSS0 0x28

#define FERRY_MAX_CPUS 8
#define FERRY_MAX_TASKS 64
#define FERRY_MAX_WORKLOADS 4
#define FERRY_MAX_PARAMS 8
#define FERRY_MAX_RAM_RANGES 4

/* I/O ports the guest uses. */
#define FERRY_PORT_SERIAL 0x3f8 /* COM1 data register: console bytes */
#define FERRY_PORT_EXIT 0xf4    /* 32-bit write: guest exit with this code */
#define FERRY_EXIT_PANIC 0xdead /* exit code written after a guest panic */

/* Interrupt vectors. */
#define FERRY_VEC_TIMER 0x20
#define FERRY_VEC_SVC 0x41 /* service device: a request was posted */
#define FERRY_VEC_APF_READY 0xec
#define FERRY_VEC_SPURIOUS 0xff

#define FERRY_BOOT_MAGIC 0x3149424f52524546ULL    /* "FERROBI1" little-endian */
#define FERRY_METRICS_MAGIC 0x314d59525245464eULL /* "NFERRYM1" little-endian */
#define FERRY_SVC_MAGIC 0x3156535952524546ULL     /* "FERRYSV1" little-endian */

/* Boot flags. */
#define FERRY_BOOT_APF (1u << 0) /* enable KVM async page faults */

#ifndef __ASSEMBLER__
/* Workload kinds and their parameters (p[i]); the VMM validates, the guest trusts. */
enum ferry_workload_kind {
  FERRY_WL_NONE = 0,
  FERRY_WL_IDLE = 1,
  FERRY_WL_DIRTY = 2,    /* p0 rate B/s (0 = max), p1 wss B, p2 pattern, p3 content, p4 tasks */
  FERRY_WL_MEMTOUCH = 3, /* p0 tasks, p1 bytes per task, p2 when (ferry_memtouch_after) */
  FERRY_WL_COMPUTE = 4,  /* p0 tasks */
  FERRY_WL_SORT = 5,     /* p0 bytes of 64-bit keys */
  FERRY_WL_FILL = 6,     /* p0 content (fill_content), p1 bytes (0 = whole arena share) */
  FERRY_WL_KV = 7,       /* p0 workers, p1 keys, p2 value bytes */
  FERRY_WL_DISK = 8,     /* p0 mode (ferry_disk_mode), p1 block bytes, p2 queue depth,
                          * p3 bytes of disk used, p4 rate B/s (0 = max), p5 disk index */
};
enum ferry_disk_mode {
  FERRY_DISK_RANDWRITE = 0, /* random writes for ever */
  FERRY_DISK_RANDREAD = 1,  /* write every block once, then random reads, each checked */
  FERRY_DISK_SEQWRITE = 2,  /* write every block once, read each back and check it, done */
  FERRY_DISK_MIXED = 3,     /* write every block once, then random reads and writes 1:1 */
};
enum ferry_disk_phase {
  FERRY_DISK_SETUP = 0,
  FERRY_DISK_FILL = 1,   /* writing every block once, in order */
  FERRY_DISK_RUN = 2,    /* random I/O */
  FERRY_DISK_VERIFY = 3, /* seqwrite: reading every block back */
  FERRY_DISK_DONE = 4,
};
enum ferry_dirty_pattern { FERRY_PAT_SEQ = 0, FERRY_PAT_RANDOM = 1, FERRY_PAT_HOTCOLD = 2 };
enum ferry_content { FERRY_CONTENT_RANDOM = 0, FERRY_CONTENT_ZERO = 1, FERRY_CONTENT_TEXT = 2 };
enum ferry_fill_content { FERRY_FILL_BEST = 0, FERRY_FILL_WORST = 1, FERRY_FILL_MIXED = 2 };
/* When memtouch's timed pass starts: at once, or (after filling its region with
 * random data) once the host info page's `migrations` changes: on the new host. */
enum ferry_memtouch_after { FERRY_AFTER_START = 0, FERRY_AFTER_MIGRATE = 1 };

typedef unsigned long long ferry_u64;
typedef unsigned int ferry_u32;

struct ferry_ram_range {
  ferry_u64 base;
  ferry_u64 size;
};

struct ferry_workload {
  ferry_u32 kind; /* enum ferry_workload_kind */
  ferry_u32 reserved;
  ferry_u64 p[FERRY_MAX_PARAMS];
}; /* 72 bytes */

struct ferry_boot_info {
  ferry_u64 magic;
  ferry_u32 version;
  ferry_u32 ncpus;
  ferry_u64 tsc_khz;
  ferry_u32 flags;
  ferry_u32 tick_hz;
  ferry_u64 seed;
  ferry_u32 nranges;
  ferry_u32 nworkloads;
  struct ferry_ram_range ram[FERRY_MAX_RAM_RANGES];
  struct ferry_workload workloads[FERRY_MAX_WORKLOADS];
};

/* Host info page (VMM -> guest): VMM memory mapped at FERRY_HOST_INFO_GPA, not
 * guest RAM, so no migration copies it and the VMM may write it at any time;
 * the guest only reads it (plain loads, no exits). */
struct ferry_host_info {
  /* Incoming migrations this VM has had. Each destination VMM sets it to the
   * source's count plus one when it restores the VM's state, before its vCPUs
   * run: a change seen by the guest means "now running on the new host"
   * (under postcopy: right after the switch, with memory still arriving). */
  ferry_u64 migrations;
  ferry_u64 reserved[7];
};

/* Disk workload counters: written by the guest, read by the VMM (no exits). A
 * block is bad when what a read returns is not what the guest last wrote there:
 * lost (no stamp: never written, overwritten by someone else, or zeroed), foreign
 * (another disk's or another block's stamp), stale (an older generation: a lost
 * write), torn (stamp right, checksum wrong: a partial or corrupted write). */
struct ferry_disk_metrics {
  ferry_u64 magic;          /* FERRY_DISK_MAGIC once set up */
  ferry_u64 tag;            /* this workload's disk tag, in every stamp */
  ferry_u64 block_bytes;
  ferry_u64 blocks;         /* blocks of the disk it uses */
  ferry_u64 phase;          /* enum ferry_disk_phase */
  ferry_u64 blocks_written; /* writes completed OK */
  ferry_u64 blocks_read;    /* reads completed OK */
  ferry_u64 blocks_checked; /* reads whose block had a known generation and was checked */
  ferry_u64 bad_blocks;     /* checked and wrong: the sum of the four below */
  ferry_u64 bad_lost;
  ferry_u64 bad_foreign;
  ferry_u64 bad_stale;
  ferry_u64 bad_torn;
  ferry_u64 io_errors;      /* requests the device failed */
  ferry_u64 ops;            /* requests completed */
  ferry_u64 lat_tsc_sum;    /* submit to completion, summed over ops */
  ferry_u64 lat_tsc_max;
  ferry_u64 first_bad_lba;  /* 1 + lba of the first bad block, 0 if none */
  ferry_u64 capacity;       /* the disk's size in bytes as the device reported it */
  ferry_u64 reserved[13];
}; /* 256 bytes */
#define FERRY_DISK_MAGIC 0x314b534459525246ULL /* "FRRYDSK1" little-endian */

/* The stamp at the start of every block the disk workload writes; the rest of
 * the block is ferry_value(lba, generation ^ tag). */
#define FERRY_BLK_STAMP_MAGIC 0x31304b4c42595246ULL /* "FRYBLK01" little-endian */
struct ferry_blk_stamp {
  ferry_u64 magic, tag, lba, generation, checksum;
}; /* 40 bytes; checksum = ferry_blk_checksum(...) */

/* Metrics: written by the guest, read by the VMM every 10 ms without exits.
 * Every field is a naturally aligned 64-bit word written with plain stores. */
enum ferry_guest_state {
  FERRY_STATE_BOOTING = 0,
  FERRY_STATE_RUNNING = 1,
  FERRY_STATE_PANIC = 3,
};
enum ferry_task_state {
  FERRY_TASK_UNUSED = 0,
  FERRY_TASK_RUNNABLE = 1,
  FERRY_TASK_SLEEPING = 2,
  FERRY_TASK_APF_WAIT = 3,
  FERRY_TASK_DONE = 4,
  FERRY_TASK_SVC_WAIT = 5,
};

struct ferry_cpu_metrics {
  ferry_u64 ticks;
  ferry_u64 context_switches;
  ferry_u64 syscalls;
  ferry_u64 idle_tsc;          /* TSC cycles spent in the idle loop */
  ferry_u64 apf_not_present;   /* 'page not present' events */
  ferry_u64 apf_ready;         /* 'page ready' events */
  ferry_u64 apf_double;        /* not-present for a token already awaited */
  ferry_u64 apf_wake_all;      /* 'page ready' with the wake-all token */
  ferry_u64 apf_waiting;       /* tasks blocked on APF right now */
  ferry_u64 apf_early_ready;   /* 'page ready' that found no task waiting for it */
  ferry_u64 apf_inline;        /* not-present waited for in KVM: no other task could run */
  ferry_u64 reserved[5];
}; /* 128 bytes */

struct ferry_workload_metrics {
  ferry_u64 kind;
  ferry_u64 tasks;
  ferry_u64 tasks_done;
  ferry_u64 result;   /* workload-defined: sort 1 = verified sorted, 2 = NOT sorted */
  ferry_u64 ready;    /* tasks done with their set-up and waiting (memtouch after=migrate) */
  ferry_u64 signal_tsc; /* memtouch after=migrate: TSC when its first task saw the move;
                         * every task's start_tsc is this, so task times run from it */
  ferry_u64 reserved[2];
}; /* 64 bytes */

struct ferry_task_metrics {
  ferry_u64 workload; /* index into workloads[] */
  ferry_u64 state;    /* enum ferry_task_state */
  ferry_u64 cpu;
  ferry_u64 progress; /* workload units: bytes written/touched, ops, keys sorted */
  ferry_u64 start_tsc;
  ferry_u64 end_tsc;  /* 0 while running */
  ferry_u64 reserved[2];
}; /* 64 bytes */

struct ferry_metrics {
  ferry_u64 magic;
  ferry_u64 version;
  ferry_u64 state;     /* enum ferry_guest_state */
  ferry_u64 ncpus;
  ferry_u64 tsc_khz;
  ferry_u64 boot_tsc;  /* TSC when the kernel started */
  ferry_u64 guest_tsc; /* TSC at the latest timer tick of vCPU 0 */
  ferry_u64 ntasks;
  struct ferry_cpu_metrics cpu[FERRY_MAX_CPUS];
  struct ferry_workload_metrics workloads[FERRY_MAX_WORKLOADS];
  struct ferry_task_metrics tasks[FERRY_MAX_TASKS];
};

/* Service ring (see docs/service.md). The VMM posts requests into FREE slots
 * and raises FERRY_VEC_SVC on a vCPU with sleepers; a worker claims a POSTED
 * slot (CAS to TAKEN), writes its response in place, marks it DONE and rings
 * FERRY_SVC_DOORBELL_GPA; the VMM sends the response and frees the slot. */
#define FERRY_SVC_SLOTS 128
#define FERRY_SVC_SLOT_SIZE 0x4000UL
#define FERRY_SVC_SLOT_HEADER 64
#define FERRY_SVC_MAX_BODY (FERRY_SVC_SLOT_SIZE - FERRY_SVC_SLOT_HEADER)
#define FERRY_SVC_HEADER_SIZE 0x1000UL
enum ferry_svc_slot_state {
  FERRY_SLOT_FREE = 0,
  FERRY_SLOT_POSTED = 1,
  FERRY_SLOT_TAKEN = 2,
  FERRY_SLOT_DONE = 3,
};

struct ferry_svc_header {
  ferry_u64 magic;      /* written by the guest when it serves */
  ferry_u64 version;
  ferry_u64 ready;      /* guest: 1 once the workload can answer */
  ferry_u64 posted;     /* VMM: requests posted so far */
  ferry_u64 taken;      /* guest: requests claimed so far */
  ferry_u64 completed;  /* guest: responses written so far */
  ferry_u64 keys;       /* guest: kv table size, for INFO */
  ferry_u64 value_size; /* guest: kv value bytes, for INFO */
  ferry_u64 sleepers[FERRY_MAX_CPUS]; /* workers blocked in the kernel, per vCPU */
  ferry_u64 spinner; /* guest: 1 + task id of the one worker polling the ring, or 0 */
};

struct ferry_svc_slot {
  ferry_u32 state; /* enum ferry_svc_slot_state */
  ferry_u32 len;   /* bytes of body in data: request when POSTED, response when DONE */
  ferry_u64 tag;   /* the VMM's own: which connection; the guest copies nothing from it */
  ferry_u64 post_tsc;
  ferry_u64 done_tsc;
  ferry_u64 reserved[4];
  unsigned char data[FERRY_SVC_MAX_BODY];
};

/* Request and response bodies: the wire frames without their u32 length
 * prefix (docs/service.md). All integers little-endian. */
enum ferry_svc_op {
  FERRY_OP_GET = 1,  /* value of key */
  FERRY_OP_SET = 2,  /* store value (seed names its content) */
  FERRY_OP_ECHO = 3, /* answered by the VMM's device itself: device-only latency */
  FERRY_OP_INFO = 4, /* key = number of keys, seed = value size */
  FERRY_OP_NOP = 5,  /* answered by a guest worker doing nothing */
  FERRY_OP_SLOW = 6, /* answered after seed ms of spinning (at most 10 s): in flight at a pause */
};
enum ferry_svc_status {
  FERRY_ST_OK = 0,
  FERRY_ST_BAD_KEY = 1,
  FERRY_ST_BAD_REQUEST = 2,
  FERRY_ST_TOO_LARGE = 3,
  FERRY_ST_NOT_READY = 4,
  FERRY_ST_BAD_VALUE = 5,
};
struct ferry_svc_request {
  unsigned char op, flags;
  unsigned short reserved;
  ferry_u32 value_len;
  ferry_u64 id, key, seed;
  /* value_len bytes of value follow (SET) */
};
struct ferry_svc_response {
  unsigned char status, op;
  unsigned short reserved;
  ferry_u32 value_len;
  ferry_u64 id, key, seed, checksum;
  /* value_len bytes follow (GET; error text when status != OK) */
};

/* An unaligned, aliasing 64-bit load/store type (x86 allows unaligned access). */
typedef ferry_u64 __attribute__((may_alias, aligned(1))) ferry_u64_unaligned;

/* Checksum of a value, computed the same way by guest, device and clients:
 * little-endian 64-bit words (the last one zero-padded), FNV-style mixing. */
static inline ferry_u64 ferry_csum(const unsigned char *p, ferry_u64 len) {
  ferry_u64 h = 0x9E3779B97F4A7C15ULL ^ len;
  for (ferry_u64 i = 0; i < len; i += 8) {
    ferry_u64 w = 0;
    if (i + 8 <= len)
      w = *(const ferry_u64_unaligned *)(p + i);
    else
      for (ferry_u64 b = 0; i + b < len; b++) w |= (ferry_u64)p[i + b] << (8 * b);
    h = (h ^ w) * 0x100000001B3ULL;
    h ^= h >> 29;
  }
  return h;
}

/* The content of key's value written with `seed`: xorshift64* words. */
static inline void ferry_value(unsigned char *out, ferry_u64 len, ferry_u64 key, ferry_u64 seed) {
  ferry_u64 s = seed ^ (0x9E3779B97F4A7C15ULL * (key + 1));
  if (!s) s = 1;
  for (ferry_u64 i = 0; i < len; i += 8) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    ferry_u64 w = s * 0x2545F4914F6CDD1DULL;
    if (i + 8 <= len)
      *(ferry_u64_unaligned *)(out + i) = w;
    else
      for (ferry_u64 b = 0; i + b < len; b++) out[i + b] = (unsigned char)(w >> (8 * b));
  }
}

/* The checksum of a stamped block of `len` bytes: over the bytes after the
 * stamp, mixed with the stamp's own fields. */
static inline ferry_u64 ferry_blk_checksum(const unsigned char *block, ferry_u64 len, ferry_u64 tag,
                                           ferry_u64 lba, ferry_u64 generation) {
  ferry_u64 h = ferry_csum(block + sizeof(struct ferry_blk_stamp), len - sizeof(struct ferry_blk_stamp));
  return h ^ (tag * 0x9E3779B97F4A7C15ULL) ^ (lba * 0xC2B2AE3D27D4EB4FULL) ^ (generation + 1);
}

#define FERRY_METRICS_OFF_CPU 64
#define FERRY_METRICS_OFF_WORKLOADS (64 + 128 * FERRY_MAX_CPUS)
#define FERRY_METRICS_OFF_TASKS (FERRY_METRICS_OFF_WORKLOADS + 64 * FERRY_MAX_WORKLOADS)
#endif

#endif
