//! `forward_cpu_at_positions`: keys held at any increasing subset of
//! positions (a context-parallel rank's shard) against a naive float64
//! attention that applies the causal mask and window to positions.

use proptest::prelude::*;
use te_attention::{
    AttentionWorkspace, AttnMaskType, AttnMetadata, AttnOutput, DotProductAttention, KvInput,
    Positions,
};
use te_kernels::QkvFormat;

/// One sequence: queries at `q_start..q_start + sq`, keys at `k_pos`.
#[derive(Clone, Debug)]
struct Seq {
    q_start: i32,
    sq: usize,
    k_pos: Vec<i32>,
}

fn seq() -> impl Strategy<Value = Seq> {
    (
        0i32..40,
        1usize..6,
        proptest::collection::vec(any::<bool>(), 0..60),
    )
        .prop_map(|(q_start, sq, held)| Seq {
            q_start,
            sq,
            // Keys anywhere before, among and after the queries.
            k_pos: held
                .iter()
                .enumerate()
                .filter(|(_, &h)| h)
                .map(|(p, _)| p as i32)
                .collect(),
        })
}

/// The f32 inputs of one forward: `q: [t, hq, d]`, `k` and `v: [tk, hkv,
/// d]` (thd, sequences in order).
#[derive(Clone, Copy)]
struct Qkv<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

/// Naive float64: `[t, hq, d]` output and `[hq, t]` lse.
fn reference(
    seqs: &[Seq],
    Qkv { q, k, v }: Qkv<'_>,
    (hq, hkv, d): (usize, usize, usize),
    causal: bool,
    window: Option<(i64, i64)>,
    softcap: Option<f32>,
) -> (Vec<f64>, Vec<f64>) {
    let t: usize = seqs.iter().map(|s| s.sq).sum();
    let mut out = vec![0f64; t * hq * d];
    let mut lse = vec![f64::NEG_INFINITY; hq * t];
    let scale = 1.0 / (d as f64).sqrt();
    let (mut qr, mut kr) = (0, 0);
    for s in seqs {
        for i in 0..s.sq {
            let p = (s.q_start as i64) + i as i64;
            for h in 0..hq {
                let g = h / (hq / hkv);
                let mut scores = Vec::new();
                for (j, &kp) in s.k_pos.iter().enumerate() {
                    let kp = kp as i64;
                    let right = if causal {
                        Some(0)
                    } else {
                        window.and_then(|w| (w.1 >= 0).then_some(w.1))
                    };
                    let left = window.and_then(|w| (w.0 >= 0).then_some(w.0));
                    if right.is_some_and(|r| kp > p + r) || left.is_some_and(|l| kp < p - l) {
                        continue;
                    }
                    let qv = &q[((qr + i) * hq + h) * d..][..d];
                    let kv = &k[((kr + j) * hkv + g) * d..][..d];
                    let mut x: f64 = qv
                        .iter()
                        .zip(kv)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale;
                    if let Some(c) = softcap {
                        x = c as f64 * (x / c as f64).tanh();
                    }
                    scores.push((j, x));
                }
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
                lse[h * t + qr + i] = m + sum.ln();
                for &(j, x) in &scores {
                    let w = (x - m).exp() / sum;
                    for e in 0..d {
                        out[((qr + i) * hq + h) * d + e] +=
                            w * v[((kr + j) * hkv + g) * d + e] as f64;
                    }
                }
            }
        }
        qr += s.sq;
        kr += s.k_pos.len();
    }
    (out, lse)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn positions_mask_matches_naive(
        seqs in proptest::collection::vec(seq(), 1..4),
        gqa in prop_oneof![Just((4usize, 2usize)), Just((2, 2)), Just((3, 1))],
        causal in any::<bool>(),
        window in proptest::option::of((-1i64..12, -1i64..6)),
        softcap in proptest::option::of(Just(5.0f32)),
        seed in any::<u64>(),
    ) {
        let (hq, hkv, d) = (gqa.0, gqa.1, 8);
        let t: usize = seqs.iter().map(|s| s.sq).sum();
        let tk: usize = seqs.iter().map(|s| s.k_pos.len()).sum();
        let mut state = seed | 1;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 2001) as f32 / 1000.0 - 1.0
        };
        let q: Vec<f32> = (0..t * hq * d).map(|_| rnd()).collect();
        let k: Vec<f32> = (0..tk * hkv * d).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..tk * hkv * d).map(|_| rnd()).collect();
        let mut cu_q = vec![0i32];
        let mut cu_k = vec![0i32];
        for s in &seqs {
            cu_q.push(cu_q.last().unwrap() + s.sq as i32);
            cu_k.push(cu_k.last().unwrap() + s.k_pos.len() as i32);
        }
        let q_start: Vec<i32> = seqs.iter().map(|s| s.q_start).collect();
        let k_pos: Vec<i32> = seqs.iter().flat_map(|s| s.k_pos.clone()).collect();
        let mut attn = DotProductAttention::new(hq, d)
            .with_num_gqa_groups(hkv)
            .with_formats(QkvFormat::Thd, QkvFormat::Thd)
            .with_attn_mask_type(if causal { AttnMaskType::PaddingCausal } else { AttnMaskType::NoMask });
        if let Some((l, r)) = window {
            attn = attn.with_window_size(l, if causal { r.min(0) } else { r });
        }
        if let Some(c) = softcap {
            attn = attn.with_softcap(c);
        }
        let meta = AttnMetadata {
            batch: seqs.len(),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(&cu_q),
            cu_seqlens_kv: Some(&cu_k),
        };
        let positions = Positions { q_start: &q_start, cu_k: &cu_k, k: &k_pos };
        // Poisoned outputs: every element must be written.
        let mut out = vec![f32::NAN; t * hq * d];
        let mut lse = vec![f32::NAN; hq * t];
        attn.forward_cpu_at_positions(
            &q,
            KvInput::Tensors { k: &k, v: &v },
            &meta,
            &positions,
            AttnOutput { out: &mut out, lse: Some(&mut lse) },
            &mut AttentionWorkspace::default(),
        )
        .unwrap();
        let window = window.map(|(l, r)| (l, if causal { r.min(0) } else { r }));
        let (want, want_lse) = reference(&seqs, Qkv { q: &q, k: &k, v: &v }, (hq, hkv, d), causal, window, softcap);
        for (i, (&got, &w)) in out.iter().zip(&want).enumerate() {
            prop_assert!((got as f64 - w).abs() <= 2e-5, "out[{i}] = {got}, want {w}");
        }
        for (i, (&got, &w)) in lse.iter().zip(&want_lse).enumerate() {
            if w == f64::NEG_INFINITY {
                prop_assert_eq!(got, f32::NEG_INFINITY, "lse[{}]", i);
            } else {
                prop_assert!((got as f64 - w).abs() <= 2e-5, "lse[{i}] = {got}, want {w}");
            }
        }
    }
}

#[test]
fn positions_that_disagree_with_the_keys_are_errors() {
    let attn = DotProductAttention::new(1, 4)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd)
        .with_attn_mask_type(AttnMaskType::PaddingCausal);
    let (q, k) = (vec![0.5f32; 4], vec![0.5f32; 8]);
    let cu_q = [0, 1];
    let cu_k = [0, 2];
    let meta = AttnMetadata {
        batch: 1,
        max_seqlen_q: 0,
        max_seqlen_kv: 0,
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_kv: Some(&cu_k),
    };
    let run = |k_pos: &[i32], cu: &[i32]| {
        let mut out = vec![0f32; 4];
        attn.forward_cpu_at_positions(
            &q,
            KvInput::Tensors { k: &k, v: &k },
            &meta,
            &Positions {
                q_start: &[5],
                cu_k: cu,
                k: k_pos,
            },
            AttnOutput {
                out: &mut out,
                lse: None,
            },
            &mut AttentionWorkspace::default(),
        )
        .map(|()| out)
    };
    let err = run(&[3, 3], &cu_k).unwrap_err().to_string();
    assert!(
        err.contains("positions.k") && err.contains("do not increase"),
        "{err}"
    );
    let err = run(&[3], &[0, 1]).unwrap_err().to_string();
    assert!(err.contains("positions.cu_k"), "{err}");
    // Both keys precede the query at position 5: equal weights.
    let out = run(&[1, 4], &cu_k).unwrap();
    assert!(out.iter().all(|&x| (x - 0.5).abs() < 1e-6), "{out:?}");
}
