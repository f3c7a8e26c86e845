//! Matrix products with 8-bit activations: the opt-in `int8` precision of
//! [`crate::matmul`] ([`crate::matmul::Precision::Int8`]).
//!
//! In exact precision every weight is decoded to its f32 value and
//! multiplied with the f32 activation, one fused multiply-add per weight.
//! In int8 precision each row of `x` is first rounded to 8-bit integers in
//! blocks of 256 columns ([`Q8Block`], one f32 scale per block), and Q4_K
//! and Q6_K weights multiply it with integer dot products: with AVX-512 BW
//! and VNNI, 64 products in two instructions (`vpmaddubsw`, `vpdpwssd`),
//! where exact precision spends four conversions and four multiply-adds;
//! with AVX2, 32 in two (`vpmaddubsw`, `vpmaddwd`; `int8/avx2.rs`).
//! This is the arithmetic llama.cpp uses by default for K-quant weights
//! (its `Q8_K` activations), written from the block formats of
//! [`crate::quant`]. The rounding of the activations changes the logits
//! (docs/benchmarks.md measures the deviation and the perplexity change);
//! every other type, and rows whose length is not a multiple of 256, stay
//! exact.
//!
//! Each output is still computed on its own, in a fixed order, so a row's
//! output is bit-identical for any number of rows, wherever the row sits
//! in the batch, and on the AVX-512, the AVX2 and the portable path.
//!
//! # Activations (per row of `x`, per block of 256 columns)
//!
//! `amax = max |x_e|`, `d = amax / 127` (one f32 division), `q_e =
//! round_half_even(x_e · (127 / amax))` in `−127..=127` (all 0 and `d = 0`
//! when `amax = 0`); `bsums16[s]` is the sum of `q` over elements `16·s ..
//! 16·s + 16`, `bsums32[s]` over `32·s .. 32·s + 32`.
//!
//! # The arithmetic of one output `y = x · w`
//!
//! Weights of a block are `d_w·sc(e)·q(e) − dmin_w·m(e)` (Q4_K: `q` the
//! 4-bit quant, `sc`, `m` the 6-bit scale and min of its sub-block of 32)
//! or `d_w·sc(e)·(q(e) − 32)` (Q6_K: `q` the 6-bit quant, `sc` the i8 scale
//! of its sub-block of 16). Sixteen f32 lanes `a[l]` start at `+0.0`; for
//! each block in order, with exact integer lane sums
//!
//! - `L[l] = Σ sc(e)·q(e)·q_x(e)` over the elements `e = 64·c + 4·l + i`
//!   (`c < 4`, `i < 4`);
//! - Q6_K: `L[l] −= 32·(sc_{2l}·bsums16[2l] + sc_{2l+1}·bsums16[2l+1])` for
//!   `l < 8`;
//! - Q4_K: `M[l] = m_{2l}·bsums32[2l] + m_{2l+1}·bsums32[2l+1]` for `l < 4`,
//!   0 above,
//!
//! the lanes take `a[l] = fma(f32(L[l]), d_w·d_x, a[l])`, then for Q4_K
//! `a[l] = fma(f32(M[l]), −(dmin_w·d_x), a[l])` (`f32(·)` rounds to
//! nearest even; each product of two scales is rounded to f32 once).
//! Finally `y = reduce16(a)`, the lane tree of [`crate::lanes`].

use crate::quant::GgmlType;

mod q8;

pub use q8::{quantize_rows, Q8Block, QK};

/// Whether weights of `ty` in rows of `k` columns multiply 8-bit
/// activations: Q4_K and Q6_K, `k` a positive multiple of [`QK`].
pub fn supported(ty: GgmlType, k: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) && k > 0 && k.is_multiple_of(QK)
}

/// The kernels a product runs on: all give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Kernels {
    /// AVX-512 F, BW, VNNI and F16C (`avx512`).
    Avx512,
    /// AVX2, FMA and F16C (`avx2`).
    Avx2,
    /// [`dot_portable`], any CPU.
    Portable,
}

/// Whether this CPU runs the AVX-512 kernels (AVX-512 F, BW, VNNI).
#[cfg(target_arch = "x86_64")]
pub(crate) fn simd() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("f16c")
}

/// Whether this CPU runs the AVX2 kernels (AVX2, FMA, F16C).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod prefetch;

/// Weight rows of one tile (as [`crate::matmul`]'s register tiles).
pub(crate) const MR: usize = 4;

/// From this many rows of `x` on, [`tile`] unpacks the weight tile once
/// (quants one per byte, scales spread per chunk) and multiplies every row
/// with it; below, it decodes each weight block in registers once for all
/// rows (`avx512::rows`; 4 rows exactly keep every accumulator in
/// registers, `avx512::tile`, and 1 row reads the weight rows one by one,
/// `avx512::one`). The unpacked tile is 2.25 times the bytes
/// of the int8 quants and, for a long row (Qwen2.5-Coder 1.5B's down
/// projection: 80 KiB), leaves L1, so it pays only for many rows. Zen 4,
/// 2 threads, Qwen2.5-Coder 1.5B, `te bench -p`, t/s: unpacked pp4 23.5,
/// pp8 30.7, pp16 43.1, pp32 50-65 (two runs), pp64 78.4; decoded per 4
/// rows pp4 48.2, pp8 50.4, pp16 58.8. Measured again on 2026-12-04 (a
/// faster minute of the same host), decoded per 4 rows against once for
/// all rows: pp3 39-45 / 46-51, pp4 59-60 / 55-57, pp6 58-60 / 63-64, pp8
/// 57-60 / 69-71, pp16 69-70 / 75-82, pp24 68-69 / 87-88. Speculative
/// verification's chunks (2 to 17 rows) take the registers; prefill's
/// longer chunks the unpacked tile.
const UNPACK_MIN_ROWS: usize = 32;

/// Bytes of `buf` [`tile`] needs for rows of `kb` blocks (none on the
/// portable path).
pub(crate) fn unpacked_bytes(kb: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    return kb * MR * avx512::UNPACKED;
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kb;
        0
    }
}

/// `store(r, y)` with `y[m] = x_r · w_m` for the `MR` weight rows `w` of
/// `ty` (each `kb` blocks, [`supported`]) and every row `r` of `x` (`kb`
/// blocks per row, from [`quantize_rows`]), with the module's arithmetic
/// on `kernels` (the CPU must have them: [`simd()`] for AVX-512,
/// [`avx2()`] for AVX2).
/// `buf` (at least [`unpacked_bytes`]) holds the unpacked tile for many
/// rows on AVX-512. Allocates nothing.
pub(crate) fn tile(
    ty: GgmlType,
    w: [&[u8]; MR],
    x: &[Q8Block],
    kb: usize,
    kernels: Kernels,
    buf: &mut [u8],
    mut store: impl FnMut(usize, [f32; MR]),
) {
    let t = x.len() / kb;
    #[cfg(target_arch = "x86_64")]
    if kernels == Kernels::Avx2 {
        // SAFETY: the caller checked the CPU; `ty` is supported and every
        // row holds `kb` whole blocks.
        unsafe {
            if ty == GgmlType::Q6_K {
                avx2::tile::<true, MR>(w, x, kb, &mut store);
            } else {
                avx2::tile::<false, MR>(w, x, kb, &mut store);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernels == Kernels::Avx512 {
        let q6 = ty == GgmlType::Q6_K;
        if t >= UNPACK_MIN_ROWS {
            // SAFETY: the caller checked the CPU; `ty` is supported and
            // every row holds `kb` whole blocks.
            unsafe {
                if q6 {
                    avx512::unpack::<true>(w, kb, buf);
                } else {
                    avx512::unpack::<false>(w, kb, buf);
                }
                for (r, xr) in x.chunks_exact(kb).enumerate() {
                    store(
                        r,
                        if q6 {
                            avx512::tile_unpacked::<true>(buf, xr)
                        } else {
                            avx512::tile_unpacked::<false>(buf, xr)
                        },
                    );
                }
            }
            return;
        }
        // SAFETY: as above.
        unsafe {
            if t == 1 {
                store(
                    0,
                    if q6 {
                        avx512::one::<true>(w, x)
                    } else {
                        avx512::one::<false>(w, x)
                    },
                );
            } else if t == 4 {
                let row = |r: usize| &x[r * kb..][..kb];
                let ys = avx512::tile::<4>(ty, w, [row(0), row(1), row(2), row(3)]);
                for (r, y) in ys.into_iter().enumerate() {
                    store(r, y);
                }
            } else if q6 {
                avx512::rows::<true>(w, x, kb, &mut store);
            } else {
                avx512::rows::<false>(w, x, kb, &mut store);
            }
        }
        return;
    }
    let _ = (kernels, buf);
    for (r, xr) in x.chunks_exact(kb).enumerate() {
        store(r, std::array::from_fn(|m| dot_portable(ty, w[m], xr)));
    }
}

/// One output with the module's arithmetic, lane by lane (the reference
/// the AVX-512 and AVX2 kernels equal bit for bit).
pub(crate) fn dot_portable(ty: GgmlType, w: &[u8], x: &[Q8Block]) -> f32 {
    let block_bytes = ty.block_layout().expect("a block type").1;
    let mut a = [0.0f32; 16];
    for (b, x) in w.chunks_exact(block_bytes).zip(x) {
        let f16 = |at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        let mut lanes = [0i32; 16];
        let mut mins = [0i32; 16];
        let d;
        let mut dm = 0.0f32;
        match ty {
            GgmlType::Q4_K => {
                d = f16(0);
                dm = f16(2);
                let sm: [(i32, i32); 8] = std::array::from_fn(|j| {
                    let (s, m) = crate::quant::k4_scale_min(&b[4..16], j);
                    (s as i32, m as i32)
                });
                for e in 0..QK {
                    let (c, hi, l) = (e / 64, (e / 32) % 2, e % 32);
                    let q = ((b[16 + 32 * c + l] >> (4 * hi)) & 0x0F) as i32;
                    lanes[(e % 64) / 4] += sm[e / 32].0 * q * x.qs[e] as i32;
                }
                for (l, m) in mins.iter_mut().take(4).enumerate() {
                    *m = sm[2 * l].1 * x.bsums32[2 * l] as i32
                        + sm[2 * l + 1].1 * x.bsums32[2 * l + 1] as i32;
                }
            }
            GgmlType::Q6_K => {
                d = f16(208);
                let sc = |s: usize| b[192 + s] as i8 as i32;
                for e in 0..QK {
                    let (h, r, l) = (e / 128, (e / 32) % 4, e % 32);
                    let low = (b[64 * h + 32 * (r % 2) + l] >> (4 * (r / 2))) & 0x0F;
                    let high = (b[128 + 32 * h + l] >> (2 * r)) & 3;
                    let q = (low | (high << 4)) as i32;
                    lanes[(e % 64) / 4] += sc(e / 16) * q * x.qs[e] as i32;
                }
                for (l, lane) in lanes.iter_mut().take(8).enumerate() {
                    *lane -= 32
                        * (sc(2 * l) * x.bsums16[2 * l] as i32
                            + sc(2 * l + 1) * x.bsums16[2 * l + 1] as i32);
                }
            }
            _ => unreachable!("int8::dot_portable: {ty:?} is not supported"),
        }
        let dd = d * x.d;
        for (a, &l) in a.iter_mut().zip(&lanes) {
            *a = (l as f32).mul_add(dd, *a);
        }
        if ty == GgmlType::Q4_K {
            let ndm = -(dm * x.d);
            for (a, &m) in a.iter_mut().zip(&mins) {
                *a = (m as f32).mul_add(ndm, *a);
            }
        }
    }
    crate::lanes::reduce16(&a)
}

#[cfg(target_arch = "x86_64")]
// Index loops over the tile read as the math does (acc[m][r]).
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::{Q8Block, MR, QK};
    use crate::quant::avx2::f16_at;
    use crate::quant::GgmlType;

    // The helpers are `#[inline(always)]` without `target_feature` of
    // their own: a `target_feature` function is not inlined into a caller
    // as large as the tile, and each call then spills the accumulators
    // (every vector register is caller-saved). Inlined into the tile, their
    // intrinsics run under its features.
    //
    // Safety of each: the CPU must support AVX-512 F, BW, VNNI and F16C.

    /// The 32 bytes at `b[at..]` in both 256-bit halves.
    #[inline(always)]
    unsafe fn bytes32x2(b: &[u8], at: usize) -> __m512i {
        let v: &[u8; 32] = b[at..at + 32].try_into().expect("32 bytes");
        // SAFETY: reads the 32 bytes of `v` (no alignment needed); the
        // caller's CPU has AVX-512F.
        unsafe { _mm512_broadcast_i64x4(_mm256_loadu_si256(v.as_ptr().cast())) }
    }

    /// The 64 bytes at `b[at..]`.
    #[inline(always)]
    unsafe fn bytes64(b: &[u8], at: usize) -> __m512i {
        let v: &[u8; 64] = b[at..at + 64].try_into().expect("64 bytes");
        // SAFETY: reads the 64 bytes of `v` (no alignment needed).
        unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
    }

    /// Prefetches block `at` of each of the `MR` rows `w` 4 tiles on into
    /// L2, as the exact decode kernels do (rows of a task are adjacent;
    /// the hardware prefetcher alone loses short rows at each 4 KiB page
    /// of a file map). A prefetch never faults, so an address past the
    /// weights is harmless.
    #[inline(always)]
    fn prefetch_ahead(w: [&[u8]; MR], at: &std::ops::Range<usize>) {
        for row in w {
            super::prefetch::row_ahead::<MR>(row, at);
        }
    }

    /// The sum of the 16 lanes of `a` by the module's lane tree
    /// ([`crate::lanes::reduce16`]).
    #[inline(always)]
    unsafe fn sum16(a: __m512) -> f32 {
        let mut lanes = [0.0f32; 16];
        // SAFETY: writes the 16 floats of `lanes`; the caller's CPU has
        // AVX-512F.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
        crate::lanes::reduce16(&lanes)
    }

    /// `acc + (i16 pair products of a and b, summed in pairs)`: one
    /// `vpdpwssd`, written as assembly because LLVM splits the intrinsic
    /// into `vpmaddwd` and `vpaddd` for generic x86-64 tuning (the same
    /// exact integer sums, one more instruction). The caller must be
    /// compiled with AVX-512 F and VNNI (a `target_feature` function).
    macro_rules! dpwssd {
        ($acc:expr, $a:expr, $b:expr) => {{
            let mut acc: __m512i = $acc;
            let (a, b): (__m512i, __m512i) = ($a, $b);
            // SAFETY: an arithmetic instruction on registers; the
            // enclosing function enables AVX-512 F and VNNI.
            unsafe {
                std::arch::asm!(
                    "vpdpwssd {acc}, {a}, {b}",
                    acc = inout(zmm_reg) acc,
                    a = in(zmm_reg) a,
                    b = in(zmm_reg) b,
                    options(pure, nomem, nostack, preserves_flags),
                );
            }
            acc
        }};
    }

    /// Activations `64·c .. 64·c + 64` of a block.
    #[inline(always)]
    unsafe fn x64(x: &Q8Block, c: usize) -> __m512i {
        let v: &[i8; 64] = x.qs[64 * c..64 * c + 64].try_into().expect("64 values");
        // SAFETY: reads the 64 bytes of `v` (64-byte aligned: the block is).
        unsafe { _mm512_load_si512(v.as_ptr().cast()) }
    }

    /// `vpshufb` controls that spread a block's sub-block scales over the
    /// i16 lanes of each chunk (`SPREAD[Q6][c]` for chunk `c`; a control
    /// byte of 0x80 gives 0). The source is [`Block::bc`].
    ///
    /// - Q4_K: every 64-bit lane of the source holds the 8 scale bytes
    ///   (u8); chunk `c`'s i16 lanes `0..16` take scale `2c`, lanes `16..32`
    ///   scale `2c + 1` (128-bit lane `L` of the result: `2c + L / 2`).
    /// - Q6_K: 128-bit lane `L` of the source holds the i16 scales `L, 4
    ///   + L, 8 + L, 12 + L` in its words `0..4`; chunk `c`'s lane `L`
    ///   takes the scale `4c + L`, its word `c`.
    static SPREAD: [[[u8; 64]; 4]; 2] = spread_controls();

    const fn spread_controls() -> [[[u8; 64]; 4]; 2] {
        let mut v = [[[0u8; 64]; 4]; 2];
        let mut c = 0;
        while c < 4 {
            let mut b = 0;
            while b < 64 {
                let lane = b / 16;
                // Q4_K: the low byte of each word is the scale, the high 0.
                v[0][c][b] = if b % 2 == 0 {
                    (2 * c + lane / 2) as u8
                } else {
                    0x80
                };
                // Q6_K: both bytes of word `c` of the lane.
                v[1][c][b] = (2 * c + b % 2) as u8;
                b += 1;
            }
            c += 1;
        }
        v
    }

    /// Q6_K: the `vpermw` index that puts scale `4j + L` (of the 16 i16
    /// scales) in word `j` of 128-bit lane `L`, for `j < 4` (words `4..8`
    /// repeat them, unused).
    static Q6_GATHER: [i16; 32] = {
        let mut v = [0i16; 32];
        let mut n = 0;
        while n < 32 {
            v[n] = (4 * (n % 4) + n / 8) as i16;
            n += 1;
        }
        v
    };

    /// The i16 scale of each pair of chunk `c`'s products ([`SPREAD`]).
    #[inline(always)]
    unsafe fn spread<const Q6: bool>(blk: &Block, c: usize) -> __m512i {
        // SAFETY: reads the 64 bytes of the control; the caller's CPU has
        // AVX-512 BW.
        unsafe {
            let ctrl = _mm512_loadu_si512(SPREAD[usize::from(Q6)][c].as_ptr().cast());
            _mm512_shuffle_epi8(blk.bc, ctrl)
        }
    }

    /// What one weight row's block shares over its chunks: its sub-block
    /// scales as i16 lanes, its mins (Q4_K) and its f16 scales as f32.
    struct Block {
        /// i16 scales (Q4_K: 8 lanes, Q6_K: 16 lanes).
        sc: __m512i,
        /// The scales arranged for [`SPREAD`] (unused where the chunks'
        /// scales come unpacked).
        bc: __m512i,
        /// Q4_K: the 8 mins as i16 lanes; Q6_K unused.
        mins: __m128i,
        d: f32,
        dmin: f32,
    }

    /// The [`Block`] of `b` (the bytes of a Q4_K block when `!Q6`, else
    /// of a Q6_K block).
    #[inline(always)]
    unsafe fn block<const Q6: bool>(b: &[u8]) -> Block {
        // SAFETY (each intrinsic): the caller's CPU has AVX-512 F and F16C;
        // the loads read the 16 bytes of `s`.
        unsafe {
            if Q6 {
                let s: &[u8; 16] = b[192..208].try_into().expect("16 scales");
                let s = _mm_loadu_si128(s.as_ptr().cast());
                let sc = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(s));
                let gather = _mm512_loadu_si512(Q6_GATHER.as_ptr().cast());
                Block {
                    sc,
                    bc: _mm512_permutexvar_epi16(gather, sc),
                    mins: _mm_setzero_si128(),
                    d: f16_at(b, 208),
                    dmin: 0.0,
                }
            } else {
                let (scale, min) = crate::quant::k4_block_scales_mins(b);
                let wide = _mm256_cvtepu8_epi16(_mm_set_epi64x(min as i64, scale as i64));
                Block {
                    sc: _mm512_zextsi256_si512(wide),
                    bc: _mm512_set1_epi64(scale as i64),
                    mins: _mm256_extracti128_si256::<1>(wide),
                    d: f16_at(b, 0),
                    dmin: f16_at(b, 2),
                }
            }
        }
    }

    /// Chunk `c` (elements `64·c .. 64·c + 64`) of block `b`: the unsigned
    /// quants, one per byte, and the i16 scale of each pair of products.
    #[inline(always)]
    unsafe fn chunk<const Q6: bool>(b: &[u8], blk: &Block, c: usize) -> (__m512i, __m512i) {
        // SAFETY (each intrinsic): the caller's CPU has AVX-512 F and BW.
        unsafe {
            if Q6 {
                // Elements 128·h + 64·p + i: low bits from ql[64·h + i]
                // (nibble p), high bits 4·p + 2·(i / 32) of qh[32·h + i % 32].
                let (h, p) = (c / 2, c % 2);
                let low = _mm512_and_si512(
                    _mm512_srl_epi16(bytes64(b, 64 * h), _mm_cvtsi32_si128(4 * p as i32)),
                    _mm512_set1_epi8(0x0F),
                );
                let s = 4 * p as i64;
                let high = _mm512_srlv_epi64(
                    bytes32x2(b, 128 + 32 * h),
                    _mm512_setr_epi64(s, s, s, s, s + 2, s + 2, s + 2, s + 2),
                );
                // Bits 0..2 of each byte, moved to bits 4..6 (within the byte).
                let high = _mm512_and_si512(_mm512_slli_epi16::<4>(high), _mm512_set1_epi8(0x30));
                (_mm512_or_si512(low, high), spread::<Q6>(blk, c))
            } else {
                // Low nibbles of qs[32·c ..] are elements 64·c .. + 32,
                // high nibbles the next 32.
                let v = bytes32x2(b, 16 + 32 * c);
                let v = _mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
                let q = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                (q, spread::<Q6>(blk, c))
            }
        }
    }

    /// The end of a block for one output: its lanes' integer sums `acc`
    /// (with the Q6_K offset taken off) scaled into the float lanes `a`,
    /// then Q4_K's mins (the module doc's arithmetic).
    #[inline(always)]
    unsafe fn finish<const Q6: bool>(acc: __m512i, blk: &Block, x: &Q8Block, a: __m512) -> __m512 {
        // SAFETY: the caller's CPU has AVX-512 F, BW; the loads read the
        // 32 and 16 bytes of the sums.
        unsafe {
            let mut lanes = acc;
            if Q6 {
                let b16 = _mm256_loadu_si256(x.bsums16.as_ptr().cast());
                let off = _mm256_madd_epi16(_mm512_castsi512_si256(blk.sc), b16);
                let off = _mm512_zextsi256_si512(_mm256_slli_epi32::<5>(off));
                lanes = _mm512_sub_epi32(lanes, off);
            }
            let dd = _mm512_set1_ps(blk.d * x.d);
            let mut a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), dd, a);
            if !Q6 {
                let b32 = _mm_loadu_si128(x.bsums32.as_ptr().cast());
                let mins = _mm512_zextsi128_si512(_mm_madd_epi16(blk.mins, b32));
                let ndm = _mm512_set1_ps(-(blk.dmin * x.d));
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), ndm, a);
            }
            a
        }
    }

    /// Bytes of one weight row's block unpacked by [`unpack`]: its 4
    /// chunks' quants (4 × 64), their scales (4 × 64), the block's i16
    /// scales (32), mins (16), `d` and `dmin` (f32), to a whole line.
    pub(super) const UNPACKED: usize = 576;

    /// Unpacks the `blocks` blocks of the `MR` rows `w` (Q4_K when `!Q6`,
    /// else Q6_K) into `out`: block `bi` of row `m` at `(bi · MR + m) ·`
    /// [`UNPACKED`], the values [`tile_of`] computes from the bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) fn unpack<const Q6: bool>(w: [&[u8]; MR], blocks: usize, out: &mut [u8]) {
        let block_bytes = if Q6 { 210 } else { 144 };
        let out = &mut out[..blocks * MR * UNPACKED];
        for (i, o) in out.chunks_exact_mut(UNPACKED).enumerate() {
            let (bi, m) = (i / MR, i % MR);
            let b = &w[m][bi * block_bytes..][..block_bytes];
            let o: &mut [u8; UNPACKED] = o.try_into().expect("an unpacked block");
            // SAFETY: this function's features.
            let blk = unsafe { block::<Q6>(b) };
            // SAFETY: this function's features; each store writes inside
            // `o` (offsets + widths <= UNPACKED).
            unsafe {
                for c in 0..QK / 64 {
                    let (q, sc) = chunk::<Q6>(b, &blk, c);
                    _mm512_storeu_si512(o[64 * c..].as_mut_ptr().cast(), q);
                    _mm512_storeu_si512(o[256 + 64 * c..].as_mut_ptr().cast(), sc);
                }
                _mm256_storeu_si256(o[512..].as_mut_ptr().cast(), _mm512_castsi512_si256(blk.sc));
                _mm_storeu_si128(o[544..].as_mut_ptr().cast(), blk.mins);
            }
            o[560..564].copy_from_slice(&blk.d.to_le_bytes());
            o[564..568].copy_from_slice(&blk.dmin.to_le_bytes());
        }
    }

    /// `y[m] = x · w_m` for one row `x` (`blocks` blocks) and the `MR`
    /// weight rows unpacked in `u` by [`unpack`]: the same operations, in
    /// the same order, as [`tile_of`], reading the unpacked values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) fn tile_unpacked<const Q6: bool>(u: &[u8], x: &[Q8Block]) -> [f32; MR] {
        let u = &u[..x.len() * MR * UNPACKED];
        let mut a = [_mm512_setzero_ps(); MR];
        for (ub, xb) in u.chunks_exact(MR * UNPACKED).zip(x) {
            let mut acc = [_mm512_setzero_si512(); MR];
            for c in 0..QK / 64 {
                // SAFETY: this function's features.
                let xc = unsafe { x64(xb, c) };
                for m in 0..MR {
                    let o = &ub[m * UNPACKED..][..UNPACKED];
                    // SAFETY: reads 64 bytes at offsets <= 448 of `o`.
                    let (q, sc) = unsafe {
                        (
                            _mm512_loadu_si512(o[64 * c..].as_ptr().cast()),
                            _mm512_loadu_si512(o[256 + 64 * c..].as_ptr().cast()),
                        )
                    };
                    acc[m] = dpwssd!(acc[m], _mm512_maddubs_epi16(q, xc), sc);
                }
            }
            for m in 0..MR {
                let o = &ub[m * UNPACKED..][..UNPACKED];
                let f = |at: usize| f32::from_le_bytes(o[at..at + 4].try_into().expect("4 bytes"));
                // SAFETY: reads 32 and 16 bytes inside `o`.
                let blk = unsafe {
                    Block {
                        sc: _mm512_zextsi256_si512(_mm256_loadu_si256(o[512..].as_ptr().cast())),
                        bc: _mm512_setzero_si512(),
                        mins: _mm_loadu_si128(o[544..].as_ptr().cast()),
                        d: f(560),
                        dmin: f(564),
                    }
                };
                // SAFETY: this function's features.
                a[m] = unsafe { finish::<Q6>(acc[m], &blk, xb, a[m]) };
            }
        }
        let mut y = [0.0f32; MR];
        for m in 0..MR {
            // SAFETY: this function's features.
            y[m] = unsafe { sum16(a[m]) };
        }
        y
    }

    /// The most rows [`rows`] takes at once.
    pub(super) const MAX_ROWS: usize = super::UNPACK_MIN_ROWS;

    /// `store(r, y)` with `y[m] = x_r · w_m` for every row `r` of `x` (`t
    /// = x.len() / blocks` rows, `2 <= t <= MAX_ROWS`, Q4_K when `!Q6`,
    /// else Q6_K): each weight block is decoded in registers once for all
    /// `t` rows (its 4 chunks' quants and scales, weight row by weight
    /// row), and each row's block sums run the same operations in the
    /// same order as [`tile_of`]'s, so the bits are the same. The float
    /// accumulators live in a stack array (up to 8 KiB, not zero-filled),
    /// one load and store per row and block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) fn rows<const Q6: bool>(
        w: [&[u8]; MR],
        x: &[Q8Block],
        blocks: usize,
        store: &mut impl FnMut(usize, [f32; MR]),
    ) {
        let block_bytes = if Q6 { 210 } else { 144 };
        let t = x.len() / blocks;
        debug_assert!((2..=MAX_ROWS).contains(&t) && x.len() == t * blocks);
        debug_assert!(w.iter().all(|r| r.len() == blocks * block_bytes));
        debug_assert!(blocks > 0);
        // Only the first `t` rows are used: written at block 0, so the
        // array is not zero-filled (8 KiB a tile).
        let mut a = [[MaybeUninit::<__m512>::uninit(); MR]; MAX_ROWS];
        for bi in 0..blocks {
            let at = bi * block_bytes..(bi + 1) * block_bytes;
            prefetch_ahead(w, &at);
            for m in 0..MR {
                let wb = &w[m][at.clone()];
                // SAFETY (the helpers): this function's features.
                let blk = unsafe { block::<Q6>(wb) };
                let mut ch = [(_mm512_setzero_si512(), _mm512_setzero_si512()); QK / 64];
                for (c, ch) in ch.iter_mut().enumerate() {
                    // SAFETY: this function's features.
                    *ch = unsafe { chunk::<Q6>(wb, &blk, c) };
                }
                for r in 0..t {
                    let xb = &x[r * blocks + bi];
                    let mut acc = _mm512_setzero_si512();
                    for (c, &(q, sc)) in ch.iter().enumerate() {
                        // SAFETY: this function's features.
                        let p = _mm512_maddubs_epi16(q, unsafe { x64(xb, c) });
                        acc = dpwssd!(acc, p, sc);
                    }
                    // SAFETY: `a[r][m]` was written at the block before
                    // `bi` (the lanes start at +0.0); this function's
                    // features.
                    let prev = if bi == 0 {
                        _mm512_setzero_ps()
                    } else {
                        unsafe { a[r][m].assume_init() }
                    };
                    a[r][m].write(unsafe { finish::<Q6>(acc, &blk, xb, prev) });
                }
            }
        }
        for (r, ar) in a.iter().take(t).enumerate() {
            let mut y = [0.0f32; MR];
            for m in 0..MR {
                // SAFETY: every block wrote rows `..t`, and there is one
                // (`t = x.len() / blocks` above divides by `blocks`); this
                // function's features.
                y[m] = unsafe { sum16(ar[m].assume_init()) };
            }
            store(r, y);
        }
    }

    /// `y[m] = x · w_m` for one row `x` (decode): the weight rows one
    /// after the other, each with the operations of [`tile_of`] in its
    /// order (the same bits). The rows lie one after the other in memory,
    /// so the tile is read as one stream; [`tile_of`] walks the 4 rows'
    /// blocks side by side, and on Zen 4 (Qwen2.5-Coder 1.5B, `te bench
    /// -n 32 --precision int8`) decoded 14.6-15.3 t/s on one thread
    /// against this kernel's 17.5 (26.1-27.3 against 27.3-28.1 on two).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) fn one<const Q6: bool>(w: [&[u8]; MR], x: &[Q8Block]) -> [f32; MR] {
        let block_bytes = if Q6 { 210 } else { 144 };
        let blocks = x.len();
        let mut y = [0.0f32; MR];
        for m in 0..MR {
            let row = &w[m][..blocks * block_bytes];
            let mut a = _mm512_setzero_ps();
            for (wb, xb) in row.chunks_exact(block_bytes).zip(x) {
                // The block's offset from the pointers: counted by
                // `enumerate` instead, this kernel decoded 16.6-16.8 t/s
                // against 19.9-20.6 (one thread, same minutes; the loop
                // compiles differently).
                let off = wb.as_ptr() as usize - row.as_ptr() as usize;
                super::prefetch::row_ahead::<MR>(row, &(off..off + block_bytes));
                // SAFETY (the helpers): this function's features.
                let blk = unsafe { block::<Q6>(wb) };
                let mut acc = _mm512_setzero_si512();
                for c in 0..QK / 64 {
                    // SAFETY: this function's features.
                    let (q, sc) = unsafe { chunk::<Q6>(wb, &blk, c) };
                    // SAFETY: this function's features.
                    let p = _mm512_maddubs_epi16(q, unsafe { x64(xb, c) });
                    acc = dpwssd!(acc, p, sc);
                }
                // SAFETY: this function's features.
                a = unsafe { finish::<Q6>(acc, &blk, xb, a) };
            }
            // SAFETY: this function's features.
            y[m] = unsafe { sum16(a) };
        }
        y
    }

    /// [`super::tile`] for `NR` rows of `x`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW, VNNI and F16C; `ty` supported;
    /// every `w` row and `x` row of the same number of whole blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn tile<const NR: usize>(
        ty: GgmlType,
        w: [&[u8]; MR],
        xs: [&[Q8Block]; NR],
    ) -> [[f32; MR]; NR] {
        match ty {
            GgmlType::Q4_K => tile_of::<NR, false>(w, xs),
            GgmlType::Q6_K => tile_of::<NR, true>(w, xs),
            _ => unreachable!("int8: {ty:?} is not supported"),
        }
    }

    /// [`tile`] for Q4_K (`!Q6`) or Q6_K (`Q6`) weights.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    fn tile_of<const NR: usize, const Q6: bool>(
        w: [&[u8]; MR],
        xs: [&[Q8Block]; NR],
    ) -> [[f32; MR]; NR] {
        let block_bytes = if Q6 { 210 } else { 144 };
        let blocks = xs[0].len();
        debug_assert!(w.iter().all(|r| r.len() == blocks * block_bytes));
        debug_assert!(xs.iter().all(|x| x.len() == blocks));
        let mut a = [[_mm512_setzero_ps(); NR]; MR];
        for bi in 0..blocks {
            let at = bi * block_bytes..(bi + 1) * block_bytes;
            prefetch_ahead(w, &at);
            let wb: [&[u8]; MR] = [
                &w[0][at.clone()],
                &w[1][at.clone()],
                &w[2][at.clone()],
                &w[3][at],
            ];
            // SAFETY (the helpers): this function's features. (Written out:
            // a closure here is not inlined.)
            let blk: [Block; MR] = unsafe {
                [
                    block::<Q6>(wb[0]),
                    block::<Q6>(wb[1]),
                    block::<Q6>(wb[2]),
                    block::<Q6>(wb[3]),
                ]
            };
            let mut acc = [[_mm512_setzero_si512(); NR]; MR];
            for c in 0..QK / 64 {
                for m in 0..MR {
                    // SAFETY: this function's features.
                    let (q, sc) = unsafe { chunk::<Q6>(wb[m], &blk[m], c) };
                    for r in 0..NR {
                        // SAFETY: this function's features.
                        let p = _mm512_maddubs_epi16(q, unsafe { x64(&xs[r][bi], c) });
                        acc[m][r] = dpwssd!(acc[m][r], p, sc);
                    }
                }
            }
            for r in 0..NR {
                for m in 0..MR {
                    // SAFETY: this function's features.
                    a[m][r] = unsafe { finish::<Q6>(acc[m][r], &blk[m], &xs[r][bi], a[m][r]) };
                }
            }
        }
        let mut y = [[0.0f32; MR]; NR];
        for r in 0..NR {
            for m in 0..MR {
                // SAFETY: this function's features.
                y[r][m] = unsafe { sum16(a[m][r]) };
            }
        }
        y
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::q8::round_ties_even;
    use super::*;
    use crate::quant::{dequantize_blocks, tests::random_row};

    const TYPES: [(GgmlType, &[usize]); 2] = [(GgmlType::Q4_K, &[0, 2]), (GgmlType::Q6_K, &[208])];

    fn random_x(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n)
            .map(|i| {
                // Some blocks all zero, some with one large outlier.
                if (i / QK) % 5 == 3 {
                    0.0
                } else if i % 97 == 0 {
                    rng.gen_range(-40.0..40.0)
                } else {
                    rng.gen_range(-2.0..2.0)
                }
            })
            .collect()
    }

    /// The rounding of activations has the value of `f32::round_ties_even`
    /// on every half-step and random values in the range it serves.
    #[test]
    fn rounding_is_round_ties_even() {
        let mut rng = StdRng::seed_from_u64(7);
        let halves = (-300..=300).map(|h| h as f32 * 0.5);
        let random = (0..100_000).map(|_| rng.gen_range(-200.0f32..200.0));
        for v in halves.chain(random) {
            assert_eq!(round_ties_even(v), v.round_ties_even(), "{v}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Quantized activations stay within half a step of `x`, and
        /// their sums are the sums of `qs`.
        #[test]
        fn activations_round_to_the_nearest_step(seed: u64, blocks in 1usize..4) {
            let mut rng = StdRng::seed_from_u64(seed);
            let x = random_x(blocks * QK, &mut rng);
            let mut q = Vec::new();
            quantize_rows(&x, QK, &mut q);
            for (b, xb) in q.iter().zip(x.chunks_exact(QK)) {
                let amax = xb.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                prop_assert!((b.d as f64 - amax / 127.0).abs() <= 1e-6 * amax);
                for (&qi, &xi) in b.qs.iter().zip(xb) {
                    prop_assert!((-127..=127).contains(&qi));
                    prop_assert!((qi as f64 * b.d as f64 - xi as f64).abs() <= 0.5001 * b.d as f64);
                }
                for s in 0..16 {
                    let want: i32 = b.qs[16 * s..16 * s + 16].iter().map(|&v| v as i32).sum();
                    prop_assert_eq!(b.bsums16[s] as i32, want);
                }
                for s in 0..8 {
                    prop_assert_eq!(b.bsums32[s], b.bsums16[2 * s] + b.bsums16[2 * s + 1]);
                }
            }
        }

        /// The portable output is the float64 dot product of the
        /// dequantized weights and the rounded activations, to f32 rounding;
        /// and within the activations' rounding of the float64 product
        /// with `x` itself.
        #[test]
        fn portable_dot_is_the_product_of_the_rounded_activations(seed: u64, blocks in 1usize..4) {
            let mut rng = StdRng::seed_from_u64(seed);
            for (ty, f16_at) in TYPES {
                let k = blocks * QK;
                let w = random_row(ty, f16_at, blocks, &mut rng);
                let mut wf = vec![0.0f32; k];
                dequantize_blocks(ty, &w, &mut wf);
                let x = random_x(k, &mut rng);
                let mut q = Vec::new();
                quantize_rows(&x, k, &mut q);
                let got = dot_portable(ty, &w, &q) as f64;
                let (mut want, mut magnitude, mut exact, mut bound) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                for e in 0..k {
                    let b = &q[e / QK];
                    let xq = b.qs[e % QK] as f64 * b.d as f64;
                    want += wf[e] as f64 * xq;
                    magnitude += (wf[e] as f64 * xq).abs();
                    exact += wf[e] as f64 * x[e] as f64;
                    bound += (wf[e] as f64).abs() * 0.5 * b.d as f64;
                }
                let tol = 1e-5 * magnitude + 1e-30;
                prop_assert!((got - want).abs() <= tol, "{:?}: {} vs {} (tol {})", ty, got, want, tol);
                prop_assert!((got - exact).abs() <= bound * 1.001 + tol, "{:?}: {} vs exact {}", ty, got, exact);
            }
        }

        /// The AVX-512 and AVX2 tiles equal the portable arithmetic bit
        /// for bit, for every weight row of the tile and rows of `x`
        /// (AVX-512: decoded in registers for 1, exactly 4, and the rest of
        /// fewer than [`UNPACK_MIN_ROWS`] all at once, or through the
        /// unpacked tile; AVX2: in passes of 4 rows and a remainder).
        #[test]
        fn simd_tiles_match_portable_bitwise(
            seed: u64,
            blocks in 1usize..4,
            rows in prop_oneof![
                Just(1usize),
                Just(4usize),
                2usize..UNPACK_MIN_ROWS,
                UNPACK_MIN_ROWS..UNPACK_MIN_ROWS + 4
            ],
        ) {
            let kernels: Vec<Kernels> = [(Kernels::Avx512, simd()), (Kernels::Avx2, avx2())]
                .into_iter()
                .filter_map(|(k, on)| on.then_some(k))
                .collect();
            if kernels.is_empty() {
                println!("skipped: this CPU has neither AVX-512 BW + VNNI nor AVX2 + FMA");
                return Ok(());
            }
            let mut rng = StdRng::seed_from_u64(seed);
            for (ty, f16_at) in TYPES {
                let k = blocks * QK;
                let ws: Vec<Vec<u8>> = (0..MR).map(|_| random_row(ty, f16_at, blocks, &mut rng)).collect();
                let x = random_x(rows * k, &mut rng);
                let mut q = Vec::new();
                quantize_rows(&x, k, &mut q);
                let w: [&[u8]; MR] = std::array::from_fn(|m| &ws[m][..]);
                let mut portable = vec![[f32::NAN; MR]; rows];
                let mut buf = vec![0u8; unpacked_bytes(blocks)];
                tile(ty, w, &q, blocks, Kernels::Portable, &mut buf, |r, y| portable[r] = y);
                for &kernels in &kernels {
                    let mut simd_out = vec![[f32::NAN; MR]; rows];
                    tile(ty, w, &q, blocks, kernels, &mut buf, |r, y| simd_out[r] = y);
                    for (r, (s, p)) in simd_out.iter().zip(&portable).enumerate() {
                        for m in 0..MR {
                            prop_assert_eq!(s[m].to_bits(), p[m].to_bits(), "{:?} {:?} row {} weight {}: {} vs {}", kernels, ty, r, m, s[m], p[m]);
                        }
                    }
                }
            }
        }
    }
}
