//! The CPU kernel: tiled online softmax (flash-attention style).
//!
//! Work unit: one sequence `b`, one KV head `g`, and a tile of up to
//! `BR` queries; the unit's rows are (query, query head of `g`'s GQA group)
//! pairs, `m = queries * kv_group <= ~64`, so each K/V row is read once for
//! the whole group. For each key tile of up to `BC` keys (only those some
//! row of the unit can see), K is gathered transposed into `kt: [d_qk, bc]`
//! and V into `v: [bc, d_v]` (f32, any dtype, any cache page layout), then
//! `s = q · kt`, softcap and mask, the running max `m`, sum `l` and output
//! `o` are rescaled (Milakov & Gimelshein 2018; Dao et al. 2022,
//! FlashAttention), and `o += p · v`. The score matrix never exceeds
//! `m x BC`. Units run in parallel with rayon; scratch is reused per worker.

use rayon::prelude::*;
use te_kernels::{Element, QkvFormat};

use crate::attention::{AttnMetadata, DotProductAttention, KvInput, Plan};
use crate::tile_math::{axpy, dot, exp, exp_sub_sum, gemm};

/// Target rows (query x head) per work unit.
const TARGET_ROWS: usize = 64;
/// Keys per key tile.
const BC: usize = 128;
/// Units with at most this many rows (decode) skip the K/V gather: scores
/// are dot products and `o += p v` axpys straight from the source rows.
const DIRECT_MAX_ROWS: usize = 8;

#[derive(Clone, Copy)]
struct Unit {
    b: usize,
    g: usize,
    i0: usize,
    i1: usize,
}

/// One unit's normalized output `[m, d_v]` and lse `[m]`, rows
/// `(query - i0) * kv_group + head_in_group`.
struct TileOut {
    unit: Unit,
    o: Vec<f32>,
    lse: Vec<f32>,
}

#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
}

struct Ctx<'a, T> {
    attn: &'a DotProductAttention,
    plan: &'a Plan,
    meta: &'a AttnMetadata<'a>,
    q: &'a [T],
    kv: KvInput<'a, T>,
    scale: f32,
    group: usize,
}

impl<T: Element> Ctx<'_, T> {
    fn q_row(&self, b: usize, i: usize) -> usize {
        let m = self.meta;
        self.attn
            .qkv_format
            .token_row(b, i, m.batch, m.max_seqlen_q, m.cu_seqlens_q.unwrap_or(&[]))
    }

    /// Row of key `j` of sequence `b` in K/V (units of `h_kv * d`) and the
    /// K and V tensors.
    #[inline]
    fn kv_row(&self, b: usize, j: usize) -> (usize, &[T], &[T]) {
        match self.kv {
            KvInput::Tensors { k, v } => {
                let m = self.meta;
                let row = self.attn.kv_format.token_row(
                    b,
                    j,
                    m.batch,
                    m.max_seqlen_kv,
                    m.cu_seqlens_kv.unwrap_or(&[]),
                );
                (row, k, v)
            }
            KvInput::Cache(view) => (view.layout.row(b, j), view.k_cache, view.v_cache),
        }
    }

    /// Runs one unit, compiled with AVX2+FMA when the CPU has them.
    fn run(&self, u: Unit, s: &mut Scratch) -> TileOut {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { self.run_avx2(u, s) };
        }
        self.run_impl::<false>(u, s)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, u: Unit, s: &mut Scratch) -> TileOut {
        self.run_impl::<true>(u, s)
    }

    #[inline(always)]
    fn run_impl<const FMA: bool>(&self, u: Unit, s: &mut Scratch) -> TileOut {
        let a = self.attn;
        let (hq, hkv, dqk, dv) = (
            a.num_attention_heads,
            a.num_gqa_groups,
            a.head_dim_qk,
            a.head_dim_v,
        );
        let group = self.group;
        let m = (u.i1 - u.i0) * group;
        let key_range = self.plan.seqs[u.b].key_range;

        // q: [m, d_qk], pre-multiplied by softmax_scale.
        s.q.resize(m * dqk, 0.0);
        for i in u.i0..u.i1 {
            let row = self.q_row(u.b, i);
            let src = &self.q[(row * hq + u.g * group) * dqk..][..group * dqk];
            let dst = &mut s.q[(i - u.i0) * group * dqk..][..group * dqk];
            for (d, x) in dst.iter_mut().zip(src) {
                *d = x.to_f32() * self.scale;
            }
        }

        let mut o = vec![0f32; m * dv];
        let mut row_max = vec![f32::NEG_INFINITY; m];
        let mut row_sum = vec![0f32; m];
        let lo = key_range.bounds(u.i0).0;
        let hi = key_range.bounds(u.i1 - 1).1;
        let mut j0 = lo;
        while j0 <= hi {
            let bc = (hi + 1 - j0).min(BC as i64) as usize;
            let j0u = j0 as usize;
            s.s.resize(m * bc, 0.0);
            if m <= DIRECT_MAX_ROWS {
                // s[r, jj] = q_r · k_(j0 + jj), read in place.
                for jj in 0..bc {
                    let (row, k, _) = self.kv_row(u.b, j0u + jj);
                    let k_src = &k[(row * hkv + u.g) * dqk..][..dqk];
                    for r in 0..m {
                        s.s[r * bc + jj] = dot::<T, FMA>(&s.q[r * dqk..][..dqk], k_src);
                    }
                }
            } else {
                // kt: [d_qk, bc], v: [bc, d_v] gathered as f32.
                s.kt.resize(dqk * bc, 0.0);
                s.v.resize(bc * dv, 0.0);
                for jj in 0..bc {
                    let (row, k, v) = self.kv_row(u.b, j0u + jj);
                    let k_src = &k[(row * hkv + u.g) * dqk..][..dqk];
                    for (p, x) in k_src.iter().enumerate() {
                        s.kt[p * bc + jj] = x.to_f32();
                    }
                    let v_src = &v[(row * hkv + u.g) * dv..][..dv];
                    for (d, x) in s.v[jj * dv..][..dv].iter_mut().zip(v_src) {
                        *d = x.to_f32();
                    }
                }
                // s: [m, bc] = q · kt.
                gemm::<FMA>(m, bc, dqk, &s.q, dqk, &s.kt, bc, &mut s.s, bc, false);
            }
            for r in 0..m {
                let (rlo, rhi) = key_range.bounds(u.i0 + r / group);
                let start = (rlo - j0).clamp(0, bc as i64) as usize;
                let end = (rhi + 1 - j0).clamp(0, bc as i64) as usize;
                let row = &mut s.s[r * bc..][..bc];
                if start >= end {
                    row.fill(0.0);
                    continue;
                }
                let valid = &mut row[start..end];
                if let Some(cap) = a.softcap {
                    for x in valid.iter_mut() {
                        *x = cap * (*x / cap).tanh();
                    }
                }
                let tile_max = valid.iter().fold(f32::NEG_INFINITY, |acc, &x| acc.max(x));
                let new_max = row_max[r].max(tile_max);
                let correction = exp(row_max[r] - new_max);
                row_sum[r] = row_sum[r] * correction + exp_sub_sum(valid, new_max);
                row_max[r] = new_max;
                if correction != 1.0 {
                    for x in &mut o[r * dv..][..dv] {
                        *x *= correction;
                    }
                }
                row[..start].fill(0.0);
                row[end..].fill(0.0);
            }
            // o: [m, d_v] += p · v.
            if m <= DIRECT_MAX_ROWS {
                for jj in 0..bc {
                    let (row, _, v) = self.kv_row(u.b, j0u + jj);
                    let v_src = &v[(row * hkv + u.g) * dv..][..dv];
                    for r in 0..m {
                        axpy::<T, FMA>(s.s[r * bc + jj], v_src, &mut o[r * dv..][..dv]);
                    }
                }
            } else {
                gemm::<FMA>(m, dv, bc, &s.s, bc, &s.v, dv, &mut o, dv, true);
            }
            j0 += bc as i64;
        }

        let mut lse = vec![f32::NEG_INFINITY; m];
        for r in 0..m {
            let o_row = &mut o[r * dv..][..dv];
            if row_sum[r] > 0.0 {
                let inv = 1.0 / row_sum[r];
                o_row.iter_mut().for_each(|x| *x *= inv);
                lse[r] = row_max[r] + row_sum[r].ln();
            } else {
                o_row.fill(0.0);
            }
        }
        TileOut { unit: u, o, lse }
    }
}

/// Runs a validated forward (see [`DotProductAttention::forward_cpu`]).
pub(crate) fn forward<T: Element, O: Element>(
    attn: &DotProductAttention,
    plan: &Plan,
    q: &[T],
    kv: KvInput<'_, T>,
    meta: &AttnMetadata<'_>,
    out: &mut [O],
    lse: Option<&mut [f32]>,
) {
    let group = attn.kv_group();
    let br = (TARGET_ROWS / group).max(1);
    let mut units = Vec::new();
    for (b, seq) in plan.seqs.iter().enumerate() {
        for g in 0..attn.num_gqa_groups {
            for i0 in (0..seq.sq).step_by(br) {
                units.push(Unit {
                    b,
                    g,
                    i0,
                    i1: (i0 + br).min(seq.sq),
                });
            }
        }
    }
    let ctx = Ctx {
        attn,
        plan,
        meta,
        q,
        kv,
        scale: attn.effective_softmax_scale(),
        group,
    };
    let tiles: Vec<TileOut> = units
        .into_par_iter()
        .map_init(Scratch::default, |s, u| ctx.run(u, s))
        .collect();

    // Scatter; rows no unit covers (bshd/sbhd padding) stay 0 / -inf.
    let (hq, dv) = (attn.num_attention_heads, attn.head_dim_v);
    out.fill(O::from_f32(0.0));
    let mut lse = lse;
    if let Some(l) = lse.as_deref_mut() {
        l.fill(f32::NEG_INFINITY);
    }
    for t in &tiles {
        let u = t.unit;
        for i in u.i0..u.i1 {
            let row = ctx.q_row(u.b, i);
            let r0 = (i - u.i0) * group;
            let dst = &mut out[(row * hq + u.g * group) * dv..][..group * dv];
            for (d, &x) in dst.iter_mut().zip(&t.o[r0 * dv..][..group * dv]) {
                *d = O::from_f32(x);
            }
            if let Some(l) = lse.as_deref_mut() {
                for hh in 0..group {
                    let h = u.g * group + hh;
                    let idx = match attn.qkv_format {
                        QkvFormat::Thd => h * plan.q_rows + row,
                        QkvFormat::Bshd | QkvFormat::Sbhd => (u.b * hq + h) * meta.max_seqlen_q + i,
                    };
                    l[idx] = t.lse[r0 + hh];
                }
            }
        }
    }
}
