//! Helpers shared by the end-to-end tests: the reference files in
//! `tests/refs` (see its README) and the `te` binary; `server`: a
//! `te serve` child process.

#![allow(dead_code)]

pub mod server;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use te_models::model::Logits;

/// `tests/refs/<model>` in the repository (or `$TE_REFS/<model>`).
pub fn refs_dir(model: &str) -> PathBuf {
    let base = match std::env::var_os("TE_REFS") {
        Some(p) => PathBuf::from(p),
        // CARGO_MANIFEST_DIR is crates/te-cli.
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/refs"),
    };
    let dir = base.join(model);
    assert!(
        dir.is_dir(),
        "reference directory {} is missing (the repository has them in tests/refs; \
         TE_REFS, if set, must hold the same <model>/ folders)",
        dir.display()
    );
    dir
}

/// Every line of a `.jsonl` reference file.
pub fn read_jsonl(model: &str, file: &str) -> Vec<Value> {
    let path = refs_dir(model).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// A reference JSON file.
pub fn read_json(model: &str, file: &str) -> Value {
    let path = refs_dir(model).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid JSON")
}

/// A JSON array of integers as u32s.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an integer id") as u32)
        .collect()
}

/// Runs `te` with `args`; returns (exit success, stdout, stderr).
pub fn te(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_te"))
        .args(args)
        .output()
        .expect("running te");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `te` and parses each stdout line as JSON, failing on a non-zero exit.
pub fn te_json(args: &[&str]) -> Vec<Value> {
    let (ok, stdout, stderr) = te(args);
    assert!(ok, "te {args:?} failed:\n{stderr}");
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

/// Checks the logits of a top-20 reference: at every row, each listed id's
/// logit within `atol` of the reference, and the same argmax.
/// `logits: [t, vocab]` for the reference's `token_ids`.
pub fn check_top20(reference: &Value, logits: &[f32], vocab: usize, atol: f64) {
    let rows = reference["rows"].as_array().expect("rows");
    let mut worst = 0.0f64;
    for row in rows {
        let p = row["pos"].as_u64().unwrap() as usize;
        let got = &logits[p * vocab..(p + 1) * vocab];
        let want_ids = ids(&row["ids"]);
        let want = row["logits"].as_array().unwrap();
        for (id, w) in want_ids.iter().zip(want) {
            let diff = (got[*id as usize] as f64 - w.as_f64().unwrap()).abs();
            worst = worst.max(diff);
            assert!(
                diff <= atol,
                "row {p}: logit of token {id} is {}, reference {} (diff {diff:.2e} > {atol})",
                got[*id as usize],
                w
            );
        }
        let argmax = got
            .iter()
            .enumerate()
            .fold(0, |best, (i, &l)| if l > got[best] { i } else { best });
        assert_eq!(argmax as u32, want_ids[0], "row {p}: argmax differs");
    }
    eprintln!(
        "top-20 logits: worst difference {worst:.2e} over {} rows",
        rows.len()
    );
}

/// The arguments of `te generate --model <model> --json --max-new-tokens
/// <max_new_tokens> --ignore-eos <extra...>` with one `--prompt` per prompt.
pub fn generate_args<'a>(
    model: &'a str,
    max_new_tokens: &'a str,
    extra: &[&'a str],
    prompts: impl IntoIterator<Item = &'a str>,
) -> Vec<&'a str> {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--json",
        "--max-new-tokens",
        max_new_tokens,
        "--ignore-eos",
    ];
    args.extend(extra);
    for p in prompts {
        args.extend(["--prompt", p]);
    }
    args
}

/// For every line of `greedy.jsonl`: `te generate --json --max-new-tokens 32
/// --ignore-eos --prompt <prompt>` gives exactly `prompt_tokens` and `tokens`.
pub fn check_greedy_each_prompt(model: &str) {
    for line in read_jsonl(model, "greedy.jsonl") {
        let prompt = line["prompt"].as_str().unwrap();
        let out = te_json(&generate_args(model, "32", &[], [prompt]));
        assert_eq!(out.len(), 1);
        let o = &out[0];
        assert_eq!(
            ids(&o["prompt_tokens"]),
            ids(&line["prompt_tokens"]),
            "prompt {prompt:?}"
        );
        assert_eq!(ids(&o["tokens"]), ids(&line["tokens"]), "prompt {prompt:?}");
        assert_eq!(o["finish_reason"], "length");
        assert_eq!(o["prompt"], prompt);
        assert!(o["text"].is_string());
    }
}

/// All prompts of `greedy.jsonl` in one batched run give each its reference tokens.
pub fn check_greedy_batched(model: &str) {
    check_greedy_batched_with(model, &[]);
}

/// [`check_greedy_batched`] with `extra` arguments for `te generate` (such
/// as `--context-parallel 4`).
pub fn check_greedy_batched_with(model: &str, extra: &[&str]) {
    let lines = read_jsonl(model, "greedy.jsonl");
    let prompts = lines.iter().map(|l| l["prompt"].as_str().unwrap());
    let out = te_json(&generate_args(model, "32", extra, prompts));
    assert_eq!(out.len(), lines.len());
    for (o, line) in out.iter().zip(&lines) {
        assert_eq!(
            ids(&o["tokens"]),
            ids(&line["tokens"]),
            "{model} {extra:?}, prompt {}",
            line["prompt"]
        );
    }
}

/// The logits `[t, vocab]` of `model` at every position of a top-20
/// reference's `token_ids` (one prefill).
fn top20_logits(model: &te_models::model::Model, reference: &Value) -> Vec<f32> {
    let tokens = ids(&reference["token_ids"]);
    let mut cache = model
        .new_cache(
            1,
            tokens.len(),
            tokens.len(),
            te_cache::CacheLayout::Contiguous,
        )
        .unwrap();
    cache.pre_step(&[(0, tokens.len())]).unwrap();
    model.forward(&tokens, &mut cache, Logits::All).unwrap()
}

/// Feeding each `top20_*.json`'s `token_ids` gives logits within `atol` of
/// the reference at every row, with the same argmax.
pub fn check_top20_files(model_name: &str, atol: f64) {
    let source =
        te_models::source::resolve_model(model_name).expect("run `cargo xtask fetch-models`");
    let loaded = te_models::loader::load_model(&source).unwrap();
    let model = &loaded.model;
    for name in ["top20_capital.json", "top20_code.json"] {
        let reference = read_json(model_name, name);
        let logits = top20_logits(model, &reference);
        check_top20(&reference, &logits, model.config.vocab_size, atol);
    }
}

/// What `--precision int8` costs on a model's top-20 references: the worst
/// |logit − float64 reference| over every listed id at position 0 and at
/// the other positions, the rows whose argmax is still the reference's,
/// and the rows (printing each row's worst difference).
pub fn int8_top20_deviation(model_name: &str) -> ([f64; 2], usize, usize) {
    let source =
        te_models::source::resolve_model(model_name).expect("run `cargo xtask fetch-models`");
    let mut loaded = te_models::loader::load_model(&source).unwrap();
    loaded
        .model
        .weights
        .set_precision(te_kernels::matmul::Precision::Int8);
    let model = &loaded.model;
    let vocab = model.config.vocab_size;
    let (mut worst, mut same, mut total) = ([0.0f64; 2], 0, 0);
    for name in ["top20_capital.json", "top20_code.json"] {
        let reference = read_json(model_name, name);
        let logits = top20_logits(model, &reference);
        for row in reference["rows"].as_array().expect("rows") {
            let p = row["pos"].as_u64().unwrap() as usize;
            let got = &logits[p * vocab..(p + 1) * vocab];
            let want_ids = ids(&row["ids"]);
            let mut row_worst = 0.0f64;
            for (id, w) in want_ids.iter().zip(row["logits"].as_array().unwrap()) {
                row_worst = row_worst.max((got[*id as usize] as f64 - w.as_f64().unwrap()).abs());
            }
            let w = &mut worst[usize::from(p > 0)];
            *w = w.max(row_worst);
            let argmax = (0..vocab).fold(0, |b, i| if got[i] > got[b] { i } else { b });
            eprintln!(
                "{model_name} {name} position {p}: worst {row_worst:.3}, argmax {}",
                if argmax as u32 == want_ids[0] {
                    "kept"
                } else {
                    "changed"
                }
            );
            same += usize::from(argmax as u32 == want_ids[0]);
            total += 1;
        }
    }
    (worst, same, total)
}

/// The model's tokenizer (loaded once, as `te tokenize` loads it) gives
/// `ids` for every `tokenize.jsonl` line, and `ids_no_parse_special`
/// without special-token parsing; [`check_tokenize_cli`] checks the same
/// through `te tokenize` for one line (the first whose two differ, if
/// any).
pub fn check_tokenize(model: &str) {
    let source = te_models::source::resolve_model(model).expect("run `cargo xtask fetch-models`");
    let tokenizer = te_models::loader::load_tokenizer(&source).unwrap();
    let lines = read_jsonl(model, "tokenize.jsonl");
    for line in &lines {
        let text = line["text"].as_str().unwrap();
        for (parse_special, key) in [(true, "ids"), (false, "ids_no_parse_special")] {
            let got = tokenizer.encode(text, parse_special).unwrap();
            assert_eq!(got, ids(&line[key]), "{key} of {text:?}");
        }
    }
    let line = lines
        .iter()
        .find(|l| l["ids"] != l["ids_no_parse_special"])
        .unwrap_or(&lines[0]);
    check_tokenize_cli(model, line);
}

/// `te tokenize --json --model MODEL` (a name or a path) of a
/// `tokenize.jsonl` line's `text` gives its `ids`, and its
/// `ids_no_parse_special` with `--no-parse-special`, echoing the text.
pub fn check_tokenize_cli(model: &str, line: &Value) {
    let text = line["text"].as_str().unwrap();
    for (flag, key) in [
        (None, "ids"),
        (Some("--no-parse-special"), "ids_no_parse_special"),
    ] {
        let mut args = vec!["tokenize", "--model", model, "--json", "--text", text];
        args.extend(flag);
        let out = te_json(&args);
        assert_eq!(ids(&out[0]["ids"]), ids(&line[key]), "{key} of {text:?}");
        assert_eq!(out[0]["text"], text);
    }
}

/// A `te serve` child process that has started listening.
pub struct Serve {
    pub child: std::process::Child,
    /// `host:port` it listens on.
    pub addr: String,
    /// Its standard error up to the "listening on" line.
    pub log: String,
}

/// Starts `te serve --model <model> --port 0 <extra...>` with `env` set,
/// and waits for its "listening on http://ADDR" line. Its standard error
/// is shown with a `[te serve]` prefix and drained to the end (a full pipe
/// would block the server). The caller kills the child.
pub fn spawn_serve(model: &str, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_te"))
        .args(["serve", "--model", model, "--port", "0"])
        .args(extra)
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("starting te serve");
    let mut stderr = BufReader::new(child.stderr.take().expect("piped"));
    let mut log = String::new();
    let mut addr = None;
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap_or(0) > 0 {
        eprint!("[te serve] {line}");
        log.push_str(&line);
        if let Some(rest) = line.split("listening on http://").nth(1) {
            addr = rest.split_whitespace().next().map(str::to_string);
            break;
        }
        line.clear();
    }
    let Some(addr) = addr else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("te serve did not start listening:\n{log}");
    };
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            eprintln!("[te serve] {line}");
        }
    });
    Serve { child, addr, log }
}
