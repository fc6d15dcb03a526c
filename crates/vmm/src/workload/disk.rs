//! The `disk` workload's spec (`disk:rw=…,bs=…,qd=…,mib=…,rate=…,disk=…`),
//! the host's mirror of its block stamp (so tests and tools can check an
//! image file the way the guest checks what it reads), and its counters as
//! the VMM reads them from guest memory (`struct ferry_disk_metrics`).

use std::fmt;

use ferry_memory::{GuestMemory, PAGE_SIZE};

use super::{SpecError, MIB};
use crate::devices::service::wire;
use crate::guest_abi::{self, BlkStamp, DiskMetrics, DISK_METRICS_GPA};

/// Its parameters.
pub const PARAMS: &[&str] = &["rw", "bs", "qd", "mib", "rate", "disk"];
/// Most requests in flight (the guest's slots).
pub const MAX_QD: u64 = 64;

/// What it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskMode {
    /// Random writes for ever.
    RandWrite,
    /// Every block written once, then random reads, each checked.
    RandRead,
    /// Every block written once, read back and checked; then done.
    SeqWrite,
    /// Every block written once, then random reads and writes 1:1.
    Mixed,
}

impl DiskMode {
    fn name(self) -> &'static str {
        match self {
            DiskMode::RandWrite => "randwrite",
            DiskMode::RandRead => "randread",
            DiskMode::SeqWrite => "seqwrite",
            DiskMode::Mixed => "mixed",
        }
    }
}

/// The disk workload's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskWorkload {
    /// What it does.
    pub mode: DiskMode,
    /// Bytes per block (a multiple of 512, 512 to 1 MiB).
    pub bs: u64,
    /// Requests in flight.
    pub qd: u64,
    /// MiB of the disk it uses, from its start.
    pub mib: u64,
    /// MiB/s of reads and writes together; `None` = as fast as it goes.
    pub rate_mib: Option<u64>,
    /// Which disk (`--disk` order).
    pub disk: u32,
}

impl Default for DiskWorkload {
    fn default() -> Self {
        DiskWorkload {
            mode: DiskMode::Mixed,
            bs: 4096,
            qd: 8,
            mib: 64,
            rate_mib: None,
            disk: 0,
        }
    }
}

impl DiskWorkload {
    /// Sets one parameter from its text.
    pub(super) fn set(&mut self, param: &'static str, value: &str) -> Result<(), SpecError> {
        let bad = |expected| SpecError::BadValue {
            workload: "disk",
            param,
            value: value.into(),
            expected,
        };
        let num = |min: u64, max: u64, expected| match super::disk_size(value) {
            Some(v) if (min..=max).contains(&v) => Ok(v),
            _ => Err(bad(expected)),
        };
        match param {
            "rw" => {
                self.mode = match value {
                    "randwrite" => DiskMode::RandWrite,
                    "randread" => DiskMode::RandRead,
                    "seqwrite" => DiskMode::SeqWrite,
                    "mixed" => DiskMode::Mixed,
                    _ => return Err(bad("randwrite, randread, seqwrite or mixed")),
                }
            }
            "bs" => {
                let bs = num(
                    512,
                    1 << 20,
                    "512 bytes to 1M, a multiple of 512 (4k, 64k, …)",
                )?;
                if !bs.is_multiple_of(512) {
                    return Err(bad("a multiple of 512"));
                }
                self.bs = bs;
            }
            "qd" => self.qd = num(1, MAX_QD, "1 to 64 requests in flight")?,
            "mib" => self.mib = num(1, 1 << 24, "MiB, at least 1")?,
            "rate" => self.rate_mib = Some(num(1, 1 << 20, "MiB/s, at least 1")?),
            "disk" => self.disk = num(0, 3, "a disk index, 0 to 3")? as u32,
            _ => {
                return Err(SpecError::UnknownParam {
                    workload: "disk",
                    param: param.into(),
                    valid: PARAMS.join(", "),
                })
            }
        }
        Ok(())
    }

    /// Blocks it uses.
    pub fn blocks(&self) -> u64 {
        self.mib * MIB / self.bs
    }

    /// Guest memory it takes (as `disk_mem_size` in guest/user/workload.h,
    /// plus two pages of its own state).
    pub fn arena_bytes(&self) -> u64 {
        let round = |v: u64| v.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        round(4 * PAGE_SIZE + self.qd * self.bs + self.blocks() * 4) + 2 * PAGE_SIZE
    }

    /// The guest's parameters p0..p5.
    pub fn params(&self) -> [u64; 6] {
        let mode = match self.mode {
            DiskMode::RandWrite => guest_abi::disk_mode::RANDWRITE,
            DiskMode::RandRead => guest_abi::disk_mode::RANDREAD,
            DiskMode::SeqWrite => guest_abi::disk_mode::SEQWRITE,
            DiskMode::Mixed => guest_abi::disk_mode::MIXED,
        };
        [
            mode,
            self.bs,
            self.qd,
            self.mib * MIB,
            self.rate_mib.map_or(0, |r| r * MIB),
            u64::from(self.disk),
        ]
    }
}

impl fmt::Display for DiskWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "disk:rw={},bs={},qd={},mib={}",
            self.mode.name(),
            self.bs,
            self.qd,
            self.mib
        )?;
        if let Some(r) = self.rate_mib {
            write!(f, ",rate={r}")?;
        }
        if self.disk != 0 {
            write!(f, ",disk={}", self.disk)?;
        }
        Ok(())
    }
}

/// `ferry_blk_checksum`: the checksum of a stamped block.
pub fn blk_checksum(block: &[u8], tag: u64, lba: u64, generation: u64) -> u64 {
    let h = wire::csum(&block[std::mem::size_of::<BlkStamp>()..]);
    h ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ lba.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ generation.wrapping_add(1)
}

/// What a block holds, by its stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockCheck {
    /// A good stamp of this tag and block, at this generation.
    Good {
        /// Its generation.
        generation: u64,
    },
    /// No stamp.
    Lost,
    /// Another disk's or another block's stamp.
    Foreign,
    /// The right stamp, the wrong checksum.
    Torn,
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Checks one block (`bs` bytes, as read from the disk) written by the
/// disk workload with `tag` at block `lba`.
pub fn check_block(block: &[u8], tag: u64, lba: u64) -> BlockCheck {
    if block.len() < std::mem::size_of::<BlkStamp>() || le64(block, 0) != guest_abi::BLK_STAMP_MAGIC
    {
        return BlockCheck::Lost;
    }
    if le64(block, 8) != tag || le64(block, 16) != lba {
        return BlockCheck::Foreign;
    }
    let generation = le64(block, 24);
    if le64(block, 32) != blk_checksum(block, tag, lba, generation) {
        return BlockCheck::Torn;
    }
    BlockCheck::Good { generation }
}

/// The disk workload's counters, if it has set them up.
pub fn read_metrics(memory: &GuestMemory) -> Option<DiskMetrics> {
    if !memory.holds_data(DISK_METRICS_GPA & !(PAGE_SIZE - 1), PAGE_SIZE) {
        return None;
    }
    let mut words = [0u64; DiskMetrics::WORDS];
    for (i, w) in words.iter_mut().enumerate() {
        *w = memory
            .read_u64_volatile(DISK_METRICS_GPA + 8 * i as u64)
            .ok()?;
    }
    // SAFETY: DiskMetrics is repr(C) and made only of u64 words (its size
    // is WORDS × 8), so any bit pattern of that size is a valid value.
    let m: DiskMetrics = unsafe { std::mem::transmute(words) };
    (m.magic == guest_abi::DISK_MAGIC).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Workload, WorkloadSet};

    fn parse(s: &str) -> Result<WorkloadSet, SpecError> {
        s.parse()
    }

    #[test]
    fn specs_parse_check_and_print_back() {
        let w = parse("disk:rw=seqwrite,bs=4k,qd=16,mib=8,rate=20").unwrap();
        let Workload::Disk(d) = w.0[0] else { panic!() };
        assert_eq!(
            d,
            DiskWorkload {
                mode: DiskMode::SeqWrite,
                bs: 4096,
                qd: 16,
                mib: 8,
                rate_mib: Some(20),
                disk: 0
            }
        );
        assert_eq!(parse(&w.to_string()).unwrap(), w);
        assert!(w.finishes());
        assert!(!parse("disk").unwrap().finishes());
        assert_eq!(w.0[0].to_guest(1).p[3], 8 * MIB);
        assert!(matches!(
            parse("disk:bs=1000"),
            Err(SpecError::BadValue { param: "bs", .. })
        ));
        assert!(matches!(
            parse("disk:qd=65"),
            Err(SpecError::BadValue { param: "qd", .. })
        ));
        assert!(matches!(
            parse("disk:rw=append"),
            Err(SpecError::BadValue { param: "rw", .. })
        ));
        assert!(matches!(parse("disk+disk"), Err(SpecError::TwoDisks)));
    }

    #[test]
    fn a_stamped_block_checks_and_a_damaged_one_does_not() {
        let (tag, lba, gen) = (0x1234_5678_9abc_def1, 7, 3);
        let mut b = vec![0u8; 4096];
        b[40..].copy_from_slice(&wire::value(4096 - 40, lba, gen ^ tag));
        for (i, v) in [guest_abi::BLK_STAMP_MAGIC, tag, lba, gen]
            .iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        let sum = blk_checksum(&b, tag, lba, gen);
        b[32..40].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(
            check_block(&b, tag, lba),
            BlockCheck::Good { generation: 3 }
        );
        assert_eq!(check_block(&b, tag + 1, lba), BlockCheck::Foreign);
        assert_eq!(check_block(&b, tag, lba + 1), BlockCheck::Foreign);
        let mut torn = b.clone();
        torn[2048] ^= 1;
        assert_eq!(check_block(&torn, tag, lba), BlockCheck::Torn);
        assert_eq!(check_block(&vec![0u8; 4096], tag, lba), BlockCheck::Lost);
    }
}
