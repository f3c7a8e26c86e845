//! The portable block decoders: plain Rust, one function per type, each
//! value computed with the f32 operations the format defines (the
//! vectorized decoders reproduce them bit for bit).

use half::{bf16, f16};

use super::format::{k4_scale_min, GgmlType};

/// The scalar [`dequantize_blocks`]: the fallback, and the reference the
/// vectorized decoders are tested against.
#[inline(always)]
pub(crate) fn dequantize_blocks_scalar(ty: GgmlType, data: &[u8], out: &mut [f32]) {
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
/// low (r < 2) or high (r ≥ 2) nibble of ql\[64·h + 32·(r % 2) + l\]; high
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
