//! NVRTC, loaded at run time by ferry itself: the few calls that turn the
//! kernel source into PTX.
//!
//! cudarc's NVRTC loader insists on every symbol of the API version it was
//! built for, and NVRTC 13 dropped one of 12.0's (`nvrtcGetNVVM`), so on a
//! CUDA 13 machine it refused to load at all. The calls used here exist
//! unchanged from NVRTC 11.1 to 13, so this loader takes whichever
//! `libnvrtc` the machine has.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use libloading::{Library, Symbol};

use crate::GpuError;

/// The names tried, newest first; dlopen searches LD_LIBRARY_PATH and the
/// loader's cache for each (`libnvrtc.so` alone exists only with a toolkit).
const CANDIDATES: [&str; 5] = [
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
    "libnvrtc.so.11.1",
];

type Program = *mut c_void;
/// `nvrtcResult`: 0 is success.
type NvrtcResult = c_int;

type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
type GetSize = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
type GetText = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
#[cfg(test)]
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;

/// A loaded libnvrtc.
pub(crate) struct Nvrtc {
    lib: Library,
    /// Which file was loaded, for messages.
    name: &'static str,
}

impl Nvrtc {
    /// The process's libnvrtc, loaded on first use and kept loaded (a
    /// CUDA library is not one to unload and load again).
    pub(crate) fn shared() -> Result<&'static Nvrtc, GpuError> {
        static NVRTC: std::sync::OnceLock<Option<Nvrtc>> = std::sync::OnceLock::new();
        NVRTC
            .get_or_init(|| Nvrtc::load().ok())
            .as_ref()
            .ok_or(GpuError::NoNvrtc)
    }

    /// Loads the first libnvrtc the machine has; `NoNvrtc` when none.
    fn load() -> Result<Nvrtc, GpuError> {
        for name in CANDIDATES {
            // SAFETY: loading libnvrtc runs only its initialisers, which set
            // up no state that outlives a failed load or conflicts with ours.
            if let Ok(lib) = unsafe { Library::new(name) } {
                return Ok(Nvrtc { lib, name });
            }
        }
        Err(GpuError::NoNvrtc)
    }

    fn symbol<T>(&self, name: &'static str) -> Result<Symbol<'_, T>, GpuError> {
        // SAFETY: every `T` used is the C signature of the NVRTC function of
        // that name, unchanged from NVRTC 11.1 to 13.
        unsafe { self.lib.get::<T>(name.as_bytes()) }
            .map_err(|e| GpuError::Compile(format!("{} lacks {name}: {e}", self.name)))
    }

    /// NVRTC's version, `(major, minor)`.
    #[cfg(test)]
    pub(crate) fn version(&self) -> Result<(i32, i32), GpuError> {
        let version = self.symbol::<Version>("nvrtcVersion\0")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are to live integers.
        check("nvrtcVersion", unsafe { version(&mut major, &mut minor) })?;
        Ok((major, minor))
    }

    /// Compiles CUDA C++ `source` to PTX; a refusal carries NVRTC's log.
    pub(crate) fn compile_ptx(&self, source: &str) -> Result<String, GpuError> {
        let create = self.symbol::<CreateProgram>("nvrtcCreateProgram\0")?;
        let compile = self.symbol::<CompileProgram>("nvrtcCompileProgram\0")?;
        let log_size = self.symbol::<GetSize>("nvrtcGetProgramLogSize\0")?;
        let log = self.symbol::<GetText>("nvrtcGetProgramLog\0")?;
        let ptx_size = self.symbol::<GetSize>("nvrtcGetPTXSize\0")?;
        let ptx = self.symbol::<GetText>("nvrtcGetPTX\0")?;
        let destroy = self.symbol::<DestroyProgram>("nvrtcDestroyProgram\0")?;

        let source = CString::new(source)
            .map_err(|_| GpuError::Compile("the kernel source holds a NUL byte".into()))?;
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: `source` and the name are NUL-terminated and live through
        // the call; no headers are passed (count 0, null arrays).
        check("nvrtcCreateProgram", unsafe {
            create(
                &mut program,
                source.as_ptr(),
                c"kernels.cu".as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        let text = |size: &GetSize, get: &GetText| -> Result<String, GpuError> {
            let mut len = 0usize;
            // SAFETY: `program` is the live program created above.
            check("nvrtcGet*Size", unsafe { size(program, &mut len) })?;
            let mut buf = vec![0u8; len.max(1)];
            // SAFETY: `buf` holds the `len` bytes NVRTC said it would write.
            check("nvrtcGet*", unsafe {
                get(program, buf.as_mut_ptr().cast())
            })?;
            let text = CStr::from_bytes_until_nul(&buf)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| String::from_utf8_lossy(&buf).into_owned());
            Ok(text)
        };
        // SAFETY: `program` is live; no options are passed (count 0, null array).
        let compiled = unsafe { compile(program, 0, std::ptr::null()) };
        let result = if compiled == 0 {
            text(&ptx_size, &ptx)
        } else {
            let log = text(&log_size, &log).unwrap_or_default();
            Err(GpuError::Compile(format!(
                "{} refused it (result {compiled}): {log}",
                self.name
            )))
        };
        // SAFETY: `program` was created above and is not used after this.
        unsafe { destroy(&mut program) };
        result
    }
}

fn check(call: &str, result: NvrtcResult) -> Result<(), GpuError> {
    if result == 0 {
        Ok(())
    } else {
        Err(GpuError::Compile(format!(
            "{call} failed (result {result})"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where this machine has an NVRTC (a GPU is not needed), the kernels
    /// compile to PTX that defines every kernel ferry launches.
    #[test]
    fn the_kernels_compile_with_this_machines_nvrtc() {
        let nvrtc = match Nvrtc::shared() {
            Ok(n) => n,
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        eprintln!("NVRTC {:?} from {}", nvrtc.version().unwrap(), nvrtc.name);
        let ptx = nvrtc.compile_ptx(crate::KERNELS_CU).expect("compile");
        for kernel in crate::Kernel::ALL {
            assert!(
                ptx.contains(&format!(".entry {}", kernel.name())),
                "no {} in the PTX",
                kernel.name()
            );
        }
        let refused = nvrtc.compile_ptx("__global__ void k() { this is not C++ }");
        match refused {
            Err(GpuError::Compile(log)) => assert!(log.contains("refused"), "{log}"),
            other => panic!("expected a refusal, got {:?}", other.map(|p| p.len())),
        }
    }
}
