//! The kernel's userfaultfd ABI, mirrored from `linux/userfaultfd.h`.
//!
//! Written out by hand (not generated) so the crate needs no bindgen; the
//! tests below pin every size, offset and number the wrapper relies on, and
//! cross-check the constants against the installed header when there is one.

/// The only API version there is.
pub(crate) const UFFD_API: u64 = 0xAA;

/// `UFFD_FEATURE_*` bits of `uffdio_api.features`.
pub(crate) mod feature {
    /// Write-protect faults carry `UFFD_PAGEFAULT_FLAG_WP` (needed for WP mode).
    pub(crate) const PAGEFAULT_FLAG_WP: u64 = 1 << 0;
    /// `UFFD_EVENT_FORK`.
    pub(crate) const EVENT_FORK: u64 = 1 << 1;
    /// `UFFD_EVENT_REMAP`.
    pub(crate) const EVENT_REMAP: u64 = 1 << 2;
    /// `UFFD_EVENT_REMOVE`.
    pub(crate) const EVENT_REMOVE: u64 = 1 << 3;
    /// MISSING mode on hugetlbfs.
    pub(crate) const MISSING_HUGETLBFS: u64 = 1 << 4;
    /// MISSING mode on shmem (memfd, tmpfs).
    pub(crate) const MISSING_SHMEM: u64 = 1 << 5;
    /// `UFFD_EVENT_UNMAP`.
    pub(crate) const EVENT_UNMAP: u64 = 1 << 6;
    /// SIGBUS instead of fault events.
    pub(crate) const SIGBUS: u64 = 1 << 7;
    /// Fault messages carry the faulting thread id.
    pub(crate) const THREAD_ID: u64 = 1 << 8;
    /// MINOR mode on hugetlbfs.
    pub(crate) const MINOR_HUGETLBFS: u64 = 1 << 9;
    /// MINOR mode on shmem.
    pub(crate) const MINOR_SHMEM: u64 = 1 << 10;
    /// Fault addresses are not rounded down to the page.
    pub(crate) const EXACT_ADDRESS: u64 = 1 << 11;
    /// WP mode on shmem and hugetlbfs.
    pub(crate) const WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
    /// WP also covers never-populated anonymous pages (Linux 6.4+; newer than
    /// some installed headers).
    pub(crate) const WP_UNPOPULATED: u64 = 1 << 13;
    /// `UFFDIO_POISON` (Linux 6.6+).
    pub(crate) const POISON: u64 = 1 << 14;
    /// Asynchronous WP for anonymous memory (Linux 6.7+).
    pub(crate) const WP_ASYNC: u64 = 1 << 15;
    /// `UFFDIO_MOVE` (Linux 6.8+).
    pub(crate) const MOVE: u64 = 1 << 16;

    /// Names for error messages, lowest bit first.
    pub(crate) const NAMES: [(u64, &str); 17] = [
        (PAGEFAULT_FLAG_WP, "PAGEFAULT_FLAG_WP"),
        (EVENT_FORK, "EVENT_FORK"),
        (EVENT_REMAP, "EVENT_REMAP"),
        (EVENT_REMOVE, "EVENT_REMOVE"),
        (MISSING_HUGETLBFS, "MISSING_HUGETLBFS"),
        (MISSING_SHMEM, "MISSING_SHMEM"),
        (EVENT_UNMAP, "EVENT_UNMAP"),
        (SIGBUS, "SIGBUS"),
        (THREAD_ID, "THREAD_ID"),
        (MINOR_HUGETLBFS, "MINOR_HUGETLBFS"),
        (MINOR_SHMEM, "MINOR_SHMEM"),
        (EXACT_ADDRESS, "EXACT_ADDRESS"),
        (WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
        (WP_UNPOPULATED, "WP_UNPOPULATED"),
        (POISON, "POISON"),
        (WP_ASYNC, "WP_ASYNC"),
        (MOVE, "MOVE"),
    ];

    /// The names of the bits set in `bits` (unknown bits as hex).
    pub(crate) fn names(bits: u64) -> Vec<String> {
        let mut out: Vec<String> = NAMES
            .iter()
            .filter(|(b, _)| bits & b != 0)
            .map(|(_, n)| (*n).to_string())
            .collect();
        let known = NAMES.iter().fold(0, |acc, (b, _)| acc | b);
        if bits & !known != 0 {
            out.push(format!("{:#x}", bits & !known));
        }
        out
    }
}

/// `UFFDIO_REGISTER_MODE_*`.
pub(crate) const REGISTER_MODE_MISSING: u64 = 1 << 0;
/// See [`REGISTER_MODE_MISSING`].
pub(crate) const REGISTER_MODE_WP: u64 = 1 << 1;
/// See [`REGISTER_MODE_MISSING`].
pub(crate) const REGISTER_MODE_MINOR: u64 = 1 << 2;

/// `UFFDIO_COPY_MODE_DONTWAKE`.
pub(crate) const COPY_MODE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_COPY_MODE_WP`: the pages land write-protected.
pub(crate) const COPY_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_CONTINUE_MODE_WP`: the pages are mapped write-protected.
pub(crate) const CONTINUE_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_WRITEPROTECT_MODE_WP`.
pub(crate) const WRITEPROTECT_MODE_WP: u64 = 1 << 0;

/// `UFFD_EVENT_*` of `uffd_msg.event` that the wrapper decodes (FORK 0x13,
/// REMAP 0x14 and UNMAP 0x16 are passed on as raw codes).
pub(crate) const EVENT_PAGEFAULT: u8 = 0x12;
/// See [`EVENT_PAGEFAULT`].
pub(crate) const EVENT_REMOVE: u8 = 0x15;

/// `UFFD_PAGEFAULT_FLAG_*` of a page fault message.
pub(crate) const PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
/// See [`PAGEFAULT_FLAG_WRITE`].
pub(crate) const PAGEFAULT_FLAG_WP: u64 = 1 << 1;
/// See [`PAGEFAULT_FLAG_WRITE`].
pub(crate) const PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;

/// Ioctl numbers (`_UFFDIO_*`): also the bit positions in the `ioctls` masks.
pub(crate) mod nr {
    /// `_UFFDIO_REGISTER`.
    pub(crate) const REGISTER: u64 = 0x00;
    /// `_UFFDIO_UNREGISTER`.
    pub(crate) const UNREGISTER: u64 = 0x01;
    /// `_UFFDIO_WAKE`.
    pub(crate) const WAKE: u64 = 0x02;
    /// `_UFFDIO_COPY`.
    pub(crate) const COPY: u64 = 0x03;
    /// `_UFFDIO_ZEROPAGE`.
    pub(crate) const ZEROPAGE: u64 = 0x04;
    /// `_UFFDIO_WRITEPROTECT`.
    pub(crate) const WRITEPROTECT: u64 = 0x06;
    /// `_UFFDIO_CONTINUE`.
    pub(crate) const CONTINUE: u64 = 0x07;
    /// `_UFFDIO_API`.
    pub(crate) const API: u64 = 0x3F;
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Range {
    pub(crate) start: u64,
    pub(crate) len: u64,
}

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Api {
    pub(crate) api: u64,
    pub(crate) features: u64,
    pub(crate) ioctls: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Register {
    pub(crate) range: Range,
    pub(crate) mode: u64,
    pub(crate) ioctls: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Copy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
    pub(crate) mode: u64,
    /// Bytes copied, or a negative errno.
    pub(crate) copy: i64,
}

/// `struct uffdio_zeropage` and `struct uffdio_continue` (same layout: the
/// last field is `zeropage` or `mapped`, bytes done or a negative errno).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RangeMode {
    pub(crate) range: Range,
    pub(crate) mode: u64,
    pub(crate) result: i64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WriteProtect {
    pub(crate) range: Range,
    pub(crate) mode: u64,
}

/// `struct uffd_msg` (packed in C, but every field is naturally aligned, so
/// `repr(C)` gives the same 32-byte layout): a header, then a union read as
/// three words. Page fault: `[flags, address, ptid]`; remove: `[start, end, _]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Msg {
    pub(crate) event: u8,
    pub(crate) reserved1: u8,
    pub(crate) reserved2: u16,
    pub(crate) reserved3: u32,
    pub(crate) arg: [u64; 3],
}

const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;
const UFFDIO: u64 = 0xAA;

/// `_IOC(dir, 0xAA, nr, size)` as in `asm-generic/ioctl.h`.
const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (UFFDIO << 8) | nr
}

/// `UFFDIO_API`.
pub(crate) const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, nr::API, size_of::<Api>());
/// `UFFDIO_REGISTER`.
pub(crate) const UFFDIO_REGISTER: u64 =
    ioc(IOC_READ | IOC_WRITE, nr::REGISTER, size_of::<Register>());
/// `UFFDIO_UNREGISTER` (`_IOR` although the kernel reads it: see the header).
pub(crate) const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, nr::UNREGISTER, size_of::<Range>());
/// `UFFDIO_WAKE` (`_IOR`, as above).
pub(crate) const UFFDIO_WAKE: u64 = ioc(IOC_READ, nr::WAKE, size_of::<Range>());
/// `UFFDIO_COPY`.
pub(crate) const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, nr::COPY, size_of::<Copy>());
/// `UFFDIO_ZEROPAGE`.
pub(crate) const UFFDIO_ZEROPAGE: u64 =
    ioc(IOC_READ | IOC_WRITE, nr::ZEROPAGE, size_of::<RangeMode>());
/// `UFFDIO_WRITEPROTECT`.
pub(crate) const UFFDIO_WRITEPROTECT: u64 = ioc(
    IOC_READ | IOC_WRITE,
    nr::WRITEPROTECT,
    size_of::<WriteProtect>(),
);
/// `UFFDIO_CONTINUE`.
pub(crate) const UFFDIO_CONTINUE: u64 =
    ioc(IOC_READ | IOC_WRITE, nr::CONTINUE, size_of::<RangeMode>());
/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd` (`_IO(0xAA, 0)`).
pub(crate) const USERFAULTFD_IOC_NEW: u64 = 0xAA00;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// Sizes, offsets and ioctl numbers as a C compiler computes them from
    /// linux/userfaultfd.h (checked with gcc on the development machine).
    #[test]
    fn layout_matches_the_kernel_abi() {
        assert_eq!(size_of::<Range>(), 16);
        assert_eq!(size_of::<Api>(), 24);
        assert_eq!(size_of::<Register>(), 32);
        assert_eq!(offset_of!(Register, mode), 16);
        assert_eq!(offset_of!(Register, ioctls), 24);
        assert_eq!(size_of::<Copy>(), 40);
        assert_eq!(offset_of!(Copy, copy), 32);
        assert_eq!(size_of::<RangeMode>(), 32);
        assert_eq!(offset_of!(RangeMode, mode), 16);
        assert_eq!(offset_of!(RangeMode, result), 24);
        assert_eq!(size_of::<WriteProtect>(), 24);
        assert_eq!(size_of::<Msg>(), 32);
        assert_eq!(offset_of!(Msg, event), 0);
        // pagefault.flags at 8, .address at 16, .feat.ptid at 24;
        // remove.start at 8, .end at 16.
        assert_eq!(offset_of!(Msg, arg), 8);

        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(UFFDIO_CONTINUE, 0xc020_aa07);
    }

    /// Parses `#define NAME value` lines with simple values (`0x12`, `(1<<5)`,
    /// `((__u64)1<<2)`) out of a header.
    fn header_defines(text: &str) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(first)) = (words.next(), words.next()) else {
                continue;
            };
            let rest: String = std::iter::once(first).chain(words).collect();
            let value = rest.split("/*").next().unwrap_or("").replace("(__u64)", "");
            let value = value.trim_matches(|c| c == '(' || c == ')');
            let parsed = if let Some((a, b)) = value.split_once("<<") {
                match (a.trim().parse::<u64>(), b.trim().parse::<u32>()) {
                    (Ok(a), Ok(b)) => Some(a << b),
                    _ => None,
                }
            } else if let Some(hex) = value.strip_prefix("0x") {
                u64::from_str_radix(hex, 16).ok()
            } else {
                None
            };
            if let Some(v) = parsed {
                out.push((name.to_string(), v));
            }
        }
        out
    }

    /// Every constant the installed header defines agrees with ours. Newer
    /// bits (e.g. WP_UNPOPULATED) may be absent from an older header.
    #[test]
    fn constants_match_the_installed_header() {
        let path = "/usr/include/linux/userfaultfd.h";
        let Ok(text) = std::fs::read_to_string(path) else {
            eprintln!("SKIP: {path} not installed");
            return;
        };
        let ours: Vec<(String, u64)> = feature::NAMES
            .iter()
            .map(|(b, n)| (format!("UFFD_FEATURE_{n}"), *b))
            .chain(
                [
                    ("UFFD_API", UFFD_API),
                    ("UFFDIO_REGISTER_MODE_MISSING", REGISTER_MODE_MISSING),
                    ("UFFDIO_REGISTER_MODE_WP", REGISTER_MODE_WP),
                    ("UFFDIO_REGISTER_MODE_MINOR", REGISTER_MODE_MINOR),
                    ("UFFDIO_COPY_MODE_DONTWAKE", COPY_MODE_DONTWAKE),
                    ("UFFDIO_COPY_MODE_WP", COPY_MODE_WP),
                    ("UFFDIO_CONTINUE_MODE_WP", CONTINUE_MODE_WP),
                    ("UFFDIO_WRITEPROTECT_MODE_WP", WRITEPROTECT_MODE_WP),
                    ("UFFD_EVENT_PAGEFAULT", EVENT_PAGEFAULT.into()),
                    ("UFFD_EVENT_REMOVE", EVENT_REMOVE.into()),
                    ("UFFD_EVENT_FORK", 0x13),
                    ("UFFD_EVENT_REMAP", 0x14),
                    ("UFFD_EVENT_UNMAP", 0x16),
                    ("UFFD_PAGEFAULT_FLAG_WRITE", PAGEFAULT_FLAG_WRITE),
                    ("UFFD_PAGEFAULT_FLAG_WP", PAGEFAULT_FLAG_WP),
                    ("UFFD_PAGEFAULT_FLAG_MINOR", PAGEFAULT_FLAG_MINOR),
                    ("_UFFDIO_REGISTER", nr::REGISTER),
                    ("_UFFDIO_UNREGISTER", nr::UNREGISTER),
                    ("_UFFDIO_WAKE", nr::WAKE),
                    ("_UFFDIO_COPY", nr::COPY),
                    ("_UFFDIO_ZEROPAGE", nr::ZEROPAGE),
                    ("_UFFDIO_WRITEPROTECT", nr::WRITEPROTECT),
                    ("_UFFDIO_CONTINUE", nr::CONTINUE),
                    ("_UFFDIO_API", nr::API),
                ]
                .into_iter()
                .map(|(n, v)| (n.to_string(), v)),
            )
            .collect();
        let theirs = header_defines(&text);
        let mut checked = 0;
        for (name, value) in &ours {
            match theirs.iter().find(|(n, _)| n == name) {
                Some((_, v)) => {
                    assert_eq!(v, value, "{name}: header says {v:#x}, we say {value:#x}");
                    checked += 1;
                }
                None => eprintln!("note: {name} is not in {path} (older header)"),
            }
        }
        // The classic constants are in every header since Linux 5.13.
        assert!(checked >= 28, "only {checked} constants found in {path}");
    }
}
