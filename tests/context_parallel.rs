//! Context-parallel generation on threads (`te generate --context-parallel
//! N`): the reference greedy tokens at 3 and 4 ranks (Qwen2.5-Coder 0.5B
//! at 4), the tokens of one
//! rank on prompts longer than Gemma 3's sliding window and than one
//! prefill chunk, last-position logits within 1e-4 of one rank, a prompt
//! whose KV cache does not fit one rank, and a rank that fails mid-run.

mod common;

use std::time::{Duration, Instant};

use common::*;
use te_cache::CacheLayout;
use te_engine::{Engine, EngineConfig, Request};
use te_models::context_parallel::ContextParallel;
use te_models::layer::Workspace;
use te_models::loader::LoadedModel;
use te_models::model::{Logits, Model};
use te_ring::{Communicator, ThreadComm};

/// A text of about 1300 tokens, sentences repeated in a scrambled order.
fn long_text() -> String {
    const SENTENCES: &[&str] = &[
        "The river ran quietly past the old mill, where the miller's daughter kept a ledger.",
        "In 1887 the town council voted to build a library on the hill.",
        "Photosynthesis converts light energy into chemical energy stored in glucose.",
        "She opened the letter slowly, afraid of what the second page might say.",
        "A binary search halves the interval at every step.",
        "Mountains to the north kept the valley warm in winter and dry in summer.",
        "Every morning the baker lit the ovens before the sun rose over the harbour.",
    ];
    (0..100)
        .map(|i: usize| SENTENCES[(i * 5 + i / 7) % SENTENCES.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn load(model: &str) -> LoadedModel {
    let source = te_models::source::resolve_model(model).expect("run `cargo xtask fetch-models`");
    te_models::loader::load_model(&source).unwrap()
}

#[test]
fn smollm2_reference_tokens_on_4_and_3_ranks() {
    check_greedy_batched_with("smollm2-135m", &["--context-parallel", "4"]);
    check_greedy_batched_with("smollm2-135m", &["--context-parallel", "3"]);
}

#[test]
fn gemma3_reference_tokens_on_4_and_3_ranks() {
    check_greedy_batched_with("gemma3-270m", &["--context-parallel", "4"]);
    check_greedy_batched_with("gemma3-270m", &["--context-parallel", "3"]);
}

/// Qwen2 (q/k/v biases) on 4 ranks: every reference prompt, the
/// 1,020-token one among them, gives the float64 reference's tokens.
#[test]
fn qwen25_coder_reference_tokens_on_4_ranks() {
    check_greedy_batched_with("qwen2.5-coder-0.5b", &["--context-parallel", "4"]);
}

/// Prompts longer than one 512-token prefill chunk (and, on Gemma 3, than
/// its 512-token window), with a short one beside them: the tokens of one
/// rank.
fn long_prompts_match_one_rank(model: &str) {
    let text = long_text();
    let words: Vec<&str> = text.split(' ').collect();
    let long = words[..words.len() * 3 / 4].join(" ");
    let prompts = [long.as_str(), text.as_str(), "The capital of France is"];
    let run = |cp: &str| {
        te_json(&generate_args(
            model,
            "12",
            &["--context-parallel", cp],
            prompts,
        ))
    };
    let one = run("1");
    assert!(ids(&one[1]["prompt_tokens"]).len() > 1100, "a long prompt");
    let four = run("4");
    for (a, b) in one.iter().zip(&four) {
        assert_eq!(
            ids(&a["tokens"]),
            ids(&b["tokens"]),
            "{model}, prompt {}",
            a["prompt"]
        );
    }
}

#[test]
fn smollm2_long_prompts_match_one_rank() {
    long_prompts_match_one_rank("smollm2-135m");
}

#[test]
fn gemma3_long_prompts_match_one_rank() {
    long_prompts_match_one_rank("gemma3-270m");
}

/// A step: `(seq_id, tokens)` of each sequence, and the tokens.
type Step = (Vec<(u64, usize)>, Vec<u32>);

/// Logits of two prefill chunks and a decode step of two sequences on one
/// rank and on `cp` ranks (threads).
fn logits_match_one_rank(model: &Model, prompts: &[Vec<u32>], cp: usize) {
    // Steps: the first 300 tokens of each prompt, the rest, one more.
    let mut steps: Vec<Step> = Vec::new();
    let cut: Vec<usize> = prompts.iter().map(|p| p.len().min(300)).collect();
    let step = |ranges: Vec<(usize, std::ops::Range<usize>)>| {
        let lens = ranges.iter().map(|(s, r)| (*s as u64, r.len())).collect();
        let toks = ranges
            .iter()
            .flat_map(|(s, r)| prompts[*s][r.clone()].to_vec())
            .collect();
        (lens, toks)
    };
    steps.push(step((0..prompts.len()).map(|s| (s, 0..cut[s])).collect()));
    let rest: Vec<_> = (0..prompts.len())
        .filter(|&s| cut[s] < prompts[s].len())
        .map(|s| (s, cut[s]..prompts[s].len()))
        .collect();
    if !rest.is_empty() {
        steps.push(step(rest));
    }
    let decode: Vec<(u64, usize)> = (0..prompts.len()).map(|s| (s as u64, 1)).collect();
    steps.push((decode, vec![42; prompts.len()]));

    let cache = || {
        model
            .new_cache(
                4,
                model.config.max_position_embeddings.min(4096),
                512,
                CacheLayout::Paged {
                    page_size: 16,
                    total_num_pages: 1024,
                },
            )
            .unwrap()
    };
    let mut single = Vec::new();
    let (mut c, mut ws) = (cache(), Workspace::default());
    for (lens, toks) in &steps {
        c.pre_step(lens).unwrap();
        single.push(
            model
                .forward_with(toks, &mut c, Logits::Last, &mut ws)
                .unwrap()
                .to_vec(),
        );
    }
    let ranks: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::ring(cp)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let (steps, cache) = (&steps, &cache);
                s.spawn(move || {
                    let mut cp = ContextParallel::new(Box::new(comm)).unwrap();
                    let (mut c, mut ws) = (cache(), Workspace::default());
                    let mut out = Vec::new();
                    for (lens, toks) in steps {
                        let placed = cp.place(lens);
                        c.pre_step_shard(&cp.local_steps(&placed)).unwrap();
                        cp.commit(placed);
                        let l = model.forward_context_parallel(toks, &mut c, &mut cp, &mut ws);
                        out.push(l.unwrap().to_vec());
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, logits) in ranks.iter().enumerate() {
        // Every rank has the same logits, bit for bit.
        assert_eq!(logits, &ranks[0], "rank {r}");
    }
    for (i, (a, b)) in single.iter().zip(&ranks[0]).enumerate() {
        // Within 1e-4 of the logit's size (at least 1): the merge of
        // partial softmaxes rounds differently from one pass.
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
            .fold(0f32, f32::max);
        let top = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        eprintln!("step {i}, {cp} ranks: worst relative difference {worst:e}, largest logit {top}");
        assert!(
            worst <= 1e-4,
            "step {i}, {cp} ranks: logits differ by {worst} relative"
        );
    }
}

#[test]
fn last_position_logits_within_1e_4_of_one_rank() {
    for name in ["smollm2-135m", "gemma3-270m"] {
        let loaded = load(name);
        let text = loaded.tokenizer.encode(&long_text(), true).unwrap();
        // Gemma 3: 700 tokens pass its 512-token window.
        let prompts = vec![text[..700].to_vec(), text[100..140].to_vec()];
        logits_match_one_rank(&loaded.model, &prompts, 4);
        logits_match_one_rank(&loaded.model, &prompts, 3);
    }
}

/// The tiny members of the newer families (q/k/v biases, YaRN and a
/// window on Qwen2; q/k norms on Qwen3; a window on every Mistral layer)
/// on 3 and 4 ranks: last-position logits within 1e-4 of one rank.
#[test]
fn tiny_families_logits_within_1e_4_of_one_rank() {
    for name in [
        "random:tiny-qwen2",
        "random:tiny-qwen3",
        "random:tiny-mistral",
    ] {
        let loaded = load(name);
        // tiny-qwen2 holds 32 positions; both prompts pass every window.
        let text = loaded.tokenizer.encode(&long_text(), true).unwrap();
        let prompts = vec![text[..24].to_vec(), text[30..40].to_vec()];
        logits_match_one_rank(&loaded.model, &prompts, 4);
        logits_match_one_rank(&loaded.model, &prompts, 3);
    }
}

/// A prompt whose KV cache needs more than one rank's pool: 4 ranks
/// generate it with the tokens of an unconstrained rank, each holding
/// about a quarter.
#[test]
fn a_prompt_too_long_for_one_rank_runs_on_four() {
    let text = long_text();
    let model = "smollm2-135m";
    let base = generate_args(model, "16", &[], [text.as_str()]);
    let one = te_json(&base);
    let n = ids(&one[0]["prompt_tokens"]).len();
    assert!(n > 1100, "{n} prompt tokens");
    // One rank of 512 tokens cannot hold it.
    let mut small = base.clone();
    small.extend(["--kv-cache-tokens", "512"]);
    let (ok, _, stderr) = te(&small);
    assert!(!ok, "a prompt of {n} tokens fit 512: {stderr}");
    small.extend(["--context-parallel", "4", "--stats"]);
    let (ok, stdout, stderr) = te(&small);
    assert!(ok, "{stderr}");
    let four: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(ids(&four["tokens"]), ids(&one[0]["tokens"]));
    let stats: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap()).unwrap();
    let per_rank: Vec<f64> = stats["kv_tokens_per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    // Prompt and generated tokens but the last one are cached somewhere.
    let total = (n + 15) as f64;
    assert_eq!(per_rank.iter().sum::<f64>(), total, "{per_rank:?}");
    for (r, &k) in per_rank.iter().enumerate() {
        assert!(
            (k - total / 4.0).abs() <= 0.1 * total / 4.0,
            "rank {r} held {k} of {total}"
        );
    }
}

/// Rank 1 of 3 stops after a few steps (its engine and ring end): every
/// other rank's next step fails within 10 s, naming rank 1.
#[test]
fn a_rank_that_fails_mid_run_stops_the_others_naming_it() {
    let loaded = load("smollm2-135m");
    let prompt = loaded.tokenizer.encode(&long_text(), true).unwrap()[..200].to_vec();
    let results: Vec<(Result<(), String>, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::ring(3)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let (loaded, prompt) = (&loaded, &prompt);
                s.spawn(move || {
                    let rank = comm.cp_rank();
                    let result = (|| {
                        let cp = ContextParallel::new(Box::new(comm)).unwrap();
                        let mut engine = Engine::with_context_parallel(
                            &loaded.model,
                            None,
                            EngineConfig::default(),
                            cp,
                        )
                        .map_err(|e| e.to_string())?;
                        engine
                            .add_request(Request::new(prompt.clone(), 64))
                            .unwrap();
                        let mut steps = 0;
                        while engine.has_work() {
                            if rank == 1 && steps == 3 {
                                return Err("rank 1 stops".to_string());
                            }
                            engine.step().map_err(|e| e.to_string())?;
                            steps += 1;
                        }
                        Ok(())
                    })();
                    (result, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stopped = results[1].1;
    for (r, (result, at)) in results.iter().enumerate() {
        let err = result.as_ref().expect_err("every rank fails");
        if r != 1 {
            assert!(err.contains("rank 1"), "rank {r}: {err}");
            let after = at.saturating_duration_since(stopped);
            assert!(
                after < Duration::from_secs(10),
                "rank {r} failed {after:?} later"
            );
        }
    }
}

/// Ranks given different prompts fail at the first step, every one of
/// them, saying that the ranks disagree.
#[test]
fn ranks_with_different_prompts_fail_at_the_first_step() {
    let loaded = load("smollm2-135m");
    let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadComm::ring(2)
            .unwrap()
            .into_iter()
            .map(|comm| {
                let loaded = &loaded;
                s.spawn(move || {
                    let rank = comm.cp_rank();
                    let cp = ContextParallel::new(Box::new(comm)).unwrap();
                    let mut engine = Engine::with_context_parallel(
                        &loaded.model,
                        None,
                        EngineConfig::default(),
                        cp,
                    )
                    .map_err(|e| e.to_string())?;
                    let prompt = loaded
                        .tokenizer
                        .encode(
                            if rank == 0 {
                                "Hello there"
                            } else {
                                "Goodbye now"
                            },
                            true,
                        )
                        .unwrap();
                    engine.add_request(Request::new(prompt, 8)).unwrap();
                    let mut steps = 0;
                    while engine.has_work() {
                        engine.step().map_err(|e| e.to_string())?;
                        steps += 1;
                    }
                    Ok(steps)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, result) in results.iter().enumerate() {
        let err = result.as_ref().expect_err("the ranks disagree");
        assert!(
            err.contains("other settings") || err.contains("failed"),
            "rank {r}: {err}"
        );
    }
    assert!(
        results
            .iter()
            .any(|r| r.as_ref().unwrap_err().contains("generation step")),
        "{results:?}"
    );
}
