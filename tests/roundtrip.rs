//! `te convert`, `te inspect` and `te perplexity` on both real models.
//!
//! Round trip: GGUF -> `te convert` -> Hugging Face directory, which must
//! give the reference greedy tokens (those the GGUF path matches) and the
//! reference token ids. Perplexity: `te perplexity` against exp(mean NLL)
//! computed here in f64 from `Logits::All` of the same windows, each run
//! alone.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use te_models::model::Logits;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("te-roundtrip-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn gguf_path(model: &str) -> String {
    match te_models::source::resolve_model(model).expect("run `cargo xtask fetch-models`") {
        te_models::source::ModelSource::Gguf(p) => p.display().to_string(),
        other => panic!("{model} resolved to {other:?}"),
    }
}

/// Converts `model`, then checks greedy tokens on two reference prompts
/// (one batched run) and every tokenize reference through the directory.
fn check_roundtrip(model: &str) {
    let tmp = TempDir::new(model);
    let out = tmp.path().join("hf");
    let out_str = out.to_str().unwrap();
    let (ok, _, stderr) = te(&["convert", "--model", model, "--out", out_str]);
    assert!(ok, "te convert failed:\n{stderr}");
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "model.safetensors",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }

    // Same resolved config as the GGUF, up to the RoPE convention.
    let gguf_cfg = te_models::loader::load_config_only(&te_models::source::ModelSource::Gguf(
        gguf_path(model).into(),
    ))
    .unwrap();
    let hf_cfg = te_models::hf::load_config(&out).unwrap();
    let mut want = gguf_cfg.clone();
    want.rope_convention = hf_cfg.rope_convention;
    want.eos_token_ids = hf_cfg.eos_token_ids.clone(); // HF lists the tokenizer's too
    assert_eq!(hf_cfg, want);
    for id in &gguf_cfg.eos_token_ids {
        assert!(hf_cfg.eos_token_ids.contains(id), "EOS {id} lost");
    }

    let lines = read_jsonl(model, "greedy.jsonl");
    let prompts = lines[..2].iter().map(|l| l["prompt"].as_str().unwrap());
    let outs = te_json(&generate_args(out_str, "32", &[], prompts));
    assert_eq!(outs.len(), 2);
    for (o, line) in outs.iter().zip(&lines) {
        assert_eq!(
            ids(&o["prompt_tokens"]),
            ids(&line["prompt_tokens"]),
            "prompt {}",
            line["prompt"]
        );
        assert_eq!(
            ids(&o["tokens"]),
            ids(&line["tokens"]),
            "prompt {}",
            line["prompt"]
        );
    }

    for line in read_jsonl(model, "tokenize.jsonl") {
        check_tokenize_cli(out_str, &line);
    }

    // The chat template travels in tokenizer_config.json: same chat prompt.
    let chat = |m: &str| {
        let (ok, stdout, stderr) = te(&[
            "generate",
            "--model",
            m,
            "--json",
            "--chat",
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "1",
        ]);
        ok.then(|| {
            serde_json::from_str::<serde_json::Value>(stdout.trim()).unwrap()["prompt_tokens"]
                .clone()
        })
        .ok_or(stderr)
    };
    match (chat(model), chat(out_str)) {
        (Ok(gguf), Ok(hf)) => assert_eq!(gguf, hf),
        (Err(gguf), Err(hf)) => {
            assert!(gguf.contains("no chat template") && hf.contains("no chat template"))
        }
        other => panic!("chat template lost or invented by te convert: {other:?}"),
    }

    // The directory inspects as f32 safetensors with the GGUF's parameters.
    let hf = te_json(&["inspect", "--model", out_str, "--json"]);
    let gguf = te_json(&["inspect", "--model", model, "--json"]);
    assert_eq!(hf[0]["format"], "safetensors");
    assert_eq!(hf[0]["parameters"], gguf[0]["parameters"]);
    let dtypes = hf[0]["tensor_dtypes"].as_object().unwrap();
    assert_eq!(dtypes.keys().collect::<Vec<_>>(), vec!["F32"]);
}

#[test]
fn smollm2_convert_roundtrip_gives_reference_tokens() {
    check_roundtrip("smollm2-135m");
}

#[test]
fn gemma3_convert_roundtrip_gives_reference_tokens() {
    check_roundtrip("gemma3-270m");
}

/// Qwen2 (q/k/v biases, untied output, no Q/K permutation to undo).
#[test]
fn qwen25_coder_convert_roundtrip_gives_reference_tokens() {
    check_roundtrip("qwen2.5-coder-0.5b");
}

#[test]
fn convert_rejects_a_hf_directory() {
    let tmp = TempDir::new("reject");
    std::fs::write(tmp.path().join("config.json"), "{}").unwrap();
    let out = tmp.path().join("out");
    let (ok, _, stderr) = te(&[
        "convert",
        "--model",
        tmp.path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(stderr.contains("GGUF"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn convert_does_not_overwrite_a_model_without_force() {
    let tmp = TempDir::new("no-clobber");
    let config = tmp.path().join("config.json");
    std::fs::write(&config, "{\"keep\": true}").unwrap();
    let (ok, _, stderr) = te(&[
        "convert",
        "--model",
        "smollm2-135m",
        "--out",
        tmp.path().to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("--force") && stderr.contains("config.json"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "{\"keep\": true}"
    );
}

#[test]
fn inspect_reports_config_dtypes_tokenizer_and_memory() {
    let o = te_json(&["inspect", "--model", "smollm2-135m", "--json"]);
    let o = &o[0];
    assert_eq!(o["architecture"], "llama");
    assert_eq!(o["format"], "gguf");
    let c = &o["config"];
    assert_eq!(c["num_hidden_layers"], 30);
    assert_eq!(c["hidden_size"], 576);
    assert_eq!(c["num_attention_heads"], 9);
    assert_eq!(c["num_key_value_heads"], 3);
    assert_eq!(c["head_dim"], 64);
    assert_eq!(c["vocab_size"], 49152);
    assert_eq!(c["rope_theta"], 100000.0);
    assert_eq!(c["rms_norm_eps"], 1e-5);
    // tests/refs/README.md: Q4_1 matrices, Q8_0 token_embd, F32 norms
    // (30 layers x 7 matrices; 30 x 2 + 1 norms).
    let d = &o["tensor_dtypes"];
    assert_eq!(
        (d["Q4_1"].as_u64(), d["Q8_0"].as_u64(), d["F32"].as_u64()),
        (Some(210), Some(1), Some(61))
    );
    // Parameters by hand: embedding + 30 layers (q, k, v, o, gate, up, down, 2 norms) + final norm.
    let (h, kv, ffn) = (576u64, 3 * 64u64, 1536u64);
    let layer = h * h + 2 * kv * h + h * h + 3 * ffn * h + 2 * h;
    assert_eq!(o["parameters"], 49152 * h + 30 * layer + h);
    assert_eq!(
        o["memory"]["weights_f32_bytes"],
        o["parameters"].as_u64().unwrap() * 4
    );
    assert_eq!(o["memory"]["kv_cache_bytes_per_token"], 2 * 30 * 3 * 64 * 4);
    assert_eq!(o["tokenizer"]["vocab_size"], 49152);
    assert!(o["tokenizer"]["kind"].as_str().unwrap().contains("BPE"));

    let (ok, text, stderr) = te(&["inspect", "--model", "gemma3-270m"]);
    assert!(ok, "{stderr}");
    for needle in [
        "gemma3",
        "Q4_K",
        "SentencePiece",
        "layer_windows",
        "KV cache",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

/// exp(mean NLL) over the second half of each window (llama.cpp's scoring),
/// each window run alone, in f64.
fn reference_ppl(model: &te_models::model::Model, windows: &[Vec<u32>]) -> f64 {
    let vocab = model.config.vocab_size;
    let (mut nll, mut n) = (0.0f64, 0usize);
    for w in windows {
        let ctx = w.len();
        let mut cache = model
            .new_cache(1, ctx, ctx, te_cache::CacheLayout::Contiguous)
            .unwrap();
        cache.pre_step(&[(7, ctx)]).unwrap();
        let logits = model.forward(w, &mut cache, Logits::All).unwrap();
        for j in ctx / 2..ctx - 1 {
            let row: Vec<f64> = logits[j * vocab..(j + 1) * vocab]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let log_z = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            nll += log_z - row[w[j + 1] as usize];
            n += 1;
        }
    }
    (nll / n as f64).exp()
}

fn check_perplexity(model_name: &str, ctx: usize) {
    let text = "The quick brown fox jumps over the lazy dog. \
        Once upon a time, in a small village nestled between two mountains, there lived a baker \
        who made the best bread in the whole valley. Every morning, people came from far away \
        to buy his loaves, and every evening he counted the coins and smiled. \
        The capital of France is Paris, and the capital of Italy is Rome.\n";
    let tmp = TempDir::new(&format!("ppl-{model_name}"));
    let file = tmp.path().join("text.txt");
    std::fs::write(&file, text).unwrap();

    let source = te_models::source::resolve_model(model_name).unwrap();
    let loaded = te_models::loader::load_model(&source).unwrap();
    let tokens = loaded.tokenizer.encode(text, false).unwrap();
    // Windows built here: the tail is dropped; a model that adds BOS gets
    // BOS as the first token of every window.
    let adds_bos = loaded.tokenizer.bos_id() == Some(tokens[0]);
    let windows: Vec<Vec<u32>> = tokens
        .chunks(ctx)
        .filter(|c| c.len() == ctx)
        .map(|c| {
            let mut w = c.to_vec();
            if adds_bos {
                w[0] = tokens[0];
            }
            w
        })
        .collect();
    assert!(
        windows.len() >= 2,
        "test text too short: {} tokens",
        tokens.len()
    );
    let want = reference_ppl(&loaded.model, &windows);

    let ctx_s = ctx.to_string();
    let o = te_json(&[
        "perplexity",
        "--model",
        model_name,
        "--file",
        file.to_str().unwrap(),
        "--ctx",
        &ctx_s,
        "--json",
        "--batch-windows",
        "2",
    ]);
    let o = &o[0];
    assert_eq!(o["windows"], windows.len());
    assert_eq!(o["scored_tokens"], windows.len() * (ctx - 1 - ctx / 2));
    let got = o["ppl"].as_f64().unwrap();
    assert!(
        (got - want).abs() <= 1e-4 * want,
        "ppl {got}, reference {want}"
    );
    let running = o["running_ppl"].as_array().unwrap();
    assert_eq!(running.len(), windows.len());
    assert_eq!(running.last().unwrap().as_f64().unwrap(), got);
    // A plausible value for real text.
    assert!(got > 1.0 && got < 1000.0, "ppl {got}");

    // Text output: running values and the final estimate.
    let (ok, stdout, stderr) = te(&[
        "perplexity",
        "--model",
        model_name,
        "--file",
        file.to_str().unwrap(),
        "--ctx",
        &ctx_s,
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("[1]") && stdout.contains("Final estimate: PPL ="),
        "{stdout}"
    );
}

#[test]
fn smollm2_perplexity_matches_f64_reference() {
    check_perplexity("smollm2-135m", 24);
}

#[test]
fn gemma3_perplexity_matches_f64_reference() {
    check_perplexity("gemma3-270m", 20);
}

#[test]
fn perplexity_errors_name_the_problem() {
    let tmp = TempDir::new("ppl-errors");
    let file = tmp.path().join("short.txt");
    std::fs::write(&file, "Hello world.").unwrap();
    let f = file.to_str().unwrap();
    for (args, needle) in [
        (
            vec![
                "perplexity",
                "--model",
                "smollm2-135m",
                "--file",
                f,
                "--ctx",
                "64",
            ],
            "at least ctx",
        ),
        (
            vec![
                "perplexity",
                "--model",
                "smollm2-135m",
                "--file",
                f,
                "--ctx",
                "2",
            ],
            "ctx 2",
        ),
        (
            vec![
                "perplexity",
                "--model",
                "smollm2-135m",
                "--file",
                "/nonexistent.txt",
            ],
            "nonexistent",
        ),
    ] {
        let (ok, _, stderr) = te(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains(needle), "expected {needle:?} in {stderr}");
    }
}
