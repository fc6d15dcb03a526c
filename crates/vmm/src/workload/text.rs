//! The text form of workload specs, both ways: parsing
//! (`memtouch:tasks=4,mib=8+compute`) with errors that name what is
//! valid, and display, which parses back to the same spec.

use std::fmt;
use std::str::FromStr;

use super::{
    DirtyContent, DirtyPattern, FillContent, MemtouchAfter, SpecError, Workload, WorkloadSet,
    MAX_KV_VALUE, NAMES,
};
use crate::guest_abi;

/// The parameters each workload takes (`parse_one`'s match sets the same).
fn params_of(workload: &str) -> &'static [&'static str] {
    match workload {
        "dirty" => &["rate", "wss", "pattern", "content", "tasks"],
        "memtouch" => &["tasks", "mib", "after"],
        "compute" => &["tasks"],
        "sort" => &["mib"],
        "fill" => &["content", "mib"],
        "kv" => &["workers", "keys", "value"],
        "disk" => super::disk::PARAMS,
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
        "disk" => Workload::Disk(super::DiskWorkload::default()),
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
            (Workload::Disk(d), _) => d.set(param, value)?,
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
        if list
            .iter()
            .filter(|w| matches!(w, Workload::Disk(_)))
            .count()
            > 1
        {
            return Err(SpecError::TwoDisks);
        }
        Ok(WorkloadSet(list))
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
            Workload::Disk(d) => write!(f, "{d}"),
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
    use crate::guest_abi::kind;

    const MIB: u64 = 1 << 20;

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
}
