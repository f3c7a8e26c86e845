//! AVX2 + F16C + FMA decoders of whole rows, bit-identical to the scalar
//! ones: quants are widened to i32 and converted to f32 exactly, and each
//! value is computed with the same f32 multiply / add / subtract, in the
//! same order, as the scalar decoder of its type (f16 → f32 is exact either
//! way). Where the scalar decoder multiplies and then adds or subtracts a
//! minimum (Q4_1, Q5_1, Q4_K), one fused multiply-add does both: the
//! product is exact in f32 (see [`mul_add`]), so rounding it first changes
//! nothing.

use std::arch::x86_64::*;

use super::format::{k4_scale_min, GgmlType};

/// Whether `ty` has a decoder here and the CPU can run it.
pub(crate) fn available(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q6_K)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("fma")
}

/// [`super::dequantize_blocks`] for a type with [`available`].
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    let groups = |e: usize, v: [__m256; 4]| {
        store32((&mut out[e..e + 32]).try_into().expect("32 outputs"), v)
    };
    // SAFETY: this function runs only with AVX2, F16C and FMA; `ty` is one
    // of `available`'s types (the caller checked).
    unsafe { for_each_group(ty, data, groups) }
}

/// F16 or BF16 values (`data: [out.len() * 2]` bytes, little-endian)
/// widened to f32, 8 per instruction: `vcvtph2ps` for F16, the 16 bits
/// shifted into the high half of an f32 for BF16. Both are exact, so the
/// values equal the scalar decoder's (a signalling NaN may come out
/// unquieted: NaN either way).
///
/// Panics when `data` is not two bytes per output.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn widen_halves(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len(), 2 * out.len(), "two bytes per half");
    let main = out.len() / 8 * 8;
    for i in (0..main).step_by(8) {
        // SAFETY: `i + 8 <= out.len()`, so bytes `2i .. 2i + 16` of `data`
        // and floats `i .. i + 8` of `out` are in bounds.
        unsafe {
            let h = _mm_loadu_si128(data.as_ptr().add(2 * i).cast());
            let v = match ty {
                GgmlType::F16 => _mm256_cvtph_ps(h),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))),
            };
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        }
    }
    super::portable::dequantize_blocks_scalar(ty, &data[2 * main..], &mut out[main..]);
}

/// Calls `f(e, v)` for each group of 32 consecutive elements of `data`
/// (whole blocks of `ty`), in order: `e` is the index of the group's
/// first element, `v[i]` holds elements `e + 8·i .. e + 8·i + 8`, with
/// values bit-identical to the scalar decoders.
///
/// # Safety
/// The CPU must support AVX2, F16C and FMA, and `ty` must be one of the
/// types [`available`] accepts (others panic).
#[inline(always)]
pub(crate) unsafe fn for_each_group(
    ty: GgmlType,
    data: &[u8],
    mut f: impl FnMut(usize, [__m256; 4]),
) {
    macro_rules! each_block {
        ($decode:ident, $block_bytes:literal, $block_len:literal) => {
            for (i, b) in data.chunks_exact($block_bytes).enumerate() {
                // SAFETY: the caller guarantees AVX2, F16C and FMA.
                unsafe { $decode(b.try_into().expect("block"), i * $block_len, &mut f) }
            }
        };
    }
    match ty {
        GgmlType::Q4_0 => each_block!(q4_0, 18, 32),
        GgmlType::Q4_1 => each_block!(q4_1, 20, 32),
        GgmlType::Q5_0 => each_block!(q5_0, 22, 32),
        GgmlType::Q5_1 => each_block!(q5_1, 24, 32),
        GgmlType::Q8_0 => each_block!(q8_0, 34, 32),
        GgmlType::Q4_K => each_block!(q4_k, 144, 256),
        GgmlType::Q6_K => each_block!(q6_k, 210, 256),
        _ => unreachable!("for_each_group: {ty:?} has no AVX2 decoder"),
    }
}

/// The little-endian f16 at byte `at`, as f32 (exact).
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[target_feature(enable = "avx2")]
fn load16(b: &[u8; 16]) -> __m128i {
    // SAFETY: reads the 16 bytes of `b` (no alignment needed).
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// The 32 bytes of `b` in one register.
#[target_feature(enable = "avx2")]
pub(crate) fn load32(b: &[u8; 32]) -> __m256i {
    // SAFETY: reads the 32 bytes of `b` (no alignment needed).
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// `o[8·i + l] = v[i][l]`.
#[target_feature(enable = "avx2")]
fn store32(o: &mut [f32; 32], v: [__m256; 4]) {
    for (i, v) in v.into_iter().enumerate() {
        // SAFETY: writes o[8·i .. 8·i + 8], inside `o` for i < 4.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), v) }
    }
}

/// The 32 bytes of `q` as signed integers, converted to f32 (exact).
#[target_feature(enable = "avx2")]
fn i8x32_to_f32(q: __m256i) -> [__m256; 4] {
    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
    ]
}

/// The 32 bytes of `q` as unsigned integers, converted to f32 (exact).
#[target_feature(enable = "avx2")]
fn u8x32_to_f32(q: __m256i) -> [__m256; 4] {
    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    [
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi))),
    ]
}

/// `[d_lo·q[0..16], d_hi·q[16..32]]`, one multiply per value.
#[target_feature(enable = "avx2")]
fn scale(q: [__m256; 4], d_lo: f32, d_hi: f32) -> [__m256; 4] {
    let (lo, hi) = (_mm256_set1_ps(d_lo), _mm256_set1_ps(d_hi));
    [
        _mm256_mul_ps(lo, q[0]),
        _mm256_mul_ps(lo, q[1]),
        _mm256_mul_ps(hi, q[2]),
        _mm256_mul_ps(hi, q[3]),
    ]
}

/// `d·q + m` in one fused multiply-add, the same bits as the scalar
/// decoders' multiply and then add: `d·q` is exact in f32, since `d` has
/// at most 17 significant bits (an f16's 11, times a 6-bit K-quant scale
/// for Q4_K) and `q < 32` at most 5, so rounding the product first is a
/// no-op (magnitudes stay far from overflow and from f32 subnormals).
#[target_feature(enable = "avx2,fma")]
fn mul_add(q: [__m256; 4], d: f32, m: f32) -> [__m256; 4] {
    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    [0, 1, 2, 3].map(|i| _mm256_fmadd_ps(d, q[i], m))
}

/// `d·q − m` in one fused multiply-subtract (exact product: [`mul_add`]).
#[target_feature(enable = "avx2,fma")]
fn mul_sub(q: [__m256; 4], d: f32, m: f32) -> [__m256; 4] {
    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    [0, 1, 2, 3].map(|i| _mm256_fmsub_ps(d, q[i], m))
}

/// The 32 nibbles of `qs[16]` in Q4_0 order: low nibbles, then high ones.
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    let v = load16(qs);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    _mm256_set_m128i(hi, lo)
}

/// Byte i = bit i of `qh`, moved to bit 4 (the 5th bit of a Q5 quant).
#[target_feature(enable = "avx2")]
fn q5_high_bits(qh: &[u8]) -> __m256i {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    // Byte i gets byte i / 8 of qh, then keeps its bit i % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q4_0(b: &[u8; 18], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let d = f16_at(b, 0);
    let q = _mm256_sub_epi8(
        nibbles(b[2..18].try_into().expect("16")),
        _mm256_set1_epi8(8),
    );
    f(e, scale(i8x32_to_f32(q), d, d));
}

#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
fn q4_1(b: &[u8; 20], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let q = nibbles(b[4..20].try_into().expect("16"));
    f(e, mul_add(u8x32_to_f32(q), d, m));
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q5_0(b: &[u8; 22], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let d = f16_at(b, 0);
    let q = _mm256_or_si256(
        nibbles(b[6..22].try_into().expect("16")),
        q5_high_bits(&b[2..6]),
    );
    let q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    f(e, scale(i8x32_to_f32(q), d, d));
}

#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
fn q5_1(b: &[u8; 24], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let q = _mm256_or_si256(
        nibbles(b[8..24].try_into().expect("16")),
        q5_high_bits(&b[4..8]),
    );
    f(e, mul_add(u8x32_to_f32(q), d, m));
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q8_0(b: &[u8; 34], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let d = f16_at(b, 0);
    let q = load32(b[2..34].try_into().expect("32"));
    f(e, scale(i8x32_to_f32(q), d, d));
}

#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
fn q4_k(b: &[u8; 144], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sc = &b[4..16];
    let mask = _mm256_set1_epi8(0x0F);
    // Sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) share qs[32c..32c + 32].
    for c in 0..4 {
        let v = load32(b[16 + 32 * c..48 + 32 * c].try_into().expect("32"));
        let halves = [
            _mm256_and_si256(v, mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
        ];
        for (hi, q) in halves.into_iter().enumerate() {
            let (scale, min) = k4_scale_min(sc, 2 * c + hi);
            let (ds, dm) = (d * scale, dmin * min);
            f(e + 64 * c + 32 * hi, mul_sub(u8x32_to_f32(q), ds, dm));
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q6_k(b: &[u8; 210], e: usize, f: &mut impl FnMut(usize, [__m256; 4])) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    let (mask4, mask2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    // Group g = 4·h + r of 32 elements; scale index e / 16 = 2g, 2g + 1.
    for g in 0..8 {
        let (h, r) = (g / 4, g % 4);
        let low = load32(ql[64 * h + 32 * (r % 2)..][..32].try_into().expect("32"));
        let high = load32(qh[32 * h..32 * h + 32].try_into().expect("32"));
        let low = _mm256_and_si256(
            _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (r / 2) as i32)),
            mask4,
        );
        let high = _mm256_and_si256(
            _mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * r as i32)),
            mask2,
        );
        let q = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
        let q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
        let ds_lo = d * (scales[2 * g] as i8) as f32;
        let ds_hi = d * (scales[2 * g + 1] as i8) as f32;
        f(e + 32 * g, scale(i8x32_to_f32(q), ds_lo, ds_hi));
    }
}
