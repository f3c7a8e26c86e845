//! End-to-end checks of the two Qwen2.5-Coder Instruct GGUF files (qwen2
//! architecture: q/k/v biases, half-split RoPE base 1e6) against
//! `tests/refs/qwen2.5-coder-*`: exact greedy tokens of an independent
//! float64 forward (short, code, CJK, a 1,020-token and a chat-templated
//! prompt), top-20 logits, llama.cpp's token ids, the perplexity of the
//! GPL-3 text at ctx 512 to 4 decimals, and the chat template.

mod common;

use common::*;

const SMALL: &str = "qwen2.5-coder-0.5b";
const LARGE: &str = "qwen2.5-coder-1.5b";

#[test]
fn greedy_tokens_match_reference_for_every_prompt() {
    check_greedy_each_prompt(SMALL);
    check_greedy_each_prompt(LARGE);
}

#[test]
fn batched_generation_equals_each_prompt_alone() {
    check_greedy_batched(SMALL);
    check_greedy_batched(LARGE);
}

#[test]
fn top20_logits_match_reference() {
    check_top20_files(SMALL, 2e-2);
    check_top20_files(LARGE, 2e-2);
}

#[test]
fn tokenize_matches_llama_cpp() {
    check_tokenize(SMALL);
    check_tokenize(LARGE);
}

/// `te perplexity` over `/usr/share/common-licenses/GPL-3` at ctx 512
/// equals the float64 value of `perplexity.json` to 4 decimals.
#[test]
fn gpl3_perplexity_matches_float64_to_4_decimals() {
    for model in [SMALL, LARGE] {
        let reference = read_json(model, "perplexity.json");
        let file = reference["text"].as_str().unwrap();
        let out = te_json(&[
            "perplexity",
            "--model",
            model,
            "--file",
            file,
            "--ctx",
            "512",
            "--json",
        ]);
        let got = out.last().unwrap();
        let want = reference["ppl"].as_f64().unwrap();
        let ppl = got["ppl"].as_f64().unwrap();
        eprintln!("{model}: ppl {ppl} vs float64 {want}");
        assert_eq!(
            got["tokens"].as_u64(),
            reference["n_tokens"].as_u64(),
            "{model}: tokens of the text"
        );
        assert!(
            (ppl - want).abs() < 5e-5,
            "{model}: perplexity {ppl}, float64 {want}"
        );
    }
}

/// `te generate --chat` renders the file's own template (Qwen's, with its
/// default system message) exactly as Hugging Face does: the prompt tokens
/// of the chat-templated reference prompt, then its greedy tokens.
#[test]
fn chat_prompt_renders_as_hugging_face() {
    for model in [SMALL, LARGE] {
        let line = read_jsonl(model, "greedy.jsonl")
            .into_iter()
            .find(|l| l["name"] == "chat")
            .expect("a chat prompt");
        let messages = line["chat_messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1);
        let user = messages[0]["content"].as_str().unwrap();
        let out = te_json(&[
            "generate",
            "--model",
            model,
            "--chat",
            "--json",
            "--max-new-tokens",
            "32",
            "--ignore-eos",
            "--prompt",
            user,
        ]);
        assert_eq!(
            ids(&out[0]["prompt_tokens"]),
            ids(&line["prompt_tokens"]),
            "{model}"
        );
        assert_eq!(ids(&out[0]["tokens"]), ids(&line["tokens"]), "{model}");
    }
}
