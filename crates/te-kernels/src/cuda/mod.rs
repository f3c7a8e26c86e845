//! CUDA versions of the te-kernels ops, through `cudarc` with dynamic loading
//! (the crate builds and runs without CUDA installed; [`gpu_available`] says
//! whether a GPU can be used).
//!
//! Kernel sources live in the crate's `kernels/` (`rope.cu`, `kv_cache.cu`,
//! and `common.cuh`, which the kernels of te-attention and te-models include
//! too, through [`KernelSource::resolved`]), are embedded with `include_str!`,
//! and are compiled by NVRTC for the device's architecture once per process
//! (cached PTX) and loaded once per [`CudaDevice`]. Every op validates its
//! arguments on the host with the same checks as its CPU twin, then makes one
//! launch on the device's stream (plus one small host-to-device copy of the
//! per-call metadata); nothing is read back.

mod device;
mod kv_save;
mod rope;
mod source;

pub use device::{gpu_available, gpu_test_device, CudaDevice, CudaElement};
pub use kv_save::{
    convert_bshd_to_thd_cuda, convert_thd_to_bshd_cuda, save_kv_cuda, save_kv_cuda_planned,
    KvSavePlan, KV_CACHE_CU, KV_CACHE_THREADS, KV_SKIP,
};
pub use rope::{
    apply_rope_cuda, apply_rope_cuda_meta, apply_rope_cuda_out, CudaRopeTable, RopeMeta, ROPE_CU,
    ROPE_THREADS,
};
pub use source::{compile_ptx, KernelSource, COMMON_CUH};

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
