//! End-to-end checks of SmolLM2-135M (GGUF Q4_1, llama architecture)
//! against `tests/refs/smollm2-135m`: exact greedy tokens of an
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
        (
            vec!["generate", "--model", MODEL, "--prompt", "hi", "--stop", ""],
            "--stop",
        ),
        (
            vec![
                "generate",
                "--model",
                MODEL,
                "--prompt",
                "hi",
                "--max-batch-size",
                "0",
            ],
            "--max-batch-size",
        ),
        (
            vec![
                "generate",
                "--model",
                MODEL,
                "--prompt",
                "hi",
                "--temperature",
                "-1",
            ],
            "temperature",
        ),
        (
            vec![
                "generate", "--model", MODEL, "--prompt", "hi", "--top-p", "2",
            ],
            "top_p",
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

/// Writes a GGUF v3 header with `kv` string metadata and no tensors.
fn gguf_with_strings(kv: &[(&str, &str)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensor_count
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        b.extend(8u32.to_le_bytes()); // value type: string
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.as_bytes());
    }
    b
}

#[test]
fn bad_model_files_give_one_line_errors() {
    let dir = std::env::temp_dir().join(format!("te-bad-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let real = te_models::hub::resolve_model(MODEL).expect("run `cargo xtask fetch-models`");
    let te_models::hub::ModelSource::Gguf(real) = real else {
        panic!("{MODEL} is a GGUF file")
    };
    let real = std::fs::read(real).unwrap();
    let mut absurd = b"GGUF".to_vec();
    absurd.extend(3u32.to_le_bytes());
    absurd.extend((1u64 << 60).to_le_bytes()); // tensor_count
    absurd.extend(1u64.to_le_bytes());
    // The real file with one tensor's type id set to 99, which no GGUF
    // reader knows: tensor info = name, n_dims u32, dims u64 x n, type u32.
    let name = b"blk.0.attn_q.weight";
    let mut tagged = (name.len() as u64).to_le_bytes().to_vec();
    tagged.extend_from_slice(name);
    let at = real
        .windows(tagged.len())
        .position(|w| w == tagged.as_slice())
        .expect("tensor info of blk.0.attn_q.weight")
        + tagged.len();
    let n_dims = u32::from_le_bytes(real[at..at + 4].try_into().unwrap()) as usize;
    let type_at = at + 4 + 8 * n_dims;
    let mut unknown_type = real.clone();
    unknown_type[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    // A corrupt length of the first metadata key (bytes 24..32).
    let mut long_key = real.clone();
    long_key[26] = 0x0b;
    // llama.block_count (a u32 value) set to 2^32 - 1.
    let key = b"llama.block_count";
    let at = real.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(real[at..at + 4], 4u32.to_le_bytes(), "block_count is a u32");
    let mut many_layers = real.clone();
    many_layers[at + 4..at + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("unknown-type.gguf", unknown_type, "blk.0.attn_q.weight"),
        ("long-key.gguf", long_key, "65535"),
        ("many-layers.gguf", many_layers, "llama.block_count"),
        (
            "not-gguf.gguf",
            b"hello, this is not a model".to_vec(),
            "not a gguf",
        ),
        ("truncated.gguf", real[..4096].to_vec(), "truncated.gguf"),
        ("absurd.gguf", absurd, "absurd.gguf"),
        (
            "mamba.gguf",
            gguf_with_strings(&[("general.architecture", "mamba")]),
            "mamba",
        ),
    ];
    for (name, bytes, needle) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let (ok, _, stderr) = te(&[
            "generate",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "hi",
        ]);
        assert!(!ok, "{name} should fail");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        assert!(
            errors[0].to_lowercase().contains(needle),
            "{name}: expected {needle:?} in {stderr}"
        );
        assert!(
            errors[0].len() < 500,
            "{name}: error line too long: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--chat` renders the GGUF's ChatML template (SmolLM2-Instruct's, with
/// its default system prompt, written out here from the model card) and
/// the instruction-tuned model answers; `--system` replaces the default.
#[test]
fn chat_prompts_use_the_models_template() {
    let question = "What is the capital of France?";
    let want = |system: &str| {
        format!(
            "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n\
             <|im_start|>assistant\n"
        )
    };
    let tokens = |text: &str| {
        te_json(&["tokenize", "--model", MODEL, "--json", "--text", text])[0]["ids"].clone()
    };
    let o = te_json(&[
        "generate",
        "--model",
        MODEL,
        "--json",
        "--chat",
        "--prompt",
        question,
        "--max-new-tokens",
        "24",
    ]);
    assert_eq!(
        o[0]["prompt_tokens"],
        tokens(&want(
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        ))
    );
    assert_eq!(o[0]["finish_reason"], "eos", "{}", o[0]);
    assert!(o[0]["text"].as_str().unwrap().contains("Paris"), "{}", o[0]);
    let o = te_json(&[
        "generate",
        "--model",
        MODEL,
        "--json",
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        question,
        "--max-new-tokens",
        "1",
    ]);
    assert_eq!(o[0]["prompt_tokens"], tokens(&want("Be brief.")));
    // --system without --chat is a usage error.
    let (ok, _, stderr) = te(&[
        "generate", "--model", MODEL, "--system", "x", "--prompt", "y",
    ]);
    assert!(!ok && stderr.contains("--chat"), "{stderr}");
}
