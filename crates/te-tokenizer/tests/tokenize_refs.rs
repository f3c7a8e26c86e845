//! Tokenizers built from the real GGUF files must reproduce llama.cpp's
//! token ids exactly (`tokenize.jsonl` and, where present, the prompts of
//! `greedy.jsonl` in `tests/refs/<model>` of the repository, or
//! `$TE_REFS/<model>`): SmolLM2 (`smollm` split), Gemma 3 (SentencePiece),
//! Qwen2.5-Coder 0.5B and 1.5B (`qwen2` split, tool and FIM tokens).
//!
//! The models come from `$TE_HOME` (see `te_formats::hub`); a missing model
//! fails the test with the command that fetches it.

use std::path::PathBuf;

use serde_json::Value;
use te_formats::gguf::GgufFile;
use te_formats::hub;
use te_tokenizer::chat::ChatMessage;
use te_tokenizer::tokenizer::Tokenizer;

fn model_path(name: &str) -> PathBuf {
    let model = hub::known_model(name).expect("a known model");
    let path = hub::cached_path(model);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask fetch-models` first (TE_HOME = {})",
        path.display(),
        hub::te_home().display()
    );
    path
}

fn refs_path(model: &str, file: &str) -> PathBuf {
    let base = match std::env::var_os("TE_REFS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/refs"),
    };
    base.join(model).join(file)
}

fn refs(model: &str, file: &str) -> Vec<Value> {
    let path = refs_path(model, file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the repository has it in tests/refs; TE_REFS overrides that)",
            path.display()
        )
    });
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an integer id") as u32)
        .collect()
}

fn check_model(name: &str) -> Tokenizer {
    let file = GgufFile::open(model_path(name)).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let mut failures = Vec::new();
    for line in refs(name, "tokenize.jsonl") {
        let text = line["text"].as_str().unwrap();
        for (key, parse_special) in [("ids", true), ("ids_no_parse_special", false)] {
            let got = tok.encode(text, parse_special).unwrap();
            let want = ids(&line[key]);
            if got != want {
                failures.push(format!(
                    "{key} of {text:?}:\n   got  {got:?}\n   want {want:?}"
                ));
            }
        }
    }
    // Not every model has greedy references (the Qwen2.5-Coder folders
    // hold tokenize.jsonl only).
    let greedy = if refs_path(name, "greedy.jsonl").is_file() {
        refs(name, "greedy.jsonl")
    } else {
        Vec::new()
    };
    for line in greedy {
        let prompt = line["prompt"].as_str().unwrap();
        let got = tok.encode(prompt, true).unwrap();
        let want = ids(&line["prompt_tokens"]);
        if got != want {
            failures.push(format!(
                "prompt {prompt:?}:\n   got  {got:?}\n   want {want:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
    tok
}

/// Decoding the encoded text gives the text back, and the streaming decoder
/// gives the same text piece by piece.
fn check_round_trip(tok: &Tokenizer, skip: usize) {
    let text = "café naïve — 東京 🎉 x=42\n\n  end";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids[skip..], true).unwrap(), text);
    let mut stream = tok.decode_stream(true);
    let mut streamed = String::new();
    for &id in &ids[skip..] {
        if let Some(piece) = stream.step(id).unwrap() {
            streamed.push_str(&piece);
        }
    }
    assert_eq!(streamed, text);
}

#[test]
fn smollm2_matches_llama_cpp() {
    let tok = check_model("smollm2-135m");
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.eos_ids().contains(&2), "{:?}", tok.eos_ids());
    check_round_trip(&tok, 0);
    assert_eq!(tok.token_to_piece(216).as_deref(), Some("Ġ"));
    assert!(tok.chat_template().is_some() && !tok.chat_template_supports_tools());
}

#[test]
fn gemma3_matches_llama_cpp() {
    let tok = check_model("gemma3-270m");
    assert_eq!(tok.bos_id(), Some(2));
    assert!(tok.eos_ids().contains(&1), "{:?}", tok.eos_ids());
    assert!(tok.eos_ids().contains(&106), "{:?}", tok.eos_ids());
    check_round_trip(&tok, 1);
}

/// Qwen2.5's `qwen2` split (one digit per piece), no BOS
/// (`add_bos_token` false), `<|im_start|>` and `<|endoftext|>` only with
/// special text parsed, `<tool_call>` (user-defined) always, and the FIM
/// markers (user-defined, but control in llama.cpp) only when parsed.
fn check_qwen(name: &str, chat_ref: &str) {
    let tok = check_model(name);
    // The GGUF's chat template is the one of the chat reference, and
    // renders its tools case as Hugging Face does.
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(refs_path("chat_templates", &format!("{chat_ref}.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(tok.chat_template(), doc["template"].as_str());
    assert!(tok.chat_template_supports_tools());
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "tool_call_dict_args")
        .unwrap();
    let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
    let tools: Vec<Value> = serde_json::from_value(case["tools"].clone()).unwrap();
    assert_eq!(
        tok.render_chat(&messages, Some(&tools)).unwrap(),
        case["expected"].as_str().unwrap()
    );
    let ids = tok.encode_chat_with_tools(&messages, Some(&tools)).unwrap();
    assert_eq!(ids[0], 151644, "<|im_start|> first, no BOS");
    assert_eq!(tok.bos_id(), Some(151643));
    // llama.cpp's end-of-generation set: `</s>` (a plain piece of Qwen's
    // vocabulary that llama.cpp makes control), <|endoftext|>, <|im_end|>,
    // <|fim_pad|>, <|repo_name|>, <|file_sep|>.
    assert_eq!(
        tok.eos_ids(),
        &[128247, 151643, 151645, 151662, 151663, 151664],
        "{:?}",
        tok.eos_ids()
    );
    assert_eq!(tok.encode("<|im_start|>", true).unwrap(), [151644]);
    assert_eq!(tok.encode("<tool_call>", false).unwrap(), [151657]);
    assert_eq!(tok.encode("<|fim_prefix|>", true).unwrap(), [151659]);
    assert!(tok.encode("<|fim_prefix|>", false).unwrap().len() > 1);
    check_round_trip(&tok, 0);
}

#[test]
fn qwen2_5_coder_0_5b_matches_llama_cpp() {
    check_qwen("qwen2.5-coder-0.5b", "qwen2.5-instruct");
}

#[test]
fn qwen2_5_coder_1_5b_matches_llama_cpp() {
    check_qwen("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b");
}

/// `src`'s GGUF metadata without tensors, `tokenizer.ggml.pre` = `pre`,
/// the keys in `drop` left out: the copy `make_tokenize_refs.py
/// --pre-variants` gave llama-tokenize (GGUF v2/v3 layout).
fn metadata_copy(src: &std::path::Path, dst: &std::path::Path, pre: &str, drop: &[&str]) {
    use std::io::{BufReader, Read};
    let mut r = BufReader::new(std::fs::File::open(src).unwrap());
    let mut take = |n: usize, out: &mut Vec<u8>| {
        let start = out.len();
        out.resize(start + n, 0);
        r.read_exact(&mut out[start..]).unwrap();
    };
    let mut header = Vec::new();
    take(24, &mut header);
    assert_eq!(&header[..4], b"GGUF");
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let n_kv = u64_at(&header, 16);
    let size = |kind: u32| match kind {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    };
    // Appends one value of `kind` to `out`.
    fn value(
        kind: u32,
        out: &mut Vec<u8>,
        take: &mut dyn FnMut(usize, &mut Vec<u8>),
        size: &dyn Fn(u32) -> Option<usize>,
    ) {
        let at = out.len();
        match kind {
            8 => {
                take(8, out);
                let n = u64::from_le_bytes(out[at..at + 8].try_into().unwrap());
                take(n as usize, out);
            }
            9 => {
                take(12, out);
                let item = u32::from_le_bytes(out[at..at + 4].try_into().unwrap());
                let n = u64::from_le_bytes(out[at + 4..at + 12].try_into().unwrap());
                match size(item) {
                    Some(s) => take(s * n as usize, out),
                    None => {
                        for _ in 0..n {
                            value(item, out, take, size);
                        }
                    }
                }
            }
            k => take(size(k).expect("a GGUF value type"), out),
        }
    }
    let string = |s: &str| {
        let mut b = (s.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(s.as_bytes());
        b
    };
    let mut kept = Vec::new();
    let mut n_kept = 0u64;
    for _ in 0..n_kv {
        let mut kv = Vec::new();
        take(8, &mut kv);
        let n = u64_at(&kv, 0) as usize;
        take(n + 4, &mut kv);
        let key = std::str::from_utf8(&kv[8..8 + n]).unwrap().to_string();
        let kind = u32_at(&kv, 8 + n);
        value(kind, &mut kv, &mut take, &size);
        if key != "tokenizer.ggml.pre" && !drop.contains(&key.as_str()) {
            kept.extend_from_slice(&kv);
            n_kept += 1;
        }
    }
    kept.extend(string("tokenizer.ggml.pre"));
    kept.extend(8u32.to_le_bytes());
    kept.extend(string(pre));
    let mut out = header[..8].to_vec();
    out.extend(0u64.to_le_bytes());
    out.extend((n_kept + 1).to_le_bytes());
    out.extend(kept);
    out.resize(out.len().next_multiple_of(32), 0);
    std::fs::write(dst, out).unwrap();
}

/// The other pre-tokenizers on Qwen's vocabulary against llama.cpp
/// (`tokenize_pre_<pre>.jsonl`, see `make_tokenize_refs.py
/// --pre-variants`): Llama 3's `llama-bpe` (and its default of adding
/// BOS), llama.cpp's `default`, `gpt-2`, `smollm`.
#[test]
fn pre_tokenizers_match_llama_cpp_on_qwen_vocab() {
    let dir = std::env::temp_dir().join(format!("te-tok-pre-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_path("qwen2.5-coder-0.5b");
    let mut failures = Vec::new();
    for pre in ["llama-bpe", "default", "gpt-2", "smollm"] {
        let path = dir.join(format!("{pre}.gguf"));
        let drop: &[&str] = if pre == "llama-bpe" {
            &["tokenizer.ggml.add_bos_token"]
        } else {
            &[]
        };
        metadata_copy(&src, &path, pre, drop);
        let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        for line in refs("qwen2.5-coder-0.5b", &format!("tokenize_pre_{pre}.jsonl")) {
            let text = line["text"].as_str().unwrap();
            for (key, parse_special) in [("ids", true), ("ids_no_parse_special", false)] {
                let got = tok.encode(text, parse_special).unwrap();
                let want = ids(&line[key]);
                if got != want {
                    failures.push(format!(
                        "{pre}: {key} of {text:?}:\n   got  {got:?}\n   want {want:?}"
                    ));
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The `tokenizer.json` written by `to_json` loads back into a tokenizer
/// that encodes the same way.
#[test]
fn to_json_round_trips() {
    for name in ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"] {
        let file = GgufFile::open(model_path(name)).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let dir = std::env::temp_dir().join(format!("te-tok-json-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tok.to_json().unwrap()).unwrap();
        let back = Tokenizer::from_file(&path).unwrap();
        for line in refs(name, "tokenize.jsonl") {
            let text = line["text"].as_str().unwrap();
            assert_eq!(
                back.encode(text, true).unwrap(),
                ids(&line["ids"]),
                "{name}: {text:?}"
            );
            assert_eq!(
                back.encode(text, false).unwrap(),
                ids(&line["ids_no_parse_special"]),
                "{name}: {text:?}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
