//! Ring attention on 1-4 thread ranks against a naive float64 attention
//! over the full sequences (docs/ARCHITECTURE.md, "Tolerances"), and its errors.

use half::bf16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_attention::{AttnMaskType, AttnOutput, DotProductAttention};
use te_kernels::Element;
use te_ring::{Communicator, RingAttention, RingError, ThreadComm, Zigzag};

#[derive(Clone, Debug)]
struct Case {
    cp: usize,
    seqlens: Vec<usize>,
    causal: bool,
    hkv: usize,
    group: usize,
    dqk: usize,
    dv: usize,
    softcap: Option<f32>,
    /// Sliding window `(left, right)` in positions, -1 unbounded.
    window: Option<(i64, i64)>,
    seed: u64,
}

impl Case {
    fn hq(&self) -> usize {
        self.hkv * self.group
    }

    fn attention(&self) -> DotProductAttention {
        let mask = if self.causal {
            AttnMaskType::Causal
        } else {
            AttnMaskType::NoMask
        };
        let mut a = DotProductAttention::new(self.hq(), self.dqk)
            .with_num_gqa_groups(self.hkv)
            .with_head_dim_v(self.dv)
            .with_attn_mask_type(mask);
        if let Some(c) = self.softcap {
            a = a.with_softcap(c);
        }
        if let Some((l, r)) = self.window {
            a = a.with_window_size(l, r);
        }
        a
    }

    /// Whether the query at position `i` sees the key at position `j`.
    fn visible(&self, i: usize, j: usize) -> bool {
        let (i, j) = (i as i128, j as i128);
        let (left, right) = self.window.unwrap_or((-1, -1));
        let (left, right) = (left as i128, if self.causal { 0 } else { right as i128 });
        (left < 0 || j >= i - left) && (right < 0 || j <= i + right)
    }

    /// Full thd q, k, v rounded to `T`.
    fn data<T: Element>(&self) -> [Vec<T>; 3] {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let t: usize = self.seqlens.iter().sum();
        let mut gen = |n: usize| -> Vec<T> {
            (0..n)
                .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)))
                .collect()
        };
        [
            gen(t * self.hq() * self.dqk),
            gen(t * self.hkv * self.dqk),
            gen(t * self.hkv * self.dv),
        ]
    }

    /// Naive float64 attention over the full sequences: out `[t, h_q, d_v]`
    /// and lse `[t, h_q]`.
    fn reference<T: Element>(&self, [q, k, v]: &[Vec<T>; 3]) -> (Vec<f64>, Vec<f64>) {
        let (hq, hkv, dqk, dv) = (self.hq(), self.hkv, self.dqk, self.dv);
        let t: usize = self.seqlens.iter().sum();
        let scale = 1.0 / (dqk as f64).sqrt();
        let mut out = vec![0.0; t * hq * dv];
        let mut lse = vec![f64::NEG_INFINITY; t * hq];
        let mut start = 0;
        for &n in &self.seqlens {
            for i in 0..n {
                for h in 0..hq {
                    let g = h / self.group;
                    let keys: Vec<usize> = (0..n).filter(|&j| self.visible(i, j)).collect();
                    let logits: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            let qr = &q[((start + i) * hq + h) * dqk..][..dqk];
                            let kr = &k[((start + j) * hkv + g) * dqk..][..dqk];
                            let s: f64 = qr
                                .iter()
                                .zip(kr)
                                .map(|(a, b)| a.to_f32() as f64 * b.to_f32() as f64)
                                .sum::<f64>()
                                * scale;
                            match self.softcap {
                                Some(c) => c as f64 * (s / c as f64).tanh(),
                                None => s,
                            }
                        })
                        .collect();
                    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = logits.iter().map(|s| (s - m).exp()).sum();
                    let row = (start + i) * hq + h;
                    lse[row] = m + sum.ln();
                    for (&j, s) in keys.iter().zip(&logits) {
                        let p = (s - m).exp() / sum;
                        let vr = &v[((start + j) * hkv + g) * dv..][..dv];
                        for (o, x) in out[row * dv..][..dv].iter_mut().zip(vr) {
                            *o += p * x.to_f32() as f64;
                        }
                    }
                }
            }
            start += n;
        }
        (out, lse)
    }

    /// Ring attention on `cp` threads; the full out `[t, h_q, d_v]` and
    /// lse `[t, h_q]` reassembled from the shards.
    fn run<T: Element, O: Element + Default>(&self, data: &[Vec<T>; 3]) -> (Vec<O>, Vec<f32>) {
        let ring = RingAttention::new(self.attention()).unwrap();
        let z = Zigzag::new(self.cp).unwrap();
        let (hq, hkv, dqk, dv) = (self.hq(), self.hkv, self.dqk, self.dv);
        let seqlens = &self.seqlens;
        let results: Vec<(Vec<O>, Vec<f32>)> = std::thread::scope(|s| {
            let ranks: Vec<_> = ThreadComm::ring(self.cp)
                .unwrap()
                .into_iter()
                .map(|mut comm| {
                    let ring = &ring;
                    s.spawn(move || {
                        let r = comm.cp_rank();
                        let q = z.shard(&data[0], hq * dqk, seqlens, r).unwrap();
                        let k = z.shard(&data[1], hkv * dqk, seqlens, r).unwrap();
                        let v = z.shard(&data[2], hkv * dv, seqlens, r).unwrap();
                        let t = q.len() / (hq * dqk);
                        // Poisoned outputs: every element must be written.
                        let mut out = vec![O::from_f32(f32::NAN); t * hq * dv];
                        let mut lse = vec![f32::NAN; hq * t];
                        let output = AttnOutput {
                            out: &mut out,
                            lse: Some(&mut lse),
                        };
                        ring.forward_cpu(&mut comm, seqlens, &q, &k, &v, output)
                            .unwrap();
                        // lse [h, t] -> [t, h] so it shards like a tensor.
                        let lse_th = (0..t * hq).map(|x| lse[(x % hq) * t + x / hq]).collect();
                        (out, lse_th)
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let outs: Vec<&[O]> = results.iter().map(|r| r.0.as_slice()).collect();
        let lses: Vec<&[f32]> = results.iter().map(|r| r.1.as_slice()).collect();
        (
            z.unshard(&outs, hq * dv, seqlens).unwrap(),
            z.unshard(&lses, hq, seqlens).unwrap(),
        )
    }
}

/// Compares with `|got - want| <= atol + rtol * |want|`; lse always f32
/// accurate (it is computed in f32 whatever the output dtype).
fn check<O: Element>(
    case: &Case,
    got: &(Vec<O>, Vec<f32>),
    want: &(Vec<f64>, Vec<f64>),
    atol: f64,
    rtol: f64,
) -> Result<(), String> {
    for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        let g = g.to_f32() as f64;
        // Written so that NaN fails.
        let close = (g - w).abs() <= atol + rtol * w.abs();
        if !close {
            return Err(format!("{case:?}: out[{i}] = {g}, reference {w}"));
        }
    }
    for (i, (&g, &w)) in got.1.iter().zip(&want.1).enumerate() {
        let g = g as f64;
        let close = (g - w).abs() <= 1e-5 * (1.0 + w.abs());
        if !close {
            return Err(format!("{case:?}: lse[{i}] = {g}, reference {w}"));
        }
    }
    Ok(())
}

fn cases() -> impl Strategy<Value = Case> {
    (
        1..=4usize,
        prop::collection::vec(prop_oneof![Just(0usize), Just(1), 0..40usize], 1..4),
        any::<bool>(),
        1..=2usize,
        prop_oneof![Just(1usize), Just(2), Just(3)],
        prop_oneof![Just(8usize), Just(16), Just(64)],
        any::<bool>(),
        any::<bool>(),
        prop_oneof![
            2 => Just(None),
            1 => (-1i64..12, -1i64..6).prop_map(Some),
        ],
        any::<u64>(),
    )
        .prop_map(
            |(cp, seqlens, causal, hkv, group, dqk, dv_differs, softcap, window, seed)| Case {
                cp,
                seqlens,
                causal,
                hkv,
                group,
                dqk,
                dv: if dv_differs { 8 } else { dqk },
                softcap: softcap.then_some(2.0),
                // Causal masks take a window right of 0 or -1.
                window: window.map(|(l, r)| (l, if causal { r.min(0) } else { r })),
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn f32_equals_single_rank_reference(case in cases()) {
        let data = case.data::<f32>();
        let got = case.run::<f32, f32>(&data);
        let want = case.reference(&data);
        prop_assert!(check(&case, &got, &want, 1e-5, 1e-5).is_ok(), "{}", check(&case, &got, &want, 1e-5, 1e-5).unwrap_err());
    }

    #[test]
    fn bf16_equals_single_rank_reference(case in cases()) {
        let data = case.data::<bf16>();
        // bf16 outputs: the ring tolerance of docs/ARCHITECTURE.md, "Tolerances" (GQA 3.5e-2).
        let got = case.run::<bf16, bf16>(&data);
        let want = case.reference(&data);
        let tol = if case.group > 1 { 3.5e-2 } else { 2.5e-2 };
        prop_assert!(check(&case, &got, &want, tol, tol).is_ok(), "{}", check(&case, &got, &want, tol, tol).unwrap_err());
        // f32 outputs of bf16 inputs: f32 accurate.
        let got = case.run::<bf16, f32>(&data);
        prop_assert!(check(&case, &got, &want, 1e-5, 1e-5).is_ok(), "{}", check(&case, &got, &want, 1e-5, 1e-5).unwrap_err());
    }
}

#[test]
fn long_causal_sequence_on_four_ranks() {
    // Several key tiles per block, lengths that do not divide by 8.
    let case = Case {
        cp: 4,
        seqlens: vec![517, 3, 300],
        causal: true,
        hkv: 2,
        group: 2,
        dqk: 64,
        dv: 64,
        softcap: None,
        window: None,
        seed: 7,
    };
    let data = case.data::<f32>();
    let got = case.run::<f32, f32>(&data);
    check(&case, &got, &case.reference(&data), 1e-5, 1e-5).unwrap();
}

#[test]
fn sliding_window_over_long_sequences_on_three_ranks() {
    // Windows shorter and longer than a chunk, causal (Gemma-style local
    // layers) and two-sided.
    for (causal, window) in [
        (true, (99, 0)),
        (true, (1000, 0)),
        (false, (37, 5)),
        (false, (-1, 60)),
    ] {
        let case = Case {
            cp: 3,
            seqlens: vec![517, 3, 300],
            causal,
            hkv: 1,
            group: 2,
            dqk: 64,
            dv: 64,
            softcap: None,
            window: Some(window),
            seed: 11,
        };
        let data = case.data::<f32>();
        let got = case.run::<f32, f32>(&data);
        check(&case, &got, &case.reference(&data), 1e-5, 1e-5).unwrap();
    }
}

#[test]
fn a_rank_with_bad_input_fails_and_its_peers_do_not_hang() {
    let ring = RingAttention::new(DotProductAttention::new(1, 8)).unwrap();
    // Rank 1 passes one token too many.
    let (_, results) = run_ranks(
        ThreadComm::ring(3).unwrap(),
        &ring,
        &[vec![12], vec![12], vec![12]],
        &[0, 1, 0],
    );
    assert!(matches!(
        results[1],
        Err(RingError::ShapeMismatch { arg: "q", .. })
    ));
    // The peers' errors name where the failure started, with its reason.
    for r in [0, 2] {
        assert!(
            matches!(&results[r], Err(RingError::Communication { cp_rank, reason })
                if *cp_rank == r && reason.starts_with("rank 1 failed: ")
                    && reason.contains("`q` has 40 elements")),
            "rank {r}: {:?}",
            results[r]
        );
    }
}

/// One rank's output, or its error.
type RankResult = Result<Vec<f32>, RingError>;

/// Runs one forward per rank of a 2- or 3-rank ring with per-rank
/// `seqlens` and token counts; the per-rank results.
fn run_ranks(
    comms: Vec<ThreadComm>,
    ring: &RingAttention,
    seqlens: &[Vec<usize>],
    extra_tokens: &[usize],
) -> (Vec<ThreadComm>, Vec<RankResult>) {
    let cp = comms.len();
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let r = comm.cp_rank();
                    let z = Zigzag::new(cp).unwrap();
                    let t = z
                        .local_cu_seqlens(&seqlens[r], r)
                        .unwrap()
                        .last()
                        .copied()
                        .unwrap() as usize
                        + extra_tokens[r];
                    let x: Vec<f32> = (0..t * 8).map(|i| (i % 5) as f32 / 5.0).collect();
                    let mut out = vec![0f32; t * 8];
                    let res = ring
                        .forward_cpu(
                            &mut comm,
                            &seqlens[r],
                            &x,
                            &x,
                            &x,
                            AttnOutput {
                                out: &mut out,
                                lse: None,
                            },
                        )
                        .map(|()| out);
                    (comm, res)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).unzip()
    })
}

#[test]
fn after_an_error_the_ring_fails_instead_of_mixing_calls() {
    let ring = RingAttention::new(
        DotProductAttention::new(1, 8).with_attn_mask_type(AttnMaskType::Causal),
    )
    .unwrap();
    let seqlens = vec![vec![9, 4]; 2];
    // Call 1: rank 1 passes a token too many.
    let (comms, first) = run_ranks(ThreadComm::ring(2).unwrap(), &ring, &seqlens, &[0, 1]);
    assert!(matches!(
        first[1],
        Err(RingError::ShapeMismatch { arg: "q", .. })
    ));
    assert!(
        matches!(&first[0], Err(RingError::Communication { reason, .. }) if reason.starts_with("rank 1 failed")),
        "{:?}",
        first[0]
    );
    // Call 2 with good input on the same communicators: every rank fails.
    let (_, second) = run_ranks(comms, &ring, &seqlens, &[0, 0]);
    for (r, res) in second.iter().enumerate() {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(err.contains("rank 1 failed"), "rank {r}: {err}");
    }
}

#[test]
fn ranks_with_different_seqlens_all_fail() {
    let ring = RingAttention::new(DotProductAttention::new(1, 8)).unwrap();
    for seqlens in [
        vec![vec![10, 3], vec![3, 10]],
        vec![vec![13], vec![10, 3]],
        vec![vec![10, 3, 7], vec![10, 3, 8], vec![10, 3, 7]],
    ] {
        let cp = seqlens.len();
        let (_, results) = run_ranks(ThreadComm::ring(cp).unwrap(), &ring, &seqlens, &vec![0; cp]);
        for (r, res) in results.iter().enumerate() {
            assert!(
                matches!(res, Err(RingError::Communication { .. })),
                "{seqlens:?} rank {r}: {res:?}"
            );
        }
    }
}
