//! The CPU path of [`DotProductAttention`]: its entry points
//! ([`DotProductAttention::forward_cpu`] and the variants taking an
//! [`AttentionWorkspace`]) and the kernel, tiled online softmax
//! (flash-attention style).
//!
//! Work unit: one sequence `b`, a range of KV heads, a tile of queries and
//! a range of keys; the unit's rows are (KV head, query, query head of that
//! KV head's GQA group) triples, so each K/V row is read once for its whole
//! group. Prefill units have one KV head and up to `TARGET_ROWS` rows.
//! Decode units (at most `DIRECT_MAX_ROWS` rows per KV head) cover every KV
//! head of the sequence, so a cache page's K and V rows are read front to
//! back, once; past `SPLIT_KEYS` keys their key ranges are split into
//! pieces of that many keys, run in parallel, and the partial results
//! merged by log-sum-exp (flash-decoding, Dao et al. 2023). Where a unit
//! splits depends on its own keys only, so a sequence's result does not
//! depend on what else is in the batch.
//!
//! For each key tile of up to `BC` keys (only those some row of the unit
//! can see), the K and V rows are read in place (any dtype, any cache page
//! layout; page addresses looked up once per page): the transposed scores
//! `s^T: [bc, m]` are `K q^T` (a register-tiled product, or on decode units
//! per-key dot products with explicit SIMD, `crate::simd`), then softcap
//! and mask, the running max, sum and output are rescaled (Milakov &
//! Gimelshein 2018; Dao et al. 2022, FlashAttention), vectorized across the
//! `m` columns, and `o += p · v` (a tiled product, or on decode units one
//! key at a time). The score matrix never exceeds `BC x m`. The kernel is
//! compiled for AVX-512, AVX2+FMA+F16C and baseline x86-64 and picked at
//! run time. No software prefetch: on decode units the hardware
//! prefetcher streams the pages better than prefetch instructions did. Units run in parallel with rayon (on the calling thread for small
//! forwards); scratch is reused per worker.

use rayon::prelude::*;
use te_kernels::{Element, QkvFormat};

use crate::attention::{AttnMetadata, AttnOutput, DotProductAttention, KvInput, Plan, Positions};
use crate::error::AttentionError;
use crate::merge::merge_row;
use crate::simd::{prefetch, Portable, Simd};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::tile_math::{exp, gemm, GemmOut};

/// Target rows (query x head) per work unit.
const TARGET_ROWS: usize = 64;
/// Keys per key tile.
const BC: usize = 128;
/// Sequences with at most this many rows per KV head (queries x GQA group:
/// decode) get decode units: every KV head, scores as dot products of each
/// K row with the head's query rows; larger ones get prefill units (one KV
/// head, a register-tiled product `s^T = K q^T`).
const DIRECT_MAX_ROWS: usize = 8;
/// Decode units are split along their keys into pieces of this many keys
/// (the last one shorter), counted from the unit's first visible key: a
/// long decode gets parallel work, and where the pieces fall depends on
/// the sequence alone, never on the batch or the thread count, so its
/// result is the same bits in any batch.
const SPLIT_KEYS: i64 = 1024;
/// Score columns of the tiled path are padded to a multiple of this (a
/// multiple of every instruction set's `NR`).
const COL_PAD: usize = 32;

/// How many keys ahead the direct (decode) path prefetches K and V rows:
/// each key's rows are a few hundred bytes of work, so without it every
/// key waits on memory (batched decode reads every sequence's cache once
/// per layer).
const PREFETCH_KEYS: usize = 8;

/// Forwards with fewer multiply-adds than this run on the calling thread
/// (rayon's wake-up costs more than the work).
const SERIAL_MACS: usize = 1 << 18;

#[derive(Clone, Copy)]
struct Unit {
    /// Sequence.
    b: usize,
    /// KV heads `g0..g1`.
    g0: usize,
    g1: usize,
    /// Queries `i0..i1`.
    i0: usize,
    i1: usize,
    /// Keys `k_lo..=k_hi` (further limited by each query's visible range).
    k_lo: i64,
    k_hi: i64,
}

impl Unit {
    /// Rows per KV head: queries x GQA group.
    fn rows_per_head(&self, group: usize) -> usize {
        (self.i1 - self.i0) * group
    }

    /// The same unit with another key range (a piece of a split).
    fn same_rows(&self, other: &Unit) -> bool {
        (self.b, self.g0, self.i0) == (other.b, other.g0, other.i0)
    }
}

/// Per-worker buffers, reused across units.
#[derive(Default)]
struct Scratch {
    /// Scaled queries: `[m, d_qk]` (direct path) or `q^T: [d_qk, mp]`.
    q: Vec<f32>,
    /// Scores, then probabilities, transposed: `[bc, mp]`.
    s: Vec<f32>,
    /// Element offsets of the tile's K and V rows (of KV head 0).
    k_off: Vec<usize>,
    v_off: Vec<usize>,
    /// Per score column: visible keys `[start, end)` of the tile, running
    /// max and sum, and the tile's max / rescale factor.
    start: Vec<u32>,
    end: Vec<u32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    tile_max: Vec<f32>,
    corr: Vec<f32>,
    /// `tile_max` repeated for each of the tile's `bc` rows: `[bc, mp]`.
    max_rows: Vec<f32>,
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

    /// The K and V tensors (or cache tensors).
    fn kv_data(&self) -> (&[T], &[T]) {
        match self.kv {
            KvInput::Tensors { k, v } => (k, v),
            KvInput::Cache(view) => (view.k_cache, view.v_cache),
        }
    }

    /// Rows (units of `h_kv * d`) of keys `j0..j0 + bc` of sequence `b`
    /// into `rows` (cleared first); a cache page's address is looked up
    /// once per page.
    fn kv_rows(&self, b: usize, j0: usize, bc: usize, rows: &mut Vec<usize>) {
        rows.clear();
        match self.kv {
            KvInput::Tensors { .. } => {
                let m = self.meta;
                let cu = m.cu_seqlens_kv.unwrap_or(&[]);
                let f = self.attn.kv_format;
                rows.extend((j0..j0 + bc).map(|j| f.token_row(b, j, m.batch, m.max_seqlen_kv, cu)));
            }
            KvInput::Cache(view) => {
                let l = view.layout;
                let mut j = j0;
                while j < j0 + bc {
                    // Slots of one page are consecutive rows; a ring
                    // (`ring_len` a multiple of `page_size`) wraps only at a
                    // page boundary.
                    let logical = l.ring_len.map_or(j, |r| j % r);
                    let run = (l.page_size - logical % l.page_size).min(j0 + bc - j);
                    let row0 = l.row(b, j);
                    rows.extend(row0..row0 + run);
                    j += run;
                }
            }
        }
    }

    /// Runs one unit with the widest instruction set the CPU has, writing
    /// its normalized output `o: [m, d_v]` and lse `lse: [m]` (rows
    /// `(kv_head - g0) * rows_per_head + (query - i0) * kv_group +
    /// head_in_group`).
    fn run(&self, u: Unit, s: &mut Scratch, o: &mut [f32], lse: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F (checked just above);
                // AVX-512F implies AVX2 and FMA.
                return unsafe { self.run_avx512(u, s, o, lse) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked just
                // above).
                return unsafe { self.run_avx2(u, s, o, lse) };
            }
        }
        // SAFETY: the portable primitives need no CPU feature.
        unsafe { self.run_impl::<Portable<false>, false, 4, 8>(u, s, o, lse) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn run_avx512(&self, u: Unit, s: &mut Scratch, o: &mut [f32], lse: &mut [f32]) {
        // SAFETY: this function is compiled for AVX-512 and its caller
        // checked the CPU.
        unsafe { self.run_impl::<Avx512, true, 8, 32>(u, s, o, lse) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, u: Unit, s: &mut Scratch, o: &mut [f32], lse: &mut [f32]) {
        // SAFETY: this function is compiled for AVX2, FMA and F16C and its
        // caller checked the CPU.
        unsafe { self.run_impl::<Avx2, true, 4, 16>(u, s, o, lse) }
    }

    /// One unit; `S`: the decode primitives, `FMA`: compiled with FMA;
    /// `MR x NR`: the register tile of the tiled path.
    ///
    /// # Safety
    /// The CPU supports `S`'s instruction set and the caller is compiled
    /// for it.
    #[inline(always)]
    unsafe fn run_impl<S: Simd, const FMA: bool, const MR: usize, const NR: usize>(
        &self,
        u: Unit,
        s: &mut Scratch,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        let a = self.attn;
        let (hq, hkv, dqk, dv) = (
            a.num_attention_heads,
            a.num_gqa_groups,
            a.head_dim_qk,
            a.head_dim_v,
        );
        let group = self.group;
        let rph = u.rows_per_head(group);
        let m = (u.g1 - u.g0) * rph;
        let direct = rph <= DIRECT_MAX_ROWS;
        debug_assert!(direct || u.g1 == u.g0 + 1);
        // Score columns: m, padded on the tiled path.
        let mp = if direct {
            m
        } else {
            m.div_ceil(COL_PAD) * COL_PAD
        };
        let (k_all, v_all) = self.kv_data();

        // Queries pre-multiplied by softmax_scale: [m, d_qk] (direct) or
        // q^T [d_qk, mp] with zero padding columns.
        s.q.clear();
        s.q.resize(if direct { m * dqk } else { dqk * mp }, 0.0);
        for g in u.g0..u.g1 {
            for i in u.i0..u.i1 {
                let row = self.q_row(u.b, i);
                let src = &self.q[(row * hq + g * group) * dqk..][..group * dqk];
                let r0 = (g - u.g0) * rph + (i - u.i0) * group;
                if direct {
                    for (d, x) in s.q[r0 * dqk..][..group * dqk].iter_mut().zip(src) {
                        *d = x.to_f32() * self.scale;
                    }
                } else {
                    for (hh, src) in src.chunks_exact(dqk).enumerate() {
                        for (p, x) in src.iter().enumerate() {
                            s.q[p * mp + r0 + hh] = x.to_f32() * self.scale;
                        }
                    }
                }
            }
        }

        debug_assert_eq!((o.len(), lse.len()), (m * dv, m));
        o.fill(0.0);
        s.row_max.clear();
        s.row_max.resize(mp, f32::NEG_INFINITY);
        s.row_sum.clear();
        s.row_sum.resize(mp, 0.0);
        for v in [&mut s.tile_max, &mut s.corr] {
            v.clear();
            v.resize(mp, 0.0);
        }
        s.start.clear();
        s.start.resize(mp, 0);
        s.end.clear();
        s.end.resize(mp, 0);

        let lo = self.plan.bounds(u.b, u.i0).0.max(u.k_lo);
        let hi = self.plan.bounds(u.b, u.i1 - 1).1.min(u.k_hi);
        let mut j0 = lo;
        while j0 <= hi {
            let bc = (hi + 1 - j0).min(BC as i64) as usize;
            let j0u = j0 as usize;
            self.kv_rows(u.b, j0u, bc, &mut s.k_off);
            s.v_off.clear();
            s.v_off.extend(s.k_off.iter().map(|&r| r * hkv * dv));
            for r in s.k_off.iter_mut() {
                *r *= hkv * dqk;
            }
            s.s.resize(bc * mp, 0.0);

            // s^T [bc, mp] = K q^T.
            if direct {
                let q = &s.q;
                for jj in 0..bc {
                    if let Some(&ko) = s.k_off.get(jj + PREFETCH_KEYS) {
                        prefetch(&k_all[ko + u.g0 * dqk..][..(u.g1 - u.g0) * dqk]);
                    }
                    let s_row = &mut s.s[jj * mp..][..mp];
                    for g in u.g0..u.g1 {
                        let k_row = &k_all[s.k_off[jj] + g * dqk..][..dqk];
                        let rows = (g - u.g0) * rph..(g - u.g0 + 1) * rph;
                        let mut r = rows.start;
                        while r + 4 <= rows.end {
                            // SAFETY: guaranteed by this function's caller.
                            let d = unsafe {
                                S::dots::<T, 4>(
                                    std::array::from_fn(|x| &q[(r + x) * dqk..][..dqk]),
                                    k_row,
                                )
                            };
                            s_row[r..r + 4].copy_from_slice(&d);
                            r += 4;
                        }
                        // The last 1-3 rows in one call (each row's sum is
                        // the same whatever the call's row count).
                        let qr = |x: usize| &q[(r + x) * dqk..][..dqk];
                        // SAFETY (each arm): guaranteed by this function's caller.
                        match rows.end - r {
                            0 => {}
                            1 => s_row[r] = unsafe { S::dots::<T, 1>([qr(0)], k_row)[0] },
                            2 => s_row[r..r + 2].copy_from_slice(&unsafe {
                                S::dots::<T, 2>([qr(0), qr(1)], k_row)
                            }),
                            3 => s_row[r..r + 3].copy_from_slice(&unsafe {
                                S::dots::<T, 3>([qr(0), qr(1), qr(2)], k_row)
                            }),
                            _ => unreachable!("fewer than 4 rows left"),
                        }
                    }
                }
            } else {
                let (q, k_off) = (&s.q, &s.k_off);
                gemm::<T, f32, MR, NR, FMA>(
                    bc,
                    mp,
                    dqk,
                    |jj| &k_all[k_off[jj] + u.g0 * dqk..][..dqk],
                    1,
                    |p| &q[p * mp..][..mp],
                    GemmOut {
                        c: &mut s.s,
                        ldc: mp,
                        accumulate: false,
                    },
                );
            }

            // Visible keys of each column in this tile.
            let mut full = true;
            for r in 0..m {
                let (rlo, rhi) = self.plan.bounds(u.b, u.i0 + (r % rph) / group);
                let start = (rlo - j0).clamp(0, bc as i64) as u32;
                let end = (rhi + 1 - j0).clamp(0, bc as i64) as u32;
                s.start[r] = start;
                s.end[r] = end;
                full &= start == 0 && end == bc as u32;
            }
            full &= m == mp;

            if let Some(cap) = a.softcap {
                for x in s.s[..bc * mp].iter_mut() {
                    *x = cap * (*x / cap).tanh();
                }
            }
            // Masked (and padding) entries become -inf, then exp gives 0.
            if !full {
                for (jj, row) in s.s.chunks_exact_mut(mp).take(bc).enumerate() {
                    let jj = jj as u32;
                    for ((x, &st), &en) in row.iter_mut().zip(&s.start).zip(&s.end) {
                        if jj < st || jj >= en {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            // Online softmax, vectorized across columns.
            s.tile_max.fill(f32::NEG_INFINITY);
            for row in s.s.chunks_exact(mp).take(bc) {
                for (t, &x) in s.tile_max.iter_mut().zip(row) {
                    *t = t.max(x);
                }
            }
            for (((t, c), rm), rs) in s
                .tile_max
                .iter_mut()
                .zip(s.corr.iter_mut())
                .zip(s.row_max.iter_mut())
                .zip(s.row_sum.iter_mut())
            {
                let new_max = rm.max(*t);
                if new_max == f32::NEG_INFINITY {
                    // Nothing visible yet: p = exp(-inf - 0) = 0 below.
                    *c = 1.0;
                    *t = 0.0;
                } else {
                    *c = exp(*rm - new_max);
                    *t = new_max;
                    *rm = new_max;
                }
                *rs *= *c;
            }
            // p = exp(s - max) over the tile as one flat run, so it
            // vectorizes whatever mp is (decode: a few columns), then each
            // column's sum in key order.
            s.max_rows.clear();
            for _ in 0..bc {
                s.max_rows.extend_from_slice(&s.tile_max);
            }
            for (x, &mx) in s.s[..bc * mp].iter_mut().zip(&s.max_rows) {
                *x = exp(*x - mx);
            }
            for row in s.s.chunks_exact(mp).take(bc) {
                for (rs, &x) in s.row_sum.iter_mut().zip(row) {
                    *rs += x;
                }
            }
            for (r, &c) in s.corr[..m].iter().enumerate() {
                if c != 1.0 {
                    for x in &mut o[r * dv..][..dv] {
                        *x *= c;
                    }
                }
            }

            // o [m, d_v] += p v, p = (s^T)^T.
            let (p, v_off) = (&s.s, &s.v_off);
            if direct {
                // Key by key, every head: the V rows in memory order.
                for (jj, &vo) in v_off.iter().enumerate() {
                    if let Some(&ahead) = v_off.get(jj + PREFETCH_KEYS) {
                        prefetch(&v_all[ahead + u.g0 * dv..][..(u.g1 - u.g0) * dv]);
                    }
                    for g in u.g0..u.g1 {
                        let rows = (g - u.g0) * rph..(g - u.g0 + 1) * rph;
                        // SAFETY: guaranteed by this function's caller.
                        unsafe {
                            S::axpy_rows::<T>(
                                &mut o[rows.start * dv..rows.end * dv],
                                &p[jj * mp + rows.start..jj * mp + rows.end],
                                &v_all[vo + g * dv..][..dv],
                            )
                        };
                    }
                }
            } else {
                gemm::<f32, T, MR, NR, FMA>(
                    m,
                    dv,
                    bc,
                    |r| &p[r..],
                    mp,
                    |jj| &v_all[v_off[jj] + u.g0 * dv..][..dv],
                    GemmOut {
                        c: o,
                        ldc: dv,
                        accumulate: true,
                    },
                );
            }
            j0 += bc as i64;
        }

        lse.fill(f32::NEG_INFINITY);
        for r in 0..m {
            let o_row = &mut o[r * dv..][..dv];
            if s.row_sum[r] > 0.0 {
                let inv = 1.0 / s.row_sum[r];
                o_row.iter_mut().for_each(|x| *x *= inv);
                lse[r] = s.row_max[r] + s.row_sum[r].ln();
            } else {
                o_row.fill(0.0);
            }
        }
    }
}

/// The work units of a forward: decode units (every KV head) for
/// sequences with at most [`DIRECT_MAX_ROWS`] rows per KV head, prefill
/// units (one KV head, a tile of queries) otherwise.
fn plan_units(plan: &Plan, attn: &DotProductAttention, units: &mut Vec<Unit>) {
    let group = attn.kv_group();
    let br = (TARGET_ROWS / group).max(1);
    units.clear();
    for (b, seq) in plan.seqs.iter().enumerate() {
        if seq.sq == 0 {
            continue;
        }
        let (k_lo, k_hi) = (0, plan.bounds(b, seq.sq - 1).1);
        if seq.sq * group <= DIRECT_MAX_ROWS {
            units.push(Unit {
                b,
                g0: 0,
                g1: attn.num_gqa_groups,
                i0: 0,
                i1: seq.sq,
                k_lo,
                k_hi,
            });
            continue;
        }
        for g in 0..attn.num_gqa_groups {
            for i0 in (0..seq.sq).step_by(br) {
                let i1 = (i0 + br).min(seq.sq);
                units.push(Unit {
                    b,
                    g0: g,
                    g1: g + 1,
                    i0,
                    i1,
                    k_lo,
                    k_hi,
                });
            }
        }
    }
}

/// Splits decode units along their keys into pieces of [`SPLIT_KEYS`]
/// keys from their first visible key (a function of the unit alone); the
/// pieces of one unit stay adjacent (merged in that order).
fn split_keys(units: &mut Vec<Unit>, split: &mut Vec<Unit>, plan: &Plan, group: usize) {
    split.clear();
    for &u in units.iter() {
        let (lo, hi) = (plan.bounds(u.b, u.i0).0, plan.bounds(u.b, u.i1 - 1).1);
        if u.rows_per_head(group) > DIRECT_MAX_ROWS || hi + 1 - lo <= SPLIT_KEYS {
            split.push(u);
            continue;
        }
        for k in (lo..=hi).step_by(SPLIT_KEYS as usize) {
            split.push(Unit {
                k_lo: k,
                k_hi: (k + SPLIT_KEYS - 1).min(hi),
                ..u
            });
        }
    }
    std::mem::swap(units, split);
}

/// Buffers of [`DotProductAttention::forward_cpu_with`], kept between
/// calls: the validated plan, the work units and their partial outputs, and
/// the kernel's scratch. A forward allocates nothing once its workspace has
/// seen a forward at least as large, so a model's layers can share one.
#[derive(Default)]
pub struct AttentionWorkspace {
    plan: Plan,
    cpu: CpuBuffers,
}

impl DotProductAttention {
    /// Attention on the CPU: a tiled online-softmax kernel (flash-attention
    /// style), parallel over sequences, KV heads and query tiles (decode:
    /// sequences and key ranges), f32 accumulation.
    ///
    /// - `q`: `[.., h_q, d_qk]` in `qkv_format` (bshd `[b, max_seqlen_q, ..]`,
    ///   sbhd `[max_seqlen_q, b, ..]`, thd `[t_q, ..]` with
    ///   `t_q = cu_seqlens_q[b]` exactly: no padded thd). With a padding
    ///   mask, bshd/sbhd sequence `b` holds its `cu_seqlens_q[b + 1] -
    ///   cu_seqlens_q[b]` real queries first, then padding.
    /// - `kv`: see [`KvInput`].
    /// - `out`: `[.., h_q, d_v]` in `qkv_format`; fully written (rows of
    ///   padded or fully masked queries get 0). `O` may differ from `T`
    ///   (e.g. bf16 inputs, f32 partial outputs for an LSE merge).
    /// - `lse`: optional f32 natural-log LSE, `[b, h_q, max_seqlen_q]`
    ///   (bshd/sbhd) or `[h_q, t_q]` (thd); -inf for queries that see no key.
    ///
    /// Errors: [`AttentionError`] naming the first invalid argument (see
    /// [`DotProductAttention::validate`], [`AttnMetadata`]); nothing is
    /// written then.
    pub fn forward_cpu<T: Element, O: Element>(
        &self,
        q: &[T],
        kv: KvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<(), AttentionError> {
        self.forward_cpu_with(q, kv, meta, out, lse, &mut AttentionWorkspace::default())
    }

    /// [`forward_cpu`](Self::forward_cpu) with its buffers kept in `ws`
    /// (same arguments, result and errors): no allocation once `ws` has
    /// seen a forward of this size, which is how a model's layers call it.
    pub fn forward_cpu_with<T: Element, O: Element>(
        &self,
        q: &[T],
        kv: KvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        out: &mut [O],
        lse: Option<&mut [f32]>,
        ws: &mut AttentionWorkspace,
    ) -> Result<(), AttentionError> {
        self.forward_cpu_planned(q, kv, meta, None, AttnOutput { out, lse }, ws)
    }

    /// [`forward_cpu_with`](Self::forward_cpu_with) where queries and keys
    /// carry absolute positions ([`Positions`]): the mask and window are
    /// applied to positions, not to query and key indices, so the keys may
    /// be any increasing subset of a sequence's positions (a
    /// context-parallel rank's shard of its KV cache). Top-left and
    /// bottom-right masks coincide here (positions are absolute). Same
    /// arguments, outputs and errors otherwise (`out` and `lse` in
    /// `output`), plus
    /// [`AttentionError::ShapeMismatch`] / [`AttentionError::InvalidSeqlens`]
    /// for `positions` that disagree with the sequences or do not
    /// increase.
    pub fn forward_cpu_at_positions<T: Element, O: Element>(
        &self,
        q: &[T],
        kv: KvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        positions: &Positions<'_>,
        output: AttnOutput<'_, O>,
        ws: &mut AttentionWorkspace,
    ) -> Result<(), AttentionError> {
        self.forward_cpu_planned(q, kv, meta, Some(positions), output, ws)
    }

    /// Validates, plans (key bounds from `positions` when given) and runs
    /// the CPU kernel: the body of both CPU forwards.
    fn forward_cpu_planned<T: Element, O: Element>(
        &self,
        q: &[T],
        kv: KvInput<'_, T>,
        meta: &AttnMetadata<'_>,
        positions: Option<&Positions<'_>>,
        output: AttnOutput<'_, O>,
        ws: &mut AttentionWorkspace,
    ) -> Result<(), AttentionError> {
        self.plan_into(
            q.len(),
            &kv.lens(),
            meta,
            output.out.len(),
            output.lse.as_ref().map(|l| l.len()),
            &mut ws.plan,
        )?;
        if let Some(p) = positions {
            p.apply(self, &mut ws.plan)?;
        }
        forward(self, &ws.plan, q, kv, meta, output, &mut ws.cpu);
        Ok(())
    }
}

/// The CPU path's buffers, reused across forwards (see
/// [`AttentionWorkspace`]).
#[derive(Default)]
pub(crate) struct CpuBuffers {
    units: Vec<Unit>,
    split: Vec<Unit>,
    /// `[units + 1]` offsets of each unit's rows in `o` (times d_v) and `lse`.
    offsets: Vec<usize>,
    o: Vec<f32>,
    lse: Vec<f32>,
    scratch: Scratch,
}

thread_local! {
    /// Each rayon worker's scratch, kept between forwards.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// A pointer that may cross threads; each task writes a disjoint range.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: only used to hand disjoint output ranges to rayon tasks.
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}

/// Runs a validated forward (see [`DotProductAttention::forward_cpu`]);
/// allocates nothing once `bufs` has grown to the forward's size.
pub(crate) fn forward<T: Element, O: Element>(
    attn: &DotProductAttention,
    plan: &Plan,
    q: &[T],
    kv: KvInput<'_, T>,
    meta: &AttnMetadata<'_>,
    AttnOutput { out, mut lse }: AttnOutput<'_, O>,
    bufs: &mut CpuBuffers,
) {
    let group = attn.kv_group();
    plan_units(plan, attn, &mut bufs.units);
    let ctx = Ctx {
        attn,
        plan,
        meta,
        q,
        kv,
        scale: attn.effective_softmax_scale(),
        group,
    };
    // Multiply-adds: rows x visible keys x (d_qk + d_v), keys bounded by
    // each unit's key span.
    let macs: usize = bufs
        .units
        .iter()
        .map(|u| {
            let span =
                (plan.bounds(u.b, u.i1 - 1).1 + 1 - plan.bounds(u.b, u.i0).0).max(0) as usize;
            (u.g1 - u.g0) * u.rows_per_head(group) * span * (attn.head_dim_qk + attn.head_dim_v)
        })
        .sum();
    let serial = macs < SERIAL_MACS;
    // Split whether or not the forward runs serially: the pieces, and so
    // the bits, must not depend on the rest of the batch.
    split_keys(&mut bufs.units, &mut bufs.split, plan, group);
    let dv = attn.head_dim_v;
    bufs.offsets.clear();
    bufs.offsets.push(0);
    for u in &bufs.units {
        let m = (u.g1 - u.g0) * u.rows_per_head(group);
        bufs.offsets.push(bufs.offsets.last().unwrap() + m);
    }
    let rows = *bufs.offsets.last().unwrap();
    bufs.o.resize(rows * dv, 0.0);
    bufs.lse.resize(rows, 0.0);
    let units = &bufs.units;
    let offsets = &bufs.offsets;
    if serial {
        for (i, &u) in units.iter().enumerate() {
            let (r0, r1) = (offsets[i], offsets[i + 1]);
            ctx.run(
                u,
                &mut bufs.scratch,
                &mut bufs.o[r0 * dv..r1 * dv],
                &mut bufs.lse[r0..r1],
            );
        }
    } else {
        let (o_ptr, lse_ptr) = (SyncPtr(bufs.o.as_mut_ptr()), SyncPtr(bufs.lse.as_mut_ptr()));
        units.par_iter().enumerate().for_each(|(i, &u)| {
            let (o_ptr, lse_ptr) = (o_ptr, lse_ptr);
            let (r0, r1) = (offsets[i], offsets[i + 1]);
            // SAFETY: unit i owns rows offsets[i]..offsets[i + 1] of `o`
            // (times d_v) and `lse`, inside the buffers resized above and
            // disjoint from every other unit's.
            let (o, l) = unsafe {
                (
                    std::slice::from_raw_parts_mut(o_ptr.0.add(r0 * dv), (r1 - r0) * dv),
                    std::slice::from_raw_parts_mut(lse_ptr.0.add(r0), r1 - r0),
                )
            };
            SCRATCH.with_borrow_mut(|s| ctx.run(u, s, o, l));
        });
    }

    // Scatter; rows no unit covers (bshd/sbhd padding) stay 0 / -inf.
    let (hq, dv) = (attn.num_attention_heads, attn.head_dim_v);
    out.fill(O::from_f32(0.0));
    if let Some(l) = lse.as_deref_mut() {
        l.fill(f32::NEG_INFINITY);
    }
    let mut ui = 0;
    while ui < units.len() {
        let u = units[ui];
        let (r0, r1) = (offsets[ui], offsets[ui + 1]);
        // Pieces of a split unit: merge their partial results into the first.
        let mut next = ui + 1;
        while next < units.len() && units[next].same_rows(&u) {
            let (p0, p1) = (offsets[next], offsets[next + 1]);
            let (head, tail) = bufs.o.split_at_mut(p0 * dv);
            let (lhead, ltail) = bufs.lse.split_at_mut(p0);
            for r in 0..r1 - r0 {
                merge_row(
                    &mut head[(r0 + r) * dv..][..dv],
                    &mut lhead[r0 + r],
                    &tail[r * dv..][..dv],
                    ltail[r],
                );
            }
            debug_assert_eq!(p1 - p0, r1 - r0);
            next += 1;
        }
        ui = next;
        let (t_o, t_lse) = (&bufs.o[r0 * dv..r1 * dv], &bufs.lse[r0..r1]);
        let rph = u.rows_per_head(group);
        for g in u.g0..u.g1 {
            for i in u.i0..u.i1 {
                let row = ctx.q_row(u.b, i);
                let r0 = (g - u.g0) * rph + (i - u.i0) * group;
                let dst = &mut out[(row * hq + g * group) * dv..][..group * dv];
                for (d, &x) in dst.iter_mut().zip(&t_o[r0 * dv..][..group * dv]) {
                    *d = O::from_f32(x);
                }
                if let Some(l) = lse.as_deref_mut() {
                    for hh in 0..group {
                        let h = g * group + hh;
                        let idx = match attn.qkv_format {
                            QkvFormat::Thd => h * plan.q_rows + row,
                            QkvFormat::Bshd | QkvFormat::Sbhd => {
                                (u.b * hq + h) * meta.max_seqlen_q + i
                            }
                        };
                        l[idx] = t_lse[r0 + hh];
                    }
                }
            }
        }
    }
}
