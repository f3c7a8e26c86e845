//! End-to-end checks of SmolLM2-135M (GGUF Q4_1, llama architecture)
//! against `../shared/refs/smollm2-135m`: exact greedy tokens of an
//! exact-math forward pass, top-20 logits, tokenizer ids, bad input.

mod common;

use common::*;

const MODEL: &str = "smollm2-135m";

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
    check_top20_files(MODEL, 1e-2);
}

#[test]
fn tokenize_matches_reference() {
    check_tokenize(MODEL);
}

#[test]
fn bad_requests_give_one_line_errors() {
    let long = "hello ".repeat(9000);
    for (args, needle) in [
        (vec!["generate", "--model", MODEL, "--prompt", ""], "empty"),
        (
            vec!["generate", "--model", MODEL, "--prompt", long.as_str()],
            "context",
        ),
        (
            vec!["generate", "--model", "no-such-model", "--prompt", "hi"],
            "smollm2-135m",
        ),
        (
            vec![
                "generate",
                "--model",
                "/nonexistent/model.gguf",
                "--prompt",
                "hi",
            ],
            "no such file",
        ),
    ] {
        let (ok, _, stderr) = te(&args);
        assert!(!ok, "te {:?} should fail", &args[..4]);
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            errors[0].to_lowercase().contains(needle),
            "expected {needle:?} in {stderr}"
        );
    }
}
