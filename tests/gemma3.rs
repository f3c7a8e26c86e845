//! End-to-end checks of Gemma 3 270M (GGUF Q4_K_M, gemma3 architecture)
//! against `tests/refs/gemma3-270m`: exact greedy tokens of an
//! exact-math forward pass, top-20 logits, tokenizer ids.

mod common;

use common::*;

const MODEL: &str = "gemma3-270m";

#[test]
fn greedy_tokens_match_reference_for_every_prompt() {
    check_greedy_each_prompt(MODEL);
}

#[test]
fn batched_generation_equals_each_prompt_alone() {
    check_greedy_batched(MODEL);
}

#[test]
fn top20_logits_match_reference() {
    check_top20_files(MODEL, 2e-2);
}

#[test]
fn tokenize_matches_reference() {
    check_tokenize(MODEL);
}

/// The Gemma 3 270M GGUF ships no chat template: `--chat` says so.
#[test]
fn chat_without_a_template_is_a_clear_error() {
    let (ok, _, stderr) = te(&["generate", "--model", MODEL, "--chat", "--prompt", "Hi"]);
    assert!(!ok);
    assert!(stderr.contains("no chat template"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
