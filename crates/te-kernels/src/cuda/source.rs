//! Kernel sources: a `kernels/*.cu` file of the crate that launches it
//! (te-kernels, te-attention, te-models), with te-kernels'
//! `kernels/common.cuh` resolved ([`KernelSource`]), and its NVRTC
//! compilation to PTX ([`compile_ptx`]).

use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::KernelError;

/// A kernel source file (`kernels/*.cu` of the crate that launches it,
/// embedded with `include_str!`), with `#include "common.cuh"` resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// File name, e.g. `rope.cu` (also the NVRTC program name).
    pub name: &'static str,
    /// The file's text.
    pub text: &'static str,
}

/// te-kernels' `kernels/common.cuh`: storage types and conversions shared
/// by the kernels of every crate.
pub const COMMON_CUH: &str = include_str!("../../kernels/common.cuh");

impl KernelSource {
    /// The source with `#include "common.cuh"` replaced by [`COMMON_CUH`]
    /// (NVRTC at run time has no file system to search).
    pub fn resolved(&self) -> String {
        self.text.replace("#include \"common.cuh\"", COMMON_CUH)
    }
}

/// Compiles `src` to PTX with NVRTC for `arch` (e.g. `compute_80`), with
/// `include_paths` searched for `#include`s. Errors carry NVRTC's log.
/// Used at run time by [`CudaDevice`](crate::cuda::CudaDevice) and by `cargo xtask kernels`.
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
