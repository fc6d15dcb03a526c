//! Workload specs: what the test guest runs, parsed from strings such as
//! `dirty:rate=256,wss=128,pattern=random` or `memtouch:tasks=4,mib=8+compute`.
//!
//! The VMM validates every spec here and hands the guest plain numbers
//! ([`guest_abi::Workload`]); the guest never parses text.

use std::fmt;
use std::str::FromStr;

use crate::guest_abi::{self, kind};

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
                             (defaults: workers=4 keys=65536 value=1024)";

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

/// Bytes of one kv table entry (lock, seed, value), as the guest lays it out.
pub fn kv_entry_size(value: u64) -> u64 {
    (16 + value + 7) & !7
}

/// Names of all workloads, for error messages.
pub const NAMES: &[&str] = &["idle", "dirty", "memtouch", "compute", "sort", "fill", "kv"];

fn params_of(workload: &str) -> &'static [&'static str] {
    match workload {
        "dirty" => &["rate", "wss", "pattern", "content", "tasks"],
        "memtouch" => &["tasks", "mib", "after"],
        "compute" => &["tasks"],
        "sort" => &["mib"],
        "fill" => &["content", "mib"],
        "kv" => &["workers", "keys", "value"],
        _ => &[],
    }
}

fn parse_num(
    workload: &'static str,
    param: &'static str,
    value: &str,
    min: u64,
    max: u64,
    expected: &'static str,
) -> Result<u64, SpecError> {
    match value.parse::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(SpecError::BadValue {
            workload,
            param,
            value: value.into(),
            expected,
        }),
    }
}

fn parse_one(text: &str) -> Result<Workload, SpecError> {
    let (name, args) = match text.split_once(':') {
        Some((n, a)) => (n.trim(), a.trim()),
        None => (text.trim(), ""),
    };
    let workload: &'static str = NAMES
        .iter()
        .copied()
        .find(|n| *n == name)
        .ok_or_else(|| SpecError::UnknownWorkload { name: name.into() })?;
    let mut w = match workload {
        "idle" => Workload::Idle,
        "dirty" => Workload::Dirty {
            rate_mib: Some(64),
            wss_mib: 64,
            pattern: DirtyPattern::Seq,
            content: DirtyContent::Random,
            tasks: None,
        },
        "memtouch" => Workload::Memtouch {
            tasks: 4,
            mib: 16,
            after: MemtouchAfter::Start,
        },
        "compute" => Workload::Compute { tasks: None },
        "sort" => Workload::Sort { mib: 64 },
        "kv" => Workload::Kv {
            workers: 4,
            keys: 65536,
            value: 1024,
        },
        _ => Workload::Fill {
            content: FillContent::Mixed,
            mib: None,
        },
    };
    for arg in args.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let (key, value) = arg.split_once('=').ok_or_else(|| SpecError::MissingValue {
            workload,
            param: arg.into(),
        })?;
        let param: &'static str = params_of(workload)
            .iter()
            .copied()
            .find(|p| *p == key.trim())
            .ok_or_else(|| SpecError::UnknownParam {
                workload,
                param: key.into(),
                valid: match params_of(workload) {
                    [] => "none".into(),
                    ps => ps.join(", "),
                },
            })?;
        let value = value.trim();
        let bad = |expected| SpecError::BadValue {
            workload,
            param,
            value: value.into(),
            expected,
        };
        let tasks_max = guest_abi::MAX_TASKS as u64;
        match (&mut w, param) {
            (Workload::Dirty { rate_mib, .. }, "rate") => {
                *rate_mib = if value == "max" {
                    None
                } else {
                    Some(parse_num(
                        workload,
                        param,
                        value,
                        1,
                        1 << 20,
                        "MiB/s from 1, or max",
                    )?)
                }
            }
            (Workload::Dirty { wss_mib, .. }, "wss") => {
                *wss_mib = parse_num(workload, param, value, 1, 1 << 20, "MiB, at least 1")?
            }
            (Workload::Dirty { pattern, .. }, "pattern") => {
                *pattern = match value {
                    "seq" => DirtyPattern::Seq,
                    "random" => DirtyPattern::Random,
                    "hotcold" => DirtyPattern::HotCold,
                    _ => return Err(bad("seq, random or hotcold")),
                }
            }
            (Workload::Dirty { content, .. }, "content") => {
                *content = match value {
                    "random" => DirtyContent::Random,
                    "zero" => DirtyContent::Zero,
                    "text" => DirtyContent::Text,
                    _ => return Err(bad("random, zero or text")),
                }
            }
            (Workload::Dirty { tasks, .. }, "tasks") | (Workload::Compute { tasks }, "tasks") => {
                *tasks = Some(parse_num(workload, param, value, 1, tasks_max, "1 to 64")? as u32)
            }
            (Workload::Memtouch { tasks, .. }, "tasks") => {
                *tasks = parse_num(workload, param, value, 1, tasks_max, "1 to 64")? as u32
            }
            (Workload::Memtouch { mib, .. }, "mib") | (Workload::Sort { mib }, "mib") => {
                *mib = parse_num(workload, param, value, 1, 1 << 20, "MiB, at least 1")?
            }
            (Workload::Memtouch { after, .. }, "after") => {
                *after = match value {
                    "start" => MemtouchAfter::Start,
                    "migrate" => MemtouchAfter::Migrate,
                    _ => return Err(bad("start or migrate")),
                }
            }
            (Workload::Fill { content, .. }, "content") => {
                *content = match value {
                    "best" => FillContent::Best,
                    "worst" => FillContent::Worst,
                    "mixed" => FillContent::Mixed,
                    _ => return Err(bad("best, worst or mixed")),
                }
            }
            (Workload::Kv { workers, .. }, "workers") => {
                *workers = parse_num(workload, param, value, 1, tasks_max, "1 to 64")? as u32
            }
            (Workload::Kv { keys, .. }, "keys") => {
                *keys = parse_num(workload, param, value, 1, 1 << 32, "1 to 2^32 keys")?
            }
            (Workload::Kv { value: v, .. }, "value") => {
                *v = parse_num(workload, param, value, 8, MAX_KV_VALUE, "8 to 8192 bytes")?
            }
            (Workload::Fill { mib, .. }, "mib") => {
                *mib = Some(parse_num(
                    workload,
                    param,
                    value,
                    1,
                    1 << 20,
                    "MiB, at least 1",
                )?)
            }
            // params_of and this match list the same parameters; a mismatch is
            // reported like an unknown parameter rather than trusted.
            _ => {
                return Err(SpecError::UnknownParam {
                    workload,
                    param: param.into(),
                    valid: params_of(workload).join(", "),
                })
            }
        }
    }
    Ok(w)
}

/// A list of workloads run together, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadSet(pub Vec<Workload>);

impl FromStr for WorkloadSet {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        if s.trim().is_empty() {
            return Err(SpecError::Empty);
        }
        let list = s.split('+').map(parse_one).collect::<Result<Vec<_>, _>>()?;
        if list.len() > guest_abi::MAX_WORKLOADS {
            return Err(SpecError::TooMany { got: list.len() });
        }
        if list
            .iter()
            .filter(|w| matches!(w, Workload::Kv { .. }))
            .count()
            > 1
        {
            return Err(SpecError::TwoServers);
        }
        Ok(WorkloadSet(list))
    }
}

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
        }
    }

    /// True for workloads whose tasks finish by themselves (the run can end then).
    pub fn finishes(&self) -> bool {
        matches!(self, Workload::Memtouch { .. } | Workload::Sort { .. })
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
            Workload::Sort { .. } | Workload::Fill { .. } => 1,
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

    /// The guest's encoding of this workload.
    pub fn to_guest(&self, vcpus: u32) -> guest_abi::Workload {
        let mut p = [0u64; guest_abi::MAX_PARAMS];
        let kind = match self {
            Workload::Idle => kind::IDLE,
            Workload::Dirty {
                rate_mib,
                wss_mib,
                pattern,
                content,
                ..
            } => {
                p[0] = rate_mib.map_or(0, |r| r * MIB);
                p[1] = wss_mib * MIB;
                p[2] = *pattern as u64;
                p[3] = *content as u64;
                p[4] = self.tasks(vcpus);
                kind::DIRTY
            }
            Workload::Memtouch { tasks, mib, after } => {
                p[0] = *tasks as u64;
                p[1] = mib * MIB;
                p[2] = match after {
                    MemtouchAfter::Start => guest_abi::memtouch_after::START,
                    MemtouchAfter::Migrate => guest_abi::memtouch_after::MIGRATE,
                };
                kind::MEMTOUCH
            }
            Workload::Compute { .. } => {
                p[0] = self.tasks(vcpus);
                kind::COMPUTE
            }
            Workload::Sort { mib } => {
                p[0] = mib * MIB;
                kind::SORT
            }
            Workload::Fill { content, mib } => {
                p[0] = *content as u64;
                p[1] = mib.unwrap_or(0) * MIB;
                kind::FILL
            }
            Workload::Kv {
                workers,
                keys,
                value,
            } => {
                p[0] = *workers as u64;
                p[1] = *keys;
                p[2] = *value;
                kind::KV
            }
        };
        guest_abi::Workload {
            kind,
            reserved: 0,
            p,
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

    /// True if every workload finishes by itself.
    pub fn finishes(&self) -> bool {
        self.0.iter().all(Workload::finishes)
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::Idle => write!(f, "idle"),
            Workload::Dirty {
                rate_mib,
                wss_mib,
                pattern,
                content,
                tasks,
            } => {
                let rate = rate_mib.map_or("max".to_string(), |r| r.to_string());
                let pattern = match pattern {
                    DirtyPattern::Seq => "seq",
                    DirtyPattern::Random => "random",
                    DirtyPattern::HotCold => "hotcold",
                };
                let content = match content {
                    DirtyContent::Random => "random",
                    DirtyContent::Zero => "zero",
                    DirtyContent::Text => "text",
                };
                write!(
                    f,
                    "dirty:rate={rate},wss={wss_mib},pattern={pattern},content={content}"
                )?;
                if let Some(t) = tasks {
                    write!(f, ",tasks={t}")?;
                }
                Ok(())
            }
            Workload::Memtouch { tasks, mib, after } => {
                write!(f, "memtouch:tasks={tasks},mib={mib}")?;
                if *after == MemtouchAfter::Migrate {
                    write!(f, ",after=migrate")?;
                }
                Ok(())
            }
            Workload::Compute { tasks: Some(t) } => write!(f, "compute:tasks={t}"),
            Workload::Compute { tasks: None } => write!(f, "compute"),
            Workload::Sort { mib } => write!(f, "sort:mib={mib}"),
            Workload::Kv {
                workers,
                keys,
                value,
            } => {
                write!(f, "kv:workers={workers},keys={keys},value={value}")
            }
            Workload::Fill { content, mib } => {
                let c = match content {
                    FillContent::Best => "best",
                    FillContent::Worst => "worst",
                    FillContent::Mixed => "mixed",
                };
                write!(f, "fill:content={c}")?;
                if let Some(m) = mib {
                    write!(f, ",mib={m}")?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for WorkloadSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, w) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "+")?;
            }
            write!(f, "{w}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<WorkloadSet, SpecError> {
        s.parse()
    }

    #[test]
    fn defaults_and_params() {
        let w = parse("dirty:rate=256,wss=128,pattern=hotcold,content=text").unwrap();
        assert_eq!(
            w.0[0],
            Workload::Dirty {
                rate_mib: Some(256),
                wss_mib: 128,
                pattern: DirtyPattern::HotCold,
                content: DirtyContent::Text,
                tasks: None
            }
        );
        assert_eq!(
            parse("memtouch").unwrap().0[0],
            Workload::Memtouch {
                tasks: 4,
                mib: 16,
                after: MemtouchAfter::Start
            }
        );
        assert_eq!(parse("dirty:rate=max").unwrap().0[0].to_guest(2).p[0], 0);
    }

    #[test]
    fn combined_workloads_round_trip_through_display() {
        for s in [
            "memtouch:tasks=4,mib=8+compute:tasks=1",
            "idle",
            "fill:content=best,mib=32",
            "memtouch:tasks=4,mib=192,after=migrate",
        ] {
            let w = parse(s).unwrap();
            assert_eq!(parse(&w.to_string()).unwrap(), w);
        }
        assert_eq!(
            parse("memtouch:tasks=4,mib=8+compute:tasks=1")
                .unwrap()
                .0
                .len(),
            2
        );
    }

    #[test]
    fn errors_name_what_is_valid() {
        let e = parse("dirt").unwrap_err();
        assert!(
            e.to_string().contains("valid workloads: idle, dirty"),
            "{e}"
        );
        let e = parse("dirty:speed=3").unwrap_err();
        assert!(
            e.to_string()
                .contains("valid: rate, wss, pattern, content, tasks"),
            "{e}"
        );
        let e = parse("dirty:pattern=zigzag").unwrap_err();
        assert!(e.to_string().contains("seq, random or hotcold"), "{e}");
        assert!(matches!(
            parse("memtouch:tasks=0"),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            parse("memtouch:tasks"),
            Err(SpecError::MissingValue { .. })
        ));
        assert!(matches!(
            parse("idle:x=1"),
            Err(SpecError::UnknownParam { .. })
        ));
        assert!(matches!(parse(""), Err(SpecError::Empty)));
        assert!(matches!(parse("kv+kv"), Err(SpecError::TwoServers)));
        assert!(matches!(
            parse("kv:value=9000"),
            Err(SpecError::BadValue { .. })
        ));
        assert!(matches!(
            parse("idle+idle+idle+idle+idle"),
            Err(SpecError::TooMany { got: 5 })
        ));
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

    #[test]
    fn memtouch_after_migrate() {
        let w = parse("memtouch:tasks=4,mib=128,after=migrate").unwrap();
        assert_eq!(
            w.0[0],
            Workload::Memtouch {
                tasks: 4,
                mib: 128,
                after: MemtouchAfter::Migrate
            }
        );
        let g = w.0[0].to_guest(2);
        assert_eq!(
            (g.kind, g.p[0], g.p[1], g.p[2]),
            (
                kind::MEMTOUCH,
                4,
                128 * MIB,
                guest_abi::memtouch_after::MIGRATE
            )
        );
        assert_eq!(w.0[0].arena_bytes(), 4 * 128 * MIB);
        // The default keeps the plain pass, and says nothing of it.
        let w = parse("memtouch:after=start").unwrap();
        assert_eq!(w.0[0].to_guest(2).p[2], guest_abi::memtouch_after::START);
        assert_eq!(w.to_string(), "memtouch:tasks=4,mib=16");
        let e = parse("memtouch:after=switch").unwrap_err();
        assert!(e.to_string().contains("start or migrate"), "{e}");
        let e = parse("memtouch:when=migrate").unwrap_err();
        assert!(e.to_string().contains("valid: tasks, mib, after"), "{e}");
    }

    #[test]
    fn guest_encoding() {
        let g = parse("sort:mib=8").unwrap().0[0].to_guest(1);
        assert_eq!((g.kind, g.p[0]), (kind::SORT, 8 * MIB));
        let g = parse("compute").unwrap().0[0].to_guest(3);
        assert_eq!((g.kind, g.p[0]), (kind::COMPUTE, 3));
    }
}
