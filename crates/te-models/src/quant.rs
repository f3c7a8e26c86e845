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
//! The exact bit positions are documented on each block decoder below.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{ModelError, Result};

/// A GGML tensor type, as stored in the `type` field of a GGUF tensor info.
///
/// Ids (llama.cpp `ggml.h`, `enum ggml_type`): F32 0, F16 1, Q4_0 2, Q4_1 3,
/// Q5_0 6, Q5_1 7, Q8_0 8, Q8_1 9, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13,
/// Q6_K 14, Q8_K 15, I8 24, I16 25, I32 26, I64 27, F64 28, BF16 30. Any other
/// id is kept as [`GgmlType::Other`]: the file still opens, but such tensors
/// cannot be read.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    I8,
    I16,
    I32,
    I64,
    F64,
    /// A type id te-rs does not know (IQ*, TQ*, MXFP4, ...).
    Other(u32),
}

impl GgmlType {
    /// The type for a GGUF type id.
    pub fn from_id(id: u32) -> GgmlType {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            other => Other(other),
        }
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
            Other(id) => id,
        }
    }

    /// The name llama.cpp uses (`"Q4_K"`), or `"id N"` for an unknown id.
    pub fn name(self) -> String {
        match self {
            GgmlType::Other(id) => format!("id {id}"),
            known => format!("{known:?}"),
        }
    }

    /// `(elements per block, bytes per block)`, or `None` for an unknown id.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        Some(match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            Other(_) => return None,
        })
    }

    /// Whether [`dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
        )
    }

    /// Bytes taken by `n_elements` elements of this type, or `None` when the
    /// type is unknown, `n_elements` is not a whole number of blocks, or the
    /// size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (block_len, block_bytes) = self.block_layout()?;
        if !n_elements.is_multiple_of(block_len as u64) {
            return None;
        }
        (n_elements / block_len as u64).checked_mul(block_bytes as u64)
    }
}

/// Dequantizes a tensor of type `ty` into `out` (f32, row-major: the same
/// element order as the stored data, rows of `row_len` = `ne[0]` elements).
///
/// `data` must hold exactly `out.len() / row_len` rows, i.e.
/// `ty.bytes_for(out.len())` bytes, and `row_len` must be a multiple of the
/// type's block length. Rows are dequantized in parallel (rayon).
///
/// Errors: [`ModelError::UnsupportedQuantization`] for a type not in
/// [`GgmlType::can_dequantize`]; [`ModelError::Tensor`] (naming `tensor`)
/// when the sizes do not fit.
pub fn dequantize(
    tensor: &str,
    ty: GgmlType,
    data: &[u8],
    row_len: usize,
    out: &mut [f32],
) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(ModelError::UnsupportedQuantization {
            tensor: tensor.to_string(),
            type_name: ty.name(),
        });
    }
    let bad = |reason: String| ModelError::Tensor {
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
/// with 16-lane decoders; with AVX2 and F16C, those and Q5_1 run with
/// 8-lane ones. The values are bit-identical to the scalar decoders (the
/// same f32 operations, or a fused multiply-add where the product is exact
/// in f32, which rounds the same).
#[inline]
pub fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512::available(ty) {
        // SAFETY: `available` checked that the CPU has AVX-512F, AVX2 and F16C.
        return unsafe { avx512::dequantize_blocks(ty, data, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available(ty) {
        // SAFETY: `available` checked that the CPU has AVX2 and F16C.
        return unsafe { avx2::dequantize_blocks(ty, data, out) };
    }
    dequantize_blocks_scalar(ty, data, out)
}

/// The scalar [`dequantize_blocks`]: the fallback, and the reference the
/// vectorized decoders are tested against.
#[inline(always)]
fn dequantize_blocks_scalar(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    let (block_len, block_bytes) = ty.block_layout().expect("checked by the caller");
    let blocks = data
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block_len));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = f16_at(b, 0)
            }
        }
        GgmlType::BF16 => {
            for (b, o) in blocks {
                o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()
            }
        }
        GgmlType::Q4_0 => {
            for (b, o) in blocks {
                q4_0(b, o)
            }
        }
        GgmlType::Q4_1 => {
            for (b, o) in blocks {
                q4_1(b, o)
            }
        }
        GgmlType::Q5_0 => {
            for (b, o) in blocks {
                q5_0(b, o)
            }
        }
        GgmlType::Q5_1 => {
            for (b, o) in blocks {
                q5_1(b, o)
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in blocks {
                q8_0(b, o)
            }
        }
        GgmlType::Q2_K => {
            for (b, o) in blocks {
                q2_k(b, o)
            }
        }
        GgmlType::Q3_K => {
            for (b, o) in blocks {
                q3_k(b, o)
            }
        }
        GgmlType::Q4_K => {
            for (b, o) in blocks {
                q4_k(b, o)
            }
        }
        GgmlType::Q5_K => {
            for (b, o) in blocks {
                q5_k(b, o)
            }
        }
        GgmlType::Q6_K => {
            for (b, o) in blocks {
                q6_k(b, o)
            }
        }
        _ => unreachable!("checked by can_dequantize"),
    }
}

/// The little-endian f16 at byte `at`, as f32.
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_0 block: `d` (f16), `qs[16]`. Element j (< 16) = low nibble of qs\[j\],
/// element j + 16 = high nibble; value = d·(q − 8).
#[inline(always)]
fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs: &[u8; 16] = b[2..18].try_into().expect("Q4_0 block");
    let o: &mut [f32; 32] = o.try_into().expect("32 outputs");
    let (lo, hi) = o.split_at_mut(16);
    for j in 0..16 {
        lo[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
    }
    for j in 0..16 {
        hi[j] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1 block: `d`, `m` (f16), `qs[16]` (nibbles as Q4_0); value = d·q + m.
#[inline(always)]
fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs: &[u8; 16] = b[4..20].try_into().expect("Q4_1 block");
    let o: &mut [f32; 32] = o.try_into().expect("32 outputs");
    let (lo, hi) = o.split_at_mut(16);
    for j in 0..16 {
        lo[j] = d * (qs[j] & 0x0F) as f32 + m;
    }
    for j in 0..16 {
        hi[j] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// The 5-bit quants of a Q5_0/Q5_1 block: low nibbles as Q4_0, bit i of the
/// little-endian u32 `qh` is bit 4 of element i.
#[inline(always)]
fn q5_quants(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; 32];
    for j in 0..16 {
        let hi0 = ((qh >> j) & 1) as u8;
        let hi1 = ((qh >> (j + 16)) & 1) as u8;
        q[j] = (qs[j] & 0x0F) | (hi0 << 4);
        q[j + 16] = (qs[j] >> 4) | (hi1 << 4);
    }
    q
}

/// Q5_0 block: `d`, `qh[4]`, `qs[16]`; value = d·(q − 16).
#[inline(always)]
fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let q = q5_quants(&b[2..6], &b[6..22]);
    for (o, &q) in o.iter_mut().zip(&q) {
        *o = d * (q as i32 - 16) as f32;
    }
}

/// Q5_1 block: `d`, `m`, `qh[4]`, `qs[16]`; value = d·q + m.
#[inline(always)]
fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let q = q5_quants(&b[4..8], &b[8..24]);
    for (o, &q) in o.iter_mut().zip(&q) {
        *o = d * q as f32 + m;
    }
}

/// Q8_0 block: `d`, `qs: i8[32]`; value = d·q.
#[inline(always)]
fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs: &[u8; 32] = b[2..34].try_into().expect("Q8_0 block");
    let o: &mut [f32; 32] = o.try_into().expect("32 outputs");
    for j in 0..32 {
        o[j] = d * (qs[j] as i8) as f32;
    }
}

/// Q2_K block: `scales[16]`, `qs[64]`, `d`, `dmin`.
///
/// Element e = 128·h + 32·s + l (h < 2, s < 4, l < 32) is the 2-bit field
/// at bit 2·s of qs\[32·h + l\]; its sub-block is 16-element group
/// k = e / 16, scale byte sc = scales\[k\]: value = d·(sc & 15)·q − dmin·(sc >> 4).
fn q2_k(b: &[u8], o: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, o) in o.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
        let q = (qs[32 * h + l] >> (2 * s)) & 3;
        let sc = scales[e / 16];
        *o = d * (sc & 0x0F) as f32 * q as f32 - dmin * (sc >> 4) as f32;
    }
}

/// Q3_K block: `hmask[32]`, `qs[64]`, `scales[12]`, `d`.
///
/// Element e = 128·h + 32·s + l: low 2 bits at bit 2·s of qs\[32·h + l\],
/// high bit = bit (4·h + s) of hmask\[l\]; q = low − (high ? 0 : 4).
/// The 16 scales (one per 16 elements, k = e / 16) are 6-bit: low 4 bits
/// from scales\[k\] & 15 (k < 8) or scales\[k − 8\] >> 4 (k ≥ 8), high 2 bits
/// from scales\[8 + k % 4\] >> (2·(k / 4)); value = d·(s − 32)·q.
fn q3_k(b: &[u8], o: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let mut scales = [0i32; 16];
    for (k, s) in scales.iter_mut().enumerate() {
        let low = if k < 8 { sc[k] & 0x0F } else { sc[k - 8] >> 4 };
        let high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        *s = (low | (high << 4)) as i32 - 32;
    }
    for (e, o) in o.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e / 32) % 4, e % 32);
        let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
        let high = (hmask[l] >> (4 * h + s)) & 1;
        let q = low - if high == 1 { 0 } else { 4 };
        *o = d * scales[e / 16] as f32 * q as f32;
    }
}

/// The 6-bit (scale, min) pair j (< 8) of a Q4_K/Q5_K `scales[12]` array:
/// j < 4: (s\[j\] & 63, s\[j + 4\] & 63); j ≥ 4: scale = (s\[j + 4\] & 15) |
/// (s\[j − 4\] >> 6) << 4, min = (s\[j + 4\] >> 4) | (s\[j\] >> 6) << 4.
fn k4_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        let scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        let min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (scale as f32, min as f32)
    }
}

/// Q4_K block: `d`, `dmin`, `scales[12]`, `qs[128]`.
///
/// Element e = 64·c + 32·hi + l (c < 4, hi < 2, l < 32) is the low (hi = 0)
/// or high (hi = 1) nibble of qs\[32·c + l\]; its sub-block is j = e / 32:
/// value = d·scale_j·q − dmin·min_j.
#[inline(always)]
fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sc = &b[4..16];
    let qs = &b[16..144];
    // Element e = 64·c + 32·hi + l: nibble hi of qs[32·c + l], sub-block e / 32.
    for (j, o) in o.chunks_exact_mut(32).enumerate() {
        let (c, hi) = (j / 2, j % 2);
        let (scale, min) = k4_scale_min(sc, j);
        let (ds, dm) = (d * scale, dmin * min);
        let q: &[u8; 32] = qs[32 * c..32 * c + 32].try_into().expect("32 quants");
        let o: &mut [f32; 32] = o.try_into().expect("32 outputs");
        for l in 0..32 {
            o[l] = ds * ((q[l] >> (4 * hi)) & 0x0F) as f32 - dm;
        }
    }
}

/// Q5_K block: `d`, `dmin`, `scales[12]`, `qh[32]`, `qs[128]`.
///
/// As Q4_K, plus bit 4 of element e = 32·j + l (sub-block j) is bit j of qh\[l\].
fn q5_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sc = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (e, o) in o.iter_mut().enumerate() {
        let (c, hi, l) = (e / 64, (e / 32) % 2, e % 32);
        let j = e / 32;
        let q = ((qs[32 * c + l] >> (4 * hi)) & 0x0F) | (((qh[l] >> j) & 1) << 4);
        let (scale, min) = k4_scale_min(sc, j);
        *o = d * scale * q as f32 - dmin * min;
    }
}

/// Q6_K block: `ql[128]`, `qh[64]`, `scales: i8[16]`, `d`.
///
/// Element e = 128·h + 32·r + l (h < 2, r < 4, l < 32): low 4 bits are the
/// low (r even) or high (r odd) nibble of ql\[64·h + 32·(r % 2) + l\]; high
/// 2 bits are bits 2·r..2·r+2 of qh\[32·h + l\]; q = bits − 32; scale =
/// scales\[e / 16\]; value = d·scale·q.
#[inline(always)]
fn q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    // Element e = 128·h + 32·r + l, scale index e / 16.
    for (g, o) in o.chunks_exact_mut(32).enumerate() {
        let (h, r) = (g / 4, g % 4);
        let low: &[u8; 32] = ql[64 * h + 32 * (r % 2)..][..32]
            .try_into()
            .expect("32 quants");
        let high: &[u8; 32] = qh[32 * h..32 * h + 32].try_into().expect("32 quants");
        let ds = [
            d * (scales[2 * g] as i8) as f32,
            d * (scales[2 * g + 1] as i8) as f32,
        ];
        let o: &mut [f32; 32] = o.try_into().expect("32 outputs");
        for l in 0..32 {
            let q = (((low[l] >> (4 * (r / 2))) & 0x0F) | (((high[l] >> (2 * r)) & 3) << 4)) as i32
                - 32;
            o[l] = ds[l / 16] * q as f32;
        }
    }
}

/// AVX2 + F16C decoders of whole rows, bit-identical to the scalar ones:
/// quants are widened to i32 and converted to f32 exactly, and each value
/// is computed with the same f32 multiply / add / subtract, in the same
/// order, as the scalar decoder of its type (f16 → f32 is exact either way).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{k4_scale_min, GgmlType};

    /// Whether `ty` has a decoder here and the CPU can run it.
    pub(crate) fn available(ty: GgmlType) -> bool {
        use GgmlType::*;
        matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q6_K)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("f16c")
    }

    /// [`super::dequantize_blocks`] for a type with [`available`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32]) {
        let groups = |e: usize, v: [__m256; 4]| {
            store32((&mut out[e..e + 32]).try_into().expect("32 outputs"), v)
        };
        // SAFETY: this function runs only with AVX2 and F16C; `ty` is one
        // of `available`'s types (the caller checked).
        unsafe { for_each_group(ty, data, groups) }
    }

    /// Calls `f(e, v)` for each group of 32 consecutive elements of `data`
    /// (whole blocks of `ty`), in order: `e` is the index of the group's
    /// first element, `v[i]` holds elements `e + 8·i .. e + 8·i + 8`, with
    /// values bit-identical to the scalar decoders.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C, and `ty` must be one of the types
    /// [`available`] accepts (others panic).
    #[inline(always)]
    pub(crate) unsafe fn for_each_group(
        ty: GgmlType,
        data: &[u8],
        mut f: impl FnMut(usize, [__m256; 4]),
    ) {
        macro_rules! each_block {
            ($decode:ident, $block_bytes:literal, $block_len:literal) => {
                for (i, b) in data.chunks_exact($block_bytes).enumerate() {
                    // SAFETY: the caller guarantees AVX2 and F16C.
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
    fn f16_at(b: &[u8], at: usize) -> f32 {
        let bits = u16::from_le_bytes([b[at], b[at + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[target_feature(enable = "avx2")]
    fn load16(b: &[u8; 16]) -> __m128i {
        // SAFETY: reads the 16 bytes of `b` (no alignment needed).
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2")]
    fn load32(b: &[u8; 32]) -> __m256i {
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

    /// `d·q + m`: a multiply, then an add (not fused).
    #[target_feature(enable = "avx2")]
    fn mul_add(q: [__m256; 4], d: f32, m: f32) -> [__m256; 4] {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        [0, 1, 2, 3].map(|i| _mm256_add_ps(_mm256_mul_ps(d, q[i]), m))
    }

    /// `d·q − m`: a multiply, then a subtract (not fused).
    #[target_feature(enable = "avx2")]
    fn mul_sub(q: [__m256; 4], d: f32, m: f32) -> [__m256; 4] {
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        [0, 1, 2, 3].map(|i| _mm256_sub_ps(_mm256_mul_ps(d, q[i]), m))
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
    #[target_feature(enable = "avx2,f16c")]
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
    #[target_feature(enable = "avx2,f16c")]
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
    #[target_feature(enable = "avx2,f16c")]
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
}

/// AVX-512 decoders, block by block, 16 values per register, bit-identical
/// to the scalar ones: 4- and 5-bit quants index a table of their block's
/// values (computed with the scalar decoder's operations, or with one fused
/// multiply-add where the product is exact in f32, which rounds the same);
/// the other types' quants are widened to i32, converted to f32 exactly
/// and multiplied by the scalar decoder's scale.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::GgmlType;

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
    // 16..32], with the values of the scalar decoder (bit for bit). The
    // 4- and 5-bit types decode through a table of their 16 or 32 values,
    // computed per block (or sub-block) with the scalar decoder's
    // operations, so they are the same bits.

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
        let (d, m) = (f16_splat(b, 0), f16_splat(b, 2));
        _mm512_fmadd_ps(d, iota16(), m)
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
        let value = |q: __m512i, bits: u16| {
            _mm512_mask_permutexvar_ps(lookup16(q, *below), bits, q, *above)
        };
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
    /// at once from the 12 bytes of packed scales.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(crate) fn q4_k_block(b: &[u8]) -> __m512 {
        let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let (w0, w1, w2) = (word(4), word(8), word(12));
        // Bytes j < 4: the low 6 bits of scales[j] / scales[j + 4]; bytes
        // j >= 4: 4 bits of scales[j + 4] with the top 2 of scales[j - 4]
        // / scales[j] above them (`k4_scale_min`, four bytes per operation).
        let low6 = 0x3f3f_3f3f;
        let scale =
            (w0 & low6) as u64 | (((w2 & 0x0f0f_0f0f) | ((w0 >> 2) & 0x3030_3030)) as u64) << 32;
        let min = (w1 & low6) as u64
            | ((((w2 >> 4) & 0x0f0f_0f0f) | ((w1 >> 2) & 0x3030_3030)) as u64) << 32;
        let ints = _mm_set_epi64x(min as i64, scale as i64);
        // [d; 8] then [dmin; 8].
        let mul = _mm512_mask_blend_ps(0xFF00, f16_splat(b, 0), f16_splat(b, 2));
        _mm512_mul_ps(mul, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ints)))
    }

    /// Lane `i` of `v` in every lane (one permute).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    fn lane(v: __m512, i: usize) -> __m512 {
        _mm512_permutexvar_ps(_mm512_set1_epi32(i as i32), v)
    }

    /// Q4_K sub-block j: d·scale_j·q − dmin·min_j, q nibble j % 2 of
    /// qs\[32·(j / 2) ..\]; from a table of the sub-block's 16 values
    /// (ds·q is exact in f32, 11 + 6 + 4 bits, so the fused
    /// multiply-subtract rounds once, as the scalar decoder does).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(crate) fn q4_k(b: &[u8], j: usize, scales: &__m512) -> [__m512; 2] {
        let table = _mm512_fmsub_ps(lane(*scales, j), iota16(), lane(*scales, 8 + j));
        let at = 16 + 32 * (j / 2);
        let nib = |q: __m512i| {
            let q = if j.is_multiple_of(2) {
                q
            } else {
                _mm512_srli_epi32::<4>(q)
            };
            lookup16(q, table)
        };
        [nib(u8x16(b, at)), nib(u8x16(b, at + 16))]
    }

    /// The 16 multipliers of a Q6_K block: d·scales\[i\] (an exact product
    /// of an f16 and an i8, as the scalar decoder computes it).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(crate) fn q6_k_block(b: &[u8]) -> __m512 {
        let d = f16_splat(b, 208);
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(i8x16(b, 192)))
    }

    /// Q6_K group i = 4·h + r: d·scale·(q − 32). The 6-bit quants are put
    /// together 16 bytes at a time (each byte's bits come from its own
    /// bytes of ql and qh), then widened.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(crate) fn q6_k(b: &[u8], i: usize, scales: &__m512) -> [__m512; 2] {
        let (h, r) = (i / 4, i % 4);
        let bytes = |at: usize| {
            let v: &[u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
            // SAFETY: reads the 16 bytes of `v` (no alignment needed).
            unsafe { _mm_loadu_si128(v.as_ptr().cast()) }
        };
        let half = |l0: usize| {
            // Shifting 16-bit lanes and masking keeps each byte's own bits
            // (shift + width <= 8).
            let low = _mm_and_si128(
                _mm_srl_epi16(
                    bytes(64 * h + 32 * (r % 2) + l0),
                    _mm_cvtsi32_si128(4 * (r / 2) as i32),
                ),
                _mm_set1_epi8(0x0F),
            );
            let high = _mm_and_si128(
                _mm_srl_epi16(bytes(128 + 32 * h + l0), _mm_cvtsi32_si128(2 * r as i32)),
                _mm_set1_epi8(3),
            );
            let q = _mm_sub_epi8(
                _mm_or_si128(low, _mm_slli_epi16::<4>(high)),
                _mm_set1_epi8(32),
            );
            let e = 128 * h + 32 * r + l0;
            _mm512_mul_ps(
                lane(*scales, e / 16),
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
            )
        };
        [half(0), half(16)]
    }
}

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

        /// The AVX2 row decoders equal the scalar ones bit for bit.
        #[test]
        fn avx2_matches_scalar_bitwise(seed: u64, n_blocks in 1usize..=12) {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
                println!("skipped: this CPU has no AVX2 + F16C");
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
                // SAFETY: the CPU has AVX2 and F16C (checked above).
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
