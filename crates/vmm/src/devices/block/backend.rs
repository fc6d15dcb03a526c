//! A disk's local raw image file ([`RawFile`]), and what every backend
//! shares (its errors, [`HostSeg`]); `backends.rs` chooses between it and
//! an NBD export (`nbd.rs`). Reads and writes of an image go straight
//! between the file and guest memory, with `O_DIRECT` where the file system
//! allows it and the request is aligned for it (the host's page cache then
//! holds no second copy of the guest's disk), buffered otherwise; flush is
//! `fdatasync`; discard and write-zeroes punch holes.
//!
//! Mixing the two descriptors on one file stays coherent: a direct read
//! first writes back what buffered writes left in the page cache for its
//! range, and a direct write drops the cached pages it covers.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::spec::{DiskSource, DiskSpec, SECTOR};

/// Alignment (file offset, length and memory address) a request needs to
/// go through `O_DIRECT`. A page: what every Linux file system accepts.
pub const DIRECT_ALIGN: u64 = 4096;

/// Why a disk's image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No such file, and no `create`.
    #[error("disk image {path} does not exist (add ',create' with a size to create it: {path},size=SIZE,create)")]
    Missing {
        /// The image.
        path: PathBuf,
    },
    /// The file is shorter than the size declared for the disk.
    #[error(
        "disk image {path} holds {have} bytes, shorter than its declared size of {declared} bytes"
    )]
    TooShort {
        /// The image.
        path: PathBuf,
        /// Its length.
        have: u64,
        /// The declared size.
        declared: u64,
    },
    /// A size the device cannot present (empty, or not whole sectors).
    #[error("disk image {path}: its size of {size} bytes is not a positive multiple of 512")]
    BadSize {
        /// The image.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// Neither a regular file nor a block device.
    #[error("disk image {path} is not a regular file or a block device")]
    NotAFile {
        /// The image.
        path: PathBuf,
    },
    /// The NBD export could not be used (the server refused, is not
    /// there, or the export does not fit the disk).
    #[error("disk {uri}: {reason}")]
    Nbd {
        /// The export's address.
        uri: String,
        /// Why, in words.
        reason: String,
    },
    /// The OS refused.
    #[error("disk image {path}: {op}: {source}")]
    Io {
        /// The image.
        path: PathBuf,
        /// What was tried.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// One piece of guest memory a request reads into or writes from, by its
/// host address.
#[derive(Clone, Copy, Debug)]
pub struct HostSeg {
    /// Host address of the first byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
}

// SAFETY: a HostSeg points into guest RAM (a shared mapping the device
// keeps alive through its Arc of the guest memory for as long as any
// request exists); the pointer is only dereferenced by the kernel in
// pread/pwrite, so moving it to an I/O thread is sound.
unsafe impl Send for HostSeg {}

/// A raw image file.
pub struct RawFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    size: u64,
}

impl RawFile {
    /// Opens (or creates) the image a spec names, checks its size, and
    /// finds out whether `O_DIRECT` works on it.
    pub fn open(spec: &DiskSpec) -> Result<Self, BackendError> {
        let path = match &spec.source {
            DiskSource::Image(p) => p.clone(),
            DiskSource::Nbd(uri) => {
                return Err(BackendError::Nbd {
                    uri: uri.clone(),
                    reason: "not an image file".into(),
                })
            }
        };
        let io_err = |op| {
            let path = path.clone();
            move |source| BackendError::Io { path, op, source }
        };
        let exists = match std::fs::metadata(&path) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_err("stat")(e)),
        };
        if !exists {
            let (true, Some(size)) = (spec.create, spec.size) else {
                return Err(BackendError::Missing { path });
            };
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(io_err("create"))?;
            f.set_len(size).map_err(io_err("set the length of"))?;
        }
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err("open"))?;
        let meta = buffered.metadata().map_err(io_err("stat"))?;
        let have = if meta.file_type().is_block_device() {
            block_device_size(&buffered).map_err(io_err("BLKGETSIZE64"))?
        } else if meta.is_file() {
            meta.len()
        } else {
            return Err(BackendError::NotAFile { path });
        };
        let size = spec.size.unwrap_or(have);
        if size == 0 || !size.is_multiple_of(SECTOR) {
            return Err(BackendError::BadSize { path, size });
        }
        if have < size {
            return Err(BackendError::TooShort {
                path,
                have,
                declared: size,
            });
        }
        let direct = open_direct(&path, size);
        Ok(RawFile {
            path,
            buffered,
            direct,
            size,
        })
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The image.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if aligned requests go through `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor for a request at `offset` over `segs`.
    fn file_for(&self, offset: u64, segs: &[HostSeg]) -> &File {
        let aligned = |v: u64| v.is_multiple_of(DIRECT_ALIGN);
        match &self.direct {
            Some(d)
                if aligned(offset)
                    && segs
                        .iter()
                        .all(|s| aligned(s.ptr as u64) && aligned(s.len as u64)) =>
            {
                d
            }
            _ => &self.buffered,
        }
    }

    /// Reads the disk from `offset` into `segs`, in order.
    pub fn read(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        let fd = self.file_for(offset, segs).as_raw_fd();
        transfer(
            offset,
            segs,
            io::ErrorKind::UnexpectedEof,
            |ptr, len, at| {
                // SAFETY: `ptr` is guest memory the request owns (HostSeg); the
                // kernel writes at most `len` bytes after it.
                unsafe { libc::pread(fd, ptr.cast(), len, at) }
            },
        )
    }

    /// Writes `segs`, in order, to the disk from `offset`.
    pub fn write(&self, offset: u64, segs: &[HostSeg]) -> io::Result<()> {
        let fd = self.file_for(offset, segs).as_raw_fd();
        transfer(offset, segs, io::ErrorKind::WriteZero, |ptr, len, at| {
            // SAFETY: as in `read`; the kernel only reads the bytes.
            unsafe { libc::pwrite(fd, ptr.cast(), len, at) }
        })
    }

    /// Makes every completed write durable.
    pub fn flush(&self) -> io::Result<()> {
        self.buffered.sync_data()
    }

    /// Zeroes `len` bytes from `offset`: a punched hole where the file
    /// system has them, else written zeros. Reads return zeros after.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let fd = self.buffered.as_raw_fd();
        // SAFETY: fallocate on our own descriptor with plain integers.
        let r = unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let zeros = vec![0u8; 64 << 10];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(zeros.len() as u64) as usize;
            let seg = HostSeg {
                ptr: zeros.as_ptr() as *mut u8,
                len: n,
            };
            // The buffered descriptor: the buffer is not aligned for direct I/O.
            let mut done = 0;
            while done < n {
                // SAFETY: `seg` is our own buffer of `n` bytes, only read.
                let w = unsafe {
                    libc::pwrite(
                        fd,
                        seg.ptr.add(done).cast(),
                        n - done,
                        (at + done as u64) as libc::off_t,
                    )
                };
                if w <= 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                    continue;
                }
                done += w as usize;
            }
            at += n as u64;
        }
        Ok(())
    }

    /// The guest no longer needs `len` bytes from `offset`. Reads of a
    /// discarded range return zeros here (a hole), which the spec allows.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len)
    }
}

/// The image opened with `O_DIRECT`, if the file system takes it: the
/// open and one aligned read must both work (some accept the flag at open
/// and refuse the I/O).
fn open_direct(path: &Path, size: u64) -> Option<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()?;
    if size < DIRECT_ALIGN {
        return None;
    }
    let layout =
        std::alloc::Layout::from_size_align(DIRECT_ALIGN as usize, DIRECT_ALIGN as usize).ok()?;
    // SAFETY: a non-zero-sized layout.
    let buf = unsafe { std::alloc::alloc(layout) };
    if buf.is_null() {
        return None;
    }
    // SAFETY: `buf` holds DIRECT_ALIGN bytes, aligned for O_DIRECT.
    let n = unsafe { libc::pread(f.as_raw_fd(), buf.cast(), DIRECT_ALIGN as usize, 0) };
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    (n == DIRECT_ALIGN as isize).then_some(f)
}

fn block_device_size(f: &File) -> io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Moves `segs`, in order, from file offset `offset` on with `io` (one
/// pread or pwrite: pointer, length, file offset; its return value),
/// through short transfers and interrupted calls; a call that moves
/// nothing is `none`.
fn transfer(
    offset: u64,
    segs: &[HostSeg],
    none: io::ErrorKind,
    io: impl Fn(*mut u8, usize, libc::off_t) -> isize,
) -> io::Result<()> {
    let mut at = offset;
    for s in segs {
        let mut done = 0usize;
        while done < s.len {
            // (`done < s.len`: the pointer stays inside the segment.)
            let n = io(
                s.ptr.wrapping_add(done),
                s.len - done,
                (at + done as u64) as libc::off_t,
            );
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(none.into()),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        at += s.len as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-blk-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    fn spec(path: &Path, size: Option<u64>, create: bool) -> DiskSpec {
        DiskSpec {
            source: DiskSource::Image(path.into()),
            size,
            create,
        }
    }

    #[test]
    fn a_missing_image_without_create_is_refused() {
        let p = tmp("missing");
        let e = RawFile::open(&spec(&p, Some(1 << 20), false))
            .err()
            .unwrap();
        assert!(matches!(e, BackendError::Missing { .. }), "{e}");
        assert!(e.to_string().contains("does not exist"));
    }

    #[test]
    fn a_short_image_is_refused() {
        let p = tmp("short");
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        let e = RawFile::open(&spec(&p, Some(1 << 20), false))
            .err()
            .unwrap();
        assert!(
            matches!(
                e,
                BackendError::TooShort {
                    have: 4096,
                    declared: 1048576,
                    ..
                }
            ),
            "{e}"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn create_makes_a_sparse_image_that_reads_and_writes() {
        let p = tmp("create");
        let f = RawFile::open(&spec(&p, Some(1 << 20), true)).unwrap();
        assert_eq!(f.size(), 1 << 20);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        // An aligned buffer (direct where the file system allows) and an
        // unaligned one (always buffered).
        let layout = std::alloc::Layout::from_size_align(8192, 4096).unwrap();
        // SAFETY: non-zero layout; freed below.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        // SAFETY: buf holds 8192 bytes.
        unsafe { std::ptr::write_bytes(buf, 0xab, 8192) };
        let seg = HostSeg {
            ptr: buf,
            len: 4096,
        };
        f.write(8192, &[seg]).unwrap();
        let odd = HostSeg {
            // SAFETY: inside the 8192-byte buffer.
            ptr: unsafe { buf.add(4096 + 7) },
            len: 512,
        };
        f.write(512, &[odd]).unwrap();
        f.flush().unwrap();
        let data = std::fs::read(&p).unwrap();
        assert!(data[8192..12288].iter().all(|b| *b == 0xab));
        assert!(data[512..1024].iter().all(|b| *b == 0xab));
        assert!(data[1024..8192].iter().all(|b| *b == 0));
        // SAFETY: buf holds 8192 bytes.
        unsafe { std::ptr::write_bytes(buf, 0, 8192) };
        f.read(8192, &[seg]).unwrap();
        // SAFETY: buf holds 8192 bytes, initialised.
        let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
        assert!(back.iter().all(|b| *b == 0xab));
        f.write_zeroes(8192, 4096).unwrap();
        f.read(8192, &[seg]).unwrap();
        // SAFETY: as above.
        let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
        assert!(back.iter().all(|b| *b == 0));
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(buf, layout) };
        // A second create of an existing file keeps its data.
        let again = RawFile::open(&spec(&p, Some(1 << 20), true)).unwrap();
        assert_eq!(again.size(), 1 << 20);
        std::fs::remove_file(&p).unwrap();
    }
}
