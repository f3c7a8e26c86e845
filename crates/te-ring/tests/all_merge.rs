//! Decode with the KV cache split across thread ranks: each rank attends
//! the replicated queries to its own keys, `all_merge` combines them;
//! compared with a naive float64 attention over all keys.

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_ring::{all_merge, Communicator, RingError, ThreadComm};

const D: usize = 16;

/// Per sequence: queries `[sq, hq, D]`, keys and values `[skv, hkv, D]`.
struct Seq {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Where each rank's keys start; rank r holds `cuts[r]..cuts[r + 1]`.
    cuts: Vec<usize>,
}

fn reference(s: &Seq, hq: usize, hkv: usize) -> (Vec<f64>, Vec<f64>) {
    let sq = s.q.len() / (hq * D);
    let skv = s.k.len() / (hkv * D);
    let mut out = vec![0.0; sq * hq * D];
    let mut lse = vec![f64::NEG_INFINITY; sq * hq];
    for i in 0..sq {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let logits: Vec<f64> = (0..skv)
                .map(|j| {
                    (0..D)
                        .map(|p| {
                            s.q[(i * hq + h) * D + p] as f64 * s.k[(j * hkv + g) * D + p] as f64
                        })
                        .sum::<f64>()
                        / (D as f64).sqrt()
                })
                .collect();
            if skv == 0 {
                continue;
            }
            let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|x| (x - m).exp()).sum();
            lse[i * hq + h] = m + sum.ln();
            for (j, x) in logits.iter().enumerate() {
                let p = (x - m).exp() / sum;
                for c in 0..D {
                    out[(i * hq + h) * D + c] += p * s.v[(j * hkv + g) * D + c] as f64;
                }
            }
        }
    }
    (out, lse)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn split_cache_decode_equals_full_attention(cp in 1..=4usize, batch in 1..4usize, group in 1..=3usize, seed: u64) {
        let (hkv, hq) = (2, 2 * group);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut gen = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect() };
        let seqs: Vec<Seq> = (0..batch)
            .map(|_| {
                let sq = 1 + (seed as usize % 3);
                let skv = [0, 1, 5, 300][(seed as usize / 7 + batch) % 4];
                let mut cuts: Vec<usize> = (0..cp - 1).map(|r| (r * 37 + seed as usize) % (skv + 1)).collect();
                cuts.push(0);
                cuts.push(skv);
                cuts.sort();
                Seq { q: gen(sq * hq * D), k: gen(skv * hkv * D), v: gen(skv * hkv * D), cuts }
            })
            .collect();
        let attn = DotProductAttention::new(hq, D)
            .with_num_gqa_groups(hkv)
            .with_attn_mask_type(AttnMaskType::Padding)
            .with_formats(te_kernels::QkvFormat::Thd, te_kernels::QkvFormat::Thd);
        let q: Vec<f32> = seqs.iter().flat_map(|s| s.q.iter().copied()).collect();
        let t = q.len() / (hq * D);
        let mut cu_q = vec![0i32];
        for s in &seqs {
            cu_q.push(cu_q.last().unwrap() + (s.q.len() / (hq * D)) as i32);
        }
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|sc| {
            let ranks: Vec<_> = ThreadComm::ring(cp).unwrap().into_iter().map(|mut comm| {
                let (seqs, attn, q, cu_q) = (&seqs, &attn, &q, &cu_q);
                sc.spawn(move || {
                    let r = comm.cp_rank();
                    // This rank's keys of every sequence, packed thd.
                    let (mut k, mut v, mut cu_kv) = (Vec::new(), Vec::new(), vec![0i32]);
                    for s in seqs {
                        let (a, b) = (s.cuts[r], s.cuts[r + 1]);
                        k.extend_from_slice(&s.k[a * hkv * D..b * hkv * D]);
                        v.extend_from_slice(&s.v[a * hkv * D..b * hkv * D]);
                        cu_kv.push(cu_kv.last().unwrap() + (b - a) as i32);
                    }
                    let max_len = |cu: &[i32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
                    let meta = AttnMetadata {
                        batch: seqs.len(),
                        max_seqlen_q: max_len(cu_q),
                        max_seqlen_kv: max_len(&cu_kv),
                        cu_seqlens_q: Some(cu_q),
                        cu_seqlens_kv: Some(&cu_kv),
                    };
                    let mut out = vec![0f32; t * hq * D];
                    let mut lse = vec![0f32; hq * t];
                    attn.forward_cpu(q, KvInput::Tensors { k: &k, v: &v }, &meta, &mut out, Some(&mut lse)).unwrap();
                    all_merge(&mut comm, &mut out, &mut lse, hq, D).unwrap();
                    (out, lse)
                })
            }).collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in 1..cp {
            prop_assert!(results[r] == results[0], "rank {r} differs from rank 0");
        }
        let (out, lse) = &results[0];
        let mut row = 0;
        for s in &seqs {
            let (want_out, want_lse) = reference(s, hq, hkv);
            let sq = s.q.len() / (hq * D);
            for i in 0..sq {
                for h in 0..hq {
                    let (g, w) = (lse[h * t + row + i] as f64, want_lse[i * hq + h]);
                    prop_assert!(g == w || (g - w).abs() <= 1e-5 * (1.0 + w.abs()), "lse {g} vs {w}");
                    for c in 0..D {
                        let (g, w) = (out[((row + i) * hq + h) * D + c] as f64, want_out[(i * hq + h) * D + c]);
                        prop_assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "out {g} vs {w}");
                    }
                }
            }
            row += sq;
        }
    }
}

#[test]
fn bad_shapes_are_named() {
    let mut comm = ThreadComm::ring(1).unwrap().pop().unwrap();
    let (mut out, mut lse) = (vec![0f32; 10], vec![0f32; 3]);
    assert!(matches!(
        all_merge(&mut comm, &mut out, &mut lse, 0, 5),
        Err(RingError::InvalidArgument {
            arg: "num_heads",
            ..
        })
    ));
    assert!(matches!(
        all_merge(&mut comm, &mut out, &mut lse, 2, 5),
        Err(RingError::ShapeMismatch { arg: "lse", .. })
    ));
    let mut lse = vec![0f32; 2];
    assert!(matches!(
        all_merge(&mut comm, &mut out, &mut lse, 2, 4),
        Err(RingError::ShapeMismatch { arg: "out", .. })
    ));
}
