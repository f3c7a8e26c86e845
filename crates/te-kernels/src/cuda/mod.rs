//! CUDA versions of the te-kernels ops, through `cudarc` with dynamic loading
//! (the crate builds and runs without CUDA installed; [`gpu_available`] says
//! whether a GPU can be used).
//!
//! Kernel sources live in `kernels/*.cu`, are embedded with `include_str!`,
//! and are compiled by NVRTC for the device's architecture once per process
//! (cached PTX) and loaded once per [`CudaDevice`]. Every op validates its
//! arguments on the host with the same checks as its CPU twin, then makes one
//! launch on the device's stream (plus one small host-to-device copy of the
//! per-call metadata); nothing is read back.

mod kv_save;
mod rope;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

pub use kv_save::{
    convert_bshd_to_thd_cuda, convert_thd_to_bshd_cuda, save_kv_cuda, save_kv_cuda_planned,
    KvSavePlan, KV_SKIP,
};
pub use rope::{
    apply_rope_cuda, apply_rope_cuda_meta, apply_rope_cuda_out, CudaRopeTable, RopeMeta,
};

use crate::{Element, KernelError};

/// A kernel source file of `kernels/`, with `#include "common.cuh"` resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// File name, e.g. `rope.cu` (also the NVRTC program name).
    pub name: &'static str,
    /// The file's text.
    pub text: &'static str,
}

/// How the host launches one kernel family: the numbers `cargo xtask
/// kernels` checks ptxas' register and shared-memory report against
/// (registers x threads per block within the register file, static plus
/// dynamic shared memory within the architecture's per-block limit). The
/// launch code uses the same constants, so the check cannot drift from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// The kernel's name without its dtype suffix (`rope_fwd` for
    /// `rope_fwd_bf16`).
    pub kernel: &'static str,
    /// Threads per block.
    pub threads_per_block: u32,
    /// The most dynamic shared memory one launch asks for, in bytes.
    pub max_dynamic_shared_bytes: u32,
}

/// Threads per block of `rope_fwd_*`.
pub const ROPE_THREADS: u32 = 128;
/// Threads per block of `kv_save_*` and the thd<->bshd conversions.
pub const KV_CACHE_THREADS: u32 = 128;

/// The launch shapes of the kernels in `rope.cu` and `kv_cache.cu`.
pub const LAUNCHES: &[LaunchShape] = &[
    LaunchShape {
        kernel: "rope_fwd",
        threads_per_block: ROPE_THREADS,
        max_dynamic_shared_bytes: 0,
    },
    LaunchShape {
        kernel: "kv_save",
        threads_per_block: KV_CACHE_THREADS,
        max_dynamic_shared_bytes: 0,
    },
    LaunchShape {
        kernel: "convert_thd_to_bshd",
        threads_per_block: KV_CACHE_THREADS,
        max_dynamic_shared_bytes: 0,
    },
    LaunchShape {
        kernel: "convert_bshd_to_thd",
        threads_per_block: KV_CACHE_THREADS,
        max_dynamic_shared_bytes: 0,
    },
];

/// `kernels/common.cuh`: storage types and conversions shared by all kernels.
pub const COMMON_CUH: &str = include_str!("../../../../kernels/common.cuh");
/// `kernels/rope.cu`.
pub const ROPE_CU: KernelSource = KernelSource {
    name: "rope.cu",
    text: include_str!("../../../../kernels/rope.cu"),
};
/// `kernels/kv_cache.cu`.
pub const KV_CACHE_CU: KernelSource = KernelSource {
    name: "kv_cache.cu",
    text: include_str!("../../../../kernels/kv_cache.cu"),
};

impl KernelSource {
    /// The source with `#include "common.cuh"` replaced by [`COMMON_CUH`]
    /// (NVRTC at run time has no file system to search).
    pub fn resolved(&self) -> String {
        self.text.replace("#include \"common.cuh\"", COMMON_CUH)
    }
}

/// Compiles `src` to PTX with NVRTC for `arch` (e.g. `compute_80`), with
/// `include_paths` searched for `#include`s. Errors carry NVRTC's log.
/// Used at run time by [`CudaDevice`] and by `cargo xtask kernels`.
pub fn compile_ptx(
    name: &str,
    src: &str,
    arch: &str,
    include_paths: &[String],
) -> Result<Ptx, KernelError> {
    // SAFETY: only checks that the library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::Cuda(
            "libnvrtc not found (set LD_LIBRARY_PATH to the CUDA lib dir)".into(),
        ));
    }
    let opts = CompileOptions {
        name: Some(name.to_string()),
        include_paths: include_paths.to_vec(),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => KernelError::Cuda(format!(
            "NVRTC failed on {name} for {arch}: {nvrtc:?}\n{}",
            log.to_string_lossy()
        )),
        other => KernelError::Cuda(format!("NVRTC failed on {name} for {arch}: {other}")),
    })
}

/// Whether a GPU can be used: libcuda and libnvrtc load and device 0 exists.
/// `Err` says why not. Never panics.
pub fn gpu_available() -> Result<(), String> {
    // SAFETY: these only try to open the libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda not found (no NVIDIA driver)".into());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc not found (no CUDA runtime libraries on LD_LIBRARY_PATH)".into());
    }
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(Ok(_)) => Err("the CUDA driver reports no device".into()),
        Ok(Err(e)) => Err(format!("CUDA driver initialization failed: {e}")),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(format!("the CUDA driver panicked while loading: {why}"))
        }
    }
}

/// Device 0 for a GPU test. Device tests are `#[ignore = "needs a CUDA GPU:
/// cargo xtask test --gpu"]` and run only when asked for (`cargo xtask test
/// --gpu`, `-- --ignored`, the GPU bundle), so a missing or unusable GPU
/// panics with the reason: a device test never passes without a device.
pub fn gpu_test_device() -> CudaDevice {
    let why = match gpu_available() {
        Ok(()) => match CudaDevice::new(0) {
            Ok(dev) => return dev,
            Err(e) => e.to_string(),
        },
        Err(why) => why,
    };
    panic!("this device test was asked to run, but there is no usable GPU: {why}");
}

/// A storage type the CUDA kernels handle; `SUFFIX` names the kernel
/// instance (`rope_fwd_bf16`).
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits {
    const SUFFIX: &'static str;
}
impl CudaElement for f32 {
    const SUFFIX: &'static str = "f32";
}
impl CudaElement for half::f16 {
    const SUFFIX: &'static str = "f16";
}
impl CudaElement for half::bf16 {
    const SUFFIX: &'static str = "bf16";
}

/// PTX per (kernel file, arch), compiled once per process.
fn ptx_cache() -> &'static Mutex<HashMap<(&'static str, String), String>> {
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, String), String>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// One GPU: its context, a stream every op launches on, and the kernel
/// modules loaded so far (other crates' kernels load through
/// [`CudaDevice::function`] too).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .finish()
    }
}

pub(crate) fn cuda_err(e: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{e:?}"))
}

impl CudaDevice {
    /// Opens GPU `ordinal` with its default stream. Errors (never panics)
    /// when no GPU or CUDA library is present.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        gpu_available().map_err(KernelError::Cuda)?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let stream = ctx.default_stream();
        Ok(Self {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// GPU `ordinal` on a stream of its own (not the legacy default stream,
    /// which cannot be captured into a CUDA graph), with cudarc's event
    /// tracking off: every buffer is used on this one stream, whose order
    /// is the synchronization, and a captured launch then waits on no
    /// event recorded outside the capture. Errors as [`CudaDevice::new`].
    pub fn new_capturable(ordinal: usize) -> Result<Self, KernelError> {
        gpu_available().map_err(KernelError::Cuda)?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        // SAFETY: before any buffer of this context exists; every buffer of
        // this device lives on its one stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let stream = ctx.new_stream().map_err(cuda_err)?;
        Ok(Self {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op of this device launches on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// NVRTC architecture of this GPU, e.g. `compute_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Kernel `name` of `source`, compiling (once per process) and loading
    /// (once per device) the module on first use.
    pub fn function(&self, source: KernelSource, name: &str) -> Result<CudaFunction, KernelError> {
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| KernelError::Cuda("module cache poisoned".into()))?;
        let module = match modules.get(source.name) {
            Some(m) => m.clone(),
            None => {
                let ptx = {
                    let mut cache = ptx_cache()
                        .lock()
                        .map_err(|_| KernelError::Cuda("PTX cache poisoned".into()))?;
                    let key = (source.name, self.arch.clone());
                    match cache.get(&key) {
                        Some(p) => p.clone(),
                        None => {
                            let p = compile_ptx(source.name, &source.resolved(), &self.arch, &[])?
                                .to_src();
                            cache.insert(key, p.clone());
                            p
                        }
                    }
                };
                let m = self.ctx.load_module(Ptx::from_src(ptx)).map_err(cuda_err)?;
                modules.insert(source.name, m.clone());
                m
            }
        };
        module.load_function(name).map_err(cuda_err)
    }
}
