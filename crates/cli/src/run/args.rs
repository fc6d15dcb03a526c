//! `ferry run`'s flags: what a person may ask of a run, with their help
//! text and parsers. Apart from the run itself so the flags can be read
//! (and their defaults checked) in one place.

use std::path::PathBuf;
use std::time::Duration;

use ferry_migration::defaults;
use ferry_vmm::boot::layout::parse_size;
use ferry_vmm::workload::WORKLOAD_HELP;
use ferry_vmm::WorkloadSet;

use crate::format;

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("'{s}' is neither on nor off")),
    }
}

fn parse_mem(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 512M, 4G)"))
}

/// When guest RAM is allocated ahead of its first touch (`--prealloc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Prealloc {
    /// All of it before the VM boots or waits.
    Now,
    /// In the background while the VM waits for its migration.
    Waiting,
    /// Never ahead: each page on its first touch.
    Off,
}

#[derive(clap::Args)]
#[command(after_help = WORKLOAD_HELP)]
pub struct RunArgs {
    /// Guest RAM (e.g. 512M, 4G).
    #[arg(long, default_value = "512M", value_parser = parse_mem)]
    pub(super) mem: u64,
    /// Number of vCPUs (1-8).
    #[arg(long, default_value_t = 1)]
    pub(super) vcpus: u32,
    /// What the guest runs (see below).
    #[arg(long, default_value = "idle")]
    pub(super) workload: WorkloadSet,
    /// Stop after this long (e.g. 10s, 500ms). Without it, the run ends when every
    /// workload has finished, or at Ctrl-C / `ferry ctl SOCKET quit` for endless ones.
    #[arg(long, value_parser = format::parse_duration)]
    pub(super) duration: Option<Duration>,
    /// Write the 10 ms metric samples here as JSON lines.
    #[arg(long)]
    pub(super) timeline: Option<PathBuf>,
    /// Give the VM a service port here (HOST:PORT, port 0 picks one). A kv
    /// workload gets 127.0.0.1 with any port when this is not given.
    #[arg(long)]
    pub(super) serve: Option<std::net::SocketAddr>,
    /// The VM's own IPv4 address on this host's network (e.g. 10.77.0.100 in
    /// `ferry lab`): added to the interface whose subnet holds it, the
    /// service listens there (port from --serve, else any), and at a
    /// migration the address and every client connection move with the VM
    /// (TCP_REPAIR) and this VMM exits. Needs CAP_NET_ADMIN.
    #[arg(long)]
    pub(super) vm_address: Option<std::net::Ipv4Addr>,
    /// Give the VM a virtio-blk disk backed by a raw image file,
    /// PATH[,size=SIZE][,create] (`create` makes a sparse file of SIZE), or
    /// by an export of an NBD server on shared storage,
    /// nbd://HOST[:PORT]/EXPORT, nbds://… (TLS with this host's
    /// certificates) or nbd+unix:///EXPORT?socket=PATH (repeatable, up to
    /// 4). A VM whose disks are all NBD exports migrates: its destination
    /// (--incoming) is given the same exports; a local image cannot move
    /// yet, and no disk is handed over yet (docs/disks.md).
    #[arg(
        long = "disk",
        value_name = "PATH[,size=SIZE][,create] | nbd://HOST/EXPORT"
    )]
    pub(super) disks: Vec<ferry_vmm::devices::block::DiskSpec>,
    /// Serve Prometheus metrics (migration progress named like KubeVirt's,
    /// and the guest's counters) at http://ADDR/metrics (port 0 picks one).
    #[arg(long)]
    pub(super) metrics: Option<std::net::SocketAddr>,
    /// Incoming postcopy: how long to wait for the source to come back
    /// when the link breaks (e.g. 5m) before the VM is given up.
    #[arg(long, value_parser = format::parse_duration,
          default_value = format::ms_arg(defaults::INCOMING_RECONNECT_TIMEOUT_MS))]
    pub(super) reconnect_timeout: Duration,
    /// Wait for a live migration on tcp:HOST:PORT (or unix:PATH, same host)
    /// instead of booting; the VM shape (--mem, --vcpus) must match the
    /// source's.
    #[arg(long)]
    pub(super) incoming: Option<ferry_migration::Endpoint>,
    /// With --incoming: take the migration only from this host, or these
    /// comma-separated hosts (a source and its postcopy standby): the peer's
    /// certificate must name one; TLS only.
    #[arg(long, requires = "incoming", value_name = "NAME")]
    pub(super) from: Option<String>,
    /// With --incoming: demand this one-time migration token from the
    /// source (`ferry migrate --token`); `auto` makes one, printed and shown
    /// by `ferry status` as `token`.
    #[arg(long, requires = "incoming", value_name = "auto|TOKEN")]
    pub(super) token: Option<String>,
    /// With --incoming: advertise this waiting VMM in the host registry
    /// (a main host `ferry migrate --mode split` can pick), until a VM
    /// arrives.
    #[arg(long, requires = "incoming")]
    pub(super) advertise: bool,
    /// The host registry for --advertise, --vm-name and --fenced: etcds://HOST:PORT (TLS),
    /// etcd://HOST:PORT or dir:PATH (default: this machine's).
    #[arg(long)]
    pub(super) registry: Option<String>,
    /// Fence this VM through the registry under NAME (docs/safety.md): its vCPUs run only
    /// while this process holds the VM's epoch there, so no second copy can run; a VM
    /// another process holds is refused
    #[arg(long, conflicts_with = "incoming", value_name = "NAME")]
    pub(super) vm_name: Option<String>,
    /// With --incoming: take only a VM fenced through the registry, from its source's claim,
    /// before its first instruction here (the source runs with --vm-name)
    #[arg(long, requires = "incoming")]
    pub(super) fenced: bool,
    /// With --advertise: guest memory offered to a split VM (default: all
    /// of --mem).
    #[arg(long, requires = "advertise", value_parser = parse_offer)]
    pub(super) offer: Option<u64>,
    /// Control socket path (default: /tmp/ferry-<pid>.sock).
    #[arg(long)]
    pub(super) control: Option<PathBuf>,
    /// Guest kernel ELF (default: the one built into ferry).
    #[arg(long)]
    pub(super) kernel: Option<PathBuf>,
    /// When to allocate guest RAM ahead of its first touch, which then
    /// happens outside the guest's and the migration's time: waiting (the
    /// default: a VMM waiting with --incoming populates it in the background
    /// until a source arrives, leaving the host a reserve of free memory; a
    /// source that may switch to postcopy or split has it given back before
    /// its first page), now (before the VM boots or waits, like QEMU's
    /// -mem-prealloc; a bare --prealloc), or off. A precopy of 1 GiB random
    /// lands 1.4x as fast into a waiting destination that populated ahead
    /// (bench/results/prealloc.md).
    #[arg(long, value_enum, default_value_t = Prealloc::Waiting, num_args = 0..=1,
          default_missing_value = "now")]
    pub(super) prealloc: Prealloc,
    /// Share guest pages with this host's other VMs run with --share-pages:
    /// this VM's RAM can be read by them (same user, read-only), and a
    /// migration into it (--incoming) takes the pages they already hold
    /// from them instead of over the link (protocol v14). The host's share
    /// directory: FERRY_SHARE_DIR, else one per network namespace under
    /// /run/ferry/share.
    #[arg(long)]
    pub(super) share_pages: bool,
    /// KVM asynchronous page faults for the guest: on, or off (the guest
    /// is not told of the feature, so a vCPU waits out every host fault).
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub(super) apf: bool,
    /// Same as --apf off.
    #[arg(long, conflicts_with = "apf")]
    pub(super) no_apf: bool,
    /// Access tracking period in ms (0 = off): every period, sampled
    /// userfaultfd minor faults (and with `--access-writes log`, KVM's
    /// dirty log) update each page's clock and aging history, which split
    /// migration ranks memory by (1000 is the paper's period). On by
    /// default: it costs a guest ~1-4% here (bench/results/access.md).
    /// Never on for --incoming.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub(super) access_period: u64,
    /// Access tracking samples 1/N of the pages per period (each page
    /// every N periods).
    #[arg(long, default_value_t = 8, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub(super) access_share: u32,
    /// Access tracking: pages one sampled fault answers for (a power of
    /// two up to 512): the fault maps that aligned group back and marks
    /// it read, so a task streaming through sampled memory faults once
    /// per group, not per page.
    #[arg(long, default_value_t = ferry_memory::DEFAULT_GRAIN_PAGES, value_name = "PAGES",
          value_parser = super::access::parse_grain)]
    pub(super) access_grain: u64,
    /// Access tracking: where writes are seen. `sample`: the sampled
    /// faults alone (a write to an armed page raises one too); `log`: KVM's
    /// dirty log as well, every write in the sampled share (on this PVM
    /// host a logging memslot slows a writing guest by ~25%).
    #[arg(long, default_value = "sample", value_parser = ["sample", "log"], value_name = "FROM")]
    pub(super) access_writes: String,
    /// Guest timer ticks per second.
    #[arg(long, default_value_t = 100)]
    pub(super) tick_hz: u32,
    /// Seed for the workloads' random numbers.
    #[arg(long, default_value_t = 0x5eed_f0e1)]
    pub(super) seed: u64,
    /// KVM device.
    #[arg(long, default_value = "/dev/kvm")]
    pub(super) kvm: String,
    /// Print the summary as JSON on stdout (live line and guest console go to stderr).
    #[arg(long)]
    pub(super) json: bool,
    /// Do not show the live line or guest console.
    #[arg(long, short)]
    pub(super) quiet: bool,
    /// Take over a running VM from the VMM at the other end of this Unix
    /// socket (how `ferry handover` starts the new VMM; not for people).
    #[arg(long, hide = true)]
    pub(super) adopt_fd: Option<i32>,
}

fn parse_offer(s: &str) -> Result<u64, String> {
    ferry_vmm::boot::layout::parse_size(s).ok_or_else(|| format!("'{s}' is not a size (e.g. 64M)"))
}
