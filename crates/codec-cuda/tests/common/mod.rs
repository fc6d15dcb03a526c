//! A host build of kernels.cu behind the `Device` trait (every launch runs
//! its threads one after another), and page generators for the comparisons
//! with the CPU codecs.

#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use ferry_codec::{CacheSizes, EncodedBatch, Method, StreamDecoder, StreamEncoder, PAGE};
use ferry_codec_cuda::{Arg, Device, GpuEncoder, GpuError, Kernel};

/// A zeroed, 8-byte aligned host allocation standing in for device memory.
pub struct EmuBuf {
    ptr: *mut u8,
    layout: Layout,
}

impl Drop for EmuBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc` with this layout, freed once.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

type Entry = unsafe extern "C" fn(u32, *const u64);

/// The kernels compiled for the host, loaded.
pub struct EmuDevice {
    lib: Arc<libloading::Library>,
}

/// Builds and loads the host kernels once; `None` (after saying why) when
/// there is no C++ compiler here.
pub fn emu() -> Option<EmuDevice> {
    static LIB: OnceLock<Option<Arc<libloading::Library>>> = OnceLock::new();
    let lib = LIB.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ferry-kernels-emu.so");
        let kernels = dir.join("src/kernels.cu");
        let built = Command::new("c++")
            .args([
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-Wall",
                "-Wextra",
                "-Werror",
            ])
            .arg(format!("-DKERNELS=\"{}\"", kernels.display()))
            .arg(dir.join("tests/emu/shim.cpp"))
            .arg("-o")
            .arg(&out)
            .status();
        match built {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("compiling kernels.cu for the host failed ({s})"),
            Err(e) => {
                eprintln!(
                    "SKIPPED: no C++ compiler (c++: {e}); the GPU kernels cannot be emulated here"
                );
                return None;
            }
        }
        // SAFETY: our own library, built just now; its constructors do nothing.
        Some(Arc::new(
            unsafe { libloading::Library::new(&out) }.expect("load the host kernels"),
        ))
    });
    lib.as_ref().map(|lib| EmuDevice { lib: lib.clone() })
}

impl Device for EmuDevice {
    type Buf = EmuBuf;

    fn alloc(&self, bytes: usize) -> Result<EmuBuf, GpuError> {
        let layout = Layout::from_size_align(bytes.max(1), 8).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Ok(EmuBuf { ptr, layout })
    }

    fn upload(&self, src: &[u8], dst: &mut EmuBuf) -> Result<(), GpuError> {
        assert!(src.len() <= dst.layout.size(), "upload past the buffer");
        // SAFETY: `dst` holds at least src.len() bytes (checked) and does not overlap `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr, src.len()) };
        Ok(())
    }

    fn launch(
        &self,
        kernel: Kernel,
        threads: u32,
        args: &[Arg<'_, EmuBuf>],
    ) -> Result<(), GpuError> {
        let words: Vec<u64> = args
            .iter()
            .map(|a| match a {
                Arg::Buf(b) => b.ptr as u64,
                Arg::U32(v) => u64::from(*v),
                Arg::U64(v) => *v,
            })
            .collect();
        let name = format!("emu_{}", kernel.name());
        // SAFETY: the shim exports every kernel under this name with this signature.
        let entry = unsafe { self.lib.get::<Entry>(name.as_bytes()) }.expect("kernel entry");
        // SAFETY: the words are the kernel's arguments in order (pointers to
        // live allocations sized for a full batch), as on the GPU.
        unsafe { entry(threads, words.as_ptr()) };
        Ok(())
    }

    fn fetch(&self, src: &EmuBuf, dst: &mut [u8]) -> Result<(), GpuError> {
        assert!(dst.len() <= src.layout.size(), "fetch past the buffer");
        // SAFETY: `src` holds at least dst.len() bytes (checked); no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A page of one of several kinds: zero, random, text-like, sparse,
/// constant, ramp, mostly-zero with a random tail.
pub fn page(rng: &mut Rng, kind: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE];
    match kind % 7 {
        0 => {}
        1 => p.iter_mut().for_each(|b| *b = rng.next() as u8),
        2 => {
            let words: [&[u8]; 6] = [b"ferry ", b"migrate ", b"page ", b"dirty ", b"the ", b"\n"];
            let mut at = 0;
            while at < PAGE {
                let w = words[rng.below(6) as usize];
                let n = w.len().min(PAGE - at);
                p[at..at + n].copy_from_slice(&w[..n]);
                at += n;
            }
        }
        3 => {
            for _ in 0..rng.below(40) {
                p[rng.below(PAGE as u64) as usize] = rng.next() as u8;
            }
        }
        4 => p.fill(rng.next() as u8 | 1),
        5 => p
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i / 3) as u8),
        _ => {
            let from = rng.below(PAGE as u64) as usize;
            p[from..].iter_mut().for_each(|b| *b = rng.next() as u8);
        }
    }
    p
}

/// Encodes every batch on both, asserts equal output, and decodes the GPU's.
pub fn same_as_cpu<D: Device>(dev: D, sizes: CacheSizes, batches: &[(Method, Vec<u64>, Vec<u8>)]) {
    let mut gpu = GpuEncoder::new(dev, sizes).expect("encoder");
    let mut cpu = StreamEncoder::new(sizes);
    let mut dec = StreamDecoder::new(sizes);
    let (mut g, mut c) = (EncodedBatch::default(), EncodedBatch::default());
    for (i, (method, pages, data)) in batches.iter().enumerate() {
        gpu.encode(*method, pages, data, &mut g)
            .expect("gpu encode");
        cpu.encode(*method, pages, data, &mut c)
            .expect("cpu encode");
        assert_eq!(g.codecs, c.codecs, "batch {i} ({method}): codecs differ");
        assert_eq!(g.lens, c.lens, "batch {i} ({method}): lengths differ");
        assert!(
            g.payload == c.payload,
            "batch {i} ({method}): payloads differ"
        );
        let mut back = vec![0u8; data.len()];
        dec.decode_batch(*method, pages, &g, &mut back)
            .expect("decode");
        assert!(
            &back == data,
            "batch {i} ({method}): decodes to other pages"
        );
    }
}

pub fn batch(rng: &mut Rng, n: usize, index_space: u64) -> (Vec<u64>, Vec<u8>) {
    let pages: Vec<u64> = (0..n).map(|_| rng.below(index_space)).collect();
    let kind = rng.next();
    let data = (0..n)
        .flat_map(|i| page(rng, kind.wrapping_add(i as u64 / 3)))
        .collect();
    (pages, data)
}

/// Pages re-sent with small changes, indices repeating within and across
/// batches, a cache small enough to evict: hits, misses, overflows, LRU.
pub fn resends(
    rng: &mut Rng,
    rounds: usize,
    n: usize,
    space: u64,
) -> Vec<(Method, Vec<u64>, Vec<u8>)> {
    let mut current: Vec<Vec<u8>> = (0..space).map(|i| page(rng, i)).collect();
    let mut out = Vec::new();
    for _ in 0..rounds {
        let pages: Vec<u64> = (0..n).map(|_| rng.below(space)).collect();
        let mut data = Vec::new();
        for &p in &pages {
            for _ in 0..rng.below(12) {
                let at = rng.below(PAGE as u64) as usize;
                current[p as usize][at] = rng.next() as u8;
            }
            if rng.below(10) == 0 {
                let kind = rng.next();
                current[p as usize] = page(rng, kind);
            }
            data.extend_from_slice(&current[p as usize]);
        }
        out.push((Method::Xbzrle, pages, data));
    }
    out
}

/// Pages made of chunks from a small pool: hits across and within batches.
pub fn pooled(
    rng: &mut Rng,
    batches: usize,
    n: usize,
    pool: usize,
) -> Vec<(Method, Vec<u64>, Vec<u8>)> {
    let chunks: Vec<Vec<u8>> = (0..pool)
        .map(|i| page(rng, i as u64 + 1)[..256].to_vec())
        .collect();
    (0..batches)
        .map(|b| {
            let pages: Vec<u64> = (0..n as u64).map(|i| b as u64 * n as u64 + i).collect();
            let data = (0..n)
                .flat_map(|_| {
                    let kind = rng.below(4);
                    (0..16)
                        .flat_map(|_| match kind {
                            0 => vec![0u8; 256],
                            1 => page(rng, 1)[..256].to_vec(),
                            _ => chunks[rng.below(pool as u64) as usize].clone(),
                        })
                        .collect::<Vec<u8>>()
                })
                .collect();
            (Method::Dedup, pages, data)
        })
        .collect()
}
