//! Workload specs: what the test guest runs, parsed from strings such as
//! `dirty:rate=256,wss=128,pattern=random` or `memtouch:tasks=4,mib=8+compute`.
//!
//! The VMM validates every spec here and hands the guest plain numbers
//! ([`guest_abi::Workload`]); the guest never parses text.
//!
//! This file holds the specs themselves and what the VMM asks of them
//! (tasks, memory, whether they fit); [`text`] their text form both ways
//! (parsing with its errors, and display), [`guest`] their encoding for
//! the guest.

pub mod disk;
pub mod guest;
pub mod text;

pub use disk::{DiskMode, DiskWorkload};

use crate::guest_abi;

/// One MiB: workload sizes are given in MiB.
const MIB: u64 = 1 << 20;

/// Help text for `ferry run --help`: every workload and parameter.
pub const WORKLOAD_HELP: &str = "\
Workloads (join several with '+', e.g. memtouch:tasks=4,mib=8+compute):
  idle                       no tasks; vCPUs halt between timer ticks
  dirty[:rate=MiB/s|max,wss=MiB,pattern=seq|random|hotcold,content=random|zero|text,tasks=N]
                             rewrites whole pages at a rate paced by guest time
                             (defaults: rate=64 wss=64 pattern=seq content=random tasks=vCPUs)
  memtouch[:tasks=T,mib=M,after=start|migrate]
                             each task writes one byte per page of its own M MiB, once,
                             and records its time (defaults: tasks=4 mib=16 after=start);
                             after=migrate: fill the region with random data first, wait
                             until the VM runs on another host, then read and write each
                             page once, timed from the moment the task saw the move
  compute[:tasks=N]          integer adds in a loop, counted as ops/s (default tasks=vCPUs)
  sort[:mib=N]               radix-sorts N MiB of random 64-bit keys, then checks the
                             order and checksums itself (default mib=64; uses 2N MiB)
  fill[:content=best|worst|mixed,mib=N]
                             fills N MiB (default: all free guest memory) with content of
                             known compressibility, then stays resident (default mixed)
  kv[:workers=G,keys=K,value=B]
                             G worker tasks serve GET/SET on K values of B bytes from the
                             service device (--serve); drive it with `ferry load`
                             (defaults: workers=4 keys=65536 value=1024)
  disk[:rw=randwrite|randread|seqwrite|mixed,bs=BYTES,qd=N,mib=M,rate=MiB/s,disk=I]
                             drives virtio-blk disk I (--disk) from one task with N requests
                             in flight over its first M MiB, stamping every block written and
                             checking every block read (bad blocks counted, never hidden);
                             seqwrite writes M MiB once, reads it back and ends; randread
                             and mixed write every block once first
                             (defaults: rw=mixed bs=4096 qd=8 mib=64, no rate limit, disk=0)";

/// Page-choice pattern of the `dirty` workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirtyPattern {
    /// Pages in order, wrapping around the working set.
    Seq,
    /// Uniformly random pages.
    Random,
    /// 80% of writes to the hottest 20% of pages.
    HotCold,
}

/// What the `dirty` workload writes into a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirtyContent {
    /// Random bytes: incompressible.
    Random,
    /// Zeros.
    Zero,
    /// English-like words.
    Text,
}

/// When `memtouch` starts its timed pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemtouchAfter {
    /// At once: write one byte per page of fresh (zero) memory.
    Start,
    /// Fill the region with random data, then wait for the guest's
    /// migration count to change (the VM now runs on the new host) and
    /// read-modify-write each page: the postcopy benchmark's memtouch.
    Migrate,
}

/// What `fill` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillContent {
    /// One repeated non-zero byte per page: compresses to almost nothing.
    Best,
    /// Random bytes: incompressible.
    Worst,
    /// A quarter each of zero, text, random and sparse pages.
    Mixed,
}

/// One workload with its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Workload {
    /// No tasks.
    Idle,
    /// Rewrites pages at a paced rate.
    Dirty {
        /// MiB/s in total; `None` = as fast as the vCPUs can.
        rate_mib: Option<u64>,
        /// Working set in MiB, shared out among the tasks.
        wss_mib: u64,
        /// Which pages.
        pattern: DirtyPattern,
        /// What goes into them.
        content: DirtyContent,
        /// Tasks; `None` = one per vCPU.
        tasks: Option<u32>,
    },
    /// Touches each page of a private region once per task.
    Memtouch {
        /// Tasks.
        tasks: u32,
        /// MiB per task.
        mib: u64,
        /// When the timed pass starts.
        after: MemtouchAfter,
    },
    /// Integer adds.
    Compute {
        /// Tasks; `None` = one per vCPU.
        tasks: Option<u32>,
    },
    /// Sorts random keys and verifies the result.
    Sort {
        /// MiB of keys.
        mib: u64,
    },
    /// Serves GET/SET requests from the service device.
    Kv {
        /// Worker tasks.
        workers: u32,
        /// Number of keys.
        keys: u64,
        /// Bytes per value.
        value: u64,
    },
    /// Drives a disk and checks every block it reads.
    Disk(DiskWorkload),
    /// Fills memory with known content.
    Fill {
        /// Content class.
        content: FillContent,
        /// MiB; `None` = all free guest memory.
        mib: Option<u64>,
    },
}

/// Why a workload spec was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// The spec was empty.
    #[error("empty workload spec (valid workloads: {valid})", valid = NAMES.join(", "))]
    Empty,
    /// No workload has this name.
    #[error("unknown workload '{name}' (valid workloads: {valid})", valid = NAMES.join(", "))]
    UnknownWorkload {
        /// What was asked for.
        name: String,
    },
    /// The workload has no such parameter.
    #[error("workload '{workload}' has no parameter '{param}' (valid: {valid})")]
    UnknownParam {
        /// Workload name.
        workload: &'static str,
        /// What was given.
        param: String,
        /// What it accepts.
        valid: String,
    },
    /// A parameter without `=value`.
    #[error("parameter '{param}' of workload '{workload}' needs a value, as in {param}=...")]
    MissingValue {
        /// Workload name.
        workload: &'static str,
        /// Parameter name.
        param: String,
    },
    /// A value out of range or of the wrong form.
    #[error("bad value '{value}' for {workload}:{param}: expected {expected}")]
    BadValue {
        /// Workload name.
        workload: &'static str,
        /// Parameter name.
        param: &'static str,
        /// What was given.
        value: String,
        /// What would be accepted.
        expected: &'static str,
    },
    /// More workloads than the guest runs at once.
    #[error("at most {max} workloads at once, got {got}", max = guest_abi::MAX_WORKLOADS)]
    TooMany {
        /// How many were given.
        got: usize,
    },
    /// More tasks than the guest supports.
    #[error("the workloads need {got} tasks; the guest runs at most {max}", max = guest_abi::MAX_TASKS)]
    TooManyTasks {
        /// Tasks asked for.
        got: u64,
    },
    /// Two kv workloads would share one service ring.
    #[error("at most one kv workload per VM (it owns the service device)")]
    TwoServers,
    /// Two disk workloads would share one counters page.
    #[error("at most one disk workload per VM")]
    TwoDisks,
    /// The workloads do not fit in guest memory.
    #[error(
        "the workloads need {need_mib} MiB of guest memory but only {have_mib} MiB are free \
         (guest RAM minus the 16 MiB kernel area): raise --mem or shrink the workloads"
    )]
    NoRoom {
        /// MiB the workloads need.
        need_mib: u64,
        /// MiB free for them.
        have_mib: u64,
    },
}

/// Largest kv value: a GET response must fit one service ring slot.
pub const MAX_KV_VALUE: u64 = 8192;

/// A size in bytes with an optional k/M/G suffix (binary), as the disk
/// workload's `bs` takes it (`4k`, `64k`, `4096`).
fn disk_size(text: &str) -> Option<u64> {
    crate::devices::block::spec::parse_size(text)
}

/// Bytes of one kv table entry (lock, seed, value), as the guest lays it out.
pub fn kv_entry_size(value: u64) -> u64 {
    (16 + value + 7) & !7
}

/// Names of all workloads, for error messages.
pub const NAMES: &[&str] = &[
    "idle", "dirty", "memtouch", "compute", "sort", "fill", "kv", "disk",
];

/// A list of workloads run together, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadSet(pub Vec<Workload>);

impl Workload {
    /// The spec name.
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Idle => "idle",
            Workload::Dirty { .. } => "dirty",
            Workload::Memtouch { .. } => "memtouch",
            Workload::Compute { .. } => "compute",
            Workload::Sort { .. } => "sort",
            Workload::Fill { .. } => "fill",
            Workload::Kv { .. } => "kv",
            Workload::Disk(_) => "disk",
        }
    }

    /// True for workloads whose tasks finish by themselves (the run can end then).
    pub fn finishes(&self) -> bool {
        matches!(
            self,
            Workload::Memtouch { .. }
                | Workload::Sort { .. }
                | Workload::Disk(DiskWorkload {
                    mode: DiskMode::SeqWrite,
                    ..
                })
        )
    }

    /// Tasks this workload runs on a VM with `vcpus` vCPUs.
    pub fn tasks(&self, vcpus: u32) -> u64 {
        match self {
            Workload::Idle => 0,
            Workload::Dirty { tasks, .. } | Workload::Compute { tasks } => {
                tasks.unwrap_or(vcpus) as u64
            }
            Workload::Memtouch { tasks, .. } => *tasks as u64,
            Workload::Kv { workers, .. } => *workers as u64,
            Workload::Sort { .. } | Workload::Fill { .. } | Workload::Disk(_) => 1,
        }
    }

    /// Guest memory (bytes) the workload takes from the arena (`fill` without a
    /// size takes what is left and counts as 0 here).
    pub fn arena_bytes(&self) -> u64 {
        match self {
            Workload::Dirty { wss_mib, .. } => wss_mib * MIB,
            Workload::Memtouch { tasks, mib, .. } => *tasks as u64 * mib * MIB,
            Workload::Sort { mib } => 2 * mib * MIB,
            Workload::Fill { mib, .. } => mib.unwrap_or(0) * MIB,
            Workload::Kv { keys, value, .. } => keys * kv_entry_size(*value),
            Workload::Disk(d) => d.arena_bytes(),
            Workload::Idle | Workload::Compute { .. } => 0,
        }
    }

    /// Unit of the per-task progress counter.
    pub fn unit(&self) -> &'static str {
        match self {
            Workload::Compute { .. } => "ops",
            Workload::Sort { .. } => "keys",
            Workload::Kv { .. } => "requests",
            _ => "bytes",
        }
    }
}

impl WorkloadSet {
    /// Checks that the set fits a guest with `vcpus` vCPUs and `arena` bytes
    /// of workload memory.
    pub fn check_fits(&self, vcpus: u32, arena: u64) -> Result<(), SpecError> {
        let tasks: u64 = self.0.iter().map(|w| w.tasks(vcpus)).sum();
        if tasks > guest_abi::MAX_TASKS as u64 {
            return Err(SpecError::TooManyTasks { got: tasks });
        }
        // Each allocation is rounded to pages and may skip the tail of the low
        // RAM range, so keep one MiB of slack per workload.
        let need: u64 = self.0.iter().map(|w| w.arena_bytes() + MIB).sum();
        if need > arena {
            return Err(SpecError::NoRoom {
                need_mib: need / MIB,
                have_mib: arena / MIB,
            });
        }
        Ok(())
    }

    /// True if a workload serves requests (and so needs the service device).
    pub fn serves(&self) -> bool {
        self.0.iter().any(|w| matches!(w, Workload::Kv { .. }))
    }

    /// The disk workload, if there is one.
    pub fn disk(&self) -> Option<&DiskWorkload> {
        self.0.iter().find_map(|w| match w {
            Workload::Disk(d) => Some(d),
            _ => None,
        })
    }

    /// True if every workload finishes by itself.
    pub fn finishes(&self) -> bool {
        self.0.iter().all(Workload::finishes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<WorkloadSet, SpecError> {
        s.parse()
    }

    #[test]
    fn fit_checks_memory_and_tasks() {
        let w = parse("memtouch:tasks=4,mib=64").unwrap();
        assert!(w.check_fits(1, 512 * MIB).is_ok());
        assert!(matches!(
            w.check_fits(1, 200 * MIB),
            Err(SpecError::NoRoom { .. })
        ));
        let w = parse("compute:tasks=40+memtouch:tasks=40,mib=1").unwrap();
        assert!(matches!(
            w.check_fits(1, 512 * MIB),
            Err(SpecError::TooManyTasks { got: 80 })
        ));
    }
}
