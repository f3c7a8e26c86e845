//! Speculative decoding by prompt lookup on tiny random models
//! (`te_models::random` presets):
//!
//! - greedy requests give exactly the tokens and finish reasons of plain
//!   decoding, alone and batched, with a KV pool small enough to preempt,
//!   on full-attention and sliding-window (ring) models, with drafts that
//!   are mostly rejected and drafts that are mostly accepted;
//! - sampled requests keep the distribution: a chi-square test of the
//!   first three tokens' joint frequencies over many seeds cannot tell
//!   speculative from plain decoding at the 1% level, while the same test
//!   rejects a deliberately wrong acceptance rule (the test of the test),
//!   and accepts the textbook rule (`min(1, p/q)`, normalised residual)
//!   computed here independently in f64 from the model's logits.

use std::collections::{BTreeMap, HashMap};

use rand::{Rng, SeedableRng};
use te_cache::CacheLayout;
use te_engine::sampling::SamplingParams;
use te_engine::speculative::{lookup, DraftSource, SpeculativeConfig};
use te_engine::{Engine, EngineConfig, EngineStats, Event, FinishReason, Request};
use te_models::loader::{load_model, LoadedModel};
use te_models::model::Logits;
use te_models::source::resolve_model;

fn load(preset: &str) -> LoadedModel {
    load_model(&resolve_model(&format!("random:{preset}")).unwrap()).unwrap()
}

type Outputs = BTreeMap<u64, (Vec<u32>, Option<FinishReason>)>;

/// Runs `requests` to completion; tokens and finish reasons by id, and the
/// engine's counters.
fn run(model: &LoadedModel, config: EngineConfig, requests: &[Request]) -> (Outputs, EngineStats) {
    let engine = Engine::new(&model.model, Some(&model.tokenizer), config).unwrap();
    drain(engine, requests)
}

/// Runs `requests` to completion on `engine`; tokens and finish reasons
/// by id, and the engine's counters.
fn drain(mut engine: Engine<'_>, requests: &[Request]) -> (Outputs, EngineStats) {
    for r in requests {
        engine.add_request(r.clone()).unwrap();
    }
    let mut out = Outputs::new();
    engine
        .run_to_completion(|e| match e {
            Event::Token { id, token, .. } => out.entry(id).or_default().0.push(token),
            Event::Finished { id, reason, .. } => out.entry(id).or_default().1 = Some(reason),
        })
        .unwrap();
    (out, engine.stats().clone())
}

/// A prompt of `len` tokens from a small alphabet (so that n-grams recur
/// and lookups find drafts), a function of `seed`.
fn prompt(seed: u64, len: usize, alphabet: u32) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| 3 + rng.gen_range(0..alphabet)).collect()
}

/// Greedy speculative decoding gives plain greedy decoding's tokens and
/// finish reasons: each preset, alone and batched by 8 with a pool that
/// forces preemption, fixed and adaptive draft lengths.
#[test]
fn greedy_tokens_are_bit_identical_to_plain_decoding() {
    // tiny-gemma2 and tiny-gemma3 have sliding-window (ring) layers.
    for preset in ["tiny-llama", "tiny-gemma2", "tiny-gemma3"] {
        let model = load(preset);
        let mut requests: Vec<Request> = (0..8)
            .map(|i| Request {
                ignore_eos: i % 2 == 0,
                ..Request::new(prompt(i, 20 + 7 * i as usize, 6), 40)
            })
            .collect();
        // A stop string inside what a draft may accept.
        requests[3].stop = vec!["a".into()];
        requests[3].skip_special_tokens = false;
        for (batch, kv) in [(1, None), (8, None), (8, Some(160))] {
            let base = EngineConfig {
                max_batch_size: batch,
                page_size: 8,
                kv_cache_tokens: kv,
                prefill_chunk: 16,
                ..EngineConfig::default()
            };
            let (plain, plain_stats) = run(&model, base.clone(), &requests);
            for draft_max in [None, Some(2), Some(6)] {
                let config = EngineConfig {
                    speculative: Some(SpeculativeConfig {
                        draft_max,
                        ..SpeculativeConfig::ngram(1)
                    }),
                    ..base.clone()
                };
                let (spec, stats) = run(&model, config, &requests);
                let what = format!("{preset} batch {batch} kv {kv:?} draft_max {draft_max:?}");
                assert_eq!(spec, plain, "{what}");
                assert!(stats.verifications > 0, "{what}: nothing was drafted");
                if draft_max.is_some() {
                    assert!(stats.accepted_tokens > 0, "{what}: nothing was accepted");
                }
                if kv.is_some() {
                    assert!(
                        plain_stats.preemptions > 0 && stats.preemptions > 0,
                        "{what}"
                    );
                }
                assert_eq!(
                    stats.generated_tokens, plain_stats.generated_tokens,
                    "{what}"
                );
            }
        }
    }
}

/// A model that repeats itself (tiny-gemma's greedy chain settles on one
/// token): continuing 120 tokens of the chain, lookups propose what the
/// model will say and drafts are accepted at length; the output is still
/// plain greedy's (the rest of the chain).
#[test]
fn accepted_drafts_give_the_same_tokens() {
    let model = load("tiny-gemma");
    let start = prompt(9, 12, 40);
    let (chain, _) = run(
        &model,
        EngineConfig::default(),
        &[Request {
            ignore_eos: true,
            ..Request::new(start.clone(), 160)
        }],
    );
    let chain = &chain[&0].0;
    let requests = [Request {
        ignore_eos: true,
        ..Request::new([&start[..], &chain[..120]].concat(), 40)
    }];
    let config = EngineConfig {
        speculative: Some(SpeculativeConfig::ngram(3)),
        ..EngineConfig::default()
    };
    let (spec, stats) = run(&model, config, &requests);
    assert_eq!(spec[&0].0, chain[120..]);
    assert!(
        stats.acceptance_rate() > 0.8 && stats.mean_accepted_length() > 2.0,
        "{stats:?}"
    );
}

/// The sampling settings of the distribution test: three candidates per
/// position, so that the joint law of three tokens has few cells.
fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 3,
        seed,
        ..SamplingParams::default()
    }
}

/// Joint frequencies of the first three generated tokens.
type Counts = HashMap<[u32; 3], usize>;

fn engine_counts(
    model: &LoadedModel,
    prompt: &[u32],
    seeds: std::ops::Range<u64>,
    speculative: bool,
) -> (Counts, EngineStats) {
    let requests: Vec<Request> = seeds
        .map(|s| Request {
            sampling: sampling(s),
            ignore_eos: true,
            ..Request::new(prompt.to_vec(), 3)
        })
        .collect();
    let config = EngineConfig {
        max_batch_size: 64,
        // The prompt but its last token in one chunk, so that the first
        // generated token is drafted and verified too (no prefix hits to
        // move the chunk).
        prefill_chunk: prompt.len() - 1,
        max_step_tokens: 64 * prompt.len(),
        prefix_caching: false,
        // A fixed length: the adaptive one rarely drafts at batch 64.
        speculative: speculative.then(|| SpeculativeConfig {
            draft_max: Some(2),
            ..SpeculativeConfig::ngram(1)
        }),
        ..EngineConfig::default()
    };
    let (out, stats) = run(model, config, &requests);
    let mut counts = Counts::new();
    for (tokens, _) in out.values() {
        *counts.entry([tokens[0], tokens[1], tokens[2]]).or_default() += 1;
    }
    (counts, stats)
}

/// Whether two samples of equal size look drawn from the same law: the
/// chi-square homogeneity statistic `sum (a - b)^2 / (a + b)` over cells
/// (cells with fewer than 10 draws together pooled into one) against the
/// 1% critical value (Wilson-Hilferty approximation). Returns the
/// statistic and the critical value.
fn chi_square(a: &Counts, b: &Counts) -> (f64, f64) {
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let (mut rest_a, mut rest_b) = (0.0, 0.0);
    let keys: std::collections::BTreeSet<_> = a.keys().chain(b.keys()).collect();
    for k in keys {
        let (x, y) = (
            a.get(k).copied().unwrap_or(0) as f64,
            b.get(k).copied().unwrap_or(0) as f64,
        );
        if x + y >= 10.0 {
            cells.push((x, y));
        } else {
            rest_a += x;
            rest_b += y;
        }
    }
    if rest_a + rest_b > 0.0 {
        cells.push((rest_a, rest_b));
    }
    let stat: f64 = cells.iter().map(|(x, y)| (x - y).powi(2) / (x + y)).sum();
    let df = (cells.len() - 1) as f64;
    let z = 2.326_347_874; // the 99% normal quantile
    let h = 2.0 / (9.0 * df);
    (stat, df * (1.0 - h + z * h.sqrt()).powi(3))
}

/// The model's sampling law `p` (top-3 at temperature 1, in f64) after
/// `tokens`, from a plain forward of the whole sequence.
struct Law<'a> {
    model: &'a LoadedModel,
    memo: HashMap<Vec<u32>, Vec<(u32, f64)>>,
}

impl Law<'_> {
    fn p(&mut self, tokens: &[u32]) -> Vec<(u32, f64)> {
        if let Some(p) = self.memo.get(tokens) {
            return p.clone();
        }
        let m = &self.model.model;
        let mut cache = m
            .new_cache(1, tokens.len(), tokens.len(), CacheLayout::Contiguous)
            .unwrap();
        cache.pre_step(&[(0, tokens.len())]).unwrap();
        let logits = m.forward(tokens, &mut cache, Logits::Last).unwrap();
        let mut ranked: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l as f64))
            .collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(3);
        let max = ranked[0].1;
        let total: f64 = ranked.iter().map(|(_, l)| (l - max).exp()).sum();
        let p: Vec<(u32, f64)> = ranked
            .iter()
            .map(|&(id, l)| (id, (l - max).exp() / total))
            .collect();
        self.memo.insert(tokens.to_vec(), p.clone());
        p
    }
}

/// One draw from weights `w` (any scale) by `u` in [0, 1).
fn draw(w: &[(u32, f64)], u: f64) -> u32 {
    let total: f64 = w.iter().map(|x| x.1).sum();
    let mut acc = 0.0;
    for &(id, x) in w {
        acc += x;
        if acc > u * total {
            return id;
        }
    }
    w.last().unwrap().0
}

/// An acceptance rule for a point-mass draft `x` under the law `p`.
type Rule = fn(&[(u32, f64)], u32, &mut rand::rngs::StdRng) -> u32;

/// The textbook rule: accept with `min(1, p(x) / q(x)) = p(x)`, else draw
/// from the normalised residual `max(0, p - q)`.
fn textbook(p: &[(u32, f64)], x: u32, rng: &mut rand::rngs::StdRng) -> u32 {
    let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1);
    if rng.gen::<f64>() < px.min(1.0) {
        return x;
    }
    let residual: Vec<(u32, f64)> = p.iter().filter(|e| e.0 != x).copied().collect();
    draw(&residual, rng.gen())
}

/// A wrong rule: on rejection it draws from `p` itself, not the residual
/// (so `x` is too likely).
fn wrong(p: &[(u32, f64)], x: u32, rng: &mut rand::rngs::StdRng) -> u32 {
    let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1);
    if rng.gen::<f64>() < px.min(1.0) {
        return x;
    }
    draw(p, rng.gen())
}

/// First three tokens of `n` chains sampled here from `p`, drafting as
/// the engine does (prompt lookup of 1-grams, at most 2 tokens and the
/// room left before the third token) and verifying each drafted token by
/// `rule`; after a fully accepted draft the next token is drawn from `p`.
fn rule_counts(law: &mut Law<'_>, prompt: &[u32], n: u64, rule: Rule) -> Counts {
    let mut counts = Counts::new();
    for s in 0..n {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1_000_000 + s);
        let mut t = prompt.to_vec();
        while t.len() < prompt.len() + 3 {
            let room = prompt.len() + 3 - t.len() - 1;
            let draft = lookup(&t, 1, room.min(2));
            let mut all_accepted = true;
            for x in draft {
                let p = law.p(&t);
                let y = rule(&p, x, &mut rng);
                t.push(y);
                if y != x {
                    all_accepted = false;
                    break;
                }
            }
            if all_accepted {
                let p = law.p(&t);
                t.push(draw(&p, rng.gen()));
            }
        }
        let k = prompt.len();
        *counts.entry([t[k], t[k + 1], t[k + 2]]).or_default() += 1;
    }
    counts
}

#[test]
fn sampling_keeps_the_distribution() {
    const N: u64 = 4000;
    let model = load("tiny-llama");
    // A prompt `base y z 20 21 y` whose lookup drafts `z` for the first
    // token, `z` the model's likeliest token there (a fixed point,
    // searched), so that drafts are often right and a wrong rule shows.
    let mut law = Law {
        model: &model,
        memo: HashMap::new(),
    };
    let (base, y) = (vec![5, 6, 7, 8, 9, 10], 11);
    let mut z = 12;
    let p = loop {
        let p: Vec<u32> = [&base[..], &[y, z, 20, 21, y]].concat();
        let best = law.p(&p)[0].0;
        if best == z {
            break p;
        }
        z = best;
    };
    let (plain, _) = engine_counts(&model, &p, 0..N, false);
    let (spec, stats) = engine_counts(&model, &p, N..2 * N, true);
    assert!(
        stats.verifications as u64 >= N && stats.accepted_tokens as u64 > N / 4,
        "drafts too rare for the test to have power: {stats:?}"
    );
    let (stat, crit) = chi_square(&plain, &spec);
    eprintln!("speculative vs plain: chi2 {stat:.1}, 1% critical value {crit:.1}; {stats:?}");
    assert!(
        stat < crit,
        "speculative vs plain: chi2 {stat:.1} >= {crit:.1}"
    );
    // The test of the test: the same statistic tells a wrong rule apart,
    // and not the textbook rule computed independently here.
    let (stat, crit) = chi_square(&plain, &rule_counts(&mut law, &p, N, textbook));
    assert!(
        stat < crit,
        "textbook rule vs plain: chi2 {stat:.1} >= {crit:.1}"
    );
    let (stat, crit) = chi_square(&plain, &rule_counts(&mut law, &p, N, wrong));
    eprintln!("wrong rule vs plain: chi2 {stat:.1}, 1% critical value {crit:.1}");
    assert!(
        stat >= crit,
        "the wrong rule passed: chi2 {stat:.1} < {crit:.1}"
    );
}

/// A draft model (`DraftSource::Model`): greedy and seeded sampled
/// requests give plain decoding's tokens (its drafts are its greedy
/// tokens, a point-mass proposal, so each position's pick is the plain
/// sampler's), with a poor draft (another random model of the same
/// vocabulary) and a perfect one (the target itself), batched by 8 in a
/// pool that preempts.
#[test]
fn draft_model_tokens_are_plain_decodings() {
    let target = load("tiny-llama");
    let other = load_model(&resolve_model("random:tiny-llama?seed=7").unwrap()).unwrap();
    let mut requests: Vec<Request> = (0..8)
        .map(|i| Request {
            ignore_eos: true,
            ..Request::new(prompt(i, 20 + 5 * i as usize, 6), 30)
        })
        .collect();
    for r in &mut requests[4..] {
        r.sampling = sampling(r.prompt_tokens.len() as u64);
    }
    let base = EngineConfig {
        max_batch_size: 8,
        page_size: 8,
        kv_cache_tokens: Some(200),
        prefill_chunk: 16,
        ..EngineConfig::default()
    };
    let (plain, plain_stats) = run(&target, base.clone(), &requests);
    assert!(plain_stats.preemptions > 0);
    for (draft, name) in [(&other, "random draft"), (&target, "the target itself")] {
        let config = EngineConfig {
            speculative: Some(SpeculativeConfig {
                source: DraftSource::Model,
                draft_max: Some(3),
                draft_min: 1,
            }),
            ..base.clone()
        };
        let engine = Engine::with_draft_model(
            &target.model,
            Some(&target.tokenizer),
            config,
            &draft.model,
            Some(1000),
        )
        .unwrap();
        let (out, stats) = drain(engine, &requests);
        assert_eq!(out, plain, "{name}");
        assert!(stats.verifications > 0, "{name}: {stats:?}");
        if name == "the target itself" {
            assert!(
                stats.verifications > 40 && stats.acceptance_rate() > 0.4,
                "{name}: {stats:?}"
            );
        }
    }
}

/// Prompts that share a prefix share its pages in the draft model's cache
/// too (within a `cache_salt`): with the target drafting for itself, every
/// greedy draft is its own next token, so a wrong shared page would show
/// as a rejected draft; the tokens are plain decoding's.
#[test]
fn draft_model_shares_prompt_prefixes_exactly() {
    let target = load("tiny-llama");
    let stem = prompt(99, 21, 6);
    let requests: Vec<Request> = (0..6)
        .map(|i| {
            let mut p = stem.clone();
            p.extend(prompt(i, 3 + i as usize, 6));
            Request {
                ignore_eos: true,
                cache_salt: (i % 2 == 1).then(|| b"salt".to_vec()),
                ..Request::new(p, 12)
            }
        })
        .collect();
    let base = EngineConfig {
        max_batch_size: 6,
        page_size: 4,
        prefill_chunk: 16,
        ..EngineConfig::default()
    };
    let (plain, plain_stats) = run(&target, base.clone(), &requests);
    assert!(plain_stats.prefix_hit_tokens > 0, "{plain_stats:?}");
    let config = EngineConfig {
        speculative: Some(SpeculativeConfig {
            source: DraftSource::Model,
            draft_max: Some(3),
            draft_min: 1,
        }),
        ..base
    };
    let engine = Engine::with_draft_model(
        &target.model,
        Some(&target.tokenizer),
        config,
        &target.model,
        None,
    )
    .unwrap();
    let (out, stats) = drain(engine, &requests);
    assert_eq!(out, plain);
    assert!(
        stats.verifications > 0 && stats.acceptance_rate() == 1.0,
        "{stats:?}"
    );
}
