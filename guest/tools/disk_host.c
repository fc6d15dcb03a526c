/* disk_host.c - the disk device's host baseline (bench/disk_device.py): the
 * same I/O the guest's disk workload asks of ferry's virtio-blk device, done
 * by a host process on the same image: bs-byte random reads or writes over
 * the first `bytes` of the file, `qd` threads each with one request in
 * flight, O_DIRECT as the device uses it (buffered if the file system refuses
 * it), for `secs` seconds. Prints one JSON line: ops, seconds, IOPS, mean
 * latency.
 *
 * Usage: disk_host PATH randread|randwrite BS QD BYTES SECS */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int fd, writes;
static uint64_t bs, blocks;
static double secs;
static volatile int stop;

struct worker {
  pthread_t t;
  uint64_t seed, ops, lat_ns;
};

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t rng(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1DULL;
}

static void *run(void *arg) {
  struct worker *w = arg;
  void *buf;
  if (posix_memalign(&buf, 4096, bs)) return NULL;
  memset(buf, 0x5a, bs);
  while (!stop) {
    off_t off = (off_t)((rng(&w->seed) % blocks) * bs);
    uint64_t t0 = now_ns();
    ssize_t n = writes ? pwrite(fd, buf, bs, off) : pread(fd, buf, bs, off);
    if (n != (ssize_t)bs) {
      perror("disk_host: I/O");
      exit(1);
    }
    w->lat_ns += now_ns() - t0;
    w->ops++;
  }
  free(buf);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s PATH randread|randwrite BS QD BYTES SECS\n", argv[0]);
    return 2;
  }
  writes = strcmp(argv[2], "randwrite") == 0;
  bs = strtoull(argv[3], 0, 0);
  int qd = atoi(argv[4]);
  blocks = strtoull(argv[5], 0, 0) / bs;
  secs = atof(argv[6]);
  int direct = 1;
  fd = open(argv[1], O_RDWR | O_DIRECT);
  if (fd < 0) {
    direct = 0;
    fd = open(argv[1], O_RDWR);
  }
  if (fd < 0 || !blocks || qd < 1) {
    perror("disk_host: open");
    return 1;
  }
  struct worker *w = calloc((size_t)qd, sizeof *w);
  uint64_t t0 = now_ns();
  for (int i = 0; i < qd; i++) {
    w[i].seed = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    pthread_create(&w[i].t, NULL, run, &w[i]);
  }
  usleep((useconds_t)(secs * 1e6));
  stop = 1;
  uint64_t ops = 0, lat = 0;
  for (int i = 0; i < qd; i++) {
    pthread_join(w[i].t, NULL);
    ops += w[i].ops;
    lat += w[i].lat_ns;
  }
  double s = (double)(now_ns() - t0) / 1e9;
  printf("{\"ops\": %llu, \"secs\": %.3f, \"iops\": %.1f, \"latency_us_mean\": %.2f, \"direct\": %s}\n",
         (unsigned long long)ops, s, (double)ops / s, ops ? (double)lat / (double)ops / 1000.0 : 0.0,
         direct ? "true" : "false");
  return 0;
}
