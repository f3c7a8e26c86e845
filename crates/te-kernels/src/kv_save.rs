//! KV-cache save (a step's new keys and values into the cache) and the
//! thd <-> bshd conversions, on the CPU.
//!
//! Addressing is [`KvCacheLayout`]'s: the step's tokens of sequence `b` are the
//! absolute positions `[cache_seqlens[b] - step_len_b, cache_seqlens[b])`, and
//! position `pos` is written to cache row `layout.row(b, pos)`.

use rayon::prelude::*;

// `check_cu_seqlens` is re-exported for `crate::nd`.
pub(crate) use crate::cu_seqlens::check_cu_seqlens;
use crate::shared_mut::SharedMut;
use crate::{Element, KernelError, KvCacheLayout, QkvFormat};

const OP: &str = "save_kv";

/// Layout of the step's new `k` and `v`.
///
/// - bshd: `k: [b, s, h_kv, d_k]`, `s = max_seqlen`;
/// - sbhd: `k: [s, b, h_kv, d_k]`;
/// - thd: `k: [t, h_kv, d_k]`, `t >= cu_seqlens[b]`.
///
/// `v` likewise with `d_v`. In every format sequence `b` has
/// `step_len_b = cu_seqlens[b + 1] - cu_seqlens[b]` new tokens (for bshd/sbhd
/// the first `step_len_b` rows of its `s`; the rest is padding, not read).
#[derive(Clone, Copy, Debug)]
pub struct KvStep<'a> {
    pub format: QkvFormat,
    /// `[b + 1]` i32, non-decreasing, `cu_seqlens[0] = 0`.
    pub cu_seqlens: &'a [i32],
    /// `s` of bshd/sbhd (`>= every step_len_b`); ignored for thd.
    pub max_seqlen: usize,
}

/// The copies one save performs: `(source token row, cache row)` pairs,
/// sorted by cache row, every cache row distinct.
///
/// On a sliding-window layer (`ring_len = Some(r)`) a sequence whose step is
/// longer than `r` keeps only its last `r` tokens (the earlier ones would be
/// overwritten within the same step).
pub(crate) fn plan_save(
    k_len: usize,
    v_len: usize,
    k_cache_len: usize,
    v_cache_len: usize,
    layout: &KvCacheLayout,
    step: &KvStep,
    pairs: &mut Vec<(u64, u64)>,
) -> Result<(), KernelError> {
    let bad = |arg, reason: String| KernelError::InvalidArgument {
        op: OP,
        arg,
        reason,
    };
    let batch = layout.batch();
    check_cu_seqlens(OP, step.cu_seqlens, batch)?;
    let (h, dk, dv, ps) = (
        layout.num_heads_kv,
        layout.head_dim_k,
        layout.head_dim_v,
        layout.page_size,
    );
    if h == 0 || dk == 0 || dv == 0 || ps == 0 {
        return Err(bad(
            "layout",
            "num_heads_kv, head_dims and page_size must be positive".into(),
        ));
    }
    let rows = match step.format {
        QkvFormat::Thd => step.cu_seqlens[batch] as usize,
        _ => batch * step.max_seqlen,
    };
    for (arg, len, d) in [("k", k_len, dk), ("v", v_len, dv)] {
        let ok = match step.format {
            QkvFormat::Thd => len.is_multiple_of(h * d) && len / (h * d) >= rows,
            _ => len == rows * h * d,
        };
        if !ok {
            return Err(KernelError::ShapeMismatch {
                op: OP,
                arg,
                expected: vec![rows, h, d],
                got: vec![len],
            });
        }
    }
    let page_elems_k = ps * h * dk;
    if k_cache_len == 0 || !k_cache_len.is_multiple_of(page_elems_k) {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            arg: "k_cache",
            expected: vec![0, ps, h, dk],
            got: vec![k_cache_len],
        });
    }
    let num_pages = k_cache_len / page_elems_k;
    if v_cache_len != num_pages * ps * h * dv {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            arg: "v_cache",
            expected: vec![num_pages, ps, h, dv],
            got: vec![v_cache_len],
        });
    }
    if layout.page_table.len() < batch * layout.max_pages_per_seq {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            arg: "page_table",
            expected: vec![batch, layout.max_pages_per_seq],
            got: vec![layout.page_table.len()],
        });
    }
    if let Some(r) = layout.ring_len {
        if r == 0 || !r.is_multiple_of(ps) {
            return Err(bad(
                "ring_len",
                format!("{r} is not a positive multiple of page_size {ps}"),
            ));
        }
    }
    pairs.clear();
    pairs.reserve(rows);
    for b in 0..batch {
        let step_len = (step.cu_seqlens[b + 1] - step.cu_seqlens[b]) as usize;
        if step.format != QkvFormat::Thd && step_len > step.max_seqlen {
            return Err(bad(
                "cu_seqlens",
                format!(
                    "sequence {b} has {step_len} new tokens, more than max_seqlen {}",
                    step.max_seqlen
                ),
            ));
        }
        let seqlen = layout.cache_seqlens[b];
        if seqlen < 0 || (seqlen as usize) < step_len {
            return Err(bad(
                "cache_seqlens",
                format!(
                    "sequence {b} has cache_seqlens {seqlen}, fewer than its {step_len} new tokens"
                ),
            ));
        }
        let seqlen = seqlen as usize;
        let first = seqlen - step_len;
        let skip = layout.ring_len.map_or(0, |r| step_len.saturating_sub(r));
        for i in skip..step_len {
            let pos = first + i;
            let logical = layout.ring_len.map_or(pos, |r| pos % r);
            let col = logical / ps;
            if col >= layout.max_pages_per_seq {
                return Err(bad(
                    "page_table",
                    format!("sequence {b} position {pos} needs page column {col}, past max_pages_per_seq {}", layout.max_pages_per_seq),
                ));
            }
            let page = layout.page_table[b * layout.max_pages_per_seq + col];
            if page < 0 || page as usize >= num_pages {
                return Err(bad(
                    "page_table",
                    format!(
                        "sequence {b} position {pos} maps to page {page}, outside 0..{num_pages}"
                    ),
                ));
            }
            let src = step
                .format
                .token_row(b, i, batch, step.max_seqlen, step.cu_seqlens);
            pairs.push((src as u64, layout.row(b, pos) as u64));
        }
    }
    pairs.sort_unstable_by_key(|&(_, dst)| dst);
    if let Some(w) = pairs.windows(2).find(|w| w[0].1 == w[1].1) {
        return Err(bad(
            "page_table",
            format!(
                "two new tokens map to the same cache row {} (pages shared between sequences)",
                w[0].1
            ),
        ));
    }
    Ok(())
}

/// Copies the step's new keys and values into the cache.
///
/// `k`, `v`: see [`KvStep`]. `k_cache: [num_pages, page_size, h_kv, d_k]`,
/// `v_cache: [num_pages, page_size, h_kv, d_v]` (a contiguous cache
/// `[max_batch, max_seqlen, h_kv, d]` is `page_size = max_seqlen` with
/// `page_table[b] = slot`). Sliding-window layers: see [`KvCacheLayout`];
/// when a step is longer than `ring_len`, only its last `ring_len` tokens are
/// written. Cache rows not addressed by the step are untouched.
///
/// Errors: shapes inconsistent with `layout` and `step`, `cache_seqlens[b]`
/// below the step length, page ids outside the cache or page-table columns
/// past `max_pages_per_seq`, two tokens mapping to one cache row. Nothing is
/// written on error.
pub fn save_kv_cpu<T: Element>(
    k: &[T],
    v: &[T],
    k_cache: &mut [T],
    v_cache: &mut [T],
    layout: &KvCacheLayout,
    step: &KvStep,
) -> Result<(), KernelError> {
    save_kv_cpu_reusing(k, v, k_cache, v_cache, layout, step, &mut Vec::new())
}

/// [`save_kv_cpu`] with the (source row, cache row) pairs it plans kept in
/// `pairs`, a buffer the caller reuses across calls so that a step
/// allocates nothing once `pairs` has grown to the step's token count.
/// Same arguments, errors and effect as [`save_kv_cpu`].
pub fn save_kv_cpu_reusing<T: Element>(
    k: &[T],
    v: &[T],
    k_cache: &mut [T],
    v_cache: &mut [T],
    layout: &KvCacheLayout,
    step: &KvStep,
    pairs: &mut Vec<(u64, u64)>,
) -> Result<(), KernelError> {
    plan_save(
        k.len(),
        v.len(),
        k_cache.len(),
        v_cache.len(),
        layout,
        step,
        pairs,
    )?;
    let rk = layout.num_heads_kv * layout.head_dim_k;
    let rv = layout.num_heads_kv * layout.head_dim_v;
    let (kc, vc) = (
        SharedMut(k_cache.as_mut_ptr()),
        SharedMut(v_cache.as_mut_ptr()),
    );
    let copy = |&(src, dst): &(u64, u64)| {
        let (kc, vc) = (kc, vc);
        let (src, dst) = (src as usize, dst as usize);
        // SAFETY: `plan_save` checked every cache row is in bounds and
        // distinct, so tasks write disjoint rows.
        unsafe {
            std::ptr::copy_nonoverlapping(k[src * rk..][..rk].as_ptr(), kc.0.add(dst * rk), rk);
            std::ptr::copy_nonoverlapping(v[src * rv..][..rv].as_ptr(), vc.0.add(dst * rv), rv);
        }
    };
    // A decode step's few rows are copied faster than the pool is woken.
    if pairs.len() * (rk + rv) <= SERIAL_SAVE_MAX {
        pairs.iter().for_each(copy);
    } else {
        pairs.par_iter().with_min_len(8).for_each(copy);
    }
    Ok(())
}

/// Up to this many values per save, rows are copied on the calling thread.
const SERIAL_SAVE_MAX: usize = 64 * 1024;

/// Shape of a thd <-> bshd conversion: `thd: [t, h, d]` with `t >=
/// cu_seqlens[b]`, `bshd: [b, s, h, d]` with `s = max_seqlen >= every
/// sequence length`.
#[derive(Clone, Copy, Debug)]
pub struct ConvertArgs<'a> {
    /// `[b + 1]` i32.
    pub cu_seqlens: &'a [i32],
    pub num_heads: usize,
    pub head_dim: usize,
    pub max_seqlen: usize,
}

impl ConvertArgs<'_> {
    /// Validates and returns `(b, t, row elements)`.
    pub(crate) fn check(
        &self,
        op: &'static str,
        thd_len: usize,
        bshd_len: usize,
    ) -> Result<(usize, usize, usize), KernelError> {
        let batch = self.cu_seqlens.len().saturating_sub(1);
        check_cu_seqlens(op, self.cu_seqlens, batch)?;
        let row = self.num_heads * self.head_dim;
        if row == 0 {
            return Err(KernelError::InvalidArgument {
                op,
                arg: "num_heads",
                reason: "heads and head_dim must be positive".into(),
            });
        }
        if let Some(b) = (0..batch)
            .find(|&b| (self.cu_seqlens[b + 1] - self.cu_seqlens[b]) as usize > self.max_seqlen)
        {
            return Err(KernelError::InvalidArgument {
                op,
                arg: "max_seqlen",
                reason: format!("sequence {b} is longer than max_seqlen {}", self.max_seqlen),
            });
        }
        if bshd_len != batch * self.max_seqlen * row {
            return Err(KernelError::ShapeMismatch {
                op,
                arg: "bshd",
                expected: vec![batch, self.max_seqlen, self.num_heads, self.head_dim],
                got: vec![bshd_len],
            });
        }
        let t = thd_len / row;
        if !thd_len.is_multiple_of(row) || t < self.cu_seqlens[batch] as usize {
            return Err(KernelError::ShapeMismatch {
                op,
                arg: "thd",
                expected: vec![
                    self.cu_seqlens[batch] as usize,
                    self.num_heads,
                    self.head_dim,
                ],
                got: vec![thd_len],
            });
        }
        Ok((batch, t, row))
    }
}

/// Packed `thd: [t, h, d]` to padded `bshd: [b, s, h, d]`; rows past each
/// sequence's length are zero. Errors: shapes inconsistent with `args`.
pub fn convert_thd_to_bshd<T: Element>(
    thd: &[T],
    bshd: &mut [T],
    args: &ConvertArgs,
) -> Result<(), KernelError> {
    let (_, _, row) = args.check("convert_thd_to_bshd", thd.len(), bshd.len())?;
    let cu = args.cu_seqlens;
    let s = args.max_seqlen;
    if s == 0 {
        return Ok(());
    }
    bshd.par_chunks_mut(row)
        .enumerate()
        .with_min_len(16)
        .for_each(|(r, out)| {
            let (b, i) = (r / s, r % s);
            let len = (cu[b + 1] - cu[b]) as usize;
            if i < len {
                let src = cu[b] as usize + i;
                out.copy_from_slice(&thd[src * row..(src + 1) * row]);
            } else {
                out.fill(T::default());
            }
        });
    Ok(())
}

/// Padded `bshd: [b, s, h, d]` to packed `thd: [t, h, d]`; rows
/// `cu_seqlens[b]..t` are zero. Errors: shapes inconsistent with `args`.
pub fn convert_bshd_to_thd<T: Element>(
    bshd: &[T],
    thd: &mut [T],
    args: &ConvertArgs,
) -> Result<(), KernelError> {
    let (batch, _, row) = args.check("convert_bshd_to_thd", thd.len(), bshd.len())?;
    let cu = args.cu_seqlens;
    let total = cu[batch] as usize;
    let s = args.max_seqlen;
    thd.par_chunks_mut(row)
        .enumerate()
        .with_min_len(16)
        .for_each(|(r, out)| {
            if r < total {
                let b = cu.partition_point(|&c| c as usize <= r) - 1;
                let src = b * s + (r - cu[b] as usize);
                out.copy_from_slice(&bshd[src * row..(src + 1) * row]);
            } else {
                out.fill(T::default());
            }
        });
    Ok(())
}
