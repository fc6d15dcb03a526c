//! The CUDA driver side: load libcuda and libnvrtc at run time, compile the
//! kernels, and give each encoder its own stream, pinned staging buffer and
//! sleep-before-sync wait.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys::CUevent_flags, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use ferry_codec::{MAX_BATCH_PAGES, PAGE};

use crate::device::{Arg, Device, Kernel};
use crate::nvrtc::Nvrtc;
use crate::{GpuError, KERNELS_CU};

/// Threads per block: small enough that a 1024-page batch (16384 chunks)
/// spreads over many multiprocessors.
const BLOCK: u32 = 128;

fn driver(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver {
        what,
        detail: e.to_string(),
    }
}

/// GPU 0 with the codec kernels loaded; shared by the encoders of a migration.
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    functions: Vec<CudaFunction>,
    name: String,
}

impl CudaGpu {
    /// Loads the driver and NVRTC, opens GPU 0 and compiles the kernels;
    /// says plainly what is missing when it cannot.
    pub fn open() -> Result<Arc<CudaGpu>, GpuError> {
        // cudarc's loader panics on a library that lacks a symbol it expects
        // (a driver older than the API ferry is built against): that is one
        // more reason the backend cannot run, not a reason to stop the VMM.
        std::panic::catch_unwind(Self::open_inner).unwrap_or_else(|panic| {
            let detail = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the CUDA loader panicked".into());
            Err(GpuError::Driver {
                what: "library",
                detail,
            })
        })
    }

    fn open_inner() -> Result<Arc<CudaGpu>, GpuError> {
        // SAFETY: these only try to dlopen the libraries and resolve their symbols.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // ferry's own loader: cudarc's refuses NVRTC 13 (see nvrtc.rs).
        let nvrtc = Nvrtc::shared()?;
        let count = CudaContext::device_count().map_err(|e| match e.0 {
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => GpuError::NoDevice,
            _ => driver("device count")(e),
        })?;
        if count < 1 {
            return Err(GpuError::NoDevice);
        }
        let ctx = CudaContext::new(0).map_err(driver("context"))?;
        // Each encoder's buffers stay on its own stream: no cross-stream
        // events are needed (they would cost two driver calls per argument).
        // SAFETY: nothing is allocated yet, and no buffer is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "GPU 0".into());
        let ptx = Ptx::from_src(nvrtc.compile_ptx(KERNELS_CU)?);
        // A driver older than NVRTC cannot load its PTX; that fails here, plainly.
        let module = ctx
            .load_module(ptx)
            .map_err(driver("module load (is the driver older than NVRTC?)"))?;
        let functions = Kernel::ALL
            .iter()
            .map(|k| {
                module
                    .load_function(k.name())
                    .map_err(driver("kernel lookup"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Arc::new(CudaGpu {
            ctx,
            functions,
            name,
        }))
    }

    /// The GPU's name, as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A device handle with its own stream, for one encoder.
    pub fn device(self: &Arc<Self>) -> Result<CudaDevice, GpuError> {
        let stream = self.ctx.new_stream().map_err(driver("stream"))?;
        // SAFETY: the staging buffer is written (by `upload`) before any copy reads it.
        let staging = unsafe { self.ctx.alloc_pinned::<u8>(MAX_BATCH_PAGES * PAGE) }
            .map_err(driver("pinned allocation"))?;
        Ok(CudaDevice {
            gpu: self.clone(),
            stream,
            staging: RefCell::new(staging),
            started: RefCell::new(None),
            staged: Cell::new(false),
            shortest: Cell::new(None),
        })
    }
}

/// One stream on the GPU. Batches are uploaded through a pinned buffer, and
/// `fetch` sleeps for the shortest time a batch has taken on the GPU before it
/// synchronizes (the paper's sleep-before-sync: the CPU is not spent spinning).
pub struct CudaDevice {
    gpu: Arc<CudaGpu>,
    stream: Arc<CudaStream>,
    staging: RefCell<PinnedHostSlice<u8>>,
    /// When and where (an event) the current batch's work began.
    started: RefCell<Option<(Instant, CudaEvent)>>,
    /// A copy from the staging buffer may still be running (no fetch since).
    staged: Cell<bool>,
    /// The shortest GPU time of a batch so far.
    shortest: Cell<Option<Duration>>,
}

impl CudaDevice {
    /// Marks the start of a batch's work on the stream (its pages going up).
    fn begin(&self) -> Result<(), GpuError> {
        let event = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("event"))?;
        *self.started.borrow_mut() = Some((Instant::now(), event));
        Ok(())
    }

    /// The shortest time a batch has taken on the GPU (what `fetch` sleeps).
    pub fn shortest_batch(&self) -> Option<Duration> {
        self.shortest.get()
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        self.gpu.name()
    }
}

impl Device for CudaDevice {
    type Buf = CudaSlice<u8>;

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>, GpuError> {
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(driver("allocation"))
    }

    fn upload(&self, src: &[u8], dst: &mut CudaSlice<u8>) -> Result<(), GpuError> {
        // From pageable memory the driver copies `src` before it returns.
        self.stream
            .memcpy_htod(src, &mut dst.slice_mut(..src.len()))
            .map_err(driver("upload"))
    }

    fn upload_pages(&self, src: &[u8], dst: &mut CudaSlice<u8>) -> Result<(), GpuError> {
        let mut staging = self.staging.borrow_mut();
        if src.len() > staging.len() {
            return self.upload(src, dst);
        }
        // The copy from the staging buffer runs after this returns; a batch
        // that failed before its fetch may have left one running.
        if self.staged.get() {
            self.stream.synchronize().map_err(driver("synchronize"))?;
        }
        self.begin()?;
        let pinned = staging.as_mut_slice().map_err(driver("pinned buffer"))?;
        pinned[..src.len()].copy_from_slice(src);
        self.staged.set(true);
        self.stream
            .memcpy_htod(&pinned[..src.len()], &mut dst.slice_mut(..src.len()))
            .map_err(driver("upload"))
    }

    fn launch(
        &self,
        kernel: Kernel,
        threads: u32,
        args: &[Arg<'_, CudaSlice<u8>>],
    ) -> Result<(), GpuError> {
        let function =
            &self.gpu.functions[Kernel::ALL.iter().position(|&k| k == kernel).unwrap_or(0)];
        let mut launch = self.stream.launch_builder(function);
        for arg in args {
            match arg {
                Arg::Buf(buf) => launch.arg(*buf),
                Arg::U32(v) => launch.arg(v),
                Arg::U64(v) => launch.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(BLOCK).max(1), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments follow the kernel's parameter list in
        // kernels.cu (encoder.rs builds them; the emulation tests run the same
        // lists against a host build of the same source), and every buffer
        // holds what the launched threads index (sized for a full batch).
        unsafe { launch.launch(cfg) }.map_err(driver("kernel launch"))?;
        Ok(())
    }

    fn fetch(&self, src: &CudaSlice<u8>, dst: &mut [u8]) -> Result<(), GpuError> {
        if let Some((since, start)) = self.started.borrow_mut().take() {
            let end = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver("event"))?;
            // Sleep-before-sync: a batch never finishes sooner than the
            // shortest one did, so sleep that long instead of spinning.
            if let Some(left) = self
                .shortest
                .get()
                .and_then(|s| s.checked_sub(since.elapsed()))
            {
                std::thread::sleep(left);
            }
            self.stream.synchronize().map_err(driver("synchronize"))?;
            self.staged.set(false);
            let ms = start.elapsed_ms(&end).map_err(driver("event timing"))?;
            let took = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            self.shortest
                .set(Some(self.shortest.get().map_or(took, |s| s.min(took))));
        }
        if dst.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&src.slice(..dst.len()), dst)
            .map_err(driver("download"))?;
        self.stream.synchronize().map_err(driver("synchronize"))
    }
}
