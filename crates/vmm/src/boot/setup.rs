//! Builds what the guest finds at entry: GDT and TSSs, identity page tables,
//! boot stacks, the boot info page, and each vCPU's registers in 64-bit mode.
//!
//! There is no firmware and no real mode (PVM cannot run it): the VMM puts the
//! vCPUs straight into long mode with KVM_SET_SREGS.

use ferry_memory::GuestMemory;
use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};

use crate::guest_abi::{
    BootInfo, RamRange, BOOT_INFO_GPA, BOOT_STACKS_GPA, GDT_GPA, MAX_RAM_RANGES, PAGE_TABLES_GPA,
    SEL_KCODE, SEL_KDATA, SEL_TSS0, TSS_GPA, TSS_STRIDE,
};

use super::layout::MemoryLayout;

const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PDE_HUGE: u64 = 1 << 7;
const PTE_PCD: u64 = 1 << 4;
const TWO_MIB: u64 = 2 << 20;
const ONE_GIB: u64 = 1 << 30;

const CR0_PE: u64 = 1 << 0;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_SCE: u64 = 1 << 0;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Bytes of boot stack per vCPU.
const BOOT_STACK_SIZE: u64 = 0x1000;

/// Writes the GDT with one TSS per vCPU, and the TSSs' fixed fields.
pub fn write_gdt(memory: &GuestMemory, vcpus: u32) -> Result<(), ferry_memory::MemoryError> {
    let mut gdt: Vec<u64> = vec![
        0,
        0x00af_9a00_0000_ffff, // 0x08 kernel code, 64-bit
        0x00cf_9200_0000_ffff, // 0x10 kernel data
        0x00af_fa00_0000_ffff, // 0x18 user code, 64-bit, DPL3
        0x00cf_f200_0000_ffff, // 0x20 user data, DPL3
    ];
    for cpu in 0..vcpus as u64 {
        let base = TSS_GPA + cpu * TSS_STRIDE;
        // 16-byte system descriptor: limit 0x67, type 0x89 (available 64-bit TSS).
        gdt.push(0x67 | ((base & 0xff_ffff) << 16) | (0x89 << 40) | ((base >> 24 & 0xff) << 56));
        gdt.push(base >> 32);
        // No I/O permission bitmap: its offset points past the TSS limit.
        memory.write_obj(base + 0x66, &0x68u16)?;
    }
    let bytes: Vec<u8> = gdt.iter().flat_map(|d| d.to_le_bytes()).collect();
    memory.write_bytes(GDT_GPA, &bytes)
}

/// Identity-maps every 2 MiB page that holds RAM, user-accessible (the test
/// guest does not isolate tasks from the kernel). Accessed and dirty bits start
/// clear so KVM's dirty log reports only what the guest really writes.
pub fn write_page_tables(
    memory: &GuestMemory,
    layout: &MemoryLayout,
) -> Result<(), ferry_memory::MemoryError> {
    let pml4 = PAGE_TABLES_GPA;
    let pdpt = pml4 + 0x1000;
    let pds = pdpt + 0x1000;
    let flags = PTE_PRESENT | PTE_WRITE | PTE_USER;
    memory.write_obj(pml4, &(pdpt | flags))?;
    // At least 4 GiB: the device page in the 32-bit hole needs its directory.
    let gib_count = layout.end().div_ceil(ONE_GIB).max(4);
    for gib in 0..gib_count {
        memory.write_obj(pdpt + gib * 8, &((pds + gib * 0x1000) | flags))?;
    }
    // The device page in the 32-bit hole (no RAM behind it: accesses exit
    // to the VMM as MMIO), uncached, user-accessible for the service doorbell.
    let hole = crate::guest_abi::SVC_DOORBELL_GPA & !(TWO_MIB - 1);
    let pd = pds + (hole / ONE_GIB) * 0x1000;
    memory.write_obj(
        pd + ((hole % ONE_GIB) / TWO_MIB) * 8,
        &(hole | flags | PDE_HUGE | PTE_PCD),
    )?;
    for &(base, size) in layout.ranges() {
        let mut addr = base & !(TWO_MIB - 1);
        while addr < base + size {
            let pd = pds + (addr / ONE_GIB) * 0x1000;
            let index = (addr % ONE_GIB) / TWO_MIB;
            let ad = if std::env::var_os("FERRY_PDE_AD").is_some() {
                0x60
            } else {
                0
            };
            memory.write_obj(pd + index * 8, &(addr | flags | PDE_HUGE | ad))?;
            addr += TWO_MIB;
        }
    }
    Ok(())
}

/// Writes the boot info page.
pub fn write_boot_info(
    memory: &GuestMemory,
    layout: &MemoryLayout,
    mut info: BootInfo,
) -> Result<(), ferry_memory::MemoryError> {
    let ranges = layout.ranges();
    info.nranges = ranges.len().min(MAX_RAM_RANGES) as u32;
    for (slot, &(base, size)) in info.ram.iter_mut().zip(ranges) {
        *slot = RamRange { base, size };
    }
    memory.write_obj(BOOT_INFO_GPA, &info)
}

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 11 } else { 3 },
        present: 1,
        dpl: 0,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// Special registers for vCPU `cpu`: long mode, paging on, flat segments, its TSS.
pub fn long_mode_sregs(mut sregs: kvm_sregs, cpu: u32) -> kvm_sregs {
    sregs.cs = segment(SEL_KCODE, true);
    let data = segment(SEL_KDATA, false);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.gdt.base = GDT_GPA;
    sregs.gdt.limit = 0xfff;
    sregs.tr = kvm_segment {
        base: TSS_GPA + cpu as u64 * TSS_STRIDE,
        limit: 0x67,
        selector: SEL_TSS0 + 16 * cpu as u16,
        type_: 11, // busy 64-bit TSS
        present: 1,
        ..Default::default()
    };
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.cr3 = PAGE_TABLES_GPA;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA | EFER_SCE;
    sregs
}

/// General registers for vCPU `cpu` at the kernel entry: rdi = cpu id, rsp = its boot stack.
pub fn entry_regs(entry: u64, cpu: u32) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: BOOT_STACKS_GPA + (cpu as u64 + 1) * BOOT_STACK_SIZE,
        rdi: cpu as u64,
        rflags: 2,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tables_cover_ram_across_the_hole() {
        let layout = MemoryLayout::for_size(4 << 30).unwrap();
        // Only the tables are written, so a small memory with the same low pages will do.
        let mem = GuestMemory::new(&[(0, 1 << 20)]).unwrap();
        write_page_tables(&mem, &layout).unwrap();
        let pd = |gib: u64, i: u64| -> u64 {
            mem.read_obj(PAGE_TABLES_GPA + 0x2000 + gib * 0x1000 + i * 8)
                .unwrap()
        };
        assert_eq!(pd(0, 0), 0x87);
        assert_eq!(pd(2, 511), ((3 << 30) - TWO_MIB) | 0x87);
        assert_eq!(pd(3, 0), 0, "the 3-4 GiB hole is not mapped");
        assert_eq!(
            pd(3, 128),
            0xD000_0000 | 0x97,
            "except the device page, uncached"
        );
        assert_eq!(pd(4, 0), (4 << 30) | 0x87);
        let pdpt4: u64 = mem.read_obj(PAGE_TABLES_GPA + 0x1000 + 4 * 8).unwrap();
        assert_eq!(pdpt4, (PAGE_TABLES_GPA + 0x2000 + 4 * 0x1000) | 7);
    }

    #[test]
    fn boot_stacks_do_not_overlap_the_page_tables() {
        let top = entry_regs(0, crate::guest_abi::MAX_CPUS as u32 - 1).rsp;
        assert!(top <= PAGE_TABLES_GPA);
    }
}
