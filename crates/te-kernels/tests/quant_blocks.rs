//! Dequantization of every supported GGML type against values computed in
//! the test from the format definition (llama.cpp `ggml-common.h` block
//! structs, packed the way the reference quantizers in `ggml-quants.c` lay
//! the bits out), independent of the decoder under test.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_kernels::quant::{dequantize, GgmlType};
use te_kernels::KernelError;

fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// A scale that is exact in f16 (so the test's f64 math uses the stored value).
fn scale(rng: &mut StdRng) -> f32 {
    f16::from_f32(rng.gen_range(-2.0f32..2.0)).to_f32()
}

/// One block: its bytes and the expected f64 values.
struct Block {
    bytes: Vec<u8>,
    want: Vec<f64>,
}

fn q4_0(rng: &mut StdRng) -> Block {
    let d = scale(rng);
    let q: Vec<u8> = (0..32).map(|_| rng.gen_range(0..16)).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
    let want = q.iter().map(|&q| d as f64 * (q as f64 - 8.0)).collect();
    Block { bytes, want }
}

fn q4_1(rng: &mut StdRng) -> Block {
    let (d, m) = (scale(rng), scale(rng));
    let q: Vec<u8> = (0..32).map(|_| rng.gen_range(0..16)).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(f16_bytes(m));
    bytes.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
    let want = q.iter().map(|&q| d as f64 * q as f64 + m as f64).collect();
    Block { bytes, want }
}

/// Q5 packing: low nibbles as Q4, bit 4 of element i into bit i of `qh`.
fn q5_pack(q: &[u8]) -> Vec<u8> {
    let mut qh = 0u32;
    for (i, &q) in q.iter().enumerate() {
        qh |= ((q >> 4) as u32) << i;
    }
    let mut bytes = qh.to_le_bytes().to_vec();
    bytes.extend((0..16).map(|j| (q[j] & 15) | ((q[j + 16] & 15) << 4)));
    bytes
}

fn q5_0(rng: &mut StdRng) -> Block {
    let d = scale(rng);
    let q: Vec<u8> = (0..32).map(|_| rng.gen_range(0..32)).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(q5_pack(&q));
    let want = q.iter().map(|&q| d as f64 * (q as f64 - 16.0)).collect();
    Block { bytes, want }
}

fn q5_1(rng: &mut StdRng) -> Block {
    let (d, m) = (scale(rng), scale(rng));
    let q: Vec<u8> = (0..32).map(|_| rng.gen_range(0..32)).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(f16_bytes(m));
    bytes.extend(q5_pack(&q));
    let want = q.iter().map(|&q| d as f64 * q as f64 + m as f64).collect();
    Block { bytes, want }
}

fn q8_0(rng: &mut StdRng) -> Block {
    let d = scale(rng);
    let q: Vec<i8> = (0..32).map(|_| rng.gen()).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(q.iter().map(|&q| q as u8));
    let want = q.iter().map(|&q| d as f64 * q as f64).collect();
    Block { bytes, want }
}

/// 2-bit fields packed four per byte: byte 32·h + l holds elements
/// 128·h + l + 32·k at bits 2·k (ggml's K-quant 2-bit layout).
fn pack_2bit(l: &[u8]) -> Vec<u8> {
    let mut qs = vec![0u8; 64];
    for j in (0..256).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
    qs
}

fn q2_k(rng: &mut StdRng) -> Block {
    let (d, dmin) = (scale(rng), scale(rng));
    let sc: Vec<u8> = (0..16).map(|_| rng.gen_range(0..16)).collect();
    let mn: Vec<u8> = (0..16).map(|_| rng.gen_range(0..16)).collect();
    let q: Vec<u8> = (0..256).map(|_| rng.gen_range(0..4)).collect();
    let mut bytes: Vec<u8> = (0..16).map(|k| sc[k] | (mn[k] << 4)).collect();
    bytes.extend(pack_2bit(&q));
    bytes.extend(f16_bytes(d));
    bytes.extend(f16_bytes(dmin));
    let want = (0..256)
        .map(|e| d as f64 * sc[e / 16] as f64 * q[e] as f64 - dmin as f64 * mn[e / 16] as f64)
        .collect();
    Block { bytes, want }
}

fn q3_k(rng: &mut StdRng) -> Block {
    let d = scale(rng);
    // 6-bit scales stored with an offset of 32; quants in -4..=3 stored + 4.
    let ls: Vec<u8> = (0..16).map(|_| rng.gen_range(0..64)).collect();
    let lq: Vec<u8> = (0..256).map(|_| rng.gen_range(0..8)).collect();
    let mut scales = [0u8; 12];
    for (j, &l) in ls.iter().enumerate() {
        if j < 8 {
            scales[j] = l & 0xF;
        } else {
            scales[j - 8] |= (l & 0xF) << 4;
        }
        scales[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
    }
    // The high bit of each 3-bit quant goes to hmask: element j sets bit
    // (j / 32) of hmask[j % 32].
    let mut hmask = [0u8; 32];
    let mut low = lq.clone();
    for j in 0..256 {
        if low[j] > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            low[j] -= 4;
        }
    }
    let mut bytes = hmask.to_vec();
    bytes.extend(pack_2bit(&low));
    bytes.extend(scales);
    bytes.extend(f16_bytes(d));
    let want = (0..256)
        .map(|e| d as f64 * (ls[e / 16] as f64 - 32.0) * (lq[e] as f64 - 4.0))
        .collect();
    Block { bytes, want }
}

/// The 12-byte packing of eight 6-bit (scale, min) pairs used by Q4_K and Q5_K.
fn pack_k4_scales(ls: &[u8], lm: &[u8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

fn q4_k(rng: &mut StdRng) -> Block {
    let (d, dmin) = (scale(rng), scale(rng));
    let ls: Vec<u8> = (0..8).map(|_| rng.gen_range(0..64)).collect();
    let lm: Vec<u8> = (0..8).map(|_| rng.gen_range(0..64)).collect();
    let q: Vec<u8> = (0..256).map(|_| rng.gen_range(0..16)).collect();
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(f16_bytes(dmin));
    bytes.extend(pack_k4_scales(&ls, &lm));
    for j in (0..256).step_by(64) {
        bytes.extend((0..32).map(|l| q[j + l] | (q[j + l + 32] << 4)));
    }
    let want = (0..256)
        .map(|e| d as f64 * ls[e / 32] as f64 * q[e] as f64 - dmin as f64 * lm[e / 32] as f64)
        .collect();
    Block { bytes, want }
}

fn q5_k(rng: &mut StdRng) -> Block {
    let (d, dmin) = (scale(rng), scale(rng));
    let ls: Vec<u8> = (0..8).map(|_| rng.gen_range(0..64)).collect();
    let lm: Vec<u8> = (0..8).map(|_| rng.gen_range(0..64)).collect();
    let q: Vec<u8> = (0..256).map(|_| rng.gen_range(0..32)).collect();
    let mut qh = [0u8; 32];
    let mut ql = Vec::new();
    let (mut m1, mut m2) = (1u8, 2u8);
    for n in (0..256).step_by(64) {
        for j in 0..32 {
            let (mut l1, mut l2) = (q[n + j], q[n + j + 32]);
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql.push(l1 | (l2 << 4));
        }
        m1 <<= 2;
        m2 <<= 2;
    }
    let mut bytes = f16_bytes(d).to_vec();
    bytes.extend(f16_bytes(dmin));
    bytes.extend(pack_k4_scales(&ls, &lm));
    bytes.extend(qh);
    bytes.extend(ql);
    let want = (0..256)
        .map(|e| d as f64 * ls[e / 32] as f64 * q[e] as f64 - dmin as f64 * lm[e / 32] as f64)
        .collect();
    Block { bytes, want }
}

fn q6_k(rng: &mut StdRng) -> Block {
    let d = scale(rng);
    let sc: Vec<i8> = (0..16).map(|_| rng.gen()).collect();
    let l: Vec<u8> = (0..256).map(|_| rng.gen_range(0..64)).collect();
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (h, j) in (0..256).step_by(128).enumerate() {
        for i in 0..32 {
            let (a, b, c, e) = (l[j + i], l[j + i + 32], l[j + i + 64], l[j + i + 96]);
            ql[64 * h + i] = (a & 0xF) | ((c & 0xF) << 4);
            ql[64 * h + i + 32] = (b & 0xF) | ((e & 0xF) << 4);
            qh[32 * h + i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
    let mut bytes = ql.to_vec();
    bytes.extend(qh);
    bytes.extend(sc.iter().map(|&s| s as u8));
    bytes.extend(f16_bytes(d));
    let want = (0..256)
        .map(|e| d as f64 * sc[e / 16] as f64 * (l[e] as f64 - 32.0))
        .collect();
    Block { bytes, want }
}

fn f32_block(rng: &mut StdRng) -> Block {
    let x: f32 = rng.gen_range(-10.0..10.0);
    Block {
        bytes: x.to_le_bytes().to_vec(),
        want: vec![x as f64],
    }
}

fn f16_block(rng: &mut StdRng) -> Block {
    let x = f16::from_f32(rng.gen_range(-10.0..10.0));
    Block {
        bytes: x.to_le_bytes().to_vec(),
        want: vec![x.to_f64()],
    }
}

fn bf16_block(rng: &mut StdRng) -> Block {
    // bf16 is the top 16 bits of an f32.
    let bits: u16 = rng.gen_range(0x3000..0x4400) | if rng.gen() { 0x8000 } else { 0 };
    Block {
        bytes: bits.to_le_bytes().to_vec(),
        want: vec![f32::from_bits((bits as u32) << 16) as f64],
    }
}

type Maker = fn(&mut StdRng) -> Block;

const CASES: &[(GgmlType, Maker)] = &[
    (GgmlType::F32, f32_block),
    (GgmlType::F16, f16_block),
    (GgmlType::BF16, bf16_block),
    (GgmlType::Q4_0, q4_0),
    (GgmlType::Q4_1, q4_1),
    (GgmlType::Q5_0, q5_0),
    (GgmlType::Q5_1, q5_1),
    (GgmlType::Q8_0, q8_0),
    (GgmlType::Q2_K, q2_k),
    (GgmlType::Q3_K, q3_k),
    (GgmlType::Q4_K, q4_k),
    (GgmlType::Q5_K, q5_k),
    (GgmlType::Q6_K, q6_k),
];

/// A tensor of `rows` rows of `blocks_per_row` blocks each, dequantized at
/// once (the parallel path) and compared element by element.
#[test]
fn every_type_matches_its_definition() {
    let mut rng = StdRng::seed_from_u64(7);
    for &(ty, make) in CASES {
        let (block_len, block_bytes) = ty.block_layout().unwrap();
        for (rows, blocks_per_row) in [(1, 1), (3, 2), (37, 4)] {
            let blocks: Vec<Block> = (0..rows * blocks_per_row).map(|_| make(&mut rng)).collect();
            let data: Vec<u8> = blocks.iter().flat_map(|b| b.bytes.clone()).collect();
            let want: Vec<f64> = blocks.iter().flat_map(|b| b.want.clone()).collect();
            assert_eq!(data.len(), blocks.len() * block_bytes, "{ty:?} block size");
            let mut out = vec![f32::NAN; want.len()];
            dequantize("t", ty, &data, block_len * blocks_per_row, &mut out).unwrap();
            for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                let tol = 1e-6 * w.abs().max(1.0);
                assert!(
                    (g as f64 - w).abs() <= tol,
                    "{ty:?} rows {rows}: element {i} is {g}, expected {w}"
                );
            }
        }
    }
}

/// A worked example by hand: Q4_0 with d = 0.5 and qs[0] = 0x9F gives
/// element 0 = 0.5·(15 − 8) = 3.5 and element 16 = 0.5·(9 − 8) = 0.5;
/// zero bytes give 0.5·(0 − 8) = −4.
#[test]
fn q4_0_worked_example() {
    let mut block = vec![0u8; 18];
    block[..2].copy_from_slice(&f16_bytes(0.5));
    block[2] = 0x9F;
    let mut out = [0f32; 32];
    dequantize("t", GgmlType::Q4_0, &block, 32, &mut out).unwrap();
    assert_eq!(out[0], 3.5);
    assert_eq!(out[16], 0.5);
    assert_eq!(out[1], -4.0);
    assert_eq!(out[31], -4.0);
}

#[test]
fn type_ids_round_trip() {
    for id in 0..64 {
        assert_eq!(GgmlType::from_id(id).id(), id);
    }
    assert_eq!(GgmlType::from_id(30), GgmlType::BF16);
    assert_eq!(GgmlType::from_id(12), GgmlType::Q4_K);
    assert_eq!(GgmlType::from_id(8), GgmlType::Q8_0);
}

#[test]
fn unsupported_types_and_bad_sizes_are_errors() {
    let err = dequantize("blk.0.x", GgmlType::Q8_K, &[0; 292], 256, &mut [0.0; 256]).unwrap_err();
    assert!(
        matches!(err, KernelError::UnsupportedQuantization { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("blk.0.x") && err.to_string().contains("Q8_K"),
        "{err}"
    );
    let err = dequantize("w", GgmlType::Other(99), &[], 1, &mut []).unwrap_err();
    assert!(err.to_string().contains("id 99"), "{err}");
    // Row length not a multiple of the block length.
    let err = dequantize("w", GgmlType::Q4_0, &[0; 18], 16, &mut [0.0; 32]).unwrap_err();
    assert!(err.to_string().contains("`w`"), "{err}");
    // Too few bytes.
    let err = dequantize("w", GgmlType::Q4_0, &[0; 17], 32, &mut [0.0; 32]).unwrap_err();
    assert!(err.to_string().contains("17 bytes"), "{err}");
}
