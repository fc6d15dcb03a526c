//! Loads the guest kernel ELF into guest memory.
//!
//! The image comes from the user (`--kernel`) or is built in; either way it is
//! checked like hostile input: every segment must land in the kernel area.

use ferry_memory::GuestMemory;
use goblin::elf::{header, program_header::PT_LOAD, Elf};

use crate::guest_abi::{ARENA_BASE, KERNEL_GPA};

/// Why the kernel image could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The file could not be read.
    #[error("cannot read guest kernel {path}: {source}")]
    Read {
        /// Path given.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Not a parseable ELF file.
    #[error("guest kernel is not a valid ELF file: {0}")]
    Parse(String),
    /// ELF for another machine or class.
    #[error("guest kernel must be a 64-bit x86-64 ELF executable (got class64={is_64}, machine={machine}, type={kind})")]
    WrongKind {
        /// ELFCLASS64?
        is_64: bool,
        /// e_machine.
        machine: u16,
        /// e_type.
        kind: u16,
    },
    /// A segment that does not fit the kernel area or the file.
    #[error("guest kernel segment {index} ({addr:#x}, {size} bytes) {reason}")]
    Segment {
        /// Program header index.
        index: usize,
        /// Physical address.
        addr: u64,
        /// Size in memory.
        size: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// Nothing to load, or the entry point is outside what was loaded.
    #[error("guest kernel has {0}")]
    Layout(&'static str),
}

/// Loads `image` into `memory`; returns the entry point.
pub fn load_kernel(memory: &GuestMemory, image: &[u8]) -> Result<u64, KernelError> {
    let elf = Elf::parse(image).map_err(|e| KernelError::Parse(e.to_string()))?;
    let h = &elf.header;
    if !elf.is_64 || h.e_machine != header::EM_X86_64 || h.e_type != header::ET_EXEC {
        return Err(KernelError::WrongKind {
            is_64: elf.is_64,
            machine: h.e_machine,
            kind: h.e_type,
        });
    }
    let mut loaded = 0;
    let mut entry_ok = false;
    for (index, ph) in elf
        .program_headers
        .iter()
        .enumerate()
        .filter(|(_, p)| p.p_type == PT_LOAD)
    {
        let (addr, size) = (ph.p_paddr, ph.p_memsz);
        let seg = |reason| KernelError::Segment {
            index,
            addr,
            size,
            reason,
        };
        let end = addr.checked_add(size).ok_or(seg("wraps around"))?;
        if addr < KERNEL_GPA || end > ARENA_BASE {
            return Err(seg("is outside the kernel area 1 MiB..16 MiB"));
        }
        if ph.p_filesz > size {
            return Err(seg("has more file bytes than memory bytes"));
        }
        let off = usize::try_from(ph.p_offset).map_err(|_| seg("has a bad file offset"))?;
        let len = usize::try_from(ph.p_filesz).map_err(|_| seg("is too large"))?;
        let bytes = off
            .checked_add(len)
            .and_then(|e| image.get(off..e))
            .ok_or(seg("runs past the end of the file"))?;
        memory
            .write_bytes(addr, bytes)
            .map_err(|_| seg("is outside guest RAM"))?;
        // Guest RAM starts zeroed (fresh memfd), which covers the rest (bss).
        entry_ok |= (addr..end).contains(&h.e_entry);
        loaded += 1;
    }
    if loaded == 0 {
        return Err(KernelError::Layout("no loadable segments"));
    }
    if !entry_ok {
        return Err(KernelError::Layout(
            "an entry point outside its loaded segments",
        ));
    }
    Ok(h.e_entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> GuestMemory {
        GuestMemory::new(&[(0, 32 << 20)]).unwrap()
    }

    #[test]
    fn loads_the_built_in_guest() {
        let entry = load_kernel(&memory(), crate::boot::GUEST_KERNEL).unwrap();
        assert_eq!(entry, KERNEL_GPA);
    }

    #[test]
    fn refuses_garbage_and_truncation() {
        assert!(matches!(
            load_kernel(&memory(), b"not an elf"),
            Err(KernelError::Parse(_))
        ));
        let img = crate::boot::GUEST_KERNEL;
        let cut = &img[..img.len() / 2];
        assert!(load_kernel(&memory(), cut).is_err());
        assert!(load_kernel(&memory(), &[]).is_err());
    }

    #[test]
    fn refuses_a_host_binary() {
        let host = std::fs::read("/proc/self/exe").unwrap();
        // A PIE host executable is ET_DYN: wrong kind, not loaded anywhere.
        assert!(matches!(
            load_kernel(&memory(), &host),
            Err(KernelError::WrongKind { .. } | KernelError::Segment { .. })
        ));
    }
}
