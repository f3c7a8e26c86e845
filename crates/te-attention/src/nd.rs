//! `ndarray` front end of [`DotProductAttention::forward_cpu`] with K/V as
//! tensors: [`DotProductAttention::forward_nd`].
//!
//! Shapes come from the views, read as the configured formats say
//! (`qkv_format` for Q and the output, `kv_format` for K and V): bshd
//! `[b, s, h, d]`, sbhd `[s, b, h, d]`, thd `[t, h, d]`. So `batch`,
//! `max_seqlen_q` and `max_seqlen_kv` are never passed by hand; only the
//! `cu_seqlens` a view cannot carry ([`NdSeqlens`]). For thd Q, the batch
//! is `cu_seqlens_q.len() - 1`.
//!
//! Layouts: views in standard (row-major, contiguous) layout are used in
//! place; other views (sliced, permuted, reversed) are copied into
//! contiguous buffers, and the output and lse are copied back. Results are
//! the same either way.
//!
//! Errors: [`AttentionError`], as the slice API's: a view of the wrong rank
//! is `InvalidArgument` naming the argument and its shape; a shape that
//! disagrees with the configuration or with another view is `ShapeMismatch`
//! with both shapes. Nothing is written on error.
//!
//! ```
//! use ndarray::{array, Array4};
//! use te_attention::nd::NdSeqlens;
//! use te_attention::DotProductAttention;
//!
//! // One sequence, one query, two keys, one head of dim 2, bshd.
//! let q = array![[[[1.0f32, 0.0]]]]; // [b, s_q, h, d] = [1, 1, 1, 2]
//! let k = array![[[[0.0f32, 0.0]], [[3f32.ln(), 0.0]]]]; // [1, 2, 1, 2]
//! let v = array![[[[1.0f32, 0.0]], [[0.0, 1.0]]]];
//! let attn = DotProductAttention::new(1, 2).with_softmax_scale(1.0);
//! let mut out = Array4::<f32>::zeros((1, 1, 1, 2));
//! let mut lse = ndarray::Array3::<f32>::zeros((1, 1, 1)); // [b, h, s_q]
//! attn.forward_nd(
//!     q.view(),
//!     k.view(),
//!     v.view(),
//!     &NdSeqlens::default(),
//!     out.view_mut(),
//!     Some(lse.view_mut().into_dyn()),
//! )
//! .unwrap();
//! // Scores (0, ln 3): softmax (1/4, 3/4), so out = v0 / 4 + 3 v1 / 4,
//! // and lse = ln(e^0 + e^ln 3) = ln 4.
//! assert!((out[[0, 0, 0, 0]] - 0.25).abs() < 1e-6);
//! assert!((out[[0, 0, 0, 1]] - 0.75).abs() < 1e-6);
//! assert!((lse[[0, 0, 0]] - 4f32.ln()).abs() < 1e-6);
//! ```

use ndarray::{Array, ArrayView, ArrayViewMut, ArrayViewMutD, Dimension};
use te_kernels::nd::Axes;
use te_kernels::{Element, QkvFormat};

use crate::attention::{lengths_from_cu, OP};
use crate::{AttentionError, AttnMetadata, DotProductAttention, KvInput};

/// The sequence offsets a forward on views needs besides the tensors (see
/// [`AttnMetadata`]; `batch` and the padded lengths come from the views).
#[derive(Clone, Copy, Debug, Default)]
pub struct NdSeqlens<'a> {
    /// `[b + 1]` i32 query offsets: required for thd Q or a padding mask.
    pub cu_seqlens_q: Option<&'a [i32]>,
    /// `[b + 1]` i32 key offsets: required for thd K/V or a padding mask.
    pub cu_seqlens_kv: Option<&'a [i32]>,
}

/// [`Axes::of`], with a wrong rank an error naming `arg` and its shape.
fn axes(arg: &'static str, format: QkvFormat, shape: &[usize]) -> Result<Axes, AttentionError> {
    Axes::of(format, shape).ok_or_else(|| AttentionError::InvalidArgument {
        op: OP,
        arg,
        reason: format!(
            "a {format} tensor is {} ({} axes); the view has shape {shape:?}",
            format.shape_name(),
            format.rank()
        ),
    })
}

fn expect_shape(
    arg: &'static str,
    expected: Vec<usize>,
    got: &[usize],
) -> Result<(), AttentionError> {
    if got != expected.as_slice() {
        return Err(AttentionError::ShapeMismatch {
            op: OP,
            arg,
            expected,
            got: got.to_vec(),
        });
    }
    Ok(())
}

/// Runs `f` on the elements of `out` in standard order: in place when `out`
/// is in standard layout, else on a default-filled contiguous buffer that
/// is copied back when `f` succeeds (the forward writes every element).
fn with_standard_mut<T: Element, D: Dimension>(
    out: &mut ArrayViewMut<'_, T, D>,
    f: impl FnOnce(&mut [T]) -> Result<(), AttentionError>,
) -> Result<(), AttentionError> {
    if out.is_standard_layout() {
        return f(out.as_slice_mut().expect("standard layout is contiguous"));
    }
    let mut tmp = Array::default(out.raw_dim());
    f(tmp.as_slice_mut().expect("a new array is contiguous"))?;
    out.assign(&tmp);
    Ok(())
}

/// Batch, padded length and (thd) total rows of a Q or K/V view.
struct Side {
    batch: usize,
    max_seqlen: usize,
    rows: usize,
}

/// Reads one side's lengths from its view (and `cu_seqlens` for thd).
fn side(
    cu_arg: &'static str,
    format: QkvFormat,
    a: Axes,
    cu: Option<&[i32]>,
    batch: Option<usize>,
) -> Result<Side, AttentionError> {
    if format != QkvFormat::Thd {
        return Ok(Side {
            batch: a.batch,
            max_seqlen: a.seq,
            rows: a.seq,
        });
    }
    let batch = match (batch, cu) {
        (Some(b), _) => b,
        (None, Some(cu)) => cu.len().saturating_sub(1),
        (None, None) => 0, // lengths_from_cu names the missing argument
    };
    let mut lens = Vec::new();
    lengths_from_cu(cu_arg, cu, batch, None, &mut lens)?;
    Ok(Side {
        batch,
        max_seqlen: 0,
        rows: lens.iter().sum(),
    })
}

impl DotProductAttention {
    /// [`DotProductAttention::forward_cpu`] on `ndarray` views, K/V as
    /// tensors (see [`crate::nd`] for how shapes and layouts are read).
    ///
    /// - `q`: `[.., h_q, d_qk]` in `qkv_format`: bshd `[b, s_q, h_q, d_qk]`,
    ///   sbhd `[s_q, b, h_q, d_qk]`, thd `[t_q, h_q, d_qk]` with `t_q =
    ///   cu_seqlens_q[b]`.
    /// - `k`, `v`: `[.., h_kv, d_qk]` and `[.., h_kv, d_v]` in `kv_format`
    ///   (bshd/sbhd with the same `b` as Q; thd `t_kv = cu_seqlens_kv[b]`).
    /// - `out`: Q's shape with `d_v`; every element written (padded or
    ///   fully masked queries get 0). `O` may differ from `T`.
    /// - `lse`: optional f32 natural-log LSE, `[b, h_q, s_q]` (bshd/sbhd)
    ///   or `[h_q, t_q]` (thd); -inf where a query sees no key. Any rank-3
    ///   or rank-2 view, passed as `lse.view_mut().into_dyn()`.
    ///
    /// Errors: a view of the wrong rank or shape (naming it, with both
    /// shapes), and every error of [`DotProductAttention::forward_cpu`].
    pub fn forward_nd<T, O, D, E, F>(
        &self,
        q: ArrayView<'_, T, D>,
        k: ArrayView<'_, T, E>,
        v: ArrayView<'_, T, E>,
        seqlens: &NdSeqlens<'_>,
        mut out: ArrayViewMut<'_, O, F>,
        lse: Option<ArrayViewMutD<'_, f32>>,
    ) -> Result<(), AttentionError>
    where
        T: Element,
        O: Element,
        D: Dimension,
        E: Dimension,
        F: Dimension,
    {
        self.validate()?;
        let (hq, hkv) = (self.num_attention_heads, self.num_gqa_groups);
        let (dqk, dv) = (self.head_dim_qk, self.head_dim_v);
        let (qf, kf) = (self.qkv_format, self.kv_format);

        // Q: its batch and lengths, then its exact shape.
        let qa = axes("q", qf, q.shape())?;
        let qs = side("cu_seqlens_q", qf, qa, seqlens.cu_seqlens_q, None)?;
        let q_axes = Axes {
            batch: if qf == QkvFormat::Thd { 0 } else { qs.batch },
            seq: qs.rows,
            heads: hq,
            dim: dqk,
        };
        expect_shape("q", q_axes.shape(qf), q.shape())?;
        let b = qs.batch;

        // K and V: the same batch as Q.
        let ka = axes("k", kf, k.shape())?;
        axes("v", kf, v.shape())?;
        let ks = side("cu_seqlens_kv", kf, ka, seqlens.cu_seqlens_kv, Some(b))?;
        let k_axes = Axes {
            batch: if kf == QkvFormat::Thd { 0 } else { b },
            seq: ks.rows,
            heads: hkv,
            dim: dqk,
        };
        expect_shape("k", k_axes.shape(kf), k.shape())?;
        expect_shape("v", Axes { dim: dv, ..k_axes }.shape(kf), v.shape())?;

        // Outputs.
        axes("out", qf, out.shape())?;
        expect_shape("out", Axes { dim: dv, ..q_axes }.shape(qf), out.shape())?;
        let lse_shape = if qf == QkvFormat::Thd {
            vec![hq, qs.rows]
        } else {
            vec![b, hq, qs.max_seqlen]
        };
        if let Some(l) = &lse {
            expect_shape("lse", lse_shape, l.shape())?;
        }

        let meta = AttnMetadata {
            batch: b,
            max_seqlen_q: qs.max_seqlen,
            max_seqlen_kv: ks.max_seqlen,
            cu_seqlens_q: seqlens.cu_seqlens_q,
            cu_seqlens_kv: seqlens.cu_seqlens_kv,
        };
        let (q, k, v) = (
            q.as_standard_layout(),
            k.as_standard_layout(),
            v.as_standard_layout(),
        );
        let contiguous = "standard layout is contiguous";
        let kv = KvInput::Tensors {
            k: k.as_slice().expect(contiguous),
            v: v.as_slice().expect(contiguous),
        };
        let q = q.as_slice().expect(contiguous);
        // A failing forward writes nothing, and nothing is copied back.
        with_standard_mut(&mut out, |out| match lse {
            None => self.forward_cpu(q, kv, &meta, out, None),
            Some(mut lse) => with_standard_mut(&mut lse, |lse| {
                self.forward_cpu(q, kv, &meta, out, Some(lse))
            }),
        })
    }
}
