//! The CUDA libraries, loaded at run time: the presence checks (the
//! driver with a device, NVRTC; cuBLAS optional) and the error of a failed
//! driver or library call.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;

use crate::{ModelError, Result};

/// A CUDA error (driver, cuBLAS, launch) as a model error.
pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> ModelError {
    ModelError::Cuda(format!("{what}: {e:?}"))
}

/// Checks the libraries the CUDA path needs: the driver with a device,
/// and NVRTC. The error names the missing one; never panics.
pub fn check_libraries() -> Result<()> {
    te_kernels::cuda::gpu_available().map_err(ModelError::Cuda)
}

/// cuBLAS on `stream` when `libcublas` loads; `None` (with a note on
/// stderr naming the library) otherwise.
pub(crate) fn load_cublas(stream: &Arc<CudaStream>) -> Option<CudaBlas> {
    // SAFETY: only tries to open the library.
    let present = std::panic::catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() });
    if !matches!(present, Ok(true)) {
        eprintln!(
            "note: libcublas not found on LD_LIBRARY_PATH: the products run on te-rs' GEMM kernel (crates/te-models/kernels/gemm.cu)"
        );
        return None;
    }
    match std::panic::catch_unwind(|| CudaBlas::new(stream.clone())) {
        Ok(Ok(blas)) => Some(blas),
        Ok(Err(e)) => {
            eprintln!(
                "note: cuBLAS failed to start ({e:?}): the products run on te-rs' GEMM kernel"
            );
            None
        }
        Err(_) => {
            eprintln!(
                "note: cuBLAS panicked while loading: the products run on te-rs' GEMM kernel"
            );
            None
        }
    }
}
