//! AVX-512 decoders, block by block, 16 values per register, bit-identical
//! to the scalar ones: the 4- and 5-bit quants of Q4_0, Q4_1 and Q5_0
//! index a table of their block's values (computed with the scalar
//! decoder's operations, or with one fused multiply-add where the product
//! is exact in f32, which rounds the same); the other types' quants are
//! widened to i32, converted to f32 exactly and multiplied by the scalar
//! decoder's scale (Q4_K: one fused multiply-subtract, exact product).
//! The K types' per-sub-block multipliers are stored once per block and
//! broadcast from memory ([`Mults`], [`splat`]), and so are Q4_1's
//! scales, converted 16 blocks at a time for the fused kernels
//! ([`Q4_1Run`]).

use std::arch::x86_64::*;

use super::format::GgmlType;

/// Whether `ty` has a decoder here and the CPU can run it.
pub(crate) fn available(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q8_0 | Q4_K | Q6_K)
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
}

/// [`super::dequantize_blocks`] for a type with [`available`]: block by
/// block, its constants from the type's `*_block` decoder, then each
/// group of 32 values from its group decoder, stored.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and F16C; `ty` one of
/// [`available`]'s types (others panic).
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) unsafe fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    macro_rules! each_block {
        ($block:ident, $group:ident) => {{
            let (block_len, block_bytes) = ty.block_layout().expect("a block type");
            for (b, o) in data
                .chunks_exact(block_bytes)
                .zip(out.chunks_exact_mut(block_len))
            {
                let c = $block(b);
                for (sub, o) in o.chunks_exact_mut(32).enumerate() {
                    let [lo, hi] = $group(b, sub, &c);
                    // SAFETY: writes the 32 floats of `o`.
                    unsafe {
                        _mm512_storeu_ps(o.as_mut_ptr(), lo);
                        _mm512_storeu_ps(o.as_mut_ptr().add(16), hi);
                    }
                }
            }
        }};
    }
    match ty {
        GgmlType::Q4_0 => each_block!(q4_0_block, q4_0),
        GgmlType::Q4_1 => each_block!(q4_1_block, q4_1),
        GgmlType::Q5_0 => each_block!(q5_0_block, q5_0),
        GgmlType::Q8_0 => each_block!(q8_0_block, q8_0),
        GgmlType::Q4_K => each_block!(q4_k_block, q4_k),
        GgmlType::Q6_K => each_block!(q6_k_block, q6_k),
        _ => unreachable!("avx512::dequantize_blocks: {ty:?} has no decoder"),
    }
}

/// The little-endian f16 at byte `at`, as f32 (exact), in every lane.
/// (Converted from a broadcast: converting a scalar let the compiler
/// merge it into a register still being accumulated, which chained
/// each block's decoding to the previous block's products.)
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn f16_splat(b: &[u8], at: usize) -> __m512 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16))
}

/// The 16 bytes at `b[at..]`, zero-extended to 16 i32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn u8x16(b: &[u8], at: usize) -> __m512i {
    let b: &[u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
    // SAFETY: reads the 16 bytes of `b` (no alignment needed).
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

/// The 16 bytes at `b[at..]`, sign-extended to 16 i32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn i8x16(b: &[u8], at: usize) -> __m512i {
    let b: &[u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
    // SAFETY: reads the 16 bytes of `b` (no alignment needed).
    _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

/// `[0.0, 1.0, .., 15.0]`: the 16 values of a 4-bit quant.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn iota16() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// Each lane's value of `table` at the lane's 4-bit quant (bits 0..4 of
/// the i32 lane; the higher bits are ignored).
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn lookup16(q: __m512i, table: __m512) -> __m512 {
    _mm512_permutexvar_ps(q, table)
}

/// The 32 nibbles of the 16 bytes at `b[at..]` through `table`: low
/// nibbles (elements 0..16), then high nibbles (elements 16..32), the
/// layout of Q4_0 and Q4_1.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn nibbles16(b: &[u8], at: usize, table: &__m512) -> [__m512; 2] {
    let q = u8x16(b, at);
    [
        lookup16(q, *table),
        lookup16(_mm512_srli_epi32::<4>(q), *table),
    ]
}

// Decoders, two per type: `*_block(b)` computes what the block `b`
// (its bytes) shares, once per block; `f(b, sub, &shared)` is elements
// 32·sub .. 32·sub + 32 of the block, as [elements 0..16, elements
// 16..32], with the values of the scalar decoder (bit for bit). Q4_0,
// Q4_1 and Q5_0 decode through a table of their 16 or 32 values,
// computed per block with the scalar decoder's operations, so they are
// the same bits.

/// Q4_0's table: d·(q − 8) for q < 16.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_0_block(b: &[u8]) -> __m512 {
    let d = f16_splat(b, 0);
    _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0)))
}

/// Q4_0 (one group, `sub` = 0): element j the low nibble of qs\[j\],
/// element j + 16 the high one.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_0(b: &[u8], _sub: usize, table: &__m512) -> [__m512; 2] {
    nibbles16(b, 2, table)
}

/// Q4_1's table: d·q + m for q < 16 (d·q is exact in f32, 11 × 4 bits,
/// so the fused multiply-add rounds d·q + m once, as the scalar
/// multiply and add do).
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_1_block(b: &[u8]) -> __m512 {
    q4_1_table(f16_splat(b, 0), f16_splat(b, 2))
}

/// [`q4_1_block`] from the block's `d` and `m`, each in every lane.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn q4_1_table(d: __m512, m: __m512) -> __m512 {
    _mm512_fmadd_ps(d, iota16(), m)
}

/// The `d` and `m` of up to 16 consecutive Q4_1 blocks, as f32 (exact),
/// stored for [`splat`] (`d.0[j]`, `m.0[j]`: block `j`'s), for the fused
/// one-row kernel: its loop had converted each block's two f16 fields
/// with two broadcasts and two conversions on the shuffle port that its
/// decoding keeps busy (`llvm-mca`: ports 0 and 5 both saturated, 14.6
/// cycles per 64 weights); now they come 16 blocks at a time from whole
/// 64-byte loads ([`q4_1_run`]) and each block broadcasts its two from
/// memory. Measured on an Emerald Rapids Xeon (SmolLM2's Q4_1 weights, 2
/// threads, 24 alternations in a quiet spell): tg64 +10% (median of the
/// paired ratios; quartiles +4%, +13%). The one-field types (Q4_0, Q5_0,
/// Q8_0) save half as much per block and were not faster this way (Q8_0
/// 1.08-1.22x the time in one process, Gemma 3's tg64 0.90x), so they
/// convert per block.
#[derive(Clone, Copy)]
pub(crate) struct Q4_1Run {
    d: Mults,
    m: Mults,
}

impl Default for Q4_1Run {
    /// Zeros (before the first run).
    fn default() -> Self {
        Q4_1Run {
            d: Mults([0.0; 16]),
            m: Mults([0.0; 16]),
        }
    }
}

/// Blocks in a [`Q4_1Run`]: one per lane of a 16-lane register.
pub(crate) const RUN_BLOCKS: usize = 16;

/// Where [`q4_1_run`] finds the fields of 16 Q4_1 blocks (20 bytes, 5
/// dwords each: block `j`'s `d` and `m` are dword `5 j`, low and high
/// half), per 128-byte window of the run (two 64-byte loads, 32 dwords):
/// each block's dword among the window's, and the mask of the blocks
/// the window holds.
const Q4_1_RUN_WINDOWS: [([u32; 16], u16); 3] = {
    let mut windows = [([0u32; 16], 0u16); 3];
    let mut j = 0;
    while j < RUN_BLOCKS {
        let dword = 5 * j;
        windows[dword / 32].0[j] = (dword % 32) as u32;
        windows[dword / 32].1 |= 1 << j;
        j += 1;
    }
    windows
};

/// The [`Q4_1Run`] of the `n` Q4_1 blocks at the start of `b` (`1 <= n
/// <= 16`; lanes from `n` on hold whatever the bytes after them convert
/// to, zero past the end of `b`). Reads only `b`: the loads that would
/// pass its end are masked.
///
/// # Panics
/// If `n` is out of range or `b` is shorter than `n` blocks (before any
/// read).
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_1_run(b: &[u8], n: usize) -> Q4_1Run {
    assert!((1..=RUN_BLOCKS).contains(&n) && b.len() >= 20 * n);
    let dwords = b.len() / 4;
    // 16 dwords from dword `at`, those past the end of `b` zero.
    let load = |at: usize| {
        if at + 16 <= dwords {
            // SAFETY: reads the 64 bytes from byte 4·at, inside `b`.
            unsafe { _mm512_loadu_si512(b.as_ptr().add(4 * at).cast()) }
        } else if at < dwords {
            let valid = ((1u32 << (dwords - at)) - 1) as __mmask16;
            // SAFETY: the masked load reads only the dwords at..dwords
            // of `b` (masked lanes are neither read nor fault).
            unsafe { _mm512_maskz_loadu_epi32(valid, b.as_ptr().add(4 * at).cast()) }
        } else {
            _mm512_setzero_si512()
        }
    };
    let mut fields = _mm512_setzero_si512();
    for (w, (index, blocks)) in Q4_1_RUN_WINDOWS.iter().enumerate() {
        // SAFETY: reads the 16 u32 of `index`.
        let index = unsafe { _mm512_loadu_si512(index.as_ptr().cast()) };
        let picked = _mm512_permutex2var_epi32(load(32 * w), index, load(32 * w + 16));
        fields = _mm512_mask_mov_epi32(fields, *blocks, picked);
    }
    let half = |v: __m512i| Mults::new(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
    Q4_1Run {
        d: half(fields),
        m: half(_mm512_srli_epi32::<16>(fields)),
    }
}

/// [`q4_1_block`] of block `j` of a run.
///
/// # Safety
/// `j <` [`RUN_BLOCKS`]; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) unsafe fn q4_1_in_run(run: &Q4_1Run, j: usize) -> __m512 {
    // SAFETY: j < RUN_BLOCKS = 16 (the caller's contract).
    unsafe { q4_1_table(splat(&run.d, j), splat(&run.m, j)) }
}

/// Q4_1 (one group): nibbles as Q4_0.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_1(b: &[u8], _sub: usize, table: &__m512) -> [__m512; 2] {
    nibbles16(b, 4, table)
}

/// Q5_0's tables: d·(q − 16) for q < 16 and for 16 <= q < 32.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q5_0_block(b: &[u8]) -> [__m512; 2] {
    let d = f16_splat(b, 0);
    [
        _mm512_mul_ps(d, _mm512_sub_ps(iota16(), _mm512_set1_ps(16.0))),
        _mm512_mul_ps(d, iota16()),
    ]
}

/// Q5_0 (one group): the 5th bit of element i is bit i of qh; the low
/// 4 bits index the lower table, replaced by the upper one in the
/// lanes whose 5th bit is set.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q5_0(b: &[u8], _sub: usize, [below, above]: &[__m512; 2]) -> [__m512; 2] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let q = u8x16(b, 6);
    let value =
        |q: __m512i, bits: u16| _mm512_mask_permutexvar_ps(lookup16(q, *below), bits, q, *above);
    [
        value(q, qh as u16),
        value(_mm512_srli_epi32::<4>(q), (qh >> 16) as u16),
    ]
}

/// Q8_0's scale d.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q8_0_block(b: &[u8]) -> __m512 {
    f16_splat(b, 0)
}

/// Q8_0 (one group): d·q.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q8_0(b: &[u8], _sub: usize, d: &__m512) -> [__m512; 2] {
    [
        _mm512_mul_ps(*d, _mm512_cvtepi32_ps(i8x16(b, 2))),
        _mm512_mul_ps(*d, _mm512_cvtepi32_ps(i8x16(b, 18))),
    ]
}

/// The multipliers of a Q4_K block's 8 sub-blocks: `[d·scale_j for j
/// < 8, dmin·min_j for j < 8]` (each an exact product of an f16 and a
/// 6-bit integer, as the scalar decoder computes it), all 16 decoded
/// at once from the 12 bytes of packed scales, and stored, so that each
/// sub-block reads its two with [`splat`].
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_k_block(b: &[u8]) -> Mults {
    let (scale, min) = super::format::k4_block_scales_mins(b);
    let ints = _mm_set_epi64x(min as i64, scale as i64);
    // [d; 8] then [dmin; 8].
    let mul = _mm512_mask_blend_ps(0xFF00, f16_splat(b, 0), f16_splat(b, 2));
    Mults::new(_mm512_mul_ps(
        mul,
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ints)),
    ))
}

/// Q4_K sub-block j: d·scale_j·q − dmin·min_j, q nibble j % 2 of
/// qs\[32·(j / 2) ..\] (ds·q is exact in f32, 11 + 6 + 4 bits, so the
/// fused multiply-subtract rounds once, as the scalar decoder does).
/// Each quant is converted to f32 rather than looked up in a table of the
/// sub-block's 16 values: a lookup and the broadcasts that build the
/// table run on the one port that also widens the bytes, which bounded
/// decoding at one token row (`llvm-mca` of the fused kernel: 68 cycles a
/// block on that port, 38 on the other).
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q4_k(b: &[u8], j: usize, mults: &Mults) -> [__m512; 2] {
    // SAFETY: j < 8, so both indices are inside the 16 multipliers.
    let (ds, dm) = unsafe { (splat(mults, j), splat(mults, 8 + j)) };
    let at = 16 + 32 * (j / 2);
    let value = |q: __m512i| {
        let q = if j.is_multiple_of(2) {
            _mm512_and_si512(q, _mm512_set1_epi32(0x0F))
        } else {
            _mm512_srli_epi32::<4>(q)
        };
        _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(q), dm)
    };
    [value(u8x16(b, at)), value(u8x16(b, at + 16))]
}

/// A block's 16 multipliers, stored (64-byte aligned) for [`splat`].
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Mults([f32; 16]);

impl Mults {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    fn new(v: __m512) -> Mults {
        let mut m = Mults([0.0; 16]);
        // SAFETY: 16 floats, 64-byte aligned (the type's alignment).
        unsafe { _mm512_store_ps(m.0.as_mut_ptr(), v) };
        m
    }
}

/// Multiplier `i` of `m` in every lane, broadcast from memory: a load
/// port does it, where broadcasting a lane of a register takes the
/// shuffle port the decoders' widening needs (the compiler turns a plain
/// read of a just-stored value back into shuffles, hence the asm).
///
/// # Safety
/// `i < 16`; the CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn splat(m: &Mults, i: usize) -> __m512 {
    debug_assert!(i < 16);
    let v: __m512;
    // SAFETY: reads the 4 bytes of m.0[i] (in bounds, as the caller
    // guarantees); touches no other memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vbroadcastss {v}, dword ptr [{p}]",
            p = in(reg) m.0.as_ptr().add(i),
            v = out(zmm_reg) v,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    v
}

/// The 16 multipliers of a Q6_K block: d·scales\[i\] (an exact product
/// of an f16 and an i8, as the scalar decoder computes it), stored for
/// [`splat`].
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q6_k_block(b: &[u8]) -> Mults {
    let d = f16_splat(b, 208);
    Mults::new(_mm512_mul_ps(d, _mm512_cvtepi32_ps(i8x16(b, 192))))
}

/// Q6_K group i = 4·h + r: d·scale·(q − 32). The group's 32 6-bit
/// quants are put together in one 256-bit register (each byte's bits come
/// from its own bytes of ql and qh), then widened 16 at a time.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
pub(crate) fn q6_k(b: &[u8], i: usize, scales: &Mults) -> [__m512; 2] {
    let (h, r) = (i / 4, i % 4);
    let bytes = |at: usize| {
        let v: &[u8; 32] = b[at..at + 32].try_into().expect("32 bytes");
        // SAFETY: reads the 32 bytes of `v` (no alignment needed).
        unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
    };
    // Shifting 16-bit lanes and masking keeps each byte's own bits
    // (shift + width <= 8).
    let low = _mm256_and_si256(
        _mm256_srl_epi16(
            bytes(64 * h + 32 * (r % 2)),
            _mm_cvtsi32_si128(4 * (r / 2) as i32),
        ),
        _mm256_set1_epi8(0x0F),
    );
    let high = _mm256_and_si256(
        _mm256_srl_epi16(bytes(128 + 32 * h), _mm_cvtsi32_si128(2 * r as i32)),
        _mm256_set1_epi8(3),
    );
    let q = _mm256_sub_epi8(
        _mm256_or_si256(low, _mm256_slli_epi16::<4>(high)),
        _mm256_set1_epi8(32),
    );
    // Elements e .. e + 32 of the block: multipliers e / 16 and e / 16 + 1.
    let e = 128 * h + 32 * r;
    let value = |q: __m128i, s: usize| {
        // SAFETY: e < 256, so s <= 15.
        let ds = unsafe { splat(scales, s) };
        _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
    };
    [
        value(_mm256_castsi256_si128(q), e / 16),
        value(_mm256_extracti128_si256::<1>(q), e / 16 + 1),
    ]
}
