//! KV-cache save and thd <-> bshd conversions on the GPU
//! (`kernels/kv_cache.cu`), same arguments and checks as the CPU ops.

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};

use super::device::{cuda_err, CudaDevice, CudaElement};
use super::source::KernelSource;
use crate::kv_save::plan_save;
use crate::{ConvertArgs, KernelError, KvCacheLayout, KvStep};

/// `kernels/kv_cache.cu`.
pub const KV_CACHE_CU: KernelSource = KernelSource {
    name: "kv_cache.cu",
    text: include_str!("../../kernels/kv_cache.cu"),
};

/// Threads per block of `kv_save_*` and the thd<->bshd conversions.
pub const KV_CACHE_THREADS: u32 = 128;

/// Mirror of `KvSaveParams` in `kernels/kv_cache.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct KvSaveParams {
    row_k: i64,
    row_v: i64,
}
// SAFETY: plain-old-data with the kernel's `repr(C)` layout.
unsafe impl DeviceRepr for KvSaveParams {}

/// Mirror of `ConvertParams` in `kernels/kv_cache.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvertParams {
    row: i64,
    batch: i32,
    max_seqlen: i32,
}
// SAFETY: plain-old-data with the kernel's `repr(C)` layout.
unsafe impl DeviceRepr for ConvertParams {}

fn grid(op: &'static str, rows: usize) -> Result<LaunchConfig, KernelError> {
    let g = u32::try_from(rows)
        .ok()
        .filter(|&g| g < i32::MAX as u32)
        .ok_or_else(|| KernelError::InvalidArgument {
            op,
            arg: "rows",
            reason: format!("{rows} rows is too many"),
        })?;
    Ok(LaunchConfig {
        grid_dim: (g, 1, 1),
        block_dim: (KV_CACHE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// [`crate::save_kv_cpu`] on the GPU: same arguments (the layout's page table
/// and lengths are host slices; the host resolves them into the list of row
/// copies, uploads it once and launches once). Asynchronous on `dev.stream()`.
pub fn save_kv_cuda<T: CudaElement>(
    dev: &CudaDevice,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    k_cache: &mut CudaSlice<T>,
    v_cache: &mut CudaSlice<T>,
    layout: &KvCacheLayout,
    step: &KvStep,
) -> Result<(), KernelError> {
    let plan = KvSavePlan::new(
        [k.len(), v.len(), k_cache.len(), v_cache.len()],
        layout,
        step,
    )?;
    if plan.rows() == 0 {
        return Ok(());
    }
    let pairs = dev.stream().clone_htod(plan.pairs()).map_err(cuda_err)?;
    save_kv_cuda_planned(dev, &plan, &pairs.slice(..), k, v, k_cache, v_cache)
}

/// A KV save resolved on the host ([`save_kv_cuda`]'s first half): the row
/// copies `pairs: [n, 2]` u64 (source token row, cache row; cache rows
/// distinct and in bounds) for the buffer lengths it was checked against.
/// Upload [`pairs`](Self::pairs) (with a step's other metadata) and run
/// [`save_kv_cuda_planned`].
#[derive(Clone, Debug, PartialEq)]
pub struct KvSavePlan {
    pairs: Vec<u64>,
    /// Elements of k, v, k_cache, v_cache.
    lens: [usize; 4],
    params: [i64; 2],
}

impl KvSavePlan {
    /// Checks a save of `k`, `v` into `k_cache`, `v_cache` (their element
    /// counts in `lens`, in that order) laid out as `layout` for `step`,
    /// and lists its row copies. Errors: those of [`crate::save_kv_cpu`].
    pub fn new(
        lens: [usize; 4],
        layout: &KvCacheLayout,
        step: &KvStep,
    ) -> Result<Self, KernelError> {
        let mut pairs = Vec::new();
        plan_save(lens[0], lens[1], lens[2], lens[3], layout, step, &mut pairs)?;
        Ok(KvSavePlan {
            pairs: pairs.iter().flat_map(|&(s, d)| [s, d]).collect(),
            lens,
            params: [
                (layout.num_heads_kv * layout.head_dim_k) as i64,
                (layout.num_heads_kv * layout.head_dim_v) as i64,
            ],
        })
    }

    /// The row copies, `[n, 2]` u64 flattened: what the device copy must hold.
    pub fn pairs(&self) -> &[u64] {
        &self.pairs
    }

    /// Rows of the launch (`n`, skipped ones included).
    pub fn rows(&self) -> usize {
        self.pairs.len() / 2
    }

    /// Appends `n` pairs that copy nothing (cache row [`KV_SKIP`]): the
    /// padded rows of a batch bucket, so the launch keeps its size while
    /// no real cache row is written for them.
    pub fn pad_rows(&mut self, n: usize) {
        for _ in 0..n {
            self.pairs.extend([0, KV_SKIP]);
        }
    }
}

/// The cache row of a [`KvSavePlan`] pair that `kv_save` skips (`~0`).
pub const KV_SKIP: u64 = u64::MAX;

/// The device half of [`save_kv_cuda`]: one launch copying the rows of
/// `plan` with `pairs` (its [`KvSavePlan::pairs`], on the device). No
/// allocation, no copy: capturable in a CUDA graph and replayable after
/// `pairs` is rewritten in place. Asynchronous on `dev.stream()`.
///
/// Errors: a buffer whose length differs from the one `plan` was checked
/// for ([`KernelError::ShapeMismatch`]); a launch failure.
pub fn save_kv_cuda_planned<T: CudaElement>(
    dev: &CudaDevice,
    plan: &KvSavePlan,
    pairs: &CudaView<'_, u64>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    k_cache: &mut CudaSlice<T>,
    v_cache: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    let got = [k.len(), v.len(), k_cache.len(), v_cache.len()];
    for (i, arg) in ["k", "v", "k_cache", "v_cache"].into_iter().enumerate() {
        if got[i] != plan.lens[i] {
            return Err(KernelError::ShapeMismatch {
                op: "save_kv",
                arg,
                expected: vec![plan.lens[i]],
                got: vec![got[i]],
            });
        }
    }
    if pairs.len() != plan.pairs.len() {
        return Err(KernelError::ShapeMismatch {
            op: "save_kv",
            arg: "pairs",
            expected: vec![plan.rows(), 2],
            got: vec![pairs.len()],
        });
    }
    if plan.rows() == 0 {
        return Ok(());
    }
    let cfg = grid("save_kv", plan.rows())?;
    let params = KvSaveParams {
        row_k: plan.params[0],
        row_v: plan.params[1],
    };
    let f = dev.function(KV_CACHE_CU, &format!("kv_save_{}", T::SUFFIX))?;
    let stream = dev.stream();
    let mut b = stream.launch_builder(&f);
    b.arg(k_cache)
        .arg(v_cache)
        .arg(k)
        .arg(v)
        .arg(pairs)
        .arg(&params);
    // SAFETY: argument types match the kernel; `plan_save` bounded every
    // row for these buffer lengths (checked above).
    unsafe { b.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}

fn convert<T: CudaElement>(
    dev: &CudaDevice,
    kernel: &'static str,
    dst: &mut CudaSlice<T>,
    src: &CudaSlice<T>,
    dst_rows: usize,
    args: &ConvertArgs,
) -> Result<(), KernelError> {
    if dst_rows == 0 {
        return Ok(());
    }
    let cfg = grid(kernel, dst_rows)?;
    let batch = args.cu_seqlens.len() - 1;
    let params = ConvertParams {
        row: (args.num_heads * args.head_dim) as i64,
        batch: batch as i32,
        max_seqlen: i32::try_from(args.max_seqlen).map_err(|_| KernelError::InvalidArgument {
            op: kernel,
            arg: "max_seqlen",
            reason: "exceeds i32".into(),
        })?,
    };
    let stream = dev.stream();
    let cu = stream.clone_htod(args.cu_seqlens).map_err(cuda_err)?;
    let f = dev.function(KV_CACHE_CU, &format!("{kernel}_{}", T::SUFFIX))?;
    let mut b = stream.launch_builder(&f);
    b.arg(dst).arg(src).arg(&cu).arg(&params);
    // SAFETY: argument types match the kernel; shapes checked by the caller.
    unsafe { b.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}

/// [`crate::convert_thd_to_bshd`] on the GPU (padding rows zeroed).
pub fn convert_thd_to_bshd_cuda<T: CudaElement>(
    dev: &CudaDevice,
    thd: &CudaSlice<T>,
    bshd: &mut CudaSlice<T>,
    args: &ConvertArgs,
) -> Result<(), KernelError> {
    let (batch, _, _) = args.check("convert_thd_to_bshd", thd.len(), bshd.len())?;
    convert(
        dev,
        "convert_thd_to_bshd",
        bshd,
        thd,
        batch * args.max_seqlen,
        args,
    )
}

/// [`crate::convert_bshd_to_thd`] on the GPU (rows past `cu_seqlens[b]` zeroed).
pub fn convert_bshd_to_thd_cuda<T: CudaElement>(
    dev: &CudaDevice,
    bshd: &CudaSlice<T>,
    thd: &mut CudaSlice<T>,
    args: &ConvertArgs,
) -> Result<(), KernelError> {
    let (_, t, _) = args.check("convert_bshd_to_thd", thd.len(), bshd.len())?;
    convert(dev, "convert_bshd_to_thd", thd, bshd, t, args)
}
