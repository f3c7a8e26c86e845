//! Property tests: random formats, ragged lengths, every mask type, windows,
//! GQA ratios, head dims, softcap, contiguous/paged/ring caches; f32 and
//! bf16 against the float64 reference of `common.rs`.

mod common;

use common::{check, run, Case, KvSource};
use half::bf16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_attention::AttnMaskType;
use te_kernels::QkvFormat;

const FORMATS: [QkvFormat; 3] = [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd];

fn pick_len(rng: &mut StdRng, max_len: usize) -> usize {
    match rng.gen_range(0..4) {
        0 => 0,
        1 => 1,
        _ => rng.gen_range(0..=max_len),
    }
}

/// Builds a case from drawn choices; lengths and data come from `seed`.
fn build(choice: [usize; 9], softcap: bool, max_len: usize, seed: u64) -> Case {
    let [qf, kv, page, mask, win, group, d, batch, h_kv] = choice;
    let mut rng = StdRng::seed_from_u64(seed);
    let mask = AttnMaskType::ALL[mask];
    let page_size = [1, 16, 64][page];
    let kv = match kv {
        0..=2 => KvSource::Tensors(FORMATS[kv]),
        3 => KvSource::Cache {
            page_size: 0,
            ring_len: None,
        }, // contiguous: page_size set below
        4 => KvSource::Cache {
            page_size,
            ring_len: None,
        },
        _ => KvSource::Cache {
            page_size,
            ring_len: Some(page_size * rng.gen_range(1..=3)),
        },
    };
    let q_format = FORMATS[qf];
    let batch = batch + 1;
    let ragged_q = q_format == QkvFormat::Thd || mask.is_padding();
    let max_seqlen_q = rng.gen_range(1..=max_len);
    let sq: Vec<usize> = (0..batch)
        .map(|_| {
            if ragged_q {
                pick_len(&mut rng, max_seqlen_q)
            } else {
                max_seqlen_q
            }
        })
        .collect();
    let max_seqlen_kv = rng.gen_range(1..=max_len);
    let skv: Vec<usize> = match kv {
        KvSource::Cache { .. } => sq
            .iter()
            .map(|&s| s + pick_len(&mut rng, max_len))
            .collect(),
        KvSource::Tensors(f) if f == QkvFormat::Thd || mask.is_padding() => (0..batch)
            .map(|_| pick_len(&mut rng, max_seqlen_kv))
            .collect(),
        KvSource::Tensors(_) => vec![max_seqlen_kv; batch],
    };
    let kv = match kv {
        KvSource::Cache { page_size: 0, .. } => KvSource::Cache {
            page_size: skv.iter().copied().max().unwrap_or(1).max(1),
            ring_len: None,
        },
        other => other,
    };
    let w = rng.gen_range(0..10i64);
    let right = if mask.is_causal() {
        [0, -1][rng.gen_range(0..2)]
    } else {
        rng.gen_range(0..6)
    };
    let window = match win {
        0 => None,
        1 => Some((w, right)),
        2 => Some((-1, right)),
        _ => Some((w, -1)),
    };
    let d_qk = [64, 128, 256][d];
    Case {
        q_format,
        kv,
        mask,
        window,
        softcap: softcap.then(|| [0.5f32, 5.0][rng.gen_range(0..2)]),
        softmax_scale: rng.gen_bool(0.3).then_some(0.3),
        h_kv: h_kv + 1,
        group: [1, 2, 3, 4, 9][group],
        d_qk,
        d_v: if rng.gen_bool(0.3) { 64 } else { d_qk },
        sq,
        skv,
        max_seqlen_q,
        max_seqlen_kv,
        seed,
    }
}

fn choices() -> impl Strategy<Value = [usize; 9]> {
    (
        0..3usize,
        0..6usize,
        0..3usize,
        0..6usize,
        0..4usize,
        0..5usize,
        0..3usize,
        0..3usize,
        0..2usize,
    )
        .prop_map(|(a, b, c, d, e, f, g, h, i)| [a, b, c, d, e, f, g, h, i])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn f32_matches_reference(choice in choices(), softcap: bool, seed: u64) {
        let case = build(choice, softcap, 12, seed);
        let data = case.data::<f32>();
        let r = run::<f32, f32>(&case, &data);
        prop_assert!(check(&case, &data, &r, 1e-5, 1e-5).is_ok(), "{case:?}: {}", check(&case, &data, &r, 1e-5, 1e-5).unwrap_err());
    }

    #[test]
    fn bf16_matches_reference(choice in choices(), softcap: bool, seed: u64) {
        let case = build(choice, softcap, 12, seed);
        let data = case.data::<bf16>();
        let r = run::<bf16, bf16>(&case, &data);
        prop_assert!(check(&case, &data, &r, 1e-2, 1e-3).is_ok(), "{case:?}: {}", check(&case, &data, &r, 1e-2, 1e-3).unwrap_err());
        // bf16 inputs with f32 output (what an LSE merge consumes).
        let r = run::<bf16, f32>(&case, &data);
        prop_assert!(check(&case, &data, &r, 1e-5, 1e-5).is_ok(), "{case:?}: {}", check(&case, &data, &r, 1e-5, 1e-5).unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// Longer sequences: several query tiles and key tiles per sequence.
    #[test]
    fn f32_long_sequences_match_reference(choice in choices(), softcap: bool, seed: u64) {
        let mut choice = choice;
        choice[6] = 0; // d = 64 keeps the reference quick
        choice[7] = 0; // one sequence
        let case = build(choice, softcap, 300, seed);
        let data = case.data::<f32>();
        let r = run::<f32, f32>(&case, &data);
        prop_assert!(check(&case, &data, &r, 1e-5, 1e-5).is_ok(), "{case:?}: {}", check(&case, &data, &r, 1e-5, 1e-5).unwrap_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Decode (1-2 queries) against caches of 1000-3000 keys in one to
    /// three sequences: big enough to run in parallel with the key ranges
    /// split across threads and merged by log-sum-exp.
    #[test]
    fn f32_decode_against_long_caches_matches_reference(
        choice in choices(), kv in 3..6usize, softcap: bool, seed: u64,
    ) {
        let mut choice = choice;
        choice[1] = kv;
        choice[6] = 0; // d = 64 keeps the reference quick
        let mut case = build(choice, softcap, 2, seed);
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        case.skv = case.sq.iter().map(|&s| s + rng.gen_range(1000..3000)).collect();
        case.max_seqlen_kv = case.skv.iter().copied().max().unwrap_or(0);
        if kv == 3 {
            // Contiguous: one page per sequence.
            case.kv = KvSource::Cache { page_size: case.max_seqlen_kv, ring_len: None };
        }
        let data = case.data::<f32>();
        let r = run::<f32, f32>(&case, &data);
        prop_assert!(check(&case, &data, &r, 1e-5, 1e-5).is_ok(), "{case:?}: {}", check(&case, &data, &r, 1e-5, 1e-5).unwrap_err());
    }
}
