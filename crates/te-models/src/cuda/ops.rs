//! [`Cuda`]: the device ops of [`crate::device::DeviceOps`] on one GPU
//! (`kernels/model_ops.cu`, `kernels/gemm.cu`, te-kernels' RoPE), f32
//! activations and bf16 weights.
//!
//! GEMM: the activations are rounded to bf16 once per product
//! (`to_bf16_f32`), then `y: [t, n] f32 = x: [t, k] bf16 · w: [n, k]ᵀ bf16`
//! with f32 accumulation, through cuBLAS (`cublasGemmEx`, bf16 in, f32
//! compute and out) when it loaded, else through our `gemm_bf16`
//! (tensor cores, `mma.sync`). Every launch is asynchronous on the
//! device's stream; nothing is read back here.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;
use te_kernels::cuda::{
    apply_rope_cuda, apply_rope_cuda_meta, CudaDevice, CudaRopeTable, KernelSource, LaunchShape,
    RopeMeta,
};
use te_kernels::rope::RopeArgs;

use super::libs::{check_libraries, cuda_err, load_cublas};
use super::plan::DevicePlan;
use crate::config::Activation;
use crate::device::DeviceOps;
use crate::{ModelError, Result};

/// `kernels/model_ops.cu`.
pub const MODEL_OPS_CU: KernelSource = KernelSource {
    name: "model_ops.cu",
    text: include_str!("../../kernels/model_ops.cu"),
};
/// `kernels/gemm.cu`.
pub const GEMM_CU: KernelSource = KernelSource {
    name: "gemm.cu",
    text: include_str!("../../kernels/gemm.cu"),
};

/// Threads per block of every `model_ops.cu` kernel (`OPS_THREADS`).
pub const OPS_THREADS: u32 = 256;
/// Threads per block of `gemm_bf16` (`GEMM_THREADS`) and its square tile
/// of `y` (`GEMM_BM = GEMM_BN`).
pub const GEMM_THREADS: u32 = 128;
const GEMM_TILE: usize = 64;
/// cuBLAS' workspace: 32 MiB, what NVIDIA advises for Hopper.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Blocks of an elementwise launch at most (grid-stride loops do the rest).
const MAX_ELEMENTWISE_BLOCKS: usize = 4096;

const fn ops_shape(kernel: &'static str) -> LaunchShape {
    LaunchShape {
        kernel,
        threads_per_block: OPS_THREADS,
        max_dynamic_shared_bytes: 0,
    }
}

/// The launch shapes of `model_ops.cu` and `gemm.cu` (for `cargo xtask
/// kernels`).
pub const LAUNCHES: &[LaunchShape] = &[
    ops_shape("rmsnorm"),
    ops_shape("gated_act"),
    ops_shape("add"),
    ops_shape("add_bias"),
    ops_shape("embed"),
    ops_shape("gather_rows"),
    ops_shape("softcap"),
    ops_shape("to_bf16"),
    ops_shape("argmax"),
    LaunchShape {
        kernel: "gemm",
        threads_per_block: GEMM_THREADS,
        max_dynamic_shared_bytes: 0,
    },
];

/// A linear layer on the device: `weight: [out_features, in_features]`
/// bf16 row-major, `bias: [out_features]` f32.
#[derive(Debug)]
pub struct CudaLinear {
    pub weight: CudaSlice<bf16>,
    pub bias: Option<CudaSlice<f32>>,
    pub out_features: usize,
    pub in_features: usize,
}

/// Which GEMM the device runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmBackend {
    /// cuBLAS `cublasGemmEx` (bf16 in, f32 compute).
    Cublas,
    /// te-rs' `gemm_bf16` kernel (`kernels/gemm.cu`).
    Kernel,
}

/// One GPU as a [`DeviceOps`] device: the te-kernels device (context,
/// stream, kernel modules), cuBLAS when it loaded, and the bf16 copy of a
/// GEMM's activations (reused).
pub struct Cuda {
    pub(crate) dev: CudaDevice,
    blas: Option<CudaBlas>,
    /// cuBLAS' workspace (`cublasSetWorkspace`), kept while `blas` lives.
    _blas_workspace: Option<CudaSlice<u8>>,
    pub(crate) x_bf16: Option<CudaSlice<bf16>>,
    backend: GemmBackend,
    /// The step's plan on the device while a step runs
    /// (`DevicePlan`, `plan.rs`): the embedding, row gather, RoPE, KV
    /// save and attention read their metadata from it instead of
    /// uploading it per call.
    pub(crate) plan: Option<Box<DevicePlan>>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("dev", &self.dev)
            .field("gemm", &self.backend)
            .finish()
    }
}

/// Rows of `dim` values in an RMSNorm input of `len` values.
fn rms_rows(len: usize, dim: usize) -> Result<usize> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(ModelError::Cuda(format!(
            "rms_norm: x holds {len} values, not rows of {dim}"
        )));
    }
    Ok(len / dim)
}

fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n
        .div_ceil(OPS_THREADS as usize)
        .clamp(1, MAX_ELEMENTWISE_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (OPS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize) -> Result<LaunchConfig> {
    let g = u32::try_from(rows)
        .ok()
        .filter(|&g| g < i32::MAX as u32)
        .ok_or_else(|| ModelError::Cuda(format!("{rows} rows is too many for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (g, 1, 1),
        block_dim: (OPS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ModelError::Cuda(format!("{what} = {v} exceeds i32")))
}

/// Checks that `buf` holds `len` values (`op`'s argument `arg`).
fn check_len(op: &str, arg: &str, got: usize, len: usize) -> Result<()> {
    if got != len {
        return Err(ModelError::Cuda(format!(
            "{op}: `{arg}` holds {got} values, expected {len}"
        )));
    }
    Ok(())
}

impl Cuda {
    /// GPU `ordinal` on a stream of its own (capturable into a CUDA graph),
    /// with cuBLAS when `use_cublas` and the library loads
    /// (else our GEMM kernel; [`gemm_backend`](Self::gemm_backend) says
    /// which). Errors name the missing library (driver, NVRTC) or the
    /// failing call; never panics.
    pub fn new(ordinal: usize, use_cublas: bool) -> Result<Self> {
        check_libraries()?;
        let dev = CudaDevice::new_capturable(ordinal).map_err(|e| {
            let count = cudarc::driver::CudaContext::device_count()
                .map_or_else(|_| "?".to_string(), |n| n.to_string());
            ModelError::Cuda(format!(
                "opening cuda:{ordinal} (the driver reports {count} GPUs): {e}"
            ))
        })?;
        let blas = if use_cublas {
            load_cublas(dev.stream())
        } else {
            None
        };
        // cuBLAS' workspace, ours: made before any capture, so a captured
        // product never allocates one.
        let blas_workspace = match &blas {
            Some(blas) => {
                let mut ws = dev
                    .stream()
                    .alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)
                    .map_err(|e| cuda_err("alloc", e))?;
                let stream = dev.stream().clone();
                let (p, _rw) = ws.device_ptr_mut(&stream);
                // SAFETY: `ws` outlives the handle's use (both live in
                // `Cuda`; the handle is dropped first, fields in order).
                let status = unsafe {
                    blas_sys::cublasSetWorkspace_v2(
                        *blas.handle(),
                        p as *mut _,
                        CUBLAS_WORKSPACE_BYTES,
                    )
                };
                if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(cuda_err("cublasSetWorkspace", status));
                }
                drop(_rw);
                Some(ws)
            }
            None => None,
        };
        let backend = if blas.is_some() {
            GemmBackend::Cublas
        } else {
            GemmBackend::Kernel
        };
        Ok(Cuda {
            dev,
            blas,
            _blas_workspace: blas_workspace,
            x_bf16: None,
            backend,
            plan: None,
        })
    }

    /// The GEMM in use.
    pub fn gemm_backend(&self) -> GemmBackend {
        self.backend
    }

    /// Makes the products run on `backend`.
    ///
    /// Errors: [`GemmBackend::Cublas`] when cuBLAS did not load.
    pub fn set_gemm_backend(&mut self, backend: GemmBackend) -> Result<()> {
        if backend == GemmBackend::Cublas && self.blas.is_none() {
            return Err(ModelError::Cuda("cuBLAS is not loaded".into()));
        }
        self.backend = backend;
        Ok(())
    }

    /// The stream every op runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.dev.stream()
    }

    /// Uploads host f32 values.
    pub fn upload(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream()
            .clone_htod(v)
            .map_err(|e| cuda_err("upload", e))
    }

    /// Copies `buf` back to the host (waits for the stream).
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        buf: &CudaSlice<T>,
        out: &mut Vec<T>,
    ) -> Result<()> {
        out.clear();
        out.resize(buf.len(), T::default());
        self.stream()
            .memcpy_dtoh(buf, out.as_mut_slice())
            .map_err(|e| cuda_err("download", e))?;
        self.stream()
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
    }

    fn function(&self, src: KernelSource, name: &str) -> Result<cudarc::driver::CudaFunction> {
        self.dev
            .function(src, name)
            .map_err(|e| ModelError::Cuda(e.to_string()))
    }

    /// `y: [t, n] = x: [t, k] · wᵀ (+ bias)` with the GEMM `backend`
    /// (either, whatever loaded: for the parity tests).
    pub fn linear_with(
        &mut self,
        backend: GemmBackend,
        w: &CudaLinear,
        x: &CudaSlice<f32>,
        t: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, k) = (w.out_features, w.in_features);
        check_len("linear", "x", x.len(), t * k)?;
        check_len("linear", "y", y.len(), t * n)?;
        if t == 0 || n == 0 {
            return Ok(());
        }
        // The activations in bf16: [t, k].
        if self.x_bf16.as_ref().is_none_or(|b| b.len() < t * k) {
            self.x_bf16 = Some(
                self.stream()
                    .alloc_zeros::<bf16>(t * k)
                    .map_err(|e| cuda_err("alloc", e))?,
            );
        }
        let mut xb = self.x_bf16.take().expect("allocated above");
        let result = self.linear_bf16(backend, w, x, &mut xb, t, y);
        self.x_bf16 = Some(xb);
        result
    }

    fn linear_bf16(
        &mut self,
        backend: GemmBackend,
        w: &CudaLinear,
        x: &CudaSlice<f32>,
        xb: &mut CudaSlice<bf16>,
        t: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, k) = (w.out_features, w.in_features);
        let stream = self.stream().clone();
        let len = (t * k) as i64;
        let f = self.function(MODEL_OPS_CU, "to_bf16_f32")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&mut *xb).arg(x).arg(&len);
        // SAFETY: out [>= t k] bf16, x [t k] f32, n = t k (checked above).
        unsafe { b.launch(elementwise(t * k)) }.map_err(|e| cuda_err("to_bf16", e))?;
        match (backend, &self.blas) {
            (GemmBackend::Cublas, Some(blas)) => {
                // Column-major view: yᵀ [n, t] = w [k, n]ᵀ · xᵀ [k, t].
                let (alpha, beta) = (1.0f32, 0.0f32);
                let (wp, _rw) = w.weight.device_ptr(&stream);
                let (xp, _rx) = xb.device_ptr(&stream);
                let (yp, _ry) = y.device_ptr_mut(&stream);
                // SAFETY: the pointers address w [n, k], x [t, k] (bf16) and
                // y [t, n] (f32) on this stream's context; lengths checked.
                unsafe {
                    blas::gemm_ex(
                        *blas.handle(),
                        blas_sys::cublasOperation_t::CUBLAS_OP_T,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        to_i32("n", n)?,
                        to_i32("t", t)?,
                        to_i32("k", k)?,
                        (&alpha as *const f32).cast(),
                        wp as *const _,
                        blas_sys::cudaDataType_t::CUDA_R_16BF,
                        to_i32("k", k)?,
                        xp as *const _,
                        blas_sys::cudaDataType_t::CUDA_R_16BF,
                        to_i32("k", k)?,
                        (&beta as *const f32).cast(),
                        yp as *mut _,
                        blas_sys::cudaDataType_t::CUDA_R_32F,
                        to_i32("n", n)?,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                    )
                }
                .map_err(|e| cuda_err("cublasGemmEx", e))?;
                drop((_rw, _rx, _ry));
                if let Some(bias) = &w.bias {
                    let f = self.function(MODEL_OPS_CU, "add_bias_f32")?;
                    let (total, cols) = ((t * n) as i64, to_i32("n", n)?);
                    let mut b = stream.launch_builder(&f);
                    b.arg(&mut *y).arg(bias).arg(&total).arg(&cols);
                    // SAFETY: y [t, n], bias [n].
                    unsafe { b.launch(elementwise(t * n)) }.map_err(|e| cuda_err("add_bias", e))?;
                }
            }
            _ => {
                let f = self.function(GEMM_CU, "gemm_bf16")?;
                let cfg = LaunchConfig {
                    grid_dim: (
                        n.div_ceil(GEMM_TILE) as u32,
                        u32::try_from(t.div_ceil(GEMM_TILE))
                            .ok()
                            .filter(|&g| g < 65536)
                            .ok_or_else(|| {
                                ModelError::Cuda(format!("gemm: {t} rows is too many"))
                            })?,
                        1,
                    ),
                    block_dim: (GEMM_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (ti, ni, ki) = (to_i32("t", t)?, to_i32("n", n)?, to_i32("k", k)?);
                let null: u64 = 0;
                let mut b = stream.launch_builder(&f);
                b.arg(&mut *y).arg(&*xb).arg(&w.weight);
                match &w.bias {
                    Some(bias) => b.arg(bias),
                    None => b.arg(&null),
                };
                b.arg(&ti).arg(&ni).arg(&ki);
                // SAFETY: y [t, n] f32, x [t, k] and w [n, k] bf16, bias [n]
                // or null; the kernel bounds every index by t, n, k.
                unsafe { b.launch(cfg) }.map_err(|e| cuda_err("gemm_bf16", e))?;
            }
        }
        Ok(())
    }

    /// Greedy tokens of `logits: [rows, vocab]` into `ids: [rows]` (the
    /// largest non-NaN logit, lowest id on ties, 0 when none: the CPU
    /// sampler's rule).
    pub fn argmax(
        &mut self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        ids: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let rows = ids.len();
        check_len("argmax", "logits", logits.len(), rows * vocab)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "argmax_f32")?;
        let v = to_i32("vocab", vocab)?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut *ids).arg(logits).arg(&v);
        // SAFETY: ids [rows] u32, logits [rows, vocab].
        unsafe { b.launch(per_row(rows)?) }.map_err(|e| cuda_err("argmax", e))?;
        Ok(())
    }
}

impl DeviceOps for Cuda {
    type Buf = CudaSlice<f32>;
    type Linear = CudaLinear;
    type Vector = CudaSlice<f32>;
    type Rope = CudaRopeTable;

    fn len(&self, buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }

    fn resize(&mut self, buf: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        // Exact lengths (te-kernels' and te-attention's launches check
        // them): a new allocation when the length changes, so a run of
        // decode steps of one batch size allocates nothing.
        if buf.len() != len {
            *buf = self
                .stream()
                .alloc_zeros::<f32>(len)
                .map_err(|e| cuda_err("alloc", e))?;
        }
        Ok(())
    }

    fn linear(
        &mut self,
        w: &CudaLinear,
        x: &CudaSlice<f32>,
        t: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let backend = self.backend;
        self.linear_with(backend, w, x, t, y)
    }

    fn rms_norm_into(
        &mut self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let dim = w.len();
        check_len("rms_norm", "y", y.len(), x.len())?;
        let rows = rms_rows(x.len(), dim)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "rmsnorm_f32")?;
        let d = to_i32("dim", dim)?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut *y).arg(x).arg(w).arg(&d).arg(&eps);
        // SAFETY: x, y [rows, dim], w [dim].
        unsafe { b.launch(per_row(rows)?) }.map_err(|e| cuda_err("rmsnorm", e))?;
        Ok(())
    }

    fn rms_norm_inplace(
        &mut self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<()> {
        let dim = w.len();
        let rows = rms_rows(x.len(), dim)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "rmsnorm_f32")?;
        let d = to_i32("dim", dim)?;
        let stream = self.stream().clone();
        // In place: y and x are the same buffer (each element is read
        // before its own write, by the same thread).
        let (xp, _rx) = x.device_ptr_mut(&stream);
        let mut b = stream.launch_builder(&f);
        b.arg(&xp).arg(&xp).arg(w).arg(&d).arg(&eps);
        // SAFETY: x [rows, dim] (read and written), w [dim].
        unsafe { b.launch(per_row(rows)?) }.map_err(|e| cuda_err("rmsnorm", e))?;
        drop(_rx);
        Ok(())
    }

    fn rope(
        &mut self,
        x: &mut CudaSlice<f32>,
        table: &CudaRopeTable,
        args: &RopeArgs,
    ) -> Result<()> {
        match self
            .plan
            .as_deref()
            .filter(|p| p.host_rope() == (args.cu_seqlens, args.start_positions))
        {
            Some(p) => {
                let (cu, starts) = p.rope_views()?;
                let meta = RopeMeta {
                    cu_seqlens: &cu,
                    start_positions: &starts,
                };
                apply_rope_cuda_meta(&self.dev, x, table, args, meta)?;
            }
            None => apply_rope_cuda(&self.dev, x, table, args)?,
        }
        Ok(())
    }

    fn gated_act(
        &mut self,
        act: Activation,
        g: &mut CudaSlice<f32>,
        u: &CudaSlice<f32>,
    ) -> Result<()> {
        check_len("gated_act", "u", u.len(), g.len())?;
        let n = g.len() as i64;
        let gelu = i32::from(act == Activation::GeluTanh);
        if n == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "gated_act_f32")?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(g).arg(u).arg(&n).arg(&gelu);
        // SAFETY: g, u [n].
        unsafe { b.launch(elementwise(n as usize)) }.map_err(|e| cuda_err("gated_act", e))?;
        Ok(())
    }

    fn add_inplace(&mut self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        check_len("add", "y", y.len(), x.len())?;
        let n = x.len() as i64;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "add_f32")?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: x, y [n].
        unsafe { b.launch(elementwise(n as usize)) }.map_err(|e| cuda_err("add", e))?;
        Ok(())
    }

    fn embed(
        &mut self,
        table: &CudaLinear,
        tokens: &[u32],
        scale: f32,
        x: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let hidden = table.in_features;
        check_len("embed", "x", x.len(), tokens.len() * hidden)?;
        if tokens.is_empty() {
            return Ok(());
        }
        // The step plan's copy of the tokens, or an upload for this call.
        let uploaded;
        let ids = match self.plan.as_deref().filter(|p| p.tokens == tokens) {
            Some(p) => p.tokens_view()?,
            None => {
                uploaded = self
                    .stream()
                    .clone_htod(tokens)
                    .map_err(|e| cuda_err("upload", e))?;
                uploaded.slice(..)
            }
        };
        let f = self.function(MODEL_OPS_CU, "embed_bf16")?;
        let h = to_i32("hidden", hidden)?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut *x)
            .arg(&table.weight)
            .arg(&ids)
            .arg(&h)
            .arg(&scale);
        // SAFETY: x [t, hidden], table [vocab, hidden], ids < vocab (checked
        // by the caller).
        unsafe { b.launch(per_row(tokens.len())?) }.map_err(|e| cuda_err("embed", e))?;
        Ok(())
    }

    fn gather_rows(
        &mut self,
        x: &CudaSlice<f32>,
        rows: &[usize],
        width: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_len("gather_rows", "out", out.len(), rows.len() * width)?;
        if let Some(&r) = rows.iter().find(|&&r| (r + 1) * width > x.len()) {
            return Err(ModelError::Cuda(format!(
                "gather_rows: row {r} is outside x"
            )));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let uploaded;
        let idx = match self.plan.as_deref().filter(|p| p.rows == rows) {
            Some(p) => p.rows_view()?,
            None => {
                let idx: Vec<u64> = rows.iter().map(|&r| r as u64).collect();
                uploaded = self
                    .stream()
                    .clone_htod(&idx)
                    .map_err(|e| cuda_err("upload", e))?;
                uploaded.slice(..)
            }
        };
        let f = self.function(MODEL_OPS_CU, "gather_rows_f32")?;
        let w = to_i32("width", width)?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut *out).arg(x).arg(&idx).arg(&w);
        // SAFETY: out [rows, width]; every row index checked against x.
        unsafe { b.launch(per_row(rows.len())?) }.map_err(|e| cuda_err("gather_rows", e))?;
        Ok(())
    }

    fn softcap(&mut self, x: &mut CudaSlice<f32>, cap: f32) -> Result<()> {
        let n = x.len() as i64;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(MODEL_OPS_CU, "softcap_f32")?;
        let stream = self.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(x).arg(&n).arg(&cap);
        // SAFETY: x [n].
        unsafe { b.launch(elementwise(n as usize)) }.map_err(|e| cuda_err("softcap", e))?;
        Ok(())
    }
}
