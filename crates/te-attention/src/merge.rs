//! Merging partial attention results by log-sum-exp (split-KV decode, ring
//! attention; docs/ARCHITECTURE.md, "Context parallelism").
//!
//! Two partial results over disjoint key sets, each normalized over its own
//! keys, `(out_a, lse_a)` and `(out_b, lse_b)`, combine into the result over
//! the union: `lse = max + ln(1 + exp(min - max))` of the two lse, and
//! `out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`. A side with
//! lse = -inf (no visible key) contributes nothing: merging with it returns
//! the other side unchanged, and two empty sides stay output 0, lse -inf.

use crate::error::AttentionError;

const OP: &str = "merge_partial";

/// Merges one row in place: `(out_a, lse_a) <- merge((out_a, lse_a),
/// (out_b, lse_b))`. `out_a`, `out_b`: `[d_v]` f32; lse: natural log.
/// [`merge_partial`] checks whole tensors and returns errors; this
/// per-row primitive panics if `out_a` and `out_b` differ in length.
#[inline]
pub fn merge_row(out_a: &mut [f32], lse_a: &mut f32, out_b: &[f32], lse_b: f32) {
    assert_eq!(
        out_a.len(),
        out_b.len(),
        "merge_row: rows of different lengths"
    );
    if lse_b == f32::NEG_INFINITY {
        return;
    }
    if *lse_a == f32::NEG_INFINITY {
        out_a.copy_from_slice(out_b);
        *lse_a = lse_b;
        return;
    }
    let (max, min) = if *lse_a >= lse_b {
        (*lse_a, lse_b)
    } else {
        (lse_b, *lse_a)
    };
    let lse = max + (min - max).exp().ln_1p();
    let wa = (*lse_a - lse).exp();
    let wb = (lse_b - lse).exp();
    for (a, &b) in out_a.iter_mut().zip(out_b) {
        *a = *a * wa + b * wb;
    }
    *lse_a = lse;
}

/// Merges a whole thd partial result into `(out_a, lse_a)` in place.
///
/// `out_a`, `out_b`: `[t, h, d_v]` f32; `lse_a`, `lse_b`: `[h, t]` f32
/// natural log (the thd LSE layout of
/// [`crate::DotProductAttention::forward_cpu`]), `t = lse.len() / h`.
///
/// Errors: [`AttentionError::ShapeMismatch`] when the lengths disagree.
pub fn merge_partial(
    out_a: &mut [f32],
    lse_a: &mut [f32],
    out_b: &[f32],
    lse_b: &[f32],
    num_heads: usize,
    head_dim_v: usize,
) -> Result<(), AttentionError> {
    if num_heads == 0 || head_dim_v == 0 {
        return Err(AttentionError::InvalidArgument {
            op: OP,
            arg: if num_heads == 0 {
                "num_heads"
            } else {
                "head_dim_v"
            },
            reason: "must be > 0".into(),
        });
    }
    let t = lse_a.len() / num_heads;
    let checks: [(&'static str, usize, Vec<usize>); 4] = [
        ("lse_a", lse_a.len(), vec![num_heads, t]),
        ("lse_b", lse_b.len(), vec![num_heads, t]),
        ("out_a", out_a.len(), vec![t, num_heads, head_dim_v]),
        ("out_b", out_b.len(), vec![t, num_heads, head_dim_v]),
    ];
    for (arg, got, expected) in checks {
        if got != expected.iter().product::<usize>() {
            return Err(AttentionError::ShapeMismatch {
                op: OP,
                arg,
                expected,
                got: vec![got],
            });
        }
    }
    for (tok, (oa, ob)) in out_a
        .chunks_exact_mut(num_heads * head_dim_v)
        .zip(out_b.chunks_exact(num_heads * head_dim_v))
        .enumerate()
    {
        for h in 0..num_heads {
            merge_row(
                &mut oa[h * head_dim_v..][..head_dim_v],
                &mut lse_a[h * t + tok],
                &ob[h * head_dim_v..][..head_dim_v],
                lse_b[h * t + tok],
            );
        }
    }
    Ok(())
}
