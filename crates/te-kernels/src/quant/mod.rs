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

use crate::KernelError;

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
