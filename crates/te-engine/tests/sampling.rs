//! The sampler against a naive float64 reference written here: random
//! logits (with ±inf, NaN, huge and tiny values) and random settings
//! always give an id the settings allow; tiny temperatures agree with
//! greedy; the frequencies of hand-computed distributions come out;
//! sampling allocates nothing after the first token; presence, frequency
//! and bias follow OpenAI's formulas (hand-computed cases, and any
//! settings equal to plain sampling of logits adjusted here); logprobs
//! equal a float64 log-softmax computed here.

#[path = "../../te-models/tests/alloc_counter/mod.rs"]
mod alloc_counter;

use proptest::prelude::*;
use te_engine::sampling::{argmax, Sampler, SamplingParams};

#[global_allocator]
static ALLOC: alloc_counter::Counting = alloc_counter::Counting;

/// The effective logits of the rules in `sampling.rs`: the repetition
/// penalty once per distinct history id inside the vocabulary (in f32, as
/// the logits are).
fn effective(logits: &[f32], history: &[u32], penalty: f32) -> Vec<f32> {
    let mut z = logits.to_vec();
    let mut done = vec![false; logits.len()];
    for &t in history {
        let t = t as usize;
        if t < z.len() && !done[t] {
            done[t] = true;
            z[t] = if z[t] > 0.0 {
                z[t] / penalty
            } else {
                z[t] * penalty
            };
        }
    }
    z
}

/// Lowest id of the largest non-NaN value (None: all NaN).
fn reference_argmax(z: &[f32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &v) in z.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|b| v > z[b]) {
            best = Some(i);
        }
    }
    best
}

/// Which ids sampling may return, in float64 with a little slack at the
/// top-p and min-p boundaries (the code computes weights in f32). Returns
/// `Err(id)` when exactly one id is allowed by the degenerate rules.
fn allowed(z: &[f32], p: &SamplingParams) -> Result<Vec<bool>, usize> {
    let Some(best) = reference_argmax(z) else {
        return Err(0);
    };
    let z_max = z[best];
    if z_max == f32::NEG_INFINITY {
        return Err(best);
    }
    // Ranking: z descending, ties by id.
    let mut order: Vec<usize> = (0..z.len()).filter(|&i| !z[i].is_nan()).collect();
    order.sort_by(|&a, &b| z[b].partial_cmp(&z[a]).unwrap().then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let weight = |i: usize| -> f64 {
        if z_max == f32::INFINITY {
            if z[i] == f32::INFINITY {
                1.0
            } else {
                0.0
            }
        } else {
            ((z[i] as f64 - z_max as f64) / p.temperature as f64).exp()
        }
    };
    let w: Vec<f64> = order.iter().map(|&i| weight(i)).collect();
    let total: f64 = w.iter().sum();
    let mut ok = vec![false; z.len()];
    let mut before = 0.0;
    for (&i, &wi) in order.iter().zip(&w) {
        let q = wi / total;
        let in_top_p = before < p.top_p as f64 + 1e-5 || p.top_p >= 1.0;
        let in_min_p = q >= p.min_p as f64 * (w[0] / total) * (1.0 - 1e-4) - 1e-30;
        // Weights that underflow f32 have no chance in the code either way.
        ok[i] = in_top_p && in_min_p && wi > 0.0;
        before += q;
    }
    Ok(ok)
}

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -40.0f32..40.0,
        2 => (-400i32..400).prop_map(|i| i as f32 / 8.0),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::NAN),
        1 => prop_oneof![Just(3.0e38f32), Just(-3.0e38), Just(1e-40), Just(-0.0)],
    ]
}

fn temperature() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(0.0f32),
        Just(1e-45),
        Just(1e-38),
        1e-30f32..1e-3,
        0.05f32..5.0,
        Just(1e30),
        Just(f32::MAX),
    ]
}

fn penalty() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => Just(1.0f32),
        3 => 0.05f32..10.0,
        1 => Just(1e-30),
        1 => Just(1e30),
    ]
}

fn params() -> impl Strategy<Value = SamplingParams> {
    (
        temperature(),
        prop_oneof![Just(0usize), 1usize..8, 8usize..400],
        prop_oneof![Just(1.0f32), 0.01f32..1.0],
        prop_oneof![Just(0.0f32), 0.0f32..1.0, Just(1.0)],
        penalty(),
        any::<u64>(),
    )
        .prop_map(
            |(temperature, top_k, top_p, min_p, repetition_penalty, seed)| SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                seed,
                ..SamplingParams::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Every sampled id is one the settings allow (NaN and -inf never,
    /// +inf whenever present, inside top-k / top-p / min-p), and greedy is
    /// the lowest id of the largest effective logit.
    #[test]
    fn sampled_ids_are_always_allowed(
        logits in prop::collection::vec(logit(), 1..300),
        history in prop::collection::vec(0u32..320, 0..40),
        p in params(),
    ) {
        prop_assert!(p.validate().is_ok());
        let z = effective(&logits, &history, p.repetition_penalty);
        let mut s = Sampler::new(p.clone());
        for _ in 0..4 {
            let id = s.sample(&logits, &history) as usize;
            prop_assert!(id < logits.len());
            if p.temperature == 0.0 {
                prop_assert_eq!(Some(id), reference_argmax(&z).or(Some(0)));
                continue;
            }
            match allowed(&z, &p) {
                Err(only) => prop_assert_eq!(id, only),
                Ok(ok) => {
                    prop_assert!(ok[id], "id {} (z {}) not allowed; z {:?}", id, z[id], z);
                    prop_assert!(!z[id].is_nan());
                }
            }
        }
    }

    /// As the temperature goes to 0 sampling agrees with greedy: the draw
    /// is among the largest effective logits, and is the greedy token when
    /// the maximum is unique. (Logits are multiples of 1/8, so every other
    /// value is far more than 100 temperatures below the max.)
    #[test]
    fn tiny_temperature_agrees_with_greedy(
        logits in prop::collection::vec((-400i32..400).prop_map(|i| i as f32 / 8.0), 1..300),
        history in prop::collection::vec(0u32..300, 0..20),
        temperature in prop_oneof![Just(1e-45f32), Just(1e-38), Just(1e-37)],
        top_k in 0usize..5,
        top_p in prop_oneof![Just(1.0f32), 0.01f32..1.0],
        min_p in 0.0f32..1.0,
        penalty in prop_oneof![Just(1.0f32), 0.5f32..2.0],
        seed: u64,
    ) {
        let p = SamplingParams { temperature, top_k, top_p, min_p, repetition_penalty: penalty, seed, ..SamplingParams::default() };
        let greedy = Sampler::new(SamplingParams { temperature: 0.0, ..p.clone() }).sample(&logits, &history);
        let z = effective(&logits, &history, penalty);
        let z_max = z[greedy as usize];
        let tied = z.iter().filter(|&&v| v == z_max).count();
        let mut s = Sampler::new(p);
        for _ in 0..4 {
            let id = s.sample(&logits, &history);
            prop_assert_eq!(z[id as usize], z_max);
            if tied == 1 {
                prop_assert_eq!(id, greedy);
            }
        }
    }
}

/// Draws `n` samples and checks each id's frequency against `want`
/// (exact probabilities) within 5 standard deviations; ids of
/// probability 0 must never appear.
fn check_frequencies(p: SamplingParams, logits: &[f32], history: &[u32], want: &[f64]) {
    let n = 40_000;
    let mut counts = vec![0usize; logits.len()];
    let mut s = Sampler::new(p.clone());
    for _ in 0..n {
        counts[s.sample(logits, history) as usize] += 1;
    }
    for (i, (&c, &q)) in counts.iter().zip(want).enumerate() {
        let f = c as f64 / n as f64;
        let sd = (q * (1.0 - q) / n as f64).sqrt();
        if q == 0.0 {
            assert_eq!(c, 0, "{p:?}: id {i} has probability 0, drawn {c} times");
        } else {
            assert!(
                (f - q).abs() <= 5.0 * sd,
                "{p:?}: id {i} frequency {f}, expected {q}"
            );
        }
    }
}

/// Probabilities 0.4, 0.3, 0.2, 0.1 (logits ln 4, ln 3, ln 2, ln 1 = 0),
/// and what each setting makes of them, computed by hand.
#[test]
fn frequencies_match_hand_computed_distributions() {
    let logits: Vec<f32> = [4.0f64, 3.0, 2.0, 1.0]
        .iter()
        .map(|x| x.ln() as f32)
        .collect();
    let base = SamplingParams {
        temperature: 1.0,
        seed: 7,
        ..SamplingParams::default()
    };
    check_frequencies(base.clone(), &logits, &[], &[0.4, 0.3, 0.2, 0.1]);
    // Top-k 2: 0.4 and 0.3 renormalized.
    let two = [4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0];
    check_frequencies(
        SamplingParams {
            top_k: 2,
            ..base.clone()
        },
        &logits,
        &[],
        &two,
    );
    // Top-p 0.75: 0.4 + 0.3 = 0.7 < 0.75, + 0.2 reaches it: three kept.
    check_frequencies(
        SamplingParams {
            top_p: 0.75,
            ..base.clone()
        },
        &logits,
        &[],
        &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0],
    );
    // Min-p 0.6: keep p >= 0.24.
    check_frequencies(
        SamplingParams {
            min_p: 0.6,
            ..base.clone()
        },
        &logits,
        &[],
        &two,
    );
    // Temperature 2: p ∝ sqrt(4, 3, 2, 1).
    let roots: Vec<f64> = [4.0f64, 3.0, 2.0, 1.0].iter().map(|x| x.sqrt()).collect();
    let sum: f64 = roots.iter().sum();
    let want: Vec<f64> = roots.iter().map(|r| r / sum).collect();
    check_frequencies(
        SamplingParams {
            temperature: 2.0,
            ..base.clone()
        },
        &logits,
        &[],
        &want,
    );
    // Repetition penalty 2 on token 0: ln 4 / 2 = ln 2, so p ∝ (2, 3, 2, 1).
    check_frequencies(
        SamplingParams {
            repetition_penalty: 2.0,
            ..base.clone()
        },
        &logits,
        &[0, 0],
        &[0.25, 0.375, 0.25, 0.125],
    );
    // Two +inf logits: uniform over them, whatever else is there.
    let inf = [1.0, f32::INFINITY, 50.0, f32::INFINITY];
    check_frequencies(base, &inf, &[], &[0.0, 0.5, 0.0, 0.5]);
}

/// The reproducer on a vocabulary-sized row: 1e-38 used to give
/// the last id (49151) through inf / NaN logits.
#[test]
fn tiny_temperature_on_a_full_vocabulary_gives_the_argmax() {
    let vocab = 49152;
    let logits: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0 + if i == 1234 { 30.0 } else { 0.0 })
        .collect();
    let want = argmax(&logits);
    assert_eq!(want, 1234);
    for top_k in [0, 5] {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1e-38,
            top_k,
            ..SamplingParams::default()
        });
        for _ in 0..4 {
            assert_eq!(s.sample(&logits, &[3, 1234]), want);
        }
    }
}

/// After the first token, sampling allocates nothing (greedy never does),
/// whatever the settings and the history.
#[test]
fn sampling_allocates_nothing_after_the_first_token() {
    let vocab = 4096;
    let logits: Vec<f32> = (0..vocab).map(|i| ((i * 31) % 97) as f32 / 10.0).collect();
    let history: Vec<u32> = (0..300).map(|i| (i * 13) % vocab as u32).collect();
    for p in [
        SamplingParams::default(),
        SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.8,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            seed: 3,
            presence_penalty: 0.5,
            frequency_penalty: 0.2,
            logit_bias: vec![(5, 2.0)],
            logprobs: None,
        },
        SamplingParams {
            temperature: 1.5,
            top_p: 0.99,
            ..SamplingParams::default()
        },
    ] {
        let mut s = Sampler::new(p.clone());
        s.sample(&logits, &history);
        let before = alloc_counter::allocations();
        for step in 0..50 {
            s.sample(&logits, &history[..history.len() - step]);
        }
        assert_eq!(
            alloc_counter::allocations(),
            before,
            "{p:?} allocated while sampling"
        );
    }
}

/// The draw itself against a float64 inverse-CDF written here, fed the
/// same uniform (the documented one `gen::<f32>()` of an RNG seeded with
/// `seed_from_u64(seed)`): on vocabulary-sized rows with and without
/// top-p the two pick the same id, except where the float64 target lies
/// within 1e-9 (relative) of a boundary.
#[test]
fn draws_match_a_float64_inverse_cdf() {
    use rand::{Rng, SeedableRng};
    let vocab = 8192;
    let mut checked = 0;
    for seed in 0..300u64 {
        let mut g = rand::rngs::StdRng::seed_from_u64(seed ^ 0xABCD);
        let logits: Vec<f32> = (0..vocab).map(|_| g.gen_range(-12.0f32..8.0)).collect();
        for (temperature, top_p) in [(0.8f32, 1.0f32), (1.0, 1.0), (1.3, 0.9)] {
            let p = SamplingParams {
                temperature,
                top_p,
                seed,
                ..SamplingParams::default()
            };
            let got = Sampler::new(p.clone()).sample(&logits, &[]) as usize;
            let u: f32 = rand::rngs::StdRng::seed_from_u64(seed).gen();
            // Reference: rank, weights in f64, top-p prefix, walk.
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let z_max = logits[order[0]] as f64;
            let w: Vec<f64> = order
                .iter()
                .map(|&i| ((logits[i] as f64 - z_max) / temperature as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut keep = w.len();
            if top_p < 1.0 {
                let mut acc = 0.0;
                for (i, wi) in w.iter().enumerate() {
                    acc += wi / total;
                    if acc >= top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
            }
            let kept: f64 = w[..keep].iter().sum();
            let target = u as f64 * kept;
            let mut acc = 0.0;
            let mut want = order[keep - 1];
            let mut near_boundary = false;
            for (k, wk) in w[..keep].iter().enumerate() {
                acc += wk;
                near_boundary |= (acc - target).abs() <= 1e-9 * kept;
                if acc >= target {
                    want = order[k];
                    break;
                }
            }
            if !near_boundary {
                assert_eq!(got, want, "seed {seed} T {temperature} top_p {top_p}");
                checked += 1;
            }
        }
    }
    assert!(checked > 850, "only {checked} draws compared");
}

/// OpenAI's penalties, hand-computed on logits [5, 4, 3.5, 0]: only
/// generated tokens count (the prompt is the history of the first call),
/// frequency times the count, presence once, bias added.
#[test]
fn presence_frequency_and_bias_follow_openais_formulas() {
    let logits = [5.0f32, 4.0, 3.5, 0.0];
    let prompt = [0u32, 0, 0, 0];
    // The choice after the prompt plus `generated`.
    let greedy = |p: SamplingParams, generated: &[u32]| {
        let mut s = Sampler::new(p);
        s.sample(&logits, &prompt);
        let mut h = prompt.to_vec();
        h.extend_from_slice(generated);
        s.sample(&logits, &h)
    };
    let freq = |f: f32| SamplingParams {
        frequency_penalty: f,
        ..SamplingParams::default()
    };
    // The prompt's four 0s are not penalized.
    assert_eq!(greedy(freq(2.0), &[]), 0);
    // 5 - 0.6 = 4.4 > 4; 5 - 2 * 0.6 = 3.8 < 4.
    assert_eq!(greedy(freq(0.6), &[0]), 0);
    assert_eq!(greedy(freq(0.6), &[0, 0]), 1);
    // 5 - 3 * 0.6 = 3.2 and 4 - 0.6 = 3.4, both below 3.5.
    assert_eq!(greedy(freq(0.6), &[0, 1, 0, 0]), 2);
    let pres = |p: f32| SamplingParams {
        presence_penalty: p,
        ..SamplingParams::default()
    };
    // Once, whatever the count: 5 - 0.9 = 4.1 > 4; 5 - 1.1 = 3.9 < 4.
    assert_eq!(greedy(pres(0.9), &[0, 0, 0, 0, 0]), 0);
    assert_eq!(greedy(pres(1.1), &[0]), 1);
    // Negative penalties reward: 0 + 2 * 2 + 1.5 = 5.5 > 5.
    let both = SamplingParams {
        frequency_penalty: -2.0,
        presence_penalty: -1.5,
        ..SamplingParams::default()
    };
    assert_eq!(greedy(both, &[3, 3]), 3);
    // Bias: 0 + 5.5 > 5; -100 removes the max; ids past the vocabulary
    // are ignored.
    let bias = |b: Vec<(u32, f32)>| SamplingParams {
        logit_bias: b,
        ..SamplingParams::default()
    };
    assert_eq!(greedy(bias(vec![(3, 5.5), (99, 50.0)]), &[]), 3);
    assert_eq!(greedy(bias(vec![(0, -100.0)]), &[]), 1);
    // Everything together, history [0, 0, 0, 0] + generated: token 0 is
    // 5 / 2 = 2.5, minus c * 0.25 + 0.25, plus 1; token 1 is 4 / 2 = 2
    // minus its penalties; token 2 is 3.5 - 1 = 2.5.
    let all = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.25,
        presence_penalty: 0.25,
        logit_bias: vec![(0, 1.0), (2, -1.0)],
        ..SamplingParams::default()
    };
    // c = 1: 3.0 > 2.5.
    assert_eq!(greedy(all.clone(), &[0, 1]), 0);
    // c = 3: 2.5 ties with token 2; the lower id wins.
    assert_eq!(greedy(all.clone(), &[0, 1, 0, 0]), 0);
    // c = 4: 2.25 < 2.5.
    assert_eq!(greedy(all, &[0, 1, 0, 0, 0]), 2);
}

/// The effective logits of OpenAI's penalties written here: repetition
/// penalty once per distinct history id, then `c * frequency + presence`
/// over the generated ids, then the bias (f32, in the documented order).
fn openai_effective(
    logits: &[f32],
    prompt: &[u32],
    generated: &[u32],
    p: &SamplingParams,
) -> Vec<f32> {
    let history: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let mut z = effective(logits, &history, p.repetition_penalty);
    let mut count = std::collections::BTreeMap::new();
    for &t in generated {
        *count.entry(t as usize).or_insert(0usize) += 1;
    }
    for (t, c) in count {
        if t < z.len() {
            z[t] -= c as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
    for &(t, b) in &p.logit_bias {
        if (t as usize) < z.len() {
            z[t as usize] += b;
        }
    }
    z
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Any settings with penalties and bias pick what plain sampling (same
    /// seed, same draws) picks from the logits adjusted by
    /// [`openai_effective`].
    #[test]
    fn penalties_and_bias_equal_plain_sampling_of_adjusted_logits(
        logits in proptest::collection::vec(-20.0f32..20.0, 1..64),
        prompt in proptest::collection::vec(0u32..70, 1..10),
        generated in proptest::collection::vec(0u32..70, 0..20),
        p in params(),
        presence in -2.0f32..2.0,
        frequency in -2.0f32..2.0,
        bias in proptest::collection::vec((0u32..70, -100.0f32..100.0), 0..5),
    ) {
        let mut bias = bias;
        bias.sort_by_key(|b| b.0);
        bias.dedup_by_key(|b| b.0);
        let p = SamplingParams { presence_penalty: presence, frequency_penalty: frequency, logit_bias: bias, ..p };
        let plain = SamplingParams { repetition_penalty: 1.0, ..SamplingParams { seed: p.seed, ..p.clone() } };
        let plain = SamplingParams { presence_penalty: 0.0, frequency_penalty: 0.0, logit_bias: Vec::new(), ..plain };
        let z = openai_effective(&logits, &prompt, &generated, &p);
        let mut s = Sampler::new(p);
        let mut r = Sampler::new(plain);
        // The first call fixes the prompt (and draws once in both).
        s.sample(&logits, &prompt);
        r.sample(&logits, &[]);
        let history: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        prop_assert_eq!(s.sample(&logits, &history), r.sample(&z, &[]));
    }
}

/// Reference log-softmax: float64, log of the sum of exponentials
/// directly (the logits here are small enough not to overflow).
fn log_softmax_f64(logits: &[f32]) -> Vec<f64> {
    let sum: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
    logits.iter().map(|&l| l as f64 - sum.ln()).collect()
}

/// Logprobs against [`log_softmax_f64`]: the chosen token's value and the
/// top k (ids by logit descending, lower id first; values) within 1e-9,
/// with any sampling settings (they are of the raw logits), and none
/// without `logprobs`.
#[test]
fn logprobs_equal_a_float64_log_softmax_of_the_raw_logits() {
    use rand::{Rng, SeedableRng};
    for seed in 0..40u64 {
        let mut g = rand::rngs::StdRng::seed_from_u64(seed);
        let vocab = g.gen_range(1..3000);
        // Few distinct values, so ties occur.
        let logits: Vec<f32> = (0..vocab)
            .map(|_| g.gen_range(-40i32..40) as f32 * 0.25)
            .collect();
        let want = log_softmax_f64(&logits);
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        for k in [0usize, 1, 5, 20] {
            let p = SamplingParams {
                temperature: if seed % 2 == 0 { 0.0 } else { 0.9 },
                repetition_penalty: 1.3,
                presence_penalty: 1.0,
                logit_bias: vec![(0, 30.0)],
                logprobs: Some(k),
                seed,
                ..SamplingParams::default()
            };
            let mut s = Sampler::new(p);
            let id = s.sample(&logits, &[1, 2, 3]);
            let lp = s.take_logprobs().expect("logprobs were asked for");
            assert!((lp.logprob - want[id as usize]).abs() < 1e-9, "seed {seed}");
            assert_eq!(lp.top.len(), k.min(vocab));
            for (&(tid, v), &o) in lp.top.iter().zip(&order) {
                assert_eq!(tid as usize, o, "seed {seed} k {k}");
                assert!((v - want[o]).abs() < 1e-9, "seed {seed} k {k}");
            }
            assert!(s.take_logprobs().is_none());
        }
    }
    let mut s = Sampler::new(SamplingParams::default());
    s.sample(&[1.0, 2.0], &[]);
    assert!(s.take_logprobs().is_none());
    // +inf shares the mass; NaN has none and is never listed.
    let mut s = Sampler::new(SamplingParams {
        logprobs: Some(3),
        ..SamplingParams::default()
    });
    s.sample(&[f32::INFINITY, f32::NAN, f32::INFINITY, 1.0], &[]);
    let lp = s.take_logprobs().unwrap();
    assert_eq!(lp.logprob, -(2f64.ln()));
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 2, 3]);
    assert_eq!(lp.top[2].1, f64::NEG_INFINITY);
}
