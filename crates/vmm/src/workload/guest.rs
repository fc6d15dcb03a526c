//! A workload's encoding for the guest ([`guest_abi::Workload`]): a kind
//! and plain numbers, so the guest never parses text.

use super::{MemtouchAfter, Workload, MIB};
use crate::guest_abi::{self, kind};

impl Workload {
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
            Workload::Disk(d) => {
                p[..6].copy_from_slice(&d.params());
                kind::DISK
            }
        };
        guest_abi::Workload {
            kind,
            reserved: 0,
            p,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{SpecError, WorkloadSet};

    fn parse(s: &str) -> Result<WorkloadSet, SpecError> {
        s.parse()
    }

    #[test]
    fn guest_encoding() {
        let g = parse("sort:mib=8").unwrap().0[0].to_guest(1);
        assert_eq!((g.kind, g.p[0]), (kind::SORT, 8 * MIB));
        let g = parse("compute").unwrap().0[0].to_guest(3);
        assert_eq!((g.kind, g.p[0]), (kind::COMPUTE, 3));
    }
}
