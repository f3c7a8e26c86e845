//! The generation engine on the real models: under KV memory pressure
//! (preemption and recompute) every request gets exactly the greedy tokens
//! and text it gets with room for all (all in one batch, which gives
//! each the tokens it gets alone: every model's
//! `batched_generation_equals_each_prompt_alone`); prompts sharing a
//! prefix share its pages (`te generate --stats`) without changing a
//! token.

mod common;

use common::*;
use te_engine::{Engine, EngineConfig, Event, FinishReason, Request};
use te_models::loader::LoadedModel;

/// English sentences; prompts are cut from a text made of them.
const SENTENCES: &[&str] = &[
    "The river ran quietly past the old mill, where the miller's daughter kept a ledger of every sack of grain.",
    "In 1887 the town council voted to build a library, although nobody could agree on where it should stand.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She opened the letter slowly, afraid of what the second page might say.",
    "A binary search halves the interval at every step, so it needs about log2(n) comparisons.",
    "The committee met on Tuesdays, and the minutes were always late.",
    "Mountains to the north kept the valley warm in winter and dry in summer.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Every morning the baker lit the ovens before the sun rose over the harbour.",
    "The theory predicted a small shift in the spectral lines, which the telescope later confirmed.",
    "He had never seen so many stars, and for a long time he said nothing at all.",
    "Rust's ownership rules let the compiler prove that no two threads write the same memory at once.",
    "The recipe called for three eggs, a cup of flour and a pinch of salt.",
    "When the storm finally passed, the fishermen counted their boats on the beach.",
    "Markets opened lower on Monday after the central bank raised interest rates.",
    "The museum's oldest map shows the coastline as it was drawn by sailors five centuries ago.",
];

/// A long text of the sentences in a scrambled order.
fn long_text() -> String {
    let mut text = String::new();
    for i in 0..120usize {
        text.push_str(SENTENCES[(i * 7 + i / 16) % SENTENCES.len()]);
        text.push(' ');
    }
    text
}

/// 16 requests of 1 to 580 prompt tokens and 24 to 183 new tokens (two
/// prompts longer than Gemma 3's 512-token window, four more crossing it
/// as they generate), every third with a stop string.
fn requests(loaded: &LoadedModel) -> Vec<Request> {
    let text = loaded.tokenizer.encode(&long_text(), true).unwrap();
    assert!(text.len() > 1300, "{} tokens", text.len());
    (0..16usize)
        .map(|i| {
            let len = 1 + (i * 131) % 600;
            let start = (i * 37) % (text.len() - len);
            let stop = match i % 3 {
                0 => vec!["\n\n".to_string()],
                1 => vec![" the ".to_string(), ".".to_string()],
                _ => vec![],
            };
            Request {
                stop,
                ..Request::new(text[start..start + len].to_vec(), 24 + (i * 53) % 161)
            }
        })
        .collect()
}

/// (tokens, text, finish reason) of each request, run by `engine`.
fn run(engine: &mut Engine, requests: &[Request]) -> Vec<(Vec<u32>, String, FinishReason)> {
    let ids: Vec<u64> = requests
        .iter()
        .map(|r| engine.add_request(r.clone()).unwrap())
        .collect();
    let mut out: Vec<(Vec<u32>, String, Option<FinishReason>)> =
        vec![(vec![], String::new(), None); requests.len()];
    let slot = |id: u64| ids.iter().position(|&i| i == id).unwrap();
    engine
        .run_to_completion(|e| match e {
            Event::Token {
                id, token, text, ..
            } => {
                let o = &mut out[slot(id)];
                o.0.push(token);
                o.1.push_str(&text);
            }
            Event::Finished {
                id, reason, text, ..
            } => {
                let o = &mut out[slot(id)];
                o.1.push_str(&text);
                o.2 = Some(reason);
            }
        })
        .unwrap();
    out.into_iter()
        .map(|(t, s, r)| (t, s, r.expect("finished")))
        .collect()
}

fn memory_pressure(model_name: &str) {
    let source =
        te_models::source::resolve_model(model_name).expect("run `cargo xtask fetch-models`");
    let loaded = te_models::loader::load_model(&source).unwrap();
    let reqs = requests(&loaded);
    let need: usize = reqs
        .iter()
        .map(|r| r.prompt_tokens.len() + r.max_new_tokens)
        .sum();
    // With room for all (and a partly filled last page each): every
    // request in one batch, no preemption.
    let mut roomy = Engine::new(
        &loaded.model,
        Some(&loaded.tokenizer),
        EngineConfig {
            max_batch_size: reqs.len(),
            kv_cache_tokens: Some(need + 64 * reqs.len()),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let roomy_out = run(&mut roomy, &reqs);
    assert_eq!(roomy.stats().preemptions, 0);
    // Together, 8 at a time, in a pool of a quarter of what they need.
    let mut engine = Engine::new(
        &loaded.model,
        Some(&loaded.tokenizer),
        EngineConfig {
            max_batch_size: 8,
            kv_cache_tokens: Some(need / 4),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let together = run(&mut engine, &reqs);
    let mut stops = 0;
    for (i, (a, t)) in roomy_out.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "{model_name} request {i}");
        stops += usize::from(a.2 == FinishReason::Stop);
    }
    let stats = engine.stats();
    eprintln!(
        "{model_name}: need {need} tokens, capacity {}, {stats:?}, {stops} stopped by a stop string",
        engine.kv_capacity_tokens()
    );
    assert!(stops > 0, "no request met its stop string");
    assert!(stats.preemptions > 0);
    assert!(stats.peak_kv_tokens <= engine.kv_capacity_tokens());
    assert!(engine.kv_capacity_tokens() < need / 3);
    assert_eq!(engine.kv_tokens_in_use(), 0);
}

#[test]
fn smollm2_under_memory_pressure_gives_every_request_its_tokens() {
    memory_pressure("smollm2-135m");
}

#[test]
fn gemma3_under_memory_pressure_gives_every_request_its_tokens() {
    memory_pressure("gemma3-270m");
}

/// 8 prompts that share a ~400-token prefix: with prefix caching the
/// later 7 reuse its whole pages (`--stats`), and every token is what a run
/// without sharing gives.
#[test]
fn shared_prefix_is_reused_across_requests() {
    let mut prefix = String::new();
    for s in SENTENCES.iter().cycle().take(26) {
        prefix.push_str(s);
        prefix.push(' ');
    }
    let endings = [
        "Summarize:",
        "In short,",
        "Question: why?",
        "The end.",
        "Next,",
        "Finally",
        "Translate:",
        "Title:",
    ];
    let prompts: Vec<String> = endings.iter().map(|e| format!("{prefix}{e}")).collect();
    let run = |extra: &[&str]| {
        let mut args = generate_args(
            "smollm2-135m",
            "8",
            &["--stats"],
            prompts.iter().map(String::as_str),
        );
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = te(&args);
        assert!(ok, "{stderr}");
        let outs: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let stats: serde_json::Value = serde_json::from_str(stderr.lines().last().unwrap())
            .unwrap_or_else(|e| panic!("--stats line: {e}\n{stderr}"));
        (outs, stats)
    };
    let (shared, stats) = run(&[]);
    let (unshared, no_stats) = run(&["--no-prefix-caching"]);
    assert_eq!(shared.len(), endings.len());
    // The token prefix all prompts share, in whole 16-token pages.
    let toks: Vec<Vec<u32>> = shared.iter().map(|o| ids(&o["prompt_tokens"])).collect();
    let common = (0..toks[0].len())
        .take_while(|&i| toks.iter().all(|t| t.get(i) == toks[0].get(i)))
        .count();
    assert!(common >= 390, "common prefix of {common} tokens");
    let pages = common / 16;
    let hits = stats["prefix_hit_tokens"].as_u64().unwrap() as usize;
    assert!(
        hits >= (endings.len() - 1) * pages * 16,
        "prefix_hit_tokens {hits}, {pages} whole pages"
    );
    assert_eq!(no_stats["prefix_hit_tokens"], 0);
    for (a, b) in shared.iter().zip(&unshared) {
        assert_eq!(a["tokens"], b["tokens"], "prompt {}", a["prompt"]);
        assert_eq!(a["text"], b["text"]);
    }
    for key in [
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "wall_s",
        "kv_capacity_tokens",
        "peak_kv_tokens",
        "preemptions",
    ] {
        assert!(stats.get(key).is_some(), "--stats lacks {key}: {stats}");
    }
    assert_eq!(stats["requests"], endings.len());
    assert_eq!(stats["generated_tokens"], endings.len() * 8);
}
