//! One GPU ([`CudaDevice`]: context, stream, loaded kernel modules),
//! whether one can be used ([`gpu_available`]), and the storage types its
//! kernels take ([`CudaElement`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::source::{compile_ptx, KernelSource};
use crate::{Element, KernelError};

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
