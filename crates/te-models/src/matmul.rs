//! `y = x · Wᵀ` on the CPU: one blocked kernel for every number of rows,
//! over f32 weights and GGUF block-quantized weights.
//!
//! Shapes: `x: [t, k]` f32 row-major (t token rows), `W: [n, k]` (n weight
//! rows, f32 or GGUF blocks with `k` a multiple of the block length),
//! `y: [t, n]` f32 row-major.
//!
//! # The arithmetic (the contract every path keeps, bit for bit)
//!
//! Weights take exactly the values of [`crate::quant::dequantize_blocks`]
//! (a full dequantization). Each output `y[i, j]` is computed on its own,
//! in sixteen lanes: lane `l` starts at `+0.0` and accumulates
//! `x[i, c] · w[j, c]` for `c ≡ l (mod 16)`, `c` increasing, one fused
//! multiply-add per step (`a = fma(x, w, a)`); in the last group of 16
//! the columns past `k` count as `fma(0, 0, a)`. The lanes are then summed
//! as a fixed tree: `s8[l] = a[l] + a[l + 8]`, `s4[l] = s8[l] + s8[l + 4]`,
//! `s2[l] = s4[l] + s4[l + 2]`, `y = s2[0] + s2[1]`.
//!
//! The AVX-512, AVX2 + FMA and portable paths all compute exactly this, so
//! a row's output is bit-identical whatever `t` is, wherever the row sits
//! in the batch, and whichever path runs (decode, batched decode and
//! prefill agree). Worked example: `k = 40` gives lanes 0..8 three
//! products each (columns l, l + 16, l + 32), lanes 8..16 two products and
//! one `fma(0, 0, a)`.
//!
//! # Blocking
//!
//! The weight rows are split over the rayon pool; each task decodes
//! panels of up to [`PANEL_BYTES`] of f32 weights (quantized types; f32
//! weights are read in place) and runs every tile of `x` against the
//! panel, so each weight block is decoded once per step whatever `t` is.
//! The register tile is `MR` weight rows by `NR` token rows of 16-lane
//! accumulators (AVX-512: 4 x 6 in 24 of its 32 registers; AVX2: 4 x 3,
//! one 8-lane half of the 16 lanes at a time).

use rayon::prelude::*;

use crate::quant::{dequantize_blocks, GgmlType};

/// A weight matrix `[n, k]` as the kernel reads it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Weights<'a> {
    /// f32, row-major.
    F32(&'a [f32]),
    /// GGUF blocks of `ty`, `k / block_len` blocks per row.
    Quantized { ty: GgmlType, data: &'a [u8] },
}

/// The instruction set a product runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F with AVX2, F16C and FMA (16-lane registers, masked tail
    /// loads; quantized weights decoded in registers for few token rows).
    Avx512,
    /// AVX2 + FMA (the 16 lanes as two 8-lane halves).
    Avx2,
    /// Plain Rust with `f32::mul_add` (any CPU; slow without hardware FMA).
    Portable,
}

impl Isa {
    /// The fastest path this CPU runs, detected once.
    pub(crate) fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Every path this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// Bytes of decoded f32 weights per panel (about a quarter of a 1 MiB L2).
const PANEL_BYTES: usize = 256 * 1024;

/// Weight rows of the register tile.
const MR: usize = 4;

/// Parallel tasks per pool thread (balance on a machine shared with
/// other work).
const TASKS_PER_THREAD: usize = 4;

/// Panel rows for row length `k`: a multiple of [`MR`], at least `MR`.
fn panel_rows(k: usize) -> usize {
    (PANEL_BYTES / (4 * k.max(1)) / MR * MR).max(MR)
}

/// Up to this many token rows (one AVX-512 register tile), quantized
/// weights are decoded in registers instead of into a panel.
#[cfg(target_arch = "x86_64")]
const FUSED_MAX_ROWS: usize = 6;

/// Whether `ty` has an AVX-512 group decoder for the fused kernels.
#[cfg(target_arch = "x86_64")]
fn fused_type(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q8_0 | Q4_K | Q6_K)
}

/// `yt[j, i] = x_i · w_j` for `rows` weight rows of GGUF blocks (`data`,
/// `row_bytes` per row) and every row of `x: [t, k]` (`t <=`
/// [`FUSED_MAX_ROWS`]), decoded in registers; `yt: [rows, t]`. Needs
/// AVX-512 and a type of [`fused_type`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn fused_product(
    ty: GgmlType,
    x: &[f32],
    t: usize,
    k: usize,
    data: &[u8],
    row_bytes: usize,
    rows: usize,
    yt: &mut [f32],
) {
    debug_assert!(t <= FUSED_MAX_ROWS && x.len() == t * k);
    for m0 in (0..rows).step_by(MR) {
        let mr = MR.min(rows - m0);
        // Rows past the edge repeat the first one (computed, never stored).
        let wr: [&[u8]; MR] = std::array::from_fn(|m| {
            let j = m0 + if m < mr { m } else { 0 };
            &data[j * row_bytes..(j + 1) * row_bytes]
        });
        let mut out = [[0.0f32; 6]; MR];
        macro_rules! go {
            ($nr:literal) => {{
                let xp: [*const f32; $nr] = std::array::from_fn(|r| x[r * k..].as_ptr());
                // SAFETY: the caller checked AVX-512 (Isa::Avx512, whose
                // detection includes AVX2, F16C and FMA via avx512f) and
                // `ty`; each x pointer starts a row of k floats, each w row
                // holds k weights of `ty`.
                let o = unsafe {
                    match ty {
                        GgmlType::Q4_0 => avx512::fused_q4_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q4_1 => avx512::fused_q4_1::<$nr>(&xp, &wr, k),
                        GgmlType::Q5_0 => avx512::fused_q5_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q8_0 => avx512::fused_q8_0::<$nr>(&xp, &wr, k),
                        GgmlType::Q4_K => avx512::fused_q4_k::<$nr>(&xp, &wr, k),
                        GgmlType::Q6_K => avx512::fused_q6_k::<$nr>(&xp, &wr, k),
                        _ => unreachable!("fused_type"),
                    }
                };
                for m in 0..MR {
                    out[m][..$nr].copy_from_slice(&o[m]);
                }
            }};
        }
        match t {
            1 => go!(1),
            2 => go!(2),
            3 => go!(3),
            4 => go!(4),
            5 => go!(5),
            6 => go!(6),
            _ => unreachable!("at most FUSED_MAX_ROWS token rows"),
        }
        for (m, o) in out.iter().enumerate().take(mr) {
            yt[(m0 + m) * t..(m0 + m + 1) * t].copy_from_slice(&o[..t]);
        }
    }
}

/// `y = x · wᵀ` (see the module doc for the exact arithmetic): `x: [t, k]`,
/// `w: [n, k]`, `y: [t, n]`. `scratch` is grown as needed and reused:
/// `[n, t]` transposed output when `t > 1`, and one decoded panel per task
/// for quantized weights.
pub(crate) fn matmul_into(
    x: &[f32],
    t: usize,
    w: Weights<'_>,
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    matmul_into_isa(Isa::detect(), x, t, w, n, k, y, scratch)
}

/// [`matmul_into`] on the given instruction set (which the CPU must run).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_into_isa(
    isa: Isa,
    x: &[f32],
    t: usize,
    w: Weights<'_>,
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    assert_eq!(x.len(), t * k, "matmul: x is not [t, k]");
    assert_eq!(y.len(), t * n, "matmul: y is not [t, n]");
    if let Weights::F32(w) = w {
        assert_eq!(w.len(), n * k, "matmul: w is not [n, k]");
    }
    if t == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = n.div_ceil(threads * TASKS_PER_THREAD).div_ceil(MR) * MR;
    let tasks = n.div_ceil(rows_per_task);
    let prows = panel_rows(k).min(rows_per_task);
    // f32 weights are read in place: one unused float per task.
    let (row_bytes, panel_len) = match w {
        Weights::F32(_) => (0, 1),
        Weights::Quantized { data, .. } => (data.len() / n, prows * k),
    };
    // scratch: [yt: n * t when t > 1][panels: tasks * panel_len]
    let yt_len = if t > 1 { n * t } else { 0 };
    let need = yt_len + tasks * panel_len;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    let (yt_buf, panels) = scratch[..need].split_at_mut(yt_len);
    // Few token rows: decode in registers (AVX-512 group decoders).
    #[cfg(target_arch = "x86_64")]
    let fused = isa == Isa::Avx512
        && t <= FUSED_MAX_ROWS
        && matches!(w, Weights::Quantized { ty, .. } if fused_type(ty));
    let yt: &mut [f32] = if t > 1 { yt_buf } else { &mut *y };
    yt.par_chunks_mut(rows_per_task * t)
        .zip(panels.par_chunks_mut(panel_len))
        .enumerate()
        .for_each(|(ti, (yt, panel))| {
            let j0 = ti * rows_per_task;
            let rows = yt.len() / t;
            #[cfg(target_arch = "x86_64")]
            if let (true, Weights::Quantized { ty, data }) = (fused, w) {
                let data = &data[j0 * row_bytes..(j0 + rows) * row_bytes];
                fused_product(ty, x, t, k, data, row_bytes, rows, yt);
                return;
            }
            for p0 in (0..rows).step_by(prows) {
                let pr = prows.min(rows - p0);
                let (r0, r1) = (j0 + p0, j0 + p0 + pr);
                let wp: &[f32] = match w {
                    Weights::F32(w) => &w[r0 * k..r1 * k],
                    Weights::Quantized { ty, data } => {
                        let dst = &mut panel[..pr * k];
                        dequantize_blocks(ty, &data[r0 * row_bytes..r1 * row_bytes], dst);
                        dst
                    }
                };
                panel_product(isa, x, t, k, wp, k, pr, &mut yt[p0 * t..(p0 + pr) * t]);
            }
        });
    if t > 1 {
        // yt: [n, t] -> y: [t, n]
        for (j, col) in scratch[..n * t].chunks_exact(t).enumerate() {
            for (i, v) in col.iter().enumerate() {
                y[i * n + j] = *v;
            }
        }
    }
}

/// `yt[j, i] = x_i · w_j` for the `rows` weight rows of one panel (`w`,
/// row stride `ldw`) and every row of `x: [t, k]`; `yt: [rows, t]`.
#[allow(clippy::too_many_arguments)]
fn panel_product(
    isa: Isa,
    x: &[f32],
    t: usize,
    k: usize,
    w: &[f32],
    ldw: usize,
    rows: usize,
    yt: &mut [f32],
) {
    let nr_max = match isa {
        Isa::Avx512 => 6,
        Isa::Avx2 => 3,
        Isa::Portable => 4,
    };
    for i0 in (0..t).step_by(nr_max) {
        let nr = nr_max.min(t - i0);
        for m0 in (0..rows).step_by(MR) {
            let mr = MR.min(rows - m0);
            // Pointers to the tile's rows; rows past the edge repeat the
            // first one (computed, never stored).
            let xr: [usize; 6] = std::array::from_fn(|r| (i0 + if r < nr { r } else { 0 }) * k);
            let wr: [usize; MR] = std::array::from_fn(|m| (m0 + if m < mr { m } else { 0 }) * ldw);
            let mut out = [[0.0f32; 6]; MR];
            tile(isa, x, &xr[..nr], w, &wr, k, &mut out);
            for (m, o) in out.iter().enumerate().take(mr) {
                yt[(m0 + m) * t + i0..(m0 + m) * t + i0 + nr].copy_from_slice(&o[..nr]);
            }
        }
    }
}

/// One register tile: `out[m][r] = x[xr[r]..][..k] · w[wr[m]..][..k]` for
/// `r < xr.len()` (at most 6), dispatched to the instruction set and to a
/// kernel specialized for the tile's number of token rows.
fn tile(
    isa: Isa,
    x: &[f32],
    xr: &[usize],
    w: &[f32],
    wr: &[usize; MR],
    k: usize,
    out: &mut [[f32; 6]; MR],
) {
    // Every offset is a whole row inside its slice.
    debug_assert!(xr.iter().all(|&o| o + k <= x.len()));
    debug_assert!(wr.iter().all(|&o| o + k <= w.len()));
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            macro_rules! go {
                ($nr:literal) => {{
                    let xp: [*const f32; $nr] = std::array::from_fn(|r| x[xr[r]..].as_ptr());
                    let wp: [*const f32; MR] = std::array::from_fn(|m| w[wr[m]..].as_ptr());
                    // SAFETY: the CPU has AVX-512F (Isa::detect / available);
                    // each pointer starts a row of k readable floats.
                    let o = unsafe { avx512::tile::<$nr>(&xp, &wp, k) };
                    for m in 0..MR {
                        out[m][..$nr].copy_from_slice(&o[m]);
                    }
                }};
            }
            match xr.len() {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                4 => go!(4),
                5 => go!(5),
                6 => go!(6),
                _ => unreachable!("at most 6 token rows per tile"),
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            macro_rules! go {
                ($nr:literal) => {{
                    let xp: [*const f32; $nr] = std::array::from_fn(|r| x[xr[r]..].as_ptr());
                    let wp: [*const f32; MR] = std::array::from_fn(|m| w[wr[m]..].as_ptr());
                    // SAFETY: the CPU has AVX2 and FMA (Isa::detect /
                    // available); each pointer starts a row of k readable floats.
                    let o = unsafe { avx2::tile::<$nr>(&xp, &wp, k) };
                    for m in 0..MR {
                        out[m][..$nr].copy_from_slice(&o[m]);
                    }
                }};
            }
            match xr.len() {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                _ => unreachable!("at most 3 token rows per AVX2 tile"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx512 | Isa::Avx2 => unreachable!("x86_64 only"),
        Isa::Portable => {
            for (m, &wo) in wr.iter().enumerate() {
                for (r, &xo) in xr.iter().enumerate() {
                    out[m][r] = dot_portable(&x[xo..xo + k], &w[wo..wo + k]);
                }
            }
        }
    }
}

/// The module's arithmetic for one pair of rows, in plain Rust: the
/// reference every SIMD path equals bit for bit.
pub(crate) fn dot_portable(x: &[f32], w: &[f32]) -> f32 {
    let mut a = [0.0f32; 16];
    for c0 in (0..x.len()).step_by(16) {
        for (l, a) in a.iter_mut().enumerate() {
            let (xv, wv) = match (x.get(c0 + l), w.get(c0 + l)) {
                (Some(&xv), Some(&wv)) => (xv, wv),
                _ => (0.0, 0.0),
            };
            *a = xv.mul_add(wv, *a);
        }
    }
    reduce16(&a)
}

/// The lane tree of the module doc.
#[inline(always)]
fn reduce16(a: &[f32; 16]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::MR;

    /// `out[m][r] = x_r · w_m` over `k` columns, each pair in its own
    /// 16-lane accumulator (the module's arithmetic).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every pointer must start `k`
    /// readable floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const NR: usize>(
        x: &[*const f32; NR],
        w: &[*const f32; MR],
        k: usize,
    ) -> [[f32; NR]; MR] {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let k16 = k / 16 * 16;
        let mut c = 0;
        while c < k16 {
            // Plain loops, not closures: a closure's body is not inlined
            // into std's generic helpers, which lack the target features.
            let mut xv = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                // SAFETY: c + 16 <= k for every row.
                xv[r] = unsafe { _mm512_loadu_ps(x[r].add(c)) };
            }
            for m in 0..MR {
                // SAFETY: as above.
                let wv = unsafe { _mm512_loadu_ps(w[m].add(c)) };
                for r in 0..NR {
                    acc[m][r] = _mm512_fmadd_ps(xv[r], wv, acc[m][r]);
                }
            }
            c += 16;
        }
        if k16 < k {
            let mask: __mmask16 = (1u32 << (k - k16)) as u16 - 1;
            let mut xv = [_mm512_setzero_ps(); NR];
            for r in 0..NR {
                // SAFETY: masked loads read only columns < k.
                xv[r] = unsafe { _mm512_maskz_loadu_ps(mask, x[r].add(c)) };
            }
            for m in 0..MR {
                // SAFETY: as above.
                let wv = unsafe { _mm512_maskz_loadu_ps(mask, w[m].add(c)) };
                for r in 0..NR {
                    acc[m][r] = _mm512_fmadd_ps(xv[r], wv, acc[m][r]);
                }
            }
        }
        let mut out = [[0.0f32; NR]; MR];
        for m in 0..MR {
            for r in 0..NR {
                out[m][r] = reduce(acc[m][r]);
            }
        }
        out
    }

    /// A kernel like [`tile`] for weight rows in GGUF blocks, decoded in
    /// registers 32 values at a time by `$decode` (`crate::quant::avx512`)
    /// and multiplied in at once: the same values and the same lanes as
    /// decoding a panel first, without storing it (decode, `t` small).
    macro_rules! fused {
        ($name:ident, $decode:path, $groups_per_block:literal) => {
            /// # Safety
            /// The CPU must support AVX-512F, AVX2, F16C and FMA; every `x`
            /// pointer must start `k` readable floats; each `w` row holds
            /// `k` weights of the decoder's type (`k` a multiple of 32).
            #[target_feature(enable = "avx512f,avx2,f16c,fma")]
            pub(super) unsafe fn $name<const NR: usize>(
                x: &[*const f32; NR],
                w: &[&[u8]; MR],
                k: usize,
            ) -> [[f32; NR]; MR] {
                let mut acc = [[_mm512_setzero_ps(); NR]; MR];
                // Block by block, each weight row's groups in order (so
                // every accumulator still sees its columns in increasing
                // order); the unrolled groups of one block share its
                // scale decoding.
                for blk in 0..k / (32 * $groups_per_block) {
                    for m in 0..MR {
                        for sub in 0..$groups_per_block {
                            let g = $groups_per_block * blk + sub;
                            let c = 32 * g;
                            let [v0, v1] = $decode(w[m], g);
                            for r in 0..NR {
                                // SAFETY: c + 32 <= k for every row.
                                let (x0, x1) = unsafe {
                                    (
                                        _mm512_loadu_ps(x[r].add(c)),
                                        _mm512_loadu_ps(x[r].add(c + 16)),
                                    )
                                };
                                acc[m][r] = _mm512_fmadd_ps(x0, v0, acc[m][r]);
                                acc[m][r] = _mm512_fmadd_ps(x1, v1, acc[m][r]);
                            }
                        }
                    }
                }
                let mut out = [[0.0f32; NR]; MR];
                for m in 0..MR {
                    for r in 0..NR {
                        out[m][r] = reduce(acc[m][r]);
                    }
                }
                out
            }
        };
    }
    fused!(fused_q4_0, crate::quant::avx512::q4_0, 1);
    fused!(fused_q4_1, crate::quant::avx512::q4_1, 1);
    fused!(fused_q5_0, crate::quant::avx512::q5_0, 1);
    fused!(fused_q8_0, crate::quant::avx512::q8_0, 1);
    fused!(fused_q4_k, crate::quant::avx512::q4_k, 8);
    fused!(fused_q6_k, crate::quant::avx512::q6_k, 8);

    /// The lane tree: `s8 = lanes 0..8 + lanes 8..16`, then halves again.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce(a: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        super::avx2::reduce8(_mm256_add_ps(lo, hi))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::MR;

    /// `out[m][r] = x_r · w_m` over `k` columns, in the module's 16 lanes:
    /// lanes 0..8 over all of `k` first, then lanes 8..16.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; every pointer must start `k`
    /// readable floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const NR: usize>(
        x: &[*const f32; NR],
        w: &[*const f32; MR],
        k: usize,
    ) -> [[f32; NR]; MR] {
        let k16 = k / 16 * 16;
        let mut halves = [[[_mm256_setzero_ps(); NR]; MR]; 2];
        for (h, half) in halves.iter_mut().enumerate() {
            let mut acc = [[_mm256_setzero_ps(); NR]; MR];
            let mut c = 8 * h;
            while c < k16 {
                let mut xv = [_mm256_setzero_ps(); NR];
                for r in 0..NR {
                    // SAFETY: c + 8 <= k16 <= k.
                    xv[r] = unsafe { _mm256_loadu_ps(x[r].add(c)) };
                }
                for m in 0..MR {
                    // SAFETY: as above.
                    let wv = unsafe { _mm256_loadu_ps(w[m].add(c)) };
                    for r in 0..NR {
                        acc[m][r] = _mm256_fmadd_ps(xv[r], wv, acc[m][r]);
                    }
                }
                c += 16;
            }
            if k16 < k {
                // Lanes 8h..8h+8 of the last group: columns k16 + 8h + l < k.
                let valid = (k - k16) as i32 - 8 * h as i32;
                let mask = _mm256_cmpgt_epi32(
                    _mm256_set1_epi32(valid),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                );
                let c = k16 + 8 * h;
                let mut xv = [_mm256_setzero_ps(); NR];
                for r in 0..NR {
                    // SAFETY: masked loads read only columns < k.
                    xv[r] = unsafe { _mm256_maskload_ps(x[r].add(c), mask) };
                }
                for m in 0..MR {
                    // SAFETY: as above.
                    let wv = unsafe { _mm256_maskload_ps(w[m].add(c), mask) };
                    for r in 0..NR {
                        acc[m][r] = _mm256_fmadd_ps(xv[r], wv, acc[m][r]);
                    }
                }
            }
            *half = acc;
        }
        let [lo, hi] = halves;
        let mut out = [[0.0f32; NR]; MR];
        for m in 0..MR {
            for r in 0..NR {
                out[m][r] = reduce8(_mm256_add_ps(lo[m][r], hi[m][r]));
            }
        }
        out
    }

    /// The lane tree from `s8`: `s4 = s8[0..4] + s8[4..8]`, `s2 = s4[0..2]
    /// + s4[2..4]`, `s2[0] + s2[1]`.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(super) fn reduce8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Every type a [`Weights::Quantized`] may hold, with the byte offsets
    /// of its f16 fields in a block.
    const TYPES: [(GgmlType, &[usize]); 13] = [
        (GgmlType::F32, &[]),
        (GgmlType::F16, &[]),
        (GgmlType::BF16, &[]),
        (GgmlType::Q4_0, &[0]),
        (GgmlType::Q4_1, &[0, 2]),
        (GgmlType::Q5_0, &[0]),
        (GgmlType::Q5_1, &[0, 2]),
        (GgmlType::Q8_0, &[0]),
        (GgmlType::Q2_K, &[80, 82]),
        (GgmlType::Q3_K, &[108]),
        (GgmlType::Q4_K, &[0, 2]),
        (GgmlType::Q5_K, &[0, 2]),
        (GgmlType::Q6_K, &[208]),
    ];

    /// `n` rows of `k` random weights of type `ty` (finite values: f16
    /// fields are random finite halves, subnormals and zeros included).
    fn random_weights(
        ty: GgmlType,
        f16_at: &[usize],
        n: usize,
        k: usize,
        rng: &mut StdRng,
    ) -> Vec<u8> {
        let value = |rng: &mut StdRng| rng.gen_range(-2.0f32..2.0);
        match ty {
            GgmlType::F32 => (0..n * k).flat_map(|_| value(rng).to_le_bytes()).collect(),
            GgmlType::F16 => (0..n * k)
                .flat_map(|_| f16::from_f32(value(rng)).to_le_bytes())
                .collect(),
            GgmlType::BF16 => (0..n * k)
                .flat_map(|_| bf16::from_f32(value(rng)).to_le_bytes())
                .collect(),
            _ => {
                let (block_len, block_bytes) = ty.block_layout().expect("layout");
                let blocks = n * k / block_len;
                let mut data: Vec<u8> = (0..blocks * block_bytes).map(|_| rng.gen()).collect();
                for block in data.chunks_exact_mut(block_bytes) {
                    for &at in f16_at {
                        let mut h = f16::from_bits(rng.gen());
                        if !h.is_finite() {
                            h = f16::from_bits(h.to_bits() & !0x4000);
                        }
                        block[at..at + 2].copy_from_slice(&h.to_le_bytes());
                    }
                }
                data
            }
        }
    }

    fn run(isa: Isa, x: &[f32], t: usize, w: Weights<'_>, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; t * n];
        // Poisoned scratch: every value the kernel reads from it is written first.
        let mut scratch = vec![f32::NAN; 7];
        matmul_into_isa(isa, x, t, w, n, k, &mut y, &mut scratch);
        y
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// A row's output is bit-identical alone and at any position of a
        /// batch of 7, 8, 33, 100 or 512 rows, on every instruction set
        /// this CPU runs, for every weight type; every instruction set
        /// equals the portable path bit for bit; and the result is within
        /// rounding of a float64 dot product of the dequantized weights.
        #[test]
        fn rows_bit_identical_for_every_t(
            seed: u64,
            type_index in 0usize..TYPES.len(),
            n in 1usize..=21,
            blocks in 1usize..=2,
            f32_k in 1usize..=70,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let (ty, f16_at) = TYPES[type_index];
            let (block_len, _) = ty.block_layout().expect("layout");
            let k = if block_len == 1 { f32_k } else { blocks * block_len };
            let data = random_weights(ty, f16_at, n, k, &mut rng);
            let mut wf = vec![f32::NAN; n * k];
            crate::quant::dequantize("w", ty, &data, k, &mut wf).expect("dequantize");
            let weights = [Weights::Quantized { ty, data: &data }, Weights::F32(&wf)];
            let row: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let want = run(Isa::Portable, &row, 1, weights[0], n, k);
            // Float64 reference of the dequantized weights.
            for (j, &g) in want.iter().enumerate() {
                let (exact, mag) = row.iter().zip(&wf[j * k..(j + 1) * k]).fold(
                    (0.0f64, 0.0f64),
                    |(s, m), (&a, &b)| (s + a as f64 * b as f64, m + (a as f64 * b as f64).abs()),
                );
                prop_assert!(
                    (g as f64 - exact).abs() <= 1e-6 * mag + 1e-30,
                    "{:?} column {}: {} vs f64 {}", ty, j, g, exact
                );
            }
            for isa in Isa::available() {
                for w in weights {
                    for t in [1usize, 7, 8, 33, 100, 512] {
                        let at = [0, t / 2, t - 1, rng.gen_range(0..t)];
                        for p in at {
                            let mut x: Vec<f32> =
                                (0..t * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                            x[p * k..(p + 1) * k].copy_from_slice(&row);
                            let y = run(isa, &x, t, w, n, k);
                            for (j, (&g, &e)) in y[p * n..(p + 1) * n].iter().zip(&want).enumerate() {
                                prop_assert_eq!(
                                    g.to_bits(), e.to_bits(),
                                    "{:?} {:?} t {} row {} column {}: {} vs {}", isa, ty, t, p, j, g, e
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The lane tree and the zero-padded tail, by hand: 40 columns put
    /// three products in lanes 0..8 and two in lanes 8..16.
    #[test]
    fn portable_dot_by_hand() {
        let x: Vec<f32> = (0..40).map(|c| c as f32).collect();
        let w = vec![1.0f32; 40];
        let want: f32 = (0..40).map(|c| c as f32).sum();
        assert_eq!(dot_portable(&x, &w), want);
        for isa in Isa::available() {
            let y = run(isa, &x, 1, Weights::F32(&w), 1, 40);
            assert_eq!(y[0], want, "{isa:?}");
        }
    }
}
