//! The int8 products with AVX2 (+ FMA, F16C): the module's arithmetic in
//! two 8-lane halves, for CPUs without AVX-512 BW + VNNI (AMD Zen 1 to
//! 3, most Intel client CPUs). 32 products in two instructions
//! (`vpmaddubsw`, then `vpmaddwd` with the sub-block scales), where the
//! exact AVX2 path spends about 26 (widening, conversions, multiplies,
//! subtractions, multiply-adds) on decoding and multiplying 32 weights.
//!
//! A group of 32 consecutive elements `32·g ..` of a block is one 256-bit
//! vector: elements `64·c .. 64·c + 32` give lanes `0..8` of the module's
//! 16 lanes, `64·c + 32 .. 64·c + 64` lanes `8..16`, so even groups add
//! into the low half and odd groups into the high half, and each lane's
//! integer sum is the portable one (integer sums do not depend on their
//! order). The float steps are the portable ones, lane by lane.

use std::arch::x86_64::*;

use super::q8::{Q8Block, QK};
use crate::quant::avx2::{f16_at, load32};

/// Rows of `x` multiplied with each decoded weight block before the next
/// block is decoded (their float lanes stay in registers: 2 each).
const ROWS: usize = 4;

/// One weight block ready for integer products: group `g`'s 32 quants
/// (unsigned bytes) and the i16 scale of each pair of its products, the
/// sub-block scales (Q6_K, for its offset) or mins (Q4_K) as i16 lanes,
/// and the f16 scales as f32.
struct Decoded {
    q: [__m256i; 8],
    sc: [__m256i; 8],
    /// Q6_K: the 16 i16 scales; Q4_K: the 8 mins in i16 lanes `0..8`.
    extra: __m256i,
    d: f32,
    dmin: f32,
}

/// The 32 bytes at `b[at..]`.
#[inline(always)]
unsafe fn bytes32(b: &[u8], at: usize) -> __m256i {
    // SAFETY: the caller's CPU has AVX2.
    unsafe { load32(b[at..at + 32].try_into().expect("32 bytes")) }
}

/// Every i16 lane of the result holds i16 lane `2·p + H` of `v` (`p` the
/// dword, `H` its half): a dword broadcast, then a byte shuffle.
#[inline(always)]
unsafe fn broadcast16<const H: bool>(v: __m256i, p: i32) -> __m256i {
    // SAFETY: register operations; the caller's CPU has AVX2.
    unsafe {
        let pair = _mm256_permutevar8x32_epi32(v, _mm256_set1_epi32(p));
        let half = if H { 0x0302 } else { 0x0100 };
        _mm256_shuffle_epi8(pair, _mm256_set1_epi16(half))
    }
}

/// Decodes the bytes of one block (Q4_K when `!Q6`, else Q6_K).
#[inline(always)]
unsafe fn decode<const Q6: bool>(b: &[u8]) -> Decoded {
    // SAFETY (each intrinsic): the caller's CPU has AVX2 and F16C; the
    // loads read inside `b` (a whole block).
    unsafe {
        let zero = _mm256_setzero_si256();
        let mut d = Decoded {
            q: [zero; 8],
            sc: [zero; 8],
            extra: zero,
            d: 0.0,
            dmin: 0.0,
        };
        if Q6 {
            let s: &[u8; 16] = b[192..208].try_into().expect("16 scales");
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(s.as_ptr().cast()));
            let mask4 = _mm256_set1_epi8(0x0F);
            let mask2 = _mm256_set1_epi8(3);
            // Group g = 4·h + r: low bits from ql[64·h + 32·(r % 2) ..]
            // (nibble r / 2), high bits 2·r of qh[32·h ..]; its two
            // sub-blocks of 16 take scales 2g (lanes 0..8 of the pairs) and
            // 2g + 1 (lanes 8..16).
            for g in 0..8 {
                let (h, r) = (g / 4, g % 4);
                let low = _mm256_srl_epi16(
                    bytes32(b, 64 * h + 32 * (r % 2)),
                    _mm_cvtsi32_si128(4 * (r / 2) as i32),
                );
                let high =
                    _mm256_srl_epi16(bytes32(b, 128 + 32 * h), _mm_cvtsi32_si128(2 * r as i32));
                d.q[g] = _mm256_or_si256(
                    _mm256_and_si256(low, mask4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(high, mask2)),
                );
                let pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(g as i32));
                // Lane 0 (128 bits) takes word 0 of the pair, lane 1 word 1.
                let ctrl = _mm256_setr_epi8(
                    0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
                    2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                );
                d.sc[g] = _mm256_shuffle_epi8(pair, ctrl);
            }
            d.extra = sc16;
            d.d = f16_at(b, 208);
        } else {
            let (scale, min) = crate::quant::k4_block_scales_mins(b);
            let sm = _mm256_cvtepu8_epi16(_mm_set_epi64x(min as i64, scale as i64));
            let mask4 = _mm256_set1_epi8(0x0F);
            // Low nibbles of qs[32·c ..] are group 2c, high nibbles 2c + 1.
            for c in 0..4 {
                let v = bytes32(b, 16 + 32 * c);
                d.q[2 * c] = _mm256_and_si256(v, mask4);
                d.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask4);
                d.sc[2 * c] = broadcast16::<false>(sm, c as i32);
                d.sc[2 * c + 1] = broadcast16::<true>(sm, c as i32);
            }
            // The mins (i16 lanes 8..16 of `sm`) into lanes 0..8.
            d.extra = _mm256_permute2x128_si256::<0x81>(sm, sm);
            d.d = f16_at(b, 0);
            d.dmin = f16_at(b, 2);
        }
        d
    }
}

/// The float lanes `a` (low, high half) after block `w` times row block
/// `x`: the integer lane sums, the Q6_K offset, the scales, the Q4_K mins.
#[inline(always)]
unsafe fn block<const Q6: bool>(w: &Decoded, x: &Q8Block, a: [__m256; 2]) -> [__m256; 2] {
    // SAFETY (each intrinsic): the caller's CPU has AVX2 and FMA; the
    // loads read inside `x` (32-byte aligned: the block is 64-byte
    // aligned).
    unsafe {
        let mut acc = [_mm256_setzero_si256(); 2];
        for g in 0..8 {
            let xg = _mm256_load_si256(x.qs[32 * g..].as_ptr().cast());
            let p = _mm256_maddubs_epi16(w.q[g], xg);
            acc[g % 2] = _mm256_add_epi32(acc[g % 2], _mm256_madd_epi16(p, w.sc[g]));
        }
        if Q6 {
            let b16 = _mm256_load_si256(x.bsums16.as_ptr().cast());
            let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(w.extra, b16));
            acc[0] = _mm256_sub_epi32(acc[0], off);
        }
        let dd = _mm256_set1_ps(w.d * x.d);
        let mut a = [
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[0]), dd, a[0]),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[1]), dd, a[1]),
        ];
        if !Q6 {
            let b32 = _mm_loadu_si128(x.bsums32.as_ptr().cast());
            let mins = _mm_madd_epi16(_mm256_castsi256_si128(w.extra), b32);
            let mins = _mm256_cvtepi32_ps(_mm256_zextsi128_si256(mins));
            let ndm = _mm256_set1_ps(-(w.dmin * x.d));
            // Lanes 4..16 take 0 · ndm, as the portable path's do.
            a[0] = _mm256_fmadd_ps(mins, ndm, a[0]);
            a[1] = _mm256_fmadd_ps(_mm256_setzero_ps(), ndm, a[1]);
        }
        a
    }
}

/// `store(r, y)` with `y[m] = x_r · w_m` for every row `r` of `x` (`kb`
/// blocks each) and the `MR` weight rows `w` (Q4_K when `!Q6`, else
/// Q6_K; `kb` blocks each): weight row by weight row (one stream of
/// bytes), each block decoded once for up to [`ROWS`] rows of `x`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn tile<const Q6: bool, const MR: usize>(
    w: [&[u8]; MR],
    x: &[Q8Block],
    kb: usize,
    store: &mut impl FnMut(usize, [f32; MR]),
) {
    let block_bytes = if Q6 { 210 } else { 144 };
    let t = x.len() / kb;
    for r0 in (0..t).step_by(ROWS) {
        let n = ROWS.min(t - r0);
        let mut y = [[0.0f32; MR]; ROWS];
        for m in 0..MR {
            let row = &w[m][..kb * block_bytes];
            let mut a = [[_mm256_setzero_ps(); 2]; ROWS];
            for (bi, wb) in row.chunks_exact(block_bytes).enumerate() {
                if r0 == 0 {
                    // The same block 4 tiles on, into L2, on the first
                    // pass only (Zen 1, decode: 8.6-8.9 t/s against
                    // 7.3-8.4 without).
                    let at = bi * block_bytes;
                    super::prefetch::row_ahead::<MR>(w[m], &(at..at + block_bytes));
                }
                // SAFETY (the helpers): this function's features.
                let dw = unsafe { decode::<Q6>(wb) };
                for r in 0..n {
                    // SAFETY: this function's features.
                    a[r] = unsafe { block::<Q6>(&dw, &x[(r0 + r) * kb + bi], a[r]) };
                }
            }
            for r in 0..n {
                let mut lanes = [0.0f32; QK / 16];
                // SAFETY: writes the 16 floats of `lanes`.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), a[r][0]);
                    _mm256_storeu_ps(lanes[8..].as_mut_ptr(), a[r][1]);
                }
                y[r][m] = crate::lanes::reduce16(&lanes);
            }
        }
        for (r, y) in y.into_iter().take(n).enumerate() {
            store(r0 + r, y);
        }
    }
}
