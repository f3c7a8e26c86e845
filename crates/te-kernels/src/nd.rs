//! `ndarray` front ends of the CPU ops: the same RoPE, KV save and
//! thd <-> bshd conversion as the slice API, with every shape and stride
//! read from the views.
//!
//! A view's axes mean what its format says (the crate-level alphabet):
//! bshd `[b, s, h, d]`, sbhd `[s, b, h, d]`, thd `[t, h, d]`; a KV cache is
//! `[num_pages, page_size, h_kv, d]` and its page table `[b,
//! max_pages_per_seq]`. So `batch`, `max_seqlen`, `num_heads`, `head_dim`,
//! `page_size` and the strides are never passed by hand; only what a view
//! cannot say is (`cu_seqlens`, `start_positions`, the page table, cached
//! lengths).
//!
//! Layouts: a view in standard (row-major, contiguous) layout is used in
//! place. [`apply_rope`] and [`apply_rope_out`] also read and write strided
//! views (sliced, permuted: a Q slice of a fused QKV tensor, sbhd memory
//! seen as bshd) in place through their strides, as long as no stride is
//! negative. Every other non-standard view is copied into a contiguous
//! buffer, the slice op runs on it, and outputs are copied back (a
//! non-standard KV cache view is therefore copied whole, twice: keep caches
//! contiguous). Results are the same either way.
//!
//! Errors are the slice API's [`KernelError`]: a view of the wrong rank is
//! `InvalidArgument` naming the argument and its shape; a view whose shape
//! disagrees with the others is `ShapeMismatch` with both shapes. Nothing is
//! written on error.
//!
//! ```
//! use ndarray::{s, Array4};
//! use te_kernels::nd::{self, NdRopeArgs};
//! use te_kernels::{QkvFormat, RopeConvention, RopeFreqs, RopeScaling, RopeTable};
//!
//! // Q of 1 sequence, 2 tokens, 1 head, head dim 2, stored sbhd and seen as
//! // bshd through a permuted view (no stride computed by hand).
//! let mut q_sbhd = Array4::<f32>::zeros((2, 1, 1, 2));
//! q_sbhd.slice_mut(s![.., 0, 0, 0]).fill(1.0); // x = (1, 0) at both tokens
//! let table = RopeTable::new(&RopeFreqs {
//!     base: 10000.0,
//!     rotary_dim: 2,
//!     max_positions: 16,
//!     scaling: RopeScaling::None,
//! })
//! .unwrap();
//! let q_bshd = q_sbhd.view_mut().permuted_axes([1, 0, 2, 3]); // [b, s, h, d]
//! nd::apply_rope(
//!     q_bshd,
//!     &table,
//!     &NdRopeArgs::new(QkvFormat::Bshd, RopeConvention::HalfSplit),
//! )
//! .unwrap();
//! // Token 1 sits at position 1: inv_freq = 10000^0 = 1, θ = 1 rad, and
//! // (1, 0) becomes (cos 1, sin 1).
//! assert!((q_sbhd[[1, 0, 0, 0]] - 0.540_302_3).abs() < 1e-6);
//! assert!((q_sbhd[[1, 0, 0, 1]] - 0.841_470_96).abs() < 1e-6);
//! // Token 0 (position 0) is unchanged.
//! assert_eq!(q_sbhd[[0, 0, 0, 0]], 1.0);
//! ```

use ndarray::{Array, ArrayView, ArrayView2, ArrayViewMut, Dimension};

use crate::kv_save::check_cu_seqlens;
use crate::rope::{check_no_overlap, rope_rows, RopeIo};
use crate::{
    apply_rope_cpu, apply_rope_cpu_out, save_kv_cpu, ConvertArgs, Element, KernelError,
    KvCacheLayout, KvStep, QkvFormat, RopeArgs, RopeConvention, RopeTable, TensorStrides,
};

/// The axes of a `[.., h, d]` activation tensor by meaning, as a format
/// reads a shape: bshd `[batch, seq, heads, dim]`, sbhd `[seq, batch,
/// heads, dim]`, thd `[seq, heads, dim]` with `seq` = `t` (packed rows) and
/// `batch` = 0 (thd's batch comes from `cu_seqlens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Axes {
    /// `b` (0 for thd).
    pub batch: usize,
    /// `s` (bshd/sbhd) or `t` (thd).
    pub seq: usize,
    /// `h`.
    pub heads: usize,
    /// `d`.
    pub dim: usize,
}

impl Axes {
    /// Reads `shape` as `format` says; `None` if its rank is not the
    /// format's ([`QkvFormat::rank`]).
    pub fn of(format: QkvFormat, shape: &[usize]) -> Option<Self> {
        if shape.len() != format.rank() {
            return None;
        }
        Some(match format {
            QkvFormat::Bshd => Axes {
                batch: shape[0],
                seq: shape[1],
                heads: shape[2],
                dim: shape[3],
            },
            QkvFormat::Sbhd => Axes {
                batch: shape[1],
                seq: shape[0],
                heads: shape[2],
                dim: shape[3],
            },
            QkvFormat::Thd => Axes {
                batch: 0,
                seq: shape[0],
                heads: shape[1],
                dim: shape[2],
            },
        })
    }

    /// The shape `format` gives these axes (the inverse of [`Axes::of`]).
    pub fn shape(self, format: QkvFormat) -> Vec<usize> {
        match format {
            QkvFormat::Bshd => vec![self.batch, self.seq, self.heads, self.dim],
            QkvFormat::Sbhd => vec![self.seq, self.batch, self.heads, self.dim],
            QkvFormat::Thd => vec![self.seq, self.heads, self.dim],
        }
    }
}

/// [`Axes::of`], with a wrong rank an error naming `arg` and its shape.
fn axes(
    op: &'static str,
    arg: &'static str,
    format: QkvFormat,
    shape: &[usize],
) -> Result<Axes, KernelError> {
    Axes::of(format, shape).ok_or_else(|| KernelError::InvalidArgument {
        op,
        arg,
        reason: format!(
            "a {format} tensor is {} ({} axes); the view has shape {shape:?}",
            format.shape_name(),
            format.rank()
        ),
    })
}

/// Checks a view's rank and that its shape equals `expected`.
fn expect_shape(
    op: &'static str,
    arg: &'static str,
    expected: Vec<usize>,
    got: &[usize],
) -> Result<(), KernelError> {
    if got != expected.as_slice() {
        return Err(KernelError::ShapeMismatch {
            op,
            arg,
            expected,
            got: got.to_vec(),
        });
    }
    Ok(())
}

/// A thd view's rows `t` must hold the `cu_seqlens[b]` packed tokens
/// (`cu_seqlens` already checked).
fn expect_rows(
    op: &'static str,
    arg: &'static str,
    cu_seqlens: &[i32],
    a: Axes,
) -> Result<(), KernelError> {
    let total = cu_seqlens.last().map_or(0, |&c| c as usize);
    if a.seq < total {
        return Err(KernelError::ShapeMismatch {
            op,
            arg,
            expected: vec![total, a.heads, a.dim],
            got: vec![a.seq, a.heads, a.dim],
        });
    }
    Ok(())
}

/// The view's element strides by meaning, or `None` if an axis longer than
/// 1 has a negative stride (the strided kernels take unsigned strides).
fn strides_of(format: QkvFormat, shape: &[usize], strides: &[isize]) -> Option<TensorStrides> {
    let st = |i: usize| -> Option<usize> {
        if shape[i] <= 1 {
            Some(0) // never stepped over
        } else {
            usize::try_from(strides[i]).ok()
        }
    };
    Some(match format {
        QkvFormat::Bshd => TensorStrides {
            batch: st(0)?,
            seq: st(1)?,
            head: st(2)?,
            dim: st(3)?,
        },
        QkvFormat::Sbhd => TensorStrides {
            batch: st(1)?,
            seq: st(0)?,
            head: st(2)?,
            dim: st(3)?,
        },
        QkvFormat::Thd => TensorStrides {
            batch: 0,
            seq: st(0)?,
            head: st(1)?,
            dim: st(2)?,
        },
    })
}

/// Runs `f` on the elements of `out` in standard (row-major) order: in
/// place if `out` is in standard layout, else on a contiguous copy (of
/// `out`'s values when `copy_in`, default values otherwise) that is copied
/// back when `f` succeeds.
fn with_standard_mut<T: Element, D: Dimension>(
    out: &mut ArrayViewMut<'_, T, D>,
    copy_in: bool,
    f: impl FnOnce(&mut [T]) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    if out.is_standard_layout() {
        return f(out.as_slice_mut().expect("standard layout is contiguous"));
    }
    let mut tmp = if copy_in {
        out.as_standard_layout().into_owned()
    } else {
        Array::default(out.raw_dim())
    };
    f(tmp.as_slice_mut().expect("a new array is contiguous"))?;
    out.assign(&tmp);
    Ok(())
}

/// RoPE arguments a view cannot carry (see [`RopeArgs`] for their meaning):
/// `batch`, `max_seqlen`, `num_heads`, `head_dim` and the strides come from
/// the tensor view.
#[derive(Clone, Copy, Debug)]
pub struct NdRopeArgs<'a> {
    /// How the view's axes are read: bshd `[b, s, h, d]`, sbhd `[s, b, h,
    /// d]`, thd `[t, h, d]`.
    pub format: QkvFormat,
    /// Which elements are rotated together (half-split or interleaved).
    pub convention: RopeConvention,
    /// thd: `[b + 1]` i32, non-decreasing, `cu_seqlens[0] = 0`, and
    /// `cu_seqlens[b] <= t` (rows past it are left alone); `&[]` for
    /// bshd/sbhd.
    pub cu_seqlens: &'a [i32],
    /// `[b]` i32 `>= 0`: position of each sequence's first token; `&[]`
    /// means all 0.
    pub start_positions: &'a [i32],
    /// Context-parallel world size (1: none); positions as in [`RopeArgs`].
    pub cp_size: usize,
    /// This rank, `< cp_size`.
    pub cp_rank: usize,
}

impl<'a> NdRopeArgs<'a> {
    /// No `cu_seqlens`, every sequence starting at position 0, no context
    /// parallelism.
    pub fn new(format: QkvFormat, convention: RopeConvention) -> Self {
        Self {
            format,
            convention,
            cu_seqlens: &[],
            start_positions: &[],
            cp_size: 1,
            cp_rank: 0,
        }
    }

    /// Sets `cu_seqlens` (thd).
    pub fn with_cu_seqlens(mut self, cu_seqlens: &'a [i32]) -> Self {
        self.cu_seqlens = cu_seqlens;
        self
    }

    /// Sets `start_positions`.
    pub fn with_start_positions(mut self, start_positions: &'a [i32]) -> Self {
        self.start_positions = start_positions;
        self
    }

    /// Sets the context-parallel world size and rank.
    pub fn with_context_parallel(mut self, cp_size: usize, cp_rank: usize) -> Self {
        self.cp_size = cp_size;
        self.cp_rank = cp_rank;
        self
    }

    /// The slice API's arguments for a view with axes `a`.
    fn rope_args(&self, a: Axes, strides: Option<TensorStrides>) -> RopeArgs<'a> {
        let thd = self.format == QkvFormat::Thd;
        RopeArgs {
            format: self.format,
            convention: self.convention,
            num_heads: a.heads,
            head_dim: a.dim,
            batch: if thd {
                self.cu_seqlens.len().saturating_sub(1)
            } else {
                a.batch
            },
            max_seqlen: if thd { 0 } else { a.seq },
            cu_seqlens: self.cu_seqlens,
            start_positions: self.start_positions,
            cp_size: self.cp_size,
            cp_rank: self.cp_rank,
            strides,
        }
    }
}

const ROPE: &str = "rope";

/// [`apply_rope_cpu`] on a view: RoPE in place on `x` (`[b, s, h, d]`,
/// `[s, b, h, d]` or `[t, h, d]` per `args.format`; f32, f16 or bf16, f32
/// math). Strided views with non-negative strides are rotated in place
/// through their strides; others go through a contiguous copy.
///
/// Errors: `x` of the wrong rank, a thd `x` with fewer than
/// `cu_seqlens[b]` rows, and every error of [`apply_rope_cpu`].
pub fn apply_rope<T: Element, D: Dimension>(
    mut x: ArrayViewMut<'_, T, D>,
    table: &RopeTable,
    args: &NdRopeArgs<'_>,
) -> Result<(), KernelError> {
    let a = axes(ROPE, "x", args.format, x.shape())?;
    let strides = strides_of(args.format, x.shape(), x.strides());
    let rope = args.rope_args(a, strides);
    // Everything is validated before any copy.
    let plan = rope.plan(table.rotary_dim(), table.max_positions())?;
    if args.format == QkvFormat::Thd {
        expect_rows(ROPE, "x", args.cu_seqlens, a)?;
    }
    if strides.is_none() {
        let rope = args.rope_args(a, None);
        return with_standard_mut(&mut x, true, |x| apply_rope_cpu(x, table, &rope));
    }
    check_no_overlap(&rope, &plan)?;
    let p = x.as_mut_ptr();
    // SAFETY: every element addressed is `(b, i, h, e)` within the view's
    // shape (bshd/sbhd: b < batch, i < max_seqlen from the shape; thd: rows
    // < cu_seqlens[b] <= t, checked above) at the view's own non-negative
    // strides, so in bounds and owned by the view (`&mut`); distinct
    // elements have distinct addresses (`check_no_overlap`).
    unsafe { rope_rows(RopeIo::in_place(p, plan.strides), table, &rope, plan.tokens) };
    Ok(())
}

/// [`apply_rope_cpu_out`] on views: reads `x` (as in [`apply_rope`], any
/// strides), writes `out`, which has `x`'s shape for bshd/sbhd and
/// `[cu_seqlens[b], h, d]` for thd (elements `d2..d` copied). `out` may be
/// any view (standard layout is written in place, others through a copy).
///
/// Errors: `x` or `out` of the wrong rank or shape, and every error of
/// [`apply_rope_cpu_out`].
pub fn apply_rope_out<T: Element, D: Dimension, E: Dimension>(
    x: ArrayView<'_, T, D>,
    mut out: ArrayViewMut<'_, T, E>,
    table: &RopeTable,
    args: &NdRopeArgs<'_>,
) -> Result<(), KernelError> {
    let a = axes(ROPE, "x", args.format, x.shape())?;
    axes(ROPE, "out", args.format, out.shape())?;
    let strides = strides_of(args.format, x.shape(), x.strides());
    let rope = args.rope_args(a, strides);
    let plan = rope.plan(table.rotary_dim(), table.max_positions())?;
    let expected = if args.format == QkvFormat::Thd {
        expect_rows(ROPE, "x", args.cu_seqlens, a)?;
        vec![plan.tokens, a.heads, a.dim]
    } else {
        x.shape().to_vec()
    };
    expect_shape(ROPE, "out", expected, out.shape())?;
    match strides {
        Some(_) => with_standard_mut(&mut out, false, |out| {
            let dst = TensorStrides::contiguous(
                rope.format,
                rope.batch,
                rope.max_seqlen,
                rope.num_heads,
                rope.head_dim,
            );
            // SAFETY: `x` is read at `(b, i, h, e)` within its shape at its
            // non-negative strides (thd rows < cu_seqlens[b] <= t, checked
            // above); `out` is contiguous with exactly `tokens * h * d`
            // elements (its shape was checked), each written by one task.
            unsafe {
                rope_rows(
                    RopeIo::out_of_place(x.as_ptr(), plan.strides, out.as_mut_ptr(), dst),
                    table,
                    &rope,
                    plan.tokens,
                )
            };
            Ok(())
        }),
        None => {
            let x = x.as_standard_layout();
            let x = x.as_slice().expect("standard layout is contiguous");
            with_standard_mut(&mut out, false, |out| {
                apply_rope_cpu_out(x, out, table, &rope)
            })
        }
    }
}

const SAVE: &str = "save_kv";

/// What [`save_kv`] needs besides the tensors: the step's layout and
/// lengths and the cache's addressing (see [`KvStep`] and
/// [`KvCacheLayout`]; `num_heads_kv`, the head dims, `page_size`,
/// `max_seqlen` and `max_pages_per_seq` come from the views).
#[derive(Clone, Debug)]
pub struct NdSaveArgs<'a> {
    /// How `k` and `v` are read: bshd `[b, s, h_kv, d]`, sbhd `[s, b, h_kv,
    /// d]`, thd `[t, h_kv, d]`.
    pub format: QkvFormat,
    /// `[b + 1]` i32: sequence `b` has `cu_seqlens[b + 1] - cu_seqlens[b]`
    /// new tokens (bshd/sbhd: the first ones of its `s` rows).
    pub cu_seqlens: &'a [i32],
    /// `[b, max_pages_per_seq]` i32 physical page ids (a contiguous cache
    /// `[max_batch, max_seqlen, ..]`: one column, `page_size = max_seqlen`,
    /// entry = the sequence's slot).
    pub page_table: ArrayView2<'a, i32>,
    /// `[b]` i32: tokens of each sequence in the cache, this step included.
    pub cache_seqlens: &'a [i32],
    /// Sliding-window ring length (a multiple of `page_size`), or `None`.
    pub ring_len: Option<usize>,
}

/// [`save_kv_cpu`] on views: copies the step's new `k` and `v` (layout per
/// `args.format`) into `k_cache: [num_pages, page_size, h_kv, d_k]` and
/// `v_cache: [num_pages, page_size, h_kv, d_v]`; cache rows the step does
/// not address keep their values. Non-standard views are copied (caches
/// whole, and back).
///
/// Errors: a view of the wrong rank; `k` whose heads or head dim differ
/// from `k_cache`'s, or (bshd/sbhd) whose batch differs from
/// `cache_seqlens`; `v` not `k`'s shape with `v_cache`'s head dim;
/// `v_cache` not `[num_pages, page_size, h_kv, _]` of `k_cache`; a page
/// table without one row per sequence; a thd `k` with fewer than
/// `cu_seqlens[b]` rows; and every error of [`save_kv_cpu`].
pub fn save_kv<T: Element, D: Dimension, E: Dimension>(
    k: ArrayView<'_, T, D>,
    v: ArrayView<'_, T, D>,
    mut k_cache: ArrayViewMut<'_, T, E>,
    mut v_cache: ArrayViewMut<'_, T, E>,
    args: &NdSaveArgs<'_>,
) -> Result<(), KernelError> {
    let batch = args.cache_seqlens.len();
    let rank4 = |arg: &'static str, shape: &[usize]| {
        if shape.len() == 4 {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument {
                op: SAVE,
                arg,
                reason: format!(
                    "a KV cache is [num_pages, page_size, h_kv, d] (4 axes); the view has shape {shape:?}"
                ),
            })
        }
    };
    rank4("k_cache", k_cache.shape())?;
    rank4("v_cache", v_cache.shape())?;
    let kc = k_cache.shape().to_vec();
    let (num_pages, page_size, h_kv, d_k) = (kc[0], kc[1], kc[2], kc[3]);
    let d_v = v_cache.shape()[3];
    expect_shape(
        SAVE,
        "v_cache",
        vec![num_pages, page_size, h_kv, d_v],
        v_cache.shape(),
    )?;
    let ka = axes(SAVE, "k", args.format, k.shape())?;
    axes(SAVE, "v", args.format, v.shape())?;
    let want_k = Axes {
        batch: if args.format == QkvFormat::Thd {
            0
        } else {
            batch
        },
        heads: h_kv,
        dim: d_k,
        ..ka
    };
    expect_shape(SAVE, "k", want_k.shape(args.format), k.shape())?;
    expect_shape(
        SAVE,
        "v",
        Axes { dim: d_v, ..want_k }.shape(args.format),
        v.shape(),
    )?;
    let pt = args.page_table;
    expect_shape(SAVE, "page_table", vec![batch, pt.ncols()], pt.shape())?;
    check_cu_seqlens(SAVE, args.cu_seqlens, batch)?;
    if args.format == QkvFormat::Thd {
        expect_rows(SAVE, "k", args.cu_seqlens, ka)?;
    }
    let pt = pt.as_standard_layout();
    let layout = KvCacheLayout {
        num_heads_kv: h_kv,
        head_dim_k: d_k,
        head_dim_v: d_v,
        page_size,
        page_table: pt.as_slice().expect("standard layout is contiguous"),
        max_pages_per_seq: args.page_table.ncols(),
        cache_seqlens: args.cache_seqlens,
        ring_len: args.ring_len,
    };
    let step = KvStep {
        format: args.format,
        cu_seqlens: args.cu_seqlens,
        max_seqlen: if args.format == QkvFormat::Thd {
            0
        } else {
            ka.seq
        },
    };
    let (k, v) = (k.as_standard_layout(), v.as_standard_layout());
    let (k, v) = (
        k.as_slice().expect("standard layout is contiguous"),
        v.as_slice().expect("standard layout is contiguous"),
    );
    // Validate before copying a non-standard cache.
    if !(k_cache.is_standard_layout() && v_cache.is_standard_layout()) {
        crate::kv_save::plan_save(
            k.len(),
            v.len(),
            k_cache.len(),
            v_cache.len(),
            &layout,
            &step,
            &mut Vec::new(),
        )?;
    }
    with_standard_mut(&mut k_cache, true, |kc| {
        with_standard_mut(&mut v_cache, true, |vc| {
            save_kv_cpu(k, v, kc, vc, &layout, &step)
        })
    })
}

/// Checks a thd <-> bshd pair of views and returns the slice API's
/// arguments.
fn convert_args<'a>(
    op: &'static str,
    thd: &[usize],
    bshd: &[usize],
    cu_seqlens: &'a [i32],
) -> Result<ConvertArgs<'a>, KernelError> {
    let t = axes(op, "thd", QkvFormat::Thd, thd)?;
    let b = axes(op, "bshd", QkvFormat::Bshd, bshd)?;
    let batch = cu_seqlens.len().saturating_sub(1);
    check_cu_seqlens(op, cu_seqlens, batch)?;
    expect_shape(op, "bshd", vec![batch, b.seq, t.heads, t.dim], bshd)?;
    expect_rows(op, "thd", cu_seqlens, t)?;
    Ok(ConvertArgs {
        cu_seqlens,
        num_heads: t.heads,
        head_dim: t.dim,
        max_seqlen: b.seq,
    })
}

/// [`crate::convert_thd_to_bshd`] on views: packed `thd: [t, h, d]` into padded
/// `bshd: [b, s, h, d]` (`b = cu_seqlens.len() - 1`); rows past each
/// sequence's length become 0.
///
/// Errors: a view of the wrong rank, `bshd` not `[b, s, h, d]` with `thd`'s
/// `h` and `d`, `t < cu_seqlens[b]`, and every error of
/// [`crate::convert_thd_to_bshd`].
pub fn convert_thd_to_bshd<T: Element, D: Dimension, E: Dimension>(
    thd: ArrayView<'_, T, D>,
    mut bshd: ArrayViewMut<'_, T, E>,
    cu_seqlens: &[i32],
) -> Result<(), KernelError> {
    let args = convert_args("convert_thd_to_bshd", thd.shape(), bshd.shape(), cu_seqlens)?;
    let thd = thd.as_standard_layout();
    let thd = thd.as_slice().expect("standard layout is contiguous");
    with_standard_mut(&mut bshd, false, |bshd| {
        crate::kv_save::convert_thd_to_bshd(thd, bshd, &args)
    })
}

/// [`crate::convert_bshd_to_thd`] on views: padded `bshd: [b, s, h, d]` into
/// packed `thd: [t, h, d]`; rows `cu_seqlens[b]..t` become 0.
///
/// Errors: as [`convert_thd_to_bshd`].
pub fn convert_bshd_to_thd<T: Element, D: Dimension, E: Dimension>(
    bshd: ArrayView<'_, T, D>,
    mut thd: ArrayViewMut<'_, T, E>,
    cu_seqlens: &[i32],
) -> Result<(), KernelError> {
    let args = convert_args("convert_bshd_to_thd", thd.shape(), bshd.shape(), cu_seqlens)?;
    let bshd = bshd.as_standard_layout();
    let bshd = bshd.as_slice().expect("standard layout is contiguous");
    with_standard_mut(&mut thd, false, |thd| {
        crate::kv_save::convert_bshd_to_thd(bshd, thd, &args)
    })
}
