//! The CUDA path of [`DotProductAttention`] (`kernels/attention.cu`): the
//! same arguments, checks and results as
//! [`DotProductAttention::forward_cpu`], on device buffers.
//!
//! `attn_fwd_<dtype>` runs one block per (tile of 16 (query, head) rows,
//! KV head, sequence): K/V tiles of 32 keys staged in shared memory as f32,
//! online softmax in f32 (Milakov & Gimelshein 2018; Dao et al. 2022). When
//! that leaves the GPU mostly idle (decode: few rows, long caches) the key
//! range of each block is split across `num_kv_splits` blocks, each writing
//! a partial `(out, lse)` in f32, and `attn_combine_<dtype>` merges them by
//! LSE (flash-decoding; the n-way form of [`crate::merge`]).
//!
//! Launches of at most 8 (query, head-in-group) rows per sequence and KV
//! head (decode, and short verification chunks of GQA models) with
//! `d_qk, d_v <= 256` run `attn_decode<R>_<dtype>` instead (R = 1, 4 or 8
//! rows, the smallest that holds them: registers scale with R): one block per
//! (KV head, sequence, split), 4 warps each walking every 4th key of the
//! block's range straight from global memory (no staged tile, no rows of
//! padding: the tiled kernel's 16-row blocks leave 15 of 16 rows idle in
//! MHA decode), merged by LSE in shared memory. Same results within f32
//! rounding; the split heuristic targets 4 resident blocks per
//! multiprocessor for it.
//!
//! Host side: the arguments are validated with the CPU path's checks, the
//! per-sequence lengths, row bases and page table go to the device in one
//! small upload, then one or two launches on [`CudaDevice::stream`]; nothing
//! is read back. Inputs f32, f16 or bf16 (`T`), f32 accumulation, output in
//! `T`, lse f32. Limits: `head_dim_v <= 256`; shared memory of the tiled
//! kernel `4 (16 d_qk + 32 (d_qk + 1) + 32 d_v + 512) + 256` bytes must fit
//! the device (d_qk = d_v = 256: 84 352 bytes, 82.4 KiB); the decode
//! kernel's is `4 (R d_qk + 4 R (2 + d_v))` bytes (R = 8, d = 256: 40.2
//! KiB).

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use te_kernels::cuda::{CudaDevice, CudaElement, KernelSource, LaunchShape};
use te_kernels::{KvCacheLayout, QkvFormat};

use crate::attention::{AttnMetadata, DotProductAttention, KvLens, Plan, SeqLens, OP};
use crate::error::AttentionError;

/// `kernels/attention.cu` (program name `attention.cu`).
pub const ATTENTION_CU: KernelSource = KernelSource {
    name: "attention.cu",
    text: include_str!("../kernels/attention.cu"),
};

/// Rows (query, head) per block, keys per tile, threads per block, and the
/// widest output row: `ATTN_ROWS`, `ATTN_BC`, `ATTN_THREADS`, `ATTN_MAX_DV`
/// of the kernel.
const ROWS: usize = 16;
const BC: usize = 32;
const THREADS: u32 = 128;
/// Largest supported `head_dim_v` (output columns live in registers).
pub const MAX_HEAD_DIM_V: usize = 256;
/// Threads per block of `attn_combine_*`.
const COMBINE_THREADS: u32 = 64;
/// `attn_decode`'s `DEC_WARPS` and `DEC_MAX_D`: warps per block and the
/// widest head it serves; its row counts `R` (the most (query,
/// head-in-group) rows of one sequence and KV head a variant serves).
const DEC_WARPS: usize = 4;
const DEC_MAX_D: usize = 256;
/// Threads per block of `attn_decode`.
const DEC_THREADS: u32 = 32 * DEC_WARPS as u32;
const DEC_ROWS: [usize; 3] = [1, 4, 8];

/// The launch shapes of `attention.cu`'s kernels (for `cargo xtask
/// kernels`); `attn_fwd`'s dynamic shared memory at its largest, head
/// dimensions of [`MAX_HEAD_DIM_V`].
pub const LAUNCHES: &[LaunchShape] = &[
    LaunchShape {
        kernel: "attn_fwd",
        threads_per_block: THREADS,
        max_dynamic_shared_bytes: shared_bytes(MAX_HEAD_DIM_V, MAX_HEAD_DIM_V) as u32,
    },
    decode_launch("attn_decode1", 1),
    decode_launch("attn_decode4", 4),
    decode_launch("attn_decode8", 8),
    LaunchShape {
        kernel: "attn_combine",
        threads_per_block: COMBINE_THREADS,
        max_dynamic_shared_bytes: 0,
    },
];

/// The launch shape of `attn_decode<rows>`.
const fn decode_launch(kernel: &'static str, rows: usize) -> LaunchShape {
    LaunchShape {
        kernel,
        threads_per_block: DEC_THREADS,
        max_dynamic_shared_bytes: decode_shared_bytes(rows, DEC_MAX_D, DEC_MAX_D) as u32,
    }
}

/// i64 fields per sequence in the metadata upload (`ATTN_SEQ_FIELDS`).
const SEQ_FIELDS: usize = 8;
/// At most this many KV splits.
const MAX_SPLITS: usize = 64;

/// The forward kernel a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `attn_fwd`: 16-row tiles, K/V staged in shared memory.
    Tiled,
    /// `attn_decode<rows>`: at most `rows` (1, 4 or 8) rows per block, K/V
    /// read straight from global memory.
    Decode(usize),
}

impl Kernel {
    /// The kernel for `max_q` query rows per sequence, `group` query heads
    /// per KV head and head dimensions `d_qk`, `d_v`.
    fn choose(max_q: usize, group: usize, d_qk: usize, d_v: usize) -> Kernel {
        let rows = max_q * group;
        match DEC_ROWS.iter().find(|&&r| rows <= r) {
            Some(&r) if d_qk <= DEC_MAX_D && d_v <= DEC_MAX_D => Kernel::Decode(r),
            _ => Kernel::Tiled,
        }
    }

    fn name(self) -> String {
        match self {
            Kernel::Tiled => "attn_fwd".into(),
            Kernel::Decode(rows) => format!("attn_decode{rows}"),
        }
    }

    fn threads(self) -> u32 {
        match self {
            Kernel::Tiled => THREADS,
            Kernel::Decode(_) => DEC_THREADS,
        }
    }

    /// Grid x: row tiles per (KV head, sequence).
    fn tiles(self, max_q: usize, group: usize) -> usize {
        match self {
            Kernel::Tiled => (max_q * group).div_ceil(ROWS),
            Kernel::Decode(_) => 1,
        }
    }

    fn shared_bytes(self, d_qk: usize, d_v: usize) -> usize {
        match self {
            Kernel::Tiled => shared_bytes(d_qk, d_v),
            Kernel::Decode(rows) => decode_shared_bytes(rows, d_qk, d_v),
        }
    }

    /// Blocks per multiprocessor the split heuristic fills (the tiled
    /// kernel's 82 KiB of shared memory leaves room for about two; the
    /// decode kernels' registers and shared memory for two to four), and
    /// the fewest keys it gives a split.
    fn split_targets(self) -> (usize, usize) {
        match self {
            Kernel::Tiled => (1, 256),
            Kernel::Decode(_) => (4, 128),
        }
    }
}

/// Where K and V come from, on the device (see [`crate::KvInput`]).
#[derive(Debug)]
pub enum CudaKvInput<'a, T> {
    /// `k: [.., h_kv, d_qk]`, `v: [.., h_kv, d_v]` in the attention's
    /// `kv_format` (bshd `[b, max_seqlen_kv, ..]`, sbhd
    /// `[max_seqlen_kv, b, ..]`, thd `[t_kv, ..]` with `cu_seqlens_kv`).
    Tensors {
        k: CudaView<'a, T>,
        v: CudaView<'a, T>,
    },
    /// A contiguous or paged cache: `k_cache: [num_pages, page_size, h_kv,
    /// d_qk]`, `v_cache: [num_pages, page_size, h_kv, d_v]` on the device,
    /// addressed by `layout` (host page table and `cache_seqlens`, uploaded
    /// per call), exactly as [`te_kernels::KvCacheView`].
    Cache {
        k_cache: CudaView<'a, T>,
        v_cache: CudaView<'a, T>,
        layout: KvCacheLayout<'a>,
    },
}

impl<T> CudaKvInput<'_, T> {
    fn lens(&self) -> KvLens<'_> {
        match self {
            CudaKvInput::Tensors { k, v } => KvLens::Tensors {
                k: k.len(),
                v: v.len(),
            },
            CudaKvInput::Cache {
                k_cache,
                v_cache,
                layout,
            } => KvLens::Cache {
                k_cache: k_cache.len(),
                v_cache: v_cache.len(),
                layout: *layout,
            },
        }
    }
}

/// Where a CUDA forward writes
/// ([`DotProductAttention::forward_cuda_with_splits`]), on the device.
#[derive(Debug)]
pub struct CudaAttnOutput<'a, T> {
    /// `[.., h_q, d_v]` in the attention's `qkv_format`, dtype `T`, fully
    /// written (padded and fully masked rows 0).
    pub out: CudaViewMut<'a, T>,
    /// Optional f32 natural-log LSE, `[b, h_q, max_seqlen_q]` (bshd/sbhd) or
    /// `[h_q, t_q]` (thd), -inf for rows that see no key.
    pub lse: Option<CudaViewMut<'a, f32>>,
}

/// The element counts (not bytes) of the buffers a launch will get, which
/// [`DotProductAttention::prepare_cuda`] validates before the buffers exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaAttnLens {
    /// Elements of `q`: `[.., h_q, d_qk]` in the `qkv_format`.
    pub q: usize,
    /// Elements of `out`: `[.., h_q, d_v]` in the `qkv_format`.
    pub out: usize,
    /// Elements of the f32 `lse` (`[b, h_q, max_seqlen_q]` or `[h_q, t_q]`);
    /// `None`: the launch writes no LSE.
    pub lse: Option<usize>,
}

/// The device buffers of one launch ([`DotProductAttention::launch_cuda`]),
/// each exactly as long as [`DotProductAttention::prepare_cuda`] was told
/// (elements; `T` the input and output dtype).
#[derive(Debug)]
pub struct CudaAttnBuffers<'a, T> {
    /// `[meta().len()]` i64: [`CudaAttnLaunch::meta`] uploaded.
    pub meta: CudaView<'a, i64>,
    /// Queries `[.., h_q, d_qk]` in the `qkv_format`.
    pub q: CudaView<'a, T>,
    /// Keys `[.., h_kv, d_qk]`: the `k` or `k_cache` of the prepared
    /// [`CudaKvInput`].
    pub k: CudaView<'a, T>,
    /// Values `[.., h_kv, d_v]`: its `v` or `v_cache`.
    pub v: CudaView<'a, T>,
    /// Output `[.., h_q, d_v]` in the `qkv_format`, fully written.
    pub out: CudaViewMut<'a, T>,
    /// f32 LSE, given exactly when `prepare_cuda` was given its length.
    pub lse: Option<CudaViewMut<'a, f32>>,
}

/// Mirror of `AttnParams` in `kernels/attention.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct AttnParams {
    q_rows: i64,
    ring_len: i64,
    window_left: i64,
    window_right: i64,
    batch: i32,
    h_q: i32,
    h_kv: i32,
    group: i32,
    d_qk: i32,
    d_v: i32,
    max_seqlen_q: i32,
    q_thd: i32,
    kv_cache: i32,
    page_size: i32,
    max_pages_per_seq: i32,
    num_splits: i32,
    has_lse: i32,
    scale: f32,
    softcap: f32,
}
// SAFETY: plain-old-data with the kernel's `repr(C)` layout.
unsafe impl DeviceRepr for AttnParams {}

fn cuda_err(e: impl std::fmt::Debug) -> AttentionError {
    AttentionError::Cuda {
        op: OP,
        reason: format!("{e:?}"),
    }
}

fn kernel_err(e: te_kernels::KernelError) -> AttentionError {
    AttentionError::Cuda {
        op: OP,
        reason: e.to_string(),
    }
}

fn to_i32(arg: &'static str, v: usize) -> Result<i32, AttentionError> {
    i32::try_from(v).map_err(|_| AttentionError::InvalidArgument {
        op: OP,
        arg,
        reason: format!("{v} exceeds i32"),
    })
}

/// `(base, stride)` of token rows of sequence `b` in `format`: token `i`
/// is row `base + i * stride`.
fn row_base(format: QkvFormat, b: usize, batch: usize, max_seqlen: usize, cu: &[i32]) -> [i64; 2] {
    match format {
        QkvFormat::Bshd => [(b * max_seqlen) as i64, 1],
        QkvFormat::Sbhd => [b as i64, batch as i64],
        QkvFormat::Thd => [cu[b] as i64, 1],
    }
}

impl DotProductAttention {
    /// Attention on the GPU: same semantics, arguments and errors as
    /// [`DotProductAttention::forward_cpu`] (which see for shapes), with
    /// device buffers; the KV split count is chosen from the device's
    /// multiprocessor count.
    ///
    /// - `q`: `[.., h_q, d_qk]` in `qkv_format`; `kv`: [`CudaKvInput`];
    /// - `meta`: host-side lengths (uploaded once per call with the page
    ///   table);
    /// - `out`: `[.., h_q, d_v]` in `qkv_format`, dtype `T`, fully written
    ///   (padded and fully masked rows 0);
    /// - `lse`: optional f32 natural-log LSE, `[b, h_q, max_seqlen_q]`
    ///   (bshd/sbhd) or `[h_q, t_q]` (thd), -inf for rows that see no key.
    ///
    /// Asynchronous on `dev.stream()`. Errors: every error of
    /// `forward_cpu`; `head_dim_v > 256` or shared memory beyond the
    /// device's limit ([`AttentionError::InvalidArgument`]); driver, NVRTC or
    /// launch failures ([`AttentionError::Cuda`]).
    pub fn forward_cuda<T: CudaElement>(
        &self,
        dev: &CudaDevice,
        q: &CudaView<'_, T>,
        kv: &CudaKvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        out: &mut CudaViewMut<'_, T>,
        lse: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<(), AttentionError> {
        let output = CudaAttnOutput {
            out: out.slice_mut(..),
            lse: lse.map(|l| l.slice_mut(..)),
        };
        self.forward_cuda_with_splits(dev, q, kv, meta, output, None)
    }

    /// [`DotProductAttention::forward_cuda`] with the number of KV splits
    /// forced (`Some(n)`, n >= 1, capped at 64; 1 = no split) or chosen
    /// (`None`). The results agree up to f32 rounding; for tests and
    /// benchmarks.
    pub fn forward_cuda_with_splits<T: CudaElement>(
        &self,
        dev: &CudaDevice,
        q: &CudaView<'_, T>,
        kv: &CudaKvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        output: CudaAttnOutput<'_, T>,
        num_kv_splits: Option<usize>,
    ) -> Result<(), AttentionError> {
        let lens = CudaAttnLens {
            q: q.len(),
            out: output.out.len(),
            lse: output.lse.as_ref().map(|l| l.len()),
        };
        let Some(launch) = self.prepare_cuda(dev, lens, kv, meta, num_kv_splits)? else {
            return Ok(());
        };
        let meta_dev = dev.stream().clone_htod(&launch.meta).map_err(cuda_err)?;
        let mut scratch = CudaAttnScratch::default();
        let (k, v) = match kv {
            CudaKvInput::Tensors { k, v } => (k, v),
            CudaKvInput::Cache {
                k_cache, v_cache, ..
            } => (k_cache, v_cache),
        };
        let bufs = CudaAttnBuffers {
            meta: meta_dev.slice(..),
            q: q.slice(..),
            k: k.slice(..),
            v: v.slice(..),
            out: output.out,
            lse: output.lse,
        };
        run(self, dev, &launch, bufs, &mut scratch)
    }

    /// The host half of [`forward_cuda_with_splits`](Self::forward_cuda_with_splits):
    /// validates the arguments (the same checks and errors; `lens` are the
    /// element counts of `q`, `out` and `lse`),
    /// chooses the grid and KV splits and builds the per-sequence metadata
    /// ([`CudaAttnLaunch::meta`]) for the caller to upload, so a step's
    /// layers can share one upload and a captured CUDA graph can be
    /// replayed with the metadata rewritten in place. `None`: nothing to
    /// launch (no rows).
    ///
    /// Errors: those of `forward_cuda_with_splits` before its launch.
    pub fn prepare_cuda<T>(
        &self,
        dev: &CudaDevice,
        lens: CudaAttnLens,
        kv: &CudaKvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        num_kv_splits: Option<usize>,
    ) -> Result<Option<CudaAttnLaunch>, AttentionError> {
        let plan = self.plan(lens.q, &kv.lens(), meta, lens.out, lens.lse)?;
        if self.head_dim_v > MAX_HEAD_DIM_V {
            return Err(AttentionError::InvalidArgument {
                op: OP,
                arg: "head_dim_v",
                reason: format!(
                    "{} exceeds the CUDA kernel's {MAX_HEAD_DIM_V}",
                    self.head_dim_v
                ),
            });
        }
        if num_kv_splits == Some(0) {
            return Err(AttentionError::InvalidArgument {
                op: OP,
                arg: "num_kv_splits",
                reason: "must be >= 1".into(),
            });
        }
        if meta.batch == 0 || plan.q_rows == 0 {
            return Ok(None);
        }
        prepare(self, dev, &plan, kv, meta, lens, num_kv_splits)
    }

    /// The device half: launches `launch` (from [`prepare_cuda`](Self::prepare_cuda)
    /// on the same shapes) on `bufs` (`bufs.k`, `bufs.v` the tensors or
    /// caches of its [`CudaKvInput`], `bufs.meta` holding
    /// [`CudaAttnLaunch::meta`] on the device), the split partials in
    /// `scratch` (grown here when too small, so a first run sizes it and
    /// later runs of the same shape allocate nothing). Asynchronous on
    /// `dev.stream()`; no host synchronization.
    ///
    /// Errors: a buffer whose length differs from the prepared one
    /// ([`AttentionError::ShapeMismatch`]); driver or launch failures.
    pub fn launch_cuda<T: CudaElement>(
        &self,
        dev: &CudaDevice,
        launch: &CudaAttnLaunch,
        bufs: CudaAttnBuffers<'_, T>,
        scratch: &mut CudaAttnScratch,
    ) -> Result<(), AttentionError> {
        let lens = [
            ("q", bufs.q.len(), launch.lens[0]),
            ("k", bufs.k.len(), launch.lens[1]),
            ("v", bufs.v.len(), launch.lens[2]),
            ("out", bufs.out.len(), launch.lens[3]),
            ("meta", bufs.meta.len(), launch.meta.len()),
        ];
        for (arg, got, expected) in lens {
            if got != expected {
                return Err(AttentionError::ShapeMismatch {
                    op: OP,
                    arg,
                    expected: vec![expected],
                    got: vec![got],
                });
            }
        }
        if bufs.lse.is_some() != (launch.params.has_lse != 0) {
            return Err(AttentionError::InvalidArgument {
                op: OP,
                arg: "lse",
                reason: "given to launch_cuda but not to prepare_cuda, or the reverse".into(),
            });
        }
        run(self, dev, launch, bufs, scratch)
    }

    /// The KV splits [`forward_cuda`](Self::forward_cuda) would choose for
    /// `batch` sequences of `max_seqlen_q` query rows with at most
    /// `max_keys` visible keys each, on `dev` (for callers that fix the
    /// split count, e.g. a CUDA graph captured once for many steps).
    ///
    /// Errors: the device attribute query failed.
    pub fn cuda_kv_splits(
        &self,
        dev: &CudaDevice,
        batch: usize,
        max_seqlen_q: usize,
        max_keys: usize,
    ) -> Result<usize, AttentionError> {
        let group = self.kv_group();
        let kernel = Kernel::choose(max_seqlen_q, group, self.head_dim_qk, self.head_dim_v);
        let sm_count = dev
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err)? as usize;
        Ok(choose_splits(
            kernel,
            kernel.tiles(max_seqlen_q, group) * self.num_gqa_groups * batch,
            max_keys,
            sm_count,
        ))
    }
}

/// A validated CUDA attention launch ([`DotProductAttention::prepare_cuda`]):
/// the kernels' by-value parameters and grids, the buffer lengths they were
/// checked for, and the per-sequence metadata to upload. Launches whose
/// [`shape`](Self::shape)s are equal issue the same kernels with the same
/// parameters; only the metadata's contents differ.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaAttnLaunch {
    kernel: Kernel,
    params: AttnParams,
    /// Row tiles (grid x of `attn_fwd`) and query rows per sequence
    /// (grid x of `attn_combine`).
    tiles: usize,
    max_q: usize,
    splits: usize,
    smem: usize,
    /// Elements of q, k (or k_cache), v (or v_cache), out.
    lens: [usize; 4],
    meta: Vec<i64>,
}

impl CudaAttnLaunch {
    /// `[b, 8]` i64 per-sequence fields (`SeqInfo` of the kernel: sq,
    /// skv, first key, diagonal offset, q row base/stride, kv row
    /// base/stride), then for a cache the page table `[b,
    /// max_pages_per_seq]` as i64: what `meta_dev` must hold.
    pub fn meta(&self) -> &[i64] {
        &self.meta
    }

    /// The launch with its metadata cleared: what stays fixed when only
    /// the metadata's contents change (a captured graph's key).
    pub fn shape(&self) -> CudaAttnLaunch {
        CudaAttnLaunch {
            meta: Vec::new(),
            ..self.clone()
        }
    }
}

/// Device scratch of CUDA attention, reused across launches: the split
/// partials `o_part: [splits, q_rows, h_q, d_v]` and `lse_part: [splits,
/// q_rows, h_q]` f32, and a one-element stand-in for an absent `lse`.
/// Grows, never shrinks; a buffer is reallocated only when too small.
#[derive(Default)]
pub struct CudaAttnScratch {
    dummy: Option<CudaSlice<f32>>,
    o_part: Option<CudaSlice<f32>>,
    lse_part: Option<CudaSlice<f32>>,
}

impl std::fmt::Debug for CudaAttnScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAttnScratch")
            .field("o_part", &self.o_part.as_ref().map(|b| b.len()))
            .finish_non_exhaustive()
    }
}

/// `slot` holding at least `len` f32 (allocated when absent or shorter).
fn grow<'s>(
    dev: &CudaDevice,
    slot: &'s mut Option<CudaSlice<f32>>,
    len: usize,
) -> Result<&'s mut CudaSlice<f32>, AttentionError> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = Some(dev.stream().alloc_zeros(len).map_err(cuda_err)?);
    }
    Ok(slot.as_mut().expect("allocated above"))
}

impl<T> CudaKvInput<'_, T> {
    /// Elements of the key and value tensors (or caches).
    fn tensor_lens(&self) -> (usize, usize) {
        match self {
            CudaKvInput::Tensors { k, v } => (k.len(), v.len()),
            CudaKvInput::Cache {
                k_cache, v_cache, ..
            } => (k_cache.len(), v_cache.len()),
        }
    }
}

/// The `[b, SEQ_FIELDS]` per-sequence fields (`SeqInfo` of the kernel:
/// sq, skv, first_key, diagonal offset, q row base/stride, kv row
/// base/stride), then the page table `[b, max_pages_per_seq]` for a cache.
fn seq_fields<T>(
    attn: &DotProductAttention,
    plan: &Plan,
    kv: &CudaKvInput<'_, T>,
    meta: &AttnMetadata<'_>,
) -> Vec<i64> {
    let b = meta.batch;
    let cu_q = meta.cu_seqlens_q.unwrap_or(&[]);
    let cu_kv = meta.cu_seqlens_kv.unwrap_or(&[]);
    let mut fields = Vec::with_capacity(b * SEQ_FIELDS);
    for (s, seq) in plan.seqs.iter().enumerate() {
        let (offset, _, _, first_key, skv) = seq.key_range.parts();
        let q = row_base(attn.qkv_format, s, b, meta.max_seqlen_q, cu_q);
        let k = match kv {
            CudaKvInput::Tensors { .. } => {
                row_base(attn.kv_format, s, b, meta.max_seqlen_kv, cu_kv)
            }
            CudaKvInput::Cache { .. } => [0, 0],
        };
        fields.extend([
            seq.sq as i64,
            skv,
            first_key,
            offset,
            q[0],
            q[1],
            k[0],
            k[1],
        ]);
    }
    if let CudaKvInput::Cache { layout, .. } = kv {
        let n = b * layout.max_pages_per_seq;
        fields.extend(layout.page_table[..n].iter().map(|&p| p as i64));
    }
    fields
}

/// Shared memory of `attn_fwd` (bytes): key rows, q, k (padded), v, p.
const fn shared_bytes(d_qk: usize, d_v: usize) -> usize {
    8 * BC + 4 * (ROWS * d_qk + BC * (d_qk + 1) + BC * d_v + ROWS * BC)
}

/// Shared memory of `attn_decode<rows>` (bytes): q, then each warp's m,
/// l and output rows.
const fn decode_shared_bytes(rows: usize, d_qk: usize, d_v: usize) -> usize {
    4 * (rows * d_qk + DEC_WARPS * rows * (2 + d_v))
}

/// KV splits of `blocks` unsplit blocks of `kernel`: none once they fill
/// `n` blocks per multiprocessor ([`Kernel::split_targets`]), else enough
/// for two such waves on `sm_count` multiprocessors, each split keeping
/// at least the kernel's fewest keys.
fn choose_splits(kernel: Kernel, blocks: usize, max_keys: usize, sm_count: usize) -> usize {
    let (per_sm, min_keys) = kernel.split_targets();
    if blocks >= per_sm * sm_count {
        return 1;
    }
    let want = (2 * per_sm * sm_count).div_ceil(blocks.max(1));
    want.min(max_keys / min_keys).clamp(1, MAX_SPLITS)
}

/// The one `(window_left, window_right)` the kernel applies to every
/// sequence (-1: unbounded). [`KeyRange`](crate::mask::KeyRange) clamps a window side to its own
/// sequence's `sq + skv`, so the sequences' sides differ; the widest one
/// still reaches every sequence's edge wherever a narrower clamp did, and
/// an unbounded side is unbounded in every sequence.
fn launch_window(seqs: &[SeqLens]) -> (i64, i64) {
    seqs.iter().fold((-1, -1), |(l, r), s| {
        let (_, sl, sr, _, _) = s.key_range.parts();
        (l.max(sl), r.max(sr))
    })
}

/// The host side of a launch on validated arguments: grid, splits,
/// parameters and metadata; `None` when no query row exists.
fn prepare<T>(
    attn: &DotProductAttention,
    dev: &CudaDevice,
    plan: &Plan,
    kv: &CudaKvInput<'_, T>,
    meta: &AttnMetadata<'_>,
    lens: CudaAttnLens,
    num_kv_splits: Option<usize>,
) -> Result<Option<CudaAttnLaunch>, AttentionError> {
    let (b, hq, hkv) = (meta.batch, attn.num_attention_heads, attn.num_gqa_groups);
    let (dqk, dv, group) = (attn.head_dim_qk, attn.head_dim_v, attn.kv_group());
    let q_thd = attn.qkv_format == QkvFormat::Thd;
    // Query rows per sequence in `out`, padding included.
    let max_q = if q_thd {
        plan.seqs.iter().map(|s| s.sq).max().unwrap_or(0)
    } else {
        meta.max_seqlen_q
    };
    if max_q == 0 {
        return Ok(None);
    }
    let kernel = Kernel::choose(max_q, group, dqk, dv);
    let tiles = kernel.tiles(max_q, group);
    let max_keys = plan
        .seqs
        .iter()
        .map(|s| {
            let (_, _, _, first, skv) = s.key_range.parts();
            (skv - first).max(0) as usize
        })
        .max()
        .unwrap_or(0);

    let ctx = dev.context();
    let attr = |a| ctx.attribute(a).map_err(cuda_err);
    let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
    let splits = num_kv_splits
        .unwrap_or_else(|| choose_splits(kernel, tiles * hkv * b, max_keys, sm_count))
        .min(MAX_SPLITS);
    // gridDim.y and .z are at most 65535: (.., h_kv, b * splits) for
    // attn_fwd, (.., h_q, b) for attn_combine.
    if b * splits > 65535 || hkv > 65535 || (splits > 1 && hq > 65535) {
        return Err(AttentionError::InvalidArgument {
            op: OP,
            arg: "batch",
            reason: format!(
                "grid too large: batch {b} x {splits} splits, {hkv} KV heads and (when split) \
                 {hq} query heads must each be <= 65535"
            ),
        });
    }
    let smem = kernel.shared_bytes(dqk, dv);
    let smem_max =
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize;
    if smem > smem_max {
        return Err(AttentionError::InvalidArgument {
            op: OP,
            arg: "head_dim_qk",
            reason: format!(
                "d_qk {dqk}, d_v {dv} need {smem} bytes of shared memory, the device has {smem_max}"
            ),
        });
    }

    let (kv_cache, page_size, max_pages, ring_len) = match kv {
        CudaKvInput::Tensors { .. } => (0, 1, 0, 0),
        CudaKvInput::Cache { layout, .. } => (
            1,
            layout.page_size,
            layout.max_pages_per_seq,
            layout.ring_len.unwrap_or(0),
        ),
    };
    let (window_left, window_right) = launch_window(&plan.seqs);
    let params = AttnParams {
        q_rows: plan.q_rows as i64,
        ring_len: ring_len as i64,
        window_left,
        window_right,
        batch: to_i32("batch", b)?,
        h_q: to_i32("num_attention_heads", hq)?,
        h_kv: to_i32("num_gqa_groups", hkv)?,
        group: to_i32("num_attention_heads", group)?,
        d_qk: to_i32("head_dim_qk", dqk)?,
        d_v: to_i32("head_dim_v", dv)?,
        max_seqlen_q: to_i32("max_seqlen_q", meta.max_seqlen_q)?,
        q_thd: q_thd as i32,
        kv_cache,
        page_size: to_i32("kv_cache.page_size", page_size)?,
        max_pages_per_seq: to_i32("kv_cache.max_pages_per_seq", max_pages)?,
        num_splits: splits as i32,
        has_lse: lens.lse.is_some() as i32,
        scale: attn.effective_softmax_scale(),
        softcap: attn.softcap.unwrap_or(0.0),
    };

    let (k_len, v_len) = kv.tensor_lens();
    Ok(Some(CudaAttnLaunch {
        kernel,
        params,
        tiles,
        max_q,
        splits,
        smem,
        lens: [lens.q, k_len, v_len, lens.out],
        meta: seq_fields(attn, plan, kv, meta),
    }))
}

/// The device side: one `attn_fwd` launch and, when split, one
/// `attn_combine`, reading `bufs.meta` and the partials in `scratch`.
fn run<T: CudaElement>(
    attn: &DotProductAttention,
    dev: &CudaDevice,
    launch: &CudaAttnLaunch,
    bufs: CudaAttnBuffers<'_, T>,
    scratch: &mut CudaAttnScratch,
) -> Result<(), AttentionError> {
    let CudaAttnBuffers {
        meta: meta_dev,
        q,
        k,
        v,
        mut out,
        lse,
    } = bufs;
    let (params, splits, smem) = (&launch.params, launch.splits, launch.smem);
    let (hq, hkv, dv) = (
        attn.num_attention_heads,
        attn.num_gqa_groups,
        attn.head_dim_v,
    );
    let b = params.batch as usize;
    let stream = dev.stream();
    // Unused pointer arguments (no lse, no split) get a one-element buffer.
    let part_rows = if splits > 1 {
        params.q_rows as usize * hq
    } else {
        0
    };
    let CudaAttnScratch {
        dummy,
        o_part,
        lse_part,
    } = scratch;
    let o_part = grow(dev, o_part, (splits * part_rows * dv).max(1))?;
    let lse_part = grow(dev, lse_part, (splits * part_rows).max(1))?;
    let dummy = grow(dev, dummy, 1)?;
    let mut lse_view = match lse {
        Some(l) => l,
        None => dummy.slice_mut(..),
    };
    let fwd = dev
        .function(
            ATTENTION_CU,
            &format!("{}_{}", launch.kernel.name(), T::SUFFIX),
        )
        .map_err(kernel_err)?;
    if smem > 48 * 1024 {
        fwd.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(cuda_err)?;
    }
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(launch.tiles).map_err(cuda_err)?,
            hkv as u32,
            (b * splits) as u32,
        ),
        block_dim: (launch.kernel.threads(), 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut builder = stream.launch_builder(&fwd);
    builder
        .arg(&q)
        .arg(&k)
        .arg(&v)
        .arg(&meta_dev)
        .arg(&mut out)
        .arg(&mut lse_view)
        .arg(&mut *o_part)
        .arg(&mut *lse_part)
        .arg(params);
    // SAFETY: the arguments match the kernel's signature; `prepare`
    // checked every length against the shapes the kernel indexes (and
    // `launch_cuda` that the buffers are those lengths), and the page
    // table against the cache size.
    unsafe { builder.launch(cfg) }.map_err(cuda_err)?;

    if splits > 1 {
        let combine = dev
            .function(ATTENTION_CU, &format!("attn_combine_{}", T::SUFFIX))
            .map_err(kernel_err)?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(launch.max_q).map_err(cuda_err)?,
                hq as u32,
                b as u32,
            ),
            block_dim: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = stream.launch_builder(&combine);
        builder
            .arg(&*o_part)
            .arg(&*lse_part)
            .arg(&meta_dev)
            .arg(&mut out)
            .arg(&mut lse_view)
            .arg(params);
        // SAFETY: as above; the partials hold at least `splits` splits.
        unsafe { builder.launch(cfg) }.map_err(cuda_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::KeyRange;
    use crate::AttnMaskType;

    #[test]
    fn splits_only_when_the_gpu_would_idle() {
        let tiled = Kernel::Tiled;
        // Prefill: plenty of blocks.
        assert_eq!(choose_splits(tiled, 1000, 4096, 132), 1);
        // 1 block, 8192 keys: 264 wanted, capped by keys and MAX_SPLITS.
        assert_eq!(choose_splits(tiled, 1, 8192, 132), 32);
        assert_eq!(choose_splits(tiled, 1, 1 << 20, 132), MAX_SPLITS);
        // Short cache: no split.
        assert_eq!(choose_splits(tiled, 4, 100, 132), 1);
        // The decode kernel fills 4 blocks per multiprocessor: batch 8 x
        // 16 KV heads over 4096 keys wants ceil(1056 / 128) = 9 splits;
        // batch 64 x 16 heads (1024 blocks) needs none at 528.
        let decode = Kernel::Decode(1);
        assert_eq!(choose_splits(decode, 128, 4096, 132), 9);
        assert_eq!(choose_splits(decode, 1024, 4096, 132), 1);
        assert_eq!(choose_splits(decode, 16, 4096, 132), 32);
        assert_eq!(choose_splits(decode, 16, 200, 132), 1);
    }

    #[test]
    fn decode_kernels_serve_at_most_8_rows_of_heads_up_to_256() {
        assert_eq!(Kernel::choose(1, 1, 256, 256), Kernel::Decode(1));
        assert_eq!(Kernel::choose(1, 2, 64, 64), Kernel::Decode(4));
        assert_eq!(Kernel::choose(1, 4, 128, 128), Kernel::Decode(4));
        assert_eq!(Kernel::choose(1, 7, 128, 128), Kernel::Decode(8));
        assert_eq!(Kernel::choose(2, 4, 64, 64), Kernel::Decode(8));
        assert_eq!(Kernel::choose(3, 4, 64, 64), Kernel::Tiled);
        assert_eq!(Kernel::choose(9, 1, 64, 64), Kernel::Tiled);
        assert_eq!(Kernel::choose(1, 1, 512, 256), Kernel::Tiled);
        assert_eq!(Kernel::Decode(8).tiles(2, 4), 1);
        assert_eq!(Kernel::Decode(4).name(), "attn_decode4");
        assert_eq!(decode_shared_bytes(8, 256, 256), 4 * (2048 + 32 * 258));
        assert!(decode_shared_bytes(8, DEC_MAX_D, DEC_MAX_D) <= 48 * 1024);
    }

    #[test]
    fn shared_memory_of_head_dim_128_fits_48_kib() {
        assert!(shared_bytes(128, 128) <= 48 * 1024);
        assert_eq!(shared_bytes(256, 256), 256 + 4 * (4096 + 8224 + 8192 + 512));
    }
    /// Every sequence's bounds under the launch window equal its own
    /// `KeyRange`'s, with short and empty sequences beside long ones (the
    /// first sequence's clamp used to be applied to all).
    #[test]
    fn launch_window_keeps_every_sequence_s_bounds() {
        let lens = [(0, 1), (4, 11), (11, 2), (0, 0), (3, 40)];
        for mask in AttnMaskType::ALL {
            for window in [
                None,
                Some((21, -1)),
                Some((-1, 3)),
                Some((2, 5)),
                Some((0, 0)),
            ] {
                let seqs: Vec<SeqLens> = lens
                    .iter()
                    .map(|&(sq, skv)| SeqLens {
                        sq,
                        key_range: KeyRange::new(mask, window, sq, skv, 0),
                        row_base: None,
                    })
                    .collect();
                let (l, r) = launch_window(&seqs);
                for s in &seqs {
                    let (offset, _, _, first, skv) = s.key_range.parts();
                    for i in 0..s.sq {
                        let diag = i as i64 + offset;
                        let lo = if l >= 0 { (diag - l).max(first) } else { first };
                        let hi = if r >= 0 {
                            (diag + r).min(skv - 1)
                        } else {
                            skv - 1
                        };
                        assert_eq!(
                            (lo.max(0), hi),
                            s.key_range.bounds(i),
                            "{mask:?} {window:?} sq {} skv {skv} row {i}",
                            s.sq
                        );
                    }
                }
            }
        }
    }
}
