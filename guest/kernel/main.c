/* main.c - boot: every vCPU enters kmain(cpu id) on its boot stack. vCPU 0 sets
 * up the shared state and the tasks; the others wait for it, then each vCPU
 * configures itself (GS base, TSS, IDT, x2APIC timer, APF) and schedules. */
#include "kernel.h"

struct ferry_boot_info *const boot = (struct ferry_boot_info *)FERRY_BOOT_INFO_GPA;
struct ferry_metrics *const metrics = (struct ferry_metrics *)FERRY_METRICS_GPA;
struct percpu percpus[FERRY_MAX_CPUS];

#define KSTACK_SIZE 16384
static u8 kstacks[FERRY_MAX_CPUS][KSTACK_SIZE] __attribute__((aligned(16)));
static u8 idle_stacks[FERRY_MAX_CPUS][4096] __attribute__((aligned(16)));
static volatile u32 boot_done;

void kmain(u64 cpu);

static void early_fail(const char *msg) {
  for (const char *p = msg; *p; p++) outb(FERRY_PORT_SERIAL, (u8)*p);
  outl(FERRY_PORT_EXIT, FERRY_EXIT_PANIC);
  for (;;) asm volatile("cli; hlt");
}

static void percpu_init(struct percpu *c, u64 cpu) {
  c->self = c;
  c->id = cpu;
  c->kstack_top = (u64)&kstacks[cpu][KSTACK_SIZE];
  c->m = &metrics->cpu[cpu];
  c->idle_frame = (struct frame){
      .rip = (u64)idle_loop,
      .cs = FERRY_SEL_KCODE,
      .rflags = 0x202,
      .rsp = (u64)&idle_stacks[cpu][4096],
      .ss = FERRY_SEL_KDATA,
  };
}

static void cpu_init(struct percpu *c) {
  wrmsr(MSR_GS_BASE, (u64)c);
  /* 64-bit TSS: rsp0 at offset 4 is the stack for interrupts taken at CPL3. */
  *(volatile u64 *)(FERRY_TSS_GPA + c->id * FERRY_TSS_STRIDE + 4) = c->kstack_top;
  idt_load();
  wrmsr(MSR_APIC_BASE, rdmsr(MSR_APIC_BASE) | (1 << 10) | (1 << 11)); /* x2APIC */
  wrmsr(X2APIC_SVR, 0x100 | FERRY_VEC_SPURIOUS);
  wrmsr(X2APIC_TIMER_DIV, 0xb); /* divide by 1 */
  wrmsr(X2APIC_LVT_TIMER, FERRY_VEC_TIMER | (1 << 17)); /* periodic */
  wrmsr(X2APIC_TIMER_INIT, LAPIC_HZ / boot->tick_hz);
  if ((boot->flags & FERRY_BOOT_APF) && c->ntasks > 1) apf_enable(c); /* see apf.c */
}

void kmain(u64 cpu) {
  struct percpu *c = &percpus[cpu];
  if (cpu == 0) {
    if (boot->magic != FERRY_BOOT_MAGIC || boot->version != FERRY_ABI_VERSION)
      early_fail("ferry guest: boot info magic/version mismatch\n");
    if (boot->ncpus == 0 || boot->ncpus > FERRY_MAX_CPUS || boot->tick_hz == 0 ||
        boot->tsc_khz == 0)
      early_fail("ferry guest: bad boot info\n");
    metrics->version = FERRY_ABI_VERSION;
    metrics->ncpus = boot->ncpus;
    metrics->tsc_khz = boot->tsc_khz;
    metrics->boot_tsc = rdtsc();
    idt_init();
    for (u32 i = 0; i < boot->ncpus; i++) percpu_init(&percpus[i], i);
    tasks_create();
    /* Last: the VMM treats the page as valid once it sees the magic. */
    __atomic_store_n(&metrics->magic, FERRY_METRICS_MAGIC, __ATOMIC_RELEASE);
    __atomic_store_n(&boot_done, 1, __ATOMIC_RELEASE);
  } else {
    while (!__atomic_load_n(&boot_done, __ATOMIC_ACQUIRE)) cpu_relax();
  }
  cpu_init(c);
  if (cpu == 0) {
    printk("ferry guest: %u vCPUs, %lu tasks, tick %u Hz, APF %s\n", boot->ncpus,
           (u64)metrics->ntasks, boot->tick_hz, boot->flags & FERRY_BOOT_APF ? "on" : "off");
    metrics->state = FERRY_STATE_RUNNING;
  }
  sched_start(c);
}
