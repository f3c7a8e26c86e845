//! RoPE on the GPU (`kernels/rope.cu`), same arguments and checks as
//! [`crate::apply_rope_cpu`].

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};

use super::device::{cuda_err, CudaDevice, CudaElement};
use super::source::KernelSource;
use crate::rope::{check_no_overlap, TensorStrides};
use crate::{KernelError, QkvFormat, RopeArgs, RopeConvention, RopeTable};

/// `kernels/rope.cu`.
pub const ROPE_CU: KernelSource = KernelSource {
    name: "rope.cu",
    text: include_str!("../../kernels/rope.cu"),
};

/// Threads per block of `rope_fwd_*`.
pub const ROPE_THREADS: u32 = 128;

/// A [`RopeTable`] uploaded to one device: `cos`, `sin` `[max_positions, d2/2]` f32.
pub struct CudaRopeTable {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    rotary_dim: usize,
    max_positions: usize,
}

impl CudaRopeTable {
    /// Uploads `table` (once; share it across layers).
    pub fn new(dev: &CudaDevice, table: &RopeTable) -> Result<Self, KernelError> {
        Ok(Self {
            cos: dev.stream().clone_htod(table.cos()).map_err(cuda_err)?,
            sin: dev.stream().clone_htod(table.sin()).map_err(cuda_err)?,
            rotary_dim: table.rotary_dim(),
            max_positions: table.max_positions(),
        })
    }

    /// Rotary dim `d2`.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// Number of positions covered.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }
}

/// Mirror of `RopeParams` in `kernels/rope.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RopeParams {
    in_strides: [i64; 4],
    out_strides: [i64; 4],
    format: i32,
    interleaved: i32,
    batch: i32,
    max_seqlen: i32,
    num_heads: i32,
    head_dim: i32,
    rotary_dim: i32,
    cp_size: i32,
    cp_rank: i32,
    copy_tail: i32,
}

// SAFETY: plain-old-data with the same `repr(C)` layout as the kernel's struct.
unsafe impl DeviceRepr for RopeParams {}

fn strides(s: &TensorStrides) -> [i64; 4] {
    [s.batch as i64, s.seq as i64, s.head as i64, s.dim as i64]
}

fn to_i32(arg: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::InvalidArgument {
        op: "rope",
        arg,
        reason: format!("{v} exceeds i32"),
    })
}

/// Shared body: `x = None` means in place on `out` with the input strides;
/// `meta = None`: `args`' cu_seqlens and start positions are uploaded here.
fn launch<T: CudaElement>(
    dev: &CudaDevice,
    x: Option<&CudaSlice<T>>,
    out: &mut CudaSlice<T>,
    table: &CudaRopeTable,
    args: &RopeArgs,
    meta: Option<RopeMeta<'_>>,
) -> Result<(), KernelError> {
    let plan = args.plan(table.rotary_dim, table.max_positions)?;
    let in_len = x.map_or(out.len(), |x| x.len());
    if in_len < plan.min_len {
        return Err(KernelError::InvalidArgument {
            op: "rope",
            arg: "x",
            reason: format!(
                "has {in_len} elements, the arguments address {}",
                plan.min_len
            ),
        });
    }
    let out_strides = match x {
        None => {
            check_no_overlap(args, &plan)?;
            plan.strides
        }
        Some(_) => {
            let n = plan.tokens * args.num_heads * args.head_dim;
            if out.len() != n {
                return Err(KernelError::ShapeMismatch {
                    op: "rope",
                    arg: "out",
                    expected: vec![plan.tokens, args.num_heads, args.head_dim],
                    got: vec![out.len()],
                });
            }
            TensorStrides::contiguous(
                args.format,
                args.batch,
                args.max_seqlen,
                args.num_heads,
                args.head_dim,
            )
        }
    };
    if plan.tokens == 0 {
        return Ok(());
    }
    let params = RopeParams {
        in_strides: strides(&plan.strides),
        out_strides: strides(&out_strides),
        format: match args.format {
            QkvFormat::Bshd => 0,
            QkvFormat::Sbhd => 1,
            QkvFormat::Thd => 2,
        },
        interleaved: (args.convention == RopeConvention::Interleaved) as i32,
        batch: to_i32("batch", args.batch)?,
        max_seqlen: to_i32("max_seqlen", args.max_seqlen)?,
        num_heads: to_i32("num_heads", args.num_heads)?,
        head_dim: to_i32("head_dim", args.head_dim)?,
        rotary_dim: table.rotary_dim as i32,
        cp_size: to_i32("cp_size", args.cp_size)?,
        cp_rank: to_i32("cp_rank", args.cp_rank)?,
        copy_tail: x.is_some() as i32,
    };
    let grid = u32::try_from(plan.tokens)
        .ok()
        .filter(|&g| g < i32::MAX as u32)
        .ok_or_else(|| KernelError::InvalidArgument {
            op: "rope",
            arg: "x",
            reason: "too many tokens".into(),
        })?;
    // Metadata: the caller's device copy, or one host-to-device copy
    // `[cu_seqlens | start_positions]`.
    let uploaded;
    let (cu, starts) = match meta {
        Some(m) => {
            let cu_len = args.cu_seqlens.len().max(1);
            let starts_len = args.start_positions.len().max(args.batch);
            if m.cu_seqlens.len() != cu_len || m.start_positions.len() != starts_len {
                return Err(KernelError::ShapeMismatch {
                    op: "rope",
                    arg: "meta",
                    expected: vec![cu_len, starts_len],
                    got: vec![m.cu_seqlens.len(), m.start_positions.len()],
                });
            }
            (m.cu_seqlens.slice(..), m.start_positions.slice(..))
        }
        None => {
            let mut host: Vec<i32> = if args.cu_seqlens.is_empty() {
                vec![0]
            } else {
                args.cu_seqlens.to_vec()
            };
            let cu_len = host.len();
            if args.start_positions.is_empty() {
                host.resize(cu_len + args.batch, 0);
            } else {
                host.extend_from_slice(args.start_positions);
            }
            uploaded = dev.stream().clone_htod(&host).map_err(cuda_err)?;
            (uploaded.slice(..cu_len), uploaded.slice(cu_len..))
        }
    };
    let stream = dev.stream();
    let f = dev.function(ROPE_CU, &format!("rope_fwd_{}", T::SUFFIX))?;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (ROPE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let null: u64 = 0;
    let mut b = stream.launch_builder(&f);
    b.arg(out);
    match x {
        Some(x) => b.arg(x),
        None => b.arg(&null),
    };
    b.arg(&table.cos)
        .arg(&table.sin)
        .arg(&cu)
        .arg(&starts)
        .arg(&params);
    // SAFETY: argument types match the kernel signature; every index the
    // kernel forms was validated by `plan` (bounds, positions < table size).
    unsafe { b.launch(cfg) }.map_err(cuda_err)?;
    Ok(())
}

/// [`crate::apply_rope_cpu`] on the GPU: RoPE in place on `x` (layout per
/// `args`, strided allowed if non-overlapping). Same errors, checked before
/// the launch; asynchronous on `dev.stream()`.
pub fn apply_rope_cuda<T: CudaElement>(
    dev: &CudaDevice,
    x: &mut CudaSlice<T>,
    table: &CudaRopeTable,
    args: &RopeArgs,
) -> Result<(), KernelError> {
    launch(dev, None, x, table, args, None)
}

/// [`crate::apply_rope_cpu_out`] on the GPU: reads strided `x`, writes
/// contiguous `out` (tail `d2..d` copied). Asynchronous on `dev.stream()`.
pub fn apply_rope_cuda_out<T: CudaElement>(
    dev: &CudaDevice,
    x: &CudaSlice<T>,
    out: &mut CudaSlice<T>,
    table: &CudaRopeTable,
    args: &RopeArgs,
) -> Result<(), KernelError> {
    launch(dev, Some(x), out, table, args, None)
}

/// `args`' `cu_seqlens: [b + 1]` and `start_positions: [b]` i32 already on
/// the device (a step's plan, uploaded once for every layer), with the same
/// contents as the host slices in `args` (which are still what is
/// validated: positions against the table).
#[derive(Clone, Copy, Debug)]
pub struct RopeMeta<'a> {
    pub cu_seqlens: &'a CudaView<'a, i32>,
    pub start_positions: &'a CudaView<'a, i32>,
}

/// [`apply_rope_cuda`] reading the metadata from `meta` instead of
/// uploading it: no allocation and no copy, so it can be captured in a CUDA
/// graph and replayed after `meta` is rewritten in place.
///
/// Errors: those of [`apply_rope_cuda`]; `meta`'s lengths differ from
/// `args`' (`[b + 1]`, `[b]`).
pub fn apply_rope_cuda_meta<T: CudaElement>(
    dev: &CudaDevice,
    x: &mut CudaSlice<T>,
    table: &CudaRopeTable,
    args: &RopeArgs,
    meta: RopeMeta<'_>,
) -> Result<(), KernelError> {
    launch(dev, None, x, table, args, Some(meta))
}
