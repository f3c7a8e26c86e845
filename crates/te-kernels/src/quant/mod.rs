//! GGML tensor types and their dequantization to f32.
//!
//! A GGML tensor is stored as consecutive *blocks*; each block holds
//! `block_len` elements in `block_bytes` bytes. Rows (`ne[0]` elements, the
//! contiguous dimension) always hold a whole number of blocks, so rows can be
//! dequantized independently; [`dequantize`] does so in parallel with rayon.
//!
//! Block layouts (all little-endian; source: llama.cpp `ggml-common.h` and
//! the reference dequantizers in `ggml-quants.c`, read as a format
//! specification). `d`, `m`, `dmin` are f16 unless noted, `q` the quant:
//!
//! | type | elems | bytes | layout | value |
//! |---|---|---|---|---|
//! | Q4_0 | 32 | 18 | d, qs\[16\] | d·(q − 8); element j < 16 is the low nibble of qs\[j\], element j + 16 its high nibble |
//! | Q4_1 | 32 | 20 | d, m, qs\[16\] | d·q + m (nibbles as Q4_0) |
//! | Q5_0 | 32 | 22 | d, qh: u32, qs\[16\] | d·(q − 16); the 5th bit of element i is bit i of qh |
//! | Q5_1 | 32 | 24 | d, m, qh: u32, qs\[16\] | d·q + m |
//! | Q8_0 | 32 | 34 | d, qs: i8\[32\] | d·q |
//! | Q2_K | 256 | 84 | scales\[16\], qs\[64\], d, dmin | 16 sub-blocks of 16: d·(sc & 15)·q − dmin·(sc >> 4) |
//! | Q3_K | 256 | 110 | hmask\[32\], qs\[64\], scales\[12\], d | 16 sub-blocks of 16: d·(s − 32)·(q − 4·(1 − hbit)), s 6-bit |
//! | Q4_K | 256 | 144 | d, dmin, scales\[12\], qs\[128\] | 8 sub-blocks of 32: d·s·q − dmin·m, s and m 6-bit |
//! | Q5_K | 256 | 176 | d, dmin, scales\[12\], qh\[32\], qs\[128\] | as Q4_K with a 5th bit from qh |
//! | Q6_K | 256 | 210 | ql\[128\], qh\[64\], scales: i8\[16\], d | 16 sub-blocks of 16: d·s·(q − 32) |
//!
//! The exact bit positions are documented on each block decoder
//! (`portable.rs`); `format.rs` holds the types, `avx2.rs` and `avx512.rs`
//! the vectorized decoders, bit-identical to the portable ones.

use rayon::prelude::*;

use crate::KernelError;

mod format;
mod portable;

pub use format::GgmlType;
pub(crate) use format::{k4_block_scales_mins, k4_scale_min};
use portable::dequantize_blocks_scalar;

/// Dequantizes a tensor of type `ty` into `out` (f32, row-major: the same
/// element order as the stored data, rows of `row_len` = `ne[0]` elements).
///
/// `data` must hold exactly `out.len() / row_len` rows, i.e.
/// `ty.bytes_for(out.len())` bytes, and `row_len` must be a multiple of the
/// type's block length. Rows are dequantized in parallel (rayon).
///
/// Errors: [`KernelError::UnsupportedQuantization`] for a type not in
/// [`GgmlType::can_dequantize`]; [`KernelError::Tensor`] (naming `tensor`)
/// when the sizes do not fit.
pub fn dequantize(
    tensor: &str,
    ty: GgmlType,
    data: &[u8],
    row_len: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if !ty.can_dequantize() {
        return Err(KernelError::UnsupportedQuantization {
            tensor: tensor.to_string(),
            type_name: ty.name(),
        });
    }
    let bad = |reason: String| KernelError::Tensor {
        tensor: tensor.to_string(),
        reason,
    };
    let (block_len, block_bytes) = ty.block_layout().expect("supported types have a layout");
    if row_len == 0 || !row_len.is_multiple_of(block_len) {
        return Err(bad(format!(
            "row length {row_len} is not a positive multiple of the {} block length {block_len}",
            ty.name()
        )));
    }
    if !out.len().is_multiple_of(row_len) {
        return Err(bad(format!(
            "{} elements is not a whole number of rows of {row_len}",
            out.len()
        )));
    }
    let row_bytes = row_len / block_len * block_bytes;
    let n_rows = out.len() / row_len;
    if data.len() != n_rows * row_bytes {
        return Err(bad(format!(
            "{} data holds {} bytes, expected {} for {n_rows} rows of {row_len}",
            ty.name(),
            data.len(),
            n_rows * row_bytes
        )));
    }
    // Several rows per task keeps the rayon overhead small for short rows.
    let rows_per_task = (16384 / row_len).max(1);
    out.par_chunks_mut(row_len * rows_per_task)
        .zip(data.par_chunks(row_bytes * rows_per_task))
        .for_each(|(o, d)| dequantize_blocks(ty, d, o));
    Ok(())
}

/// Dequantizes whole blocks on the calling thread (no checks beyond the
/// block layout): `data.len() / block_bytes == out.len() / block_len`, `ty`
/// one of [`GgmlType::can_dequantize`]. Used for one weight row at a time.
///
/// On x86_64 CPUs with AVX-512F, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K run
/// with 16-lane decoders; with AVX2, F16C and FMA, those and Q5_1 run with
/// 8-lane ones. The values are bit-identical to the scalar decoders (the
/// same f32 operations, or a fused multiply-add where the product is exact
/// in f32, which rounds the same). F16 and BF16 widen 8 values per
/// instruction with AVX2 and F16C (exact either way).
#[inline]
pub fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(ty, GgmlType::F16 | GgmlType::BF16)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
    {
        // SAFETY: the CPU has AVX2 and F16C (checked above).
        return unsafe { avx2::widen_halves(ty, data, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx512::available(ty) {
        // SAFETY: `available` checked that the CPU has AVX-512F, AVX2 and F16C.
        return unsafe { avx512::dequantize_blocks(ty, data, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available(ty) {
        // SAFETY: `available` checked that the CPU has AVX2, F16C and FMA.
        return unsafe { avx2::dequantize_blocks(ty, data, out) };
    }
    dequantize_blocks_scalar(ty, data, out)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) mod tests {
    use half::f16;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Each vectorized type with the byte offsets of its f16 fields in a block.
    pub(crate) const AVX2_TYPES: [(GgmlType, &[usize]); 7] = [
        (GgmlType::Q4_0, &[0]),
        (GgmlType::Q4_1, &[0, 2]),
        (GgmlType::Q5_0, &[0]),
        (GgmlType::Q5_1, &[0, 2]),
        (GgmlType::Q8_0, &[0]),
        (GgmlType::Q4_K, &[0, 2]),
        (GgmlType::Q6_K, &[208]),
    ];

    /// `n_blocks` blocks of random bytes whose f16 fields hold random finite
    /// values (subnormals and zeros included).
    pub(crate) fn random_row(
        ty: GgmlType,
        f16_at: &[usize],
        n_blocks: usize,
        rng: &mut StdRng,
    ) -> Vec<u8> {
        let (_, block_bytes) = ty.block_layout().expect("layout");
        let mut data: Vec<u8> = (0..n_blocks * block_bytes).map(|_| rng.gen()).collect();
        for block in data.chunks_exact_mut(block_bytes) {
            for &at in f16_at {
                let mut x = f16::from_bits(rng.gen());
                if !x.is_finite() {
                    x = f16::from_bits(x.to_bits() & !0x4000);
                }
                block[at..at + 2].copy_from_slice(&x.to_le_bytes());
            }
        }
        data
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The packed Q4_K scales and mins of a block (bytes 4..16)
        /// unpacked all at once are the ones unpacked one by one.
        #[test]
        fn k4_scales_mins_are_k4_scale_min(s: [u8; 12], head: [u8; 4]) {
            let block: Vec<u8> = head.iter().chain(&s).copied().collect();
            let (scales, mins) = k4_block_scales_mins(&block);
            for j in 0..8 {
                let (scale, min) = k4_scale_min(&s, j);
                prop_assert_eq!((scales >> (8 * j)) as u8 as f32, scale, "scale {}", j);
                prop_assert_eq!((mins >> (8 * j)) as u8 as f32, min, "min {}", j);
            }
        }

        /// F16 and BF16 rows widen as the scalar decoder does, bit for bit
        /// (lengths off the 8-value step included).
        #[test]
        fn half_rows_widen_as_the_scalar_decoder(seed: u64, n in 0usize..=70) {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
                println!("skipped: this CPU has no AVX2 + F16C");
                return Ok(());
            }
            let mut rng = StdRng::seed_from_u64(seed);
            for ty in [GgmlType::F16, GgmlType::BF16] {
                // Random bits, NaNs made finite (one exponent bit cleared):
                // every other value, subnormals and infinities included.
                let exp = if ty == GgmlType::F16 { 0x7c00 } else { 0x7f80 };
                let data: Vec<u8> = (0..n)
                    .flat_map(|_| {
                        let mut b: u16 = rng.gen();
                        if b & exp == exp && b & !(exp | 0x8000) != 0 {
                            b &= !0x4000;
                        }
                        b.to_le_bytes()
                    })
                    .collect();
                let mut want = vec![f32::NAN; n];
                let mut got = vec![f32::NAN; n];
                dequantize_blocks_scalar(ty, &data, &mut want);
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                unsafe { avx2::widen_halves(ty, &data, &mut got) };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    prop_assert_eq!(g.to_bits(), w.to_bits(), "{:?} element {}: {} vs {}", ty, i, g, w);
                }
            }
        }

        /// The AVX2 row decoders equal the scalar ones bit for bit.
        #[test]
        fn avx2_matches_scalar_bitwise(seed: u64, n_blocks in 1usize..=12) {
            if !(is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("fma"))
            {
                println!("skipped: this CPU has no AVX2 + F16C + FMA");
                return Ok(());
            }
            let mut rng = StdRng::seed_from_u64(seed);
            for (ty, f16_at) in AVX2_TYPES {
                prop_assert!(avx2::available(ty));
                let (block_len, _) = ty.block_layout().expect("layout");
                let data = random_row(ty, f16_at, n_blocks, &mut rng);
                let mut want = vec![f32::NAN; n_blocks * block_len];
                let mut got = vec![f32::NAN; n_blocks * block_len];
                dequantize_blocks_scalar(ty, &data, &mut want);
                // SAFETY: the CPU has AVX2, F16C and FMA (checked above).
                unsafe { avx2::dequantize_blocks(ty, &data, &mut got) };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    prop_assert_eq!(g.to_bits(), w.to_bits(), "{:?} element {}: {} vs {}", ty, i, g, w);
                }
                if avx512::available(ty) {
                    got.fill(f32::NAN);
                    // SAFETY: `available` checked AVX-512F, AVX2 and F16C.
                    unsafe { avx512::dequantize_blocks(ty, &data, &mut got) };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        prop_assert_eq!(g.to_bits(), w.to_bits(), "AVX-512 {:?} element {}: {} vs {}", ty, i, g, w);
                    }
                }
            }
        }
    }
}
