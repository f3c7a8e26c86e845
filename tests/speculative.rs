//! Speculative decoding by prompt lookup (`--draft-ngram`) on a real
//! model: greedy tokens equal the reference tokens of
//! `tests/refs/smollm2-135m/greedy.jsonl` (an independent float64
//! forward) for every prompt, alone and batched with other requests in a
//! KV pool small enough to preempt, with a fixed and the adaptive draft
//! length; `--stats` reports the draft counters. Qwen2.5-Coder 0.5B's
//! reference prompts (one of 1,020 tokens) batched with drafts likewise.

mod common;

use common::*;
use serde_json::Value;

const MODEL: &str = "smollm2-135m";

/// Runs `te generate --json --stats`; the output lines and the stats.
fn generate_with_stats(args: &[&str]) -> (Vec<Value>, Value) {
    let mut args = args.to_vec();
    args.push("--stats");
    let (ok, stdout, stderr) = te(&args);
    assert!(ok, "te {args:?} failed:\n{stderr}");
    let outs = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let stats = serde_json::from_str(stderr.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("--stats line: {e}\n{stderr}"));
    (outs, stats)
}

const FIXED: &[&str] = &["--draft-ngram", "1", "--draft-max", "4"];
const ADAPTIVE: &[&str] = &["--draft-ngram", "2"];

#[test]
fn greedy_tokens_match_reference_alone_with_drafts() {
    for draft in [FIXED, ADAPTIVE] {
        let mut drafted = 0;
        for line in read_jsonl(MODEL, "greedy.jsonl") {
            let prompt = line["prompt"].as_str().unwrap();
            let (out, stats) = generate_with_stats(&generate_args(MODEL, "32", draft, [prompt]));
            assert_eq!(
                ids(&out[0]["tokens"]),
                ids(&line["tokens"]),
                "{draft:?} prompt {prompt:?}"
            );
            drafted += stats["draft_tokens"].as_u64().unwrap();
        }
        assert!(drafted > 0, "{draft:?}: nothing was drafted");
    }
}

/// The reference prompts and three more (8 requests) in a pool of 128
/// tokens: sequences are preempted and recomputed, drafts verified beside
/// other sequences' prefill and decode; every reference prompt still gets
/// its reference tokens, and the others their plain tokens.
#[test]
fn greedy_tokens_match_reference_batched_and_preempted() {
    let lines = read_jsonl(MODEL, "greedy.jsonl");
    let mut prompts: Vec<&str> = lines
        .iter()
        .map(|l| l["prompt"].as_str().unwrap())
        .collect();
    prompts.extend([
        "def add(a, b):\n    return a + b\n\ndef add(a, b):",
        "1, 2, 3, 4, 5, 6, 7, 8,",
        "The cat sat on the mat. The cat sat on the",
    ]);
    let small = ["--max-batch-size", "8", "--kv-cache-tokens", "128"];
    let plain_args = generate_args(MODEL, "32", &small, prompts.iter().copied());
    let (plain, plain_stats) = generate_with_stats(&plain_args);
    for draft in [FIXED, ADAPTIVE] {
        let mut args = plain_args.clone();
        args.extend_from_slice(draft);
        let (out, stats) = generate_with_stats(&args);
        assert_eq!(out.len(), 8);
        for (o, line) in out.iter().zip(&lines) {
            assert_eq!(
                ids(&o["tokens"]),
                ids(&line["tokens"]),
                "{draft:?} prompt {}",
                line["prompt"]
            );
        }
        for (o, p) in out.iter().zip(&plain).skip(lines.len()) {
            assert_eq!(o["tokens"], p["tokens"], "{draft:?} prompt {}", p["prompt"]);
            assert_eq!(o["text"], p["text"]);
        }
        assert!(
            stats["preemptions"].as_u64().unwrap() > 0,
            "no preemption: {stats}"
        );
        for key in [
            "draft_tokens",
            "accepted_tokens",
            "acceptance_rate",
            "mean_accepted_length",
        ] {
            assert!(stats.get(key).is_some(), "--stats lacks {key}: {stats}");
        }
        assert!(stats["accepted_tokens"].as_u64().unwrap() > 0, "{stats}");
        assert_eq!(stats["generated_tokens"], plain_stats["generated_tokens"]);
    }
    assert!(plain_stats.get("draft_tokens").is_none());
}

#[test]
fn qwen_greedy_tokens_match_reference_batched_with_drafts() {
    check_greedy_batched_with("qwen2.5-coder-0.5b", FIXED);
}

/// `--model-draft`: SmolLM2 drafting for itself (its drafts are then
/// mostly accepted) gives the reference tokens batched with preemption; a
/// draft model of another vocabulary is refused at load, naming it.
#[test]
fn draft_model_gives_the_reference_tokens_and_other_vocabularies_are_refused() {
    let lines = read_jsonl(MODEL, "greedy.jsonl");
    let prompts = lines.iter().map(|l| l["prompt"].as_str().unwrap());
    let extra = [
        "--model-draft",
        MODEL,
        "--draft-max",
        "3",
        "--kv-cache-tokens",
        "96",
        "--kv-cache-tokens-draft",
        "512",
    ];
    let (out, stats) = generate_with_stats(&generate_args(MODEL, "32", &extra, prompts));
    for (o, line) in out.iter().zip(&lines) {
        assert_eq!(
            ids(&o["tokens"]),
            ids(&line["tokens"]),
            "prompt {}",
            line["prompt"]
        );
    }
    assert!(stats["preemptions"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["acceptance_rate"].as_f64().unwrap() > 0.9, "{stats}");
    let (ok, _, stderr) = te(&[
        "generate",
        "--model",
        "random:tiny-llama",
        "--model-draft",
        MODEL,
        "--prompt",
        "x",
    ]);
    assert!(
        !ok && stderr.contains("--model-draft") && stderr.contains("vocabulary"),
        "{stderr}"
    );
}

/// Qwen2.5-Coder 0.5B drafting for the 1.5B: every reference prompt of
/// the 1.5B gets its reference tokens, batched. Slow on two cores (the
/// 1.5B's 1,020-token prompt, twice the models): `cargo test -- --ignored`;
/// the claim is covered by default by the tiny-model draft tests
/// (`crates/te-engine/tests/speculative.rs`) and SmolLM2 drafting for
/// itself above.
#[test]
#[ignore = "slow: Qwen2.5-Coder 1.5B with the 0.5B as draft"]
fn qwen_small_drafting_for_large_gives_the_reference_tokens() {
    check_greedy_batched_with(
        "qwen2.5-coder-1.5b",
        &["--model-draft", "qwen2.5-coder-0.5b", "--draft-max", "4"],
    );
}
