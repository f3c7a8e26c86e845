//! Model validation (issue 15): files that disagree with themselves are
//! refused with errors naming the tensors and fields involved, by loading
//! and by `inspect` alike; biases are applied, never dropped.
//!
//! GGUF cases use the tiny llama of `tiny_gguf/`; Hugging Face cases the
//! tiny checkpoints of `tiny/` (whose float64 reference includes biases).

mod tiny;
mod tiny_gguf;

use te_formats::gguf::GgufFile;
use te_models::inspect::inspect;
use te_models::loader::{load_model, load_parts};
use te_models::source::ModelSource;
use te_tokenizer::tokenizer::Tokenizer;
use tiny::{Checkpoint, Spec};
use tiny_gguf::{add_biases, tiny_llama, Gguf, TempFile, Value};

fn gguf_source(f: &TempFile) -> ModelSource {
    ModelSource::Gguf(f.path.clone())
}

/// The error of loading `g` (also what `inspect` reports, when the file
/// gets that far), which must name every one of `needles`.
fn assert_refused(g: &Gguf, tag: &str, needles: &[&str]) -> String {
    let f = g.write(tag);
    let msg = match load_parts(&gguf_source(&f)) {
        Ok(_) => panic!("{tag}: loaded"),
        Err(e) => e.to_string(),
    };
    for n in needles {
        assert!(msg.contains(n), "{tag}: `{n}` missing from: {msg}");
    }
    assert!(
        msg.contains(&f.path.display().to_string()),
        "{tag}: file not named: {msg}"
    );
    // inspect: the same problems, unless the file is refused on opening.
    match inspect(&gguf_source(&f)) {
        Ok(info) => {
            assert!(!info.problems.is_empty(), "{tag}: inspect found nothing");
            let all = info.problems.join("; ");
            for n in needles {
                assert!(all.contains(n), "{tag}: inspect lacks `{n}`: {all}");
            }
        }
        Err(e) => assert_eq!(e.to_string(), msg, "{tag}: inspect and load disagree"),
    }
    msg
}

#[test]
fn tiny_gguf_loads_and_inspects_clean() {
    let f = tiny_llama().write("clean");
    let loaded = load_model(&gguf_source(&f)).expect("tiny llama loads");
    let c = &loaded.model.config;
    assert_eq!(
        (c.num_hidden_layers, c.vocab_size, c.head_dim),
        (tiny_gguf::LAYERS, tiny_gguf::VOCAB, tiny_gguf::HEAD_DIM)
    );
    assert!(!c.attention_bias && !c.mlp_bias && c.tie_word_embeddings);
    let info = inspect(&gguf_source(&f)).expect("inspect");
    assert!(info.problems.is_empty(), "{:?}", info.problems);
    assert_eq!(
        loaded.tokenizer.encode("the ab", false).unwrap(),
        [54, 52, 56] // "the", "Ġ", "ab"
    );
}

/// Reproducer 5: `llama.block_count` that disagrees with the `blk.N`
/// tensors, either way.
#[test]
fn block_count_must_match_the_layers_in_the_file() {
    let mut g = tiny_llama();
    g.set("llama.block_count", Value::U32(1));
    let msg = assert_refused(&g, "fewer-layers", &["llama.block_count", "blk.1."]);
    assert!(msg.contains("not used"), "{msg}");
    g.set("llama.block_count", Value::U32(3));
    let msg = assert_refused(
        &g,
        "more-layers",
        &["llama.block_count", "blk.2.attn_norm.weight"],
    );
    assert!(msg.contains("missing"), "{msg}");
}

/// Reproducer 5: redundant metadata checked against the tensors.
#[test]
fn redundant_gguf_metadata_must_agree_with_the_tensors() {
    for v in [0, 1, 4, u32::MAX] {
        let mut g = tiny_llama();
        g.set("llama.rope.dimension_count", Value::U32(v));
        assert_refused(
            &g,
            "rope-dims",
            &["llama.rope.dimension_count", &v.to_string()],
        );
    }
    for v in [0, 1, 63, u32::MAX] {
        let mut g = tiny_llama();
        g.set("llama.vocab_size", Value::U32(v));
        assert_refused(&g, "vocab", &["llama.vocab_size", "token_embd.weight"]);
    }
    let mut g = tiny_llama();
    g.set("llama.attention.value_length", Value::U32(8));
    assert_refused(&g, "value-length", &["llama.attention.value_length"]);
    let mut g = tiny_llama();
    g.set("llama.expert_count", Value::U32(8));
    assert_refused(&g, "experts", &["llama.expert_count"]);
    // A vocabulary one token short of the embedding.
    let mut g = tiny_llama();
    let mut tokens = tiny_gguf::vocabulary();
    tokens.pop();
    let mut types = vec![1; tokens.len()];
    types[tiny_gguf::EOS as usize] = 3;
    g.set("tokenizer.ggml.tokens", Value::StrArray(tokens))
        .set("tokenizer.ggml.token_type", Value::I32Array(types));
    assert_refused(
        &g,
        "tokens",
        &["tokenizer.ggml.tokens", "token_embd.weight"],
    );
    // Absent redundant keys are fine.
    let mut g = tiny_llama();
    g.unset("llama.vocab_size")
        .unset("llama.rope.dimension_count");
    load_parts(&gguf_source(&g.write("no-redundant"))).expect("loads");
}

/// A config field contradicting a tensor's shape names both.
#[test]
fn shape_contradicting_the_config_names_tensor_and_field() {
    let mut g = tiny_llama();
    g.set("llama.attention.head_count_kv", Value::U32(2));
    assert_refused(
        &g,
        "kv-heads",
        &[
            "blk.0.attn_k.weight",
            "llama.attention.head_count_kv",
            "[32, 32]",
        ],
    );
    let mut g = tiny_llama();
    g.set("llama.feed_forward_length", Value::U32(32));
    assert_refused(
        &g,
        "ffn",
        &["blk.0.ffn_gate.weight", "llama.feed_forward_length"],
    );
}

/// Reproducer 4: relabelling a tensor's type makes its data overlap the
/// next tensor's (F16, BF16) or leave a gap (Q4_0); both are refused when
/// the file is opened, naming both tensors.
#[test]
fn relabelled_tensor_types_are_refused() {
    let (bytes, fields) = tiny_llama().bytes_and_fields();
    let at = fields
        .iter()
        .find(|f| f.what == "tensor blk.1.attn_k.weight type")
        .expect("type field")
        .at;
    for (ty, word) in [
        (tiny_gguf::F16, "overlaps"),
        (tiny_gguf::BF16, "overlaps"),
        (tiny_gguf::Q4_0, "gap"),
    ] {
        let mut b = bytes.clone();
        b[at..at + 4].copy_from_slice(&ty.to_le_bytes());
        let f = TempFile::new("relabel", &b);
        let e = GgufFile::open(&f.path).expect_err("relabelled type opens");
        let msg = e.to_string();
        assert!(matches!(e, te_formats::FormatError::Format { .. }), "{msg}");
        for n in ["blk.1.attn_k.weight", "blk.1.attn_v.weight", word] {
            assert!(msg.contains(n), "type {ty}: `{n}` missing from {msg}");
        }
    }
}

/// Reproducer 8: a type `generate` cannot read is a problem for `inspect`
/// too (the reader opens the file; the model is refused).
#[test]
fn unreadable_tensor_types_are_problems_for_inspect_and_load() {
    let (mut b, fields) = tiny_llama().bytes_and_fields();
    // The last tensor: no tensor follows, so its unknown size is no
    // layout problem.
    let at = fields
        .iter()
        .find(|f| f.what == "tensor output_norm.weight type")
        .expect("type field")
        .at;
    b[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let f = TempFile::new("type99", &b);
    GgufFile::open(&f.path).expect("the reader opens unknown types");
    let info = inspect(&gguf_source(&f)).expect("inspect runs");
    assert_eq!(info.problems.len(), 1, "{:?}", info.problems);
    assert!(info.problems[0].contains("output_norm.weight") && info.problems[0].contains("id 99"));
    let msg = load_parts(&gguf_source(&f))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        msg.contains("output_norm.weight") && msg.contains("id 99"),
        "{msg}"
    );
}

/// Reproducer 8: a corrupt merges list names the field and the file.
#[test]
fn corrupt_merges_name_the_field_and_file() {
    let mut g = tiny_llama();
    let mut m = tiny_gguf::merges();
    m[2] = "Ġ thX".into(); // "thX" is not in the vocabulary
    g.set("tokenizer.ggml.merges", Value::StrArray(m));
    let f = g.write("merges");
    let msg = load_parts(&gguf_source(&f))
        .err()
        .expect("refused")
        .to_string();
    for n in ["tokenizer.ggml.merges", &f.path.display().to_string()] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
}

/// Reproducer 2 (GGUF side): `blk.N.*.bias` tensors are detected and
/// applied; an incomplete set is refused, naming what is missing.
#[test]
fn gguf_biases_are_loaded_or_refused() {
    let mut g = tiny_llama();
    add_biases(&mut g, &["attn_q", "attn_k", "attn_v", "attn_output"]);
    let f = g.write("attn-bias");
    let parts = load_parts(&gguf_source(&f)).expect("biased model loads");
    assert!(parts.config.attention_bias && !parts.config.mlp_bias);
    let l0 = &parts.weights.layers[0];
    assert_eq!(l0.q_proj.bias.as_ref().map(Vec::len), Some(32));
    assert_eq!(l0.o_proj.bias.as_ref().map(Vec::len), Some(32));
    assert!(l0.gate_proj.bias.is_none());
    // The stored values, exactly.
    let want = GgufFile::open(&f.path)
        .unwrap()
        .dequantize("blk.0.attn_k.bias")
        .unwrap();
    assert_eq!(l0.k_proj.bias.as_deref(), Some(&want[..]));

    let mut g = tiny_llama();
    add_biases(&mut g, &["ffn_gate", "ffn_up"]);
    assert_refused(&g, "partial-mlp-bias", &["blk.0.ffn_down.bias", "missing"]);

    let mut g = tiny_llama();
    add_biases(&mut g, &["attn_q", "attn_k", "attn_v", "attn_output"]);
    let t = g.tensor_mut("blk.1.attn_v.bias");
    t.dims = vec![8];
    t.data.truncate(32);
    assert_refused(&g, "short-bias", &["blk.1.attn_v.bias", "[16]"]);
}

// ------------------------------------------------------ Hugging Face

fn load_error(ck: &Checkpoint) -> String {
    match ck.load() {
        Ok(_) => panic!("{}: loaded", ck.dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites `config.json` of `ck` with `edit`.
fn edit_config(
    ck: &Checkpoint,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) {
    let path = ck.dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(c.as_object_mut().unwrap());
    std::fs::write(&path, c.to_string()).unwrap();
}

/// Reproducer 2: bias tensors without the flag, or the flag without them.
#[test]
fn hf_biases_and_flags_must_agree() {
    let ck = Checkpoint::write(Spec {
        attention_bias: true,
        mlp_bias: true,
        ..Spec::llama()
    });
    ck.load().expect("biased checkpoint loads");
    // The tensors without the flags: refused, not ignored.
    edit_config(&ck, |c| {
        c.insert("attention_bias".into(), false.into());
    });
    let msg = load_error(&ck);
    for n in [
        "model.layers.0.self_attn.q_proj.bias",
        "attention_bias",
        "not used",
    ] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
    edit_config(&ck, |c| {
        c.remove("attention_bias");
        c.remove("mlp_bias");
    });
    let msg = load_error(&ck);
    assert!(msg.contains("mlp.gate_proj.bias"), "{msg}");

    // The flags without the tensors.
    for flag in ["attention_bias", "mlp_bias"] {
        let ck = Checkpoint::write(Spec::llama());
        edit_config(&ck, |c| {
            c.insert(flag.into(), true.into());
        });
        let msg = load_error(&ck);
        let tensor = if flag == "attention_bias" {
            "model.layers.0.self_attn.q_proj.bias"
        } else {
            "model.layers.0.mlp.gate_proj.bias"
        };
        for n in [tensor, flag, "missing"] {
            assert!(msg.contains(n), "{flag}: `{n}` missing from {msg}");
        }
    }
}

/// Reproducer 5 (Hugging Face): `num_hidden_layers` below the layers the
/// file holds.
#[test]
fn hf_layer_count_must_match_the_file() {
    let ck = Checkpoint::write(Spec::llama());
    edit_config(&ck, |c| {
        c.insert("num_hidden_layers".into(), 1.into());
    });
    let msg = load_error(&ck);
    for n in ["num_hidden_layers", "model.layers.1.", "not used"] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
}

/// Older Llama checkpoints store `rotary_emb.inv_freq`: allowed unused.
#[test]
fn hf_rotary_inv_freq_may_be_stored() {
    let ck = Checkpoint::write_with(Spec::llama(), |t| {
        t.push(tiny::Tensor {
            name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            shape: vec![8],
            values: vec![0.5; 8],
        })
    });
    ck.load().expect("inv_freq is allowed");
    let ck = Checkpoint::write_with(Spec::llama(), |t| {
        t.push(tiny::Tensor {
            name: "model.layers.0.self_attn.extra.weight".into(),
            shape: vec![8],
            values: vec![0.5; 8],
        })
    });
    assert!(load_error(&ck).contains("model.layers.0.self_attn.extra.weight"));
}

/// Reproducer 7: `weight_map` shards must be relative paths inside the
/// model directory.
#[test]
fn shards_outside_the_model_directory_are_refused() {
    let ck = Checkpoint::write(Spec {
        shards: 2,
        ..Spec::llama()
    });
    // Another checkpoint's shard, by absolute path and by climbing out.
    let other = Checkpoint::write(Spec {
        shards: 2,
        ..Spec::llama()
    });
    let shard = "model-00002-of-00002.safetensors";
    let absolute = other.dir.join(shard).display().to_string();
    let other_name = other
        .dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let climbing = format!("../{other_name}/{shard}");
    let index = ck.dir.join("model.safetensors.index.json");
    let original = std::fs::read_to_string(&index).unwrap();
    for bad in [
        absolute.as_str(),
        climbing.as_str(),
        "sub/../../x.safetensors",
        "",
    ] {
        let text = original.replace(
            &format!("\"{shard}\""),
            &serde_json::to_string(bad).unwrap(),
        );
        assert_ne!(text, original);
        std::fs::write(&index, text).unwrap();
        let msg = load_error(&ck);
        assert!(
            msg.contains("model.safetensors.index.json") && msg.contains("not a relative path"),
            "{bad}: {msg}"
        );
    }
    std::fs::write(&index, &original).unwrap();
    ck.load().expect("the original index loads");
}

/// A `weight_map` entry naming a tensor its shard lacks, and a tensor
/// stored in two shards, are refused.
#[test]
fn shard_index_must_match_the_shards() {
    let ck = Checkpoint::write(Spec {
        shards: 2,
        ..Spec::llama()
    });
    let index = ck.dir.join("model.safetensors.index.json");
    let mut idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let map = idx["weight_map"].as_object_mut().unwrap();
    let (name, shard) = map
        .iter()
        .find(|(_, v)| v.as_str() == Some("model-00001-of-00002.safetensors"))
        .map(|(k, _)| (k.clone(), "model-00002-of-00002.safetensors"))
        .unwrap();
    map.insert(name.clone(), shard.into());
    std::fs::write(&index, idx.to_string()).unwrap();
    let msg = load_error(&ck);
    assert!(msg.contains(&name) && msg.contains("weight_map"), "{msg}");
}

/// A Hugging Face `tokenizer.json` written from the tiny GGUF's tokenizer.
fn tokenizer_json() -> String {
    let f = tiny_llama().write("tok");
    let t = Tokenizer::from_gguf(&GgufFile::open(&f.path).unwrap()).unwrap();
    t.to_json().unwrap()
}

/// Reproducer 6: a present but unreadable `tokenizer_config.json` (or
/// `generation_config.json`) is an error naming it, not "no chat template".
#[test]
fn unreadable_tokenizer_side_files_are_errors() {
    let dir = tiny::temp_dir("tokcfg");
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    Tokenizer::from_file(&dir.join("tokenizer.json")).expect("clean tokenizer");
    for name in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::write(dir.join(name), b"\xff\xfe garbage \x00").unwrap();
        let msg = Tokenizer::from_file(&dir.join("tokenizer.json"))
            .err()
            .unwrap_or_else(|| panic!("{name}: accepted"))
            .to_string();
        assert!(msg.contains(name), "{name}: {msg}");
        std::fs::write(dir.join(name), "{\"not\": json").unwrap();
        let msg = Tokenizer::from_file(&dir.join("tokenizer.json"))
            .err()
            .unwrap_or_else(|| panic!("{name}: accepted"))
            .to_string();
        assert!(
            msg.contains(name) && msg.contains("not JSON"),
            "{name}: {msg}"
        );
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reproducer 8: an added token whose id `tokenizers` would renumber is
/// refused when the tokenizer loads.
#[test]
fn added_token_ids_must_be_kept() {
    let dir = tiny::temp_dir("added");
    let mut json: serde_json::Value = serde_json::from_str(&tokenizer_json()).unwrap();
    let added = json["added_tokens"].as_array_mut().unwrap();
    assert_eq!(added[0]["content"], "<|endoftext|>");
    added[0]["id"] = 1_000_000_000u64.into();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let msg = Tokenizer::from_file(&path)
        .expect_err("refused")
        .to_string();
    for n in ["tokenizer.json", "<|endoftext|>", "1000000000"] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tokenizer with ids past the model's vocabulary is refused at load
/// (it used to fail only when such a token reached the embedding).
#[test]
fn tokenizer_ids_must_fit_the_vocabulary() {
    // The tiny checkpoint has 53 embedding rows; the tokenizer 64 tokens.
    let ck = Checkpoint::write(Spec::llama());
    std::fs::write(ck.dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    let msg = match load_model(&ModelSource::HfDir(ck.dir.clone())) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    for n in ["token id 63", "vocabulary of 53"] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
    let info = inspect(&ModelSource::HfDir(ck.dir.clone())).expect("inspect");
    assert!(
        info.problems.iter().any(|p| p.contains("token id 63")),
        "{:?}",
        info.problems
    );
}

/// One error lists several problems, and inspect sees the same ones.
#[test]
fn every_problem_is_reported_at_once() {
    let ck = Checkpoint::write_with(Spec::llama(), |t| {
        t.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
        let q = t
            .iter_mut()
            .find(|t| t.name == "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        q.shape = vec![32, 64];
    });
    let msg = load_error(&ck);
    for n in [
        "problems",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "num_attention_heads × head_dim",
    ] {
        assert!(msg.contains(n), "`{n}` missing from {msg}");
    }
}

/// `te convert` keeps biases: a biased GGUF llama and its Hugging Face
/// conversion (Q/K rows and their biases un-permuted, half-split RoPE) give
/// the same logits, and the conversion would differ without the biases.
#[test]
fn converted_biased_gguf_keeps_its_biases() {
    use te_cache::CacheLayout;
    use te_models::model::Logits;
    let mut g = tiny_llama();
    add_biases(
        &mut g,
        &[
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    );
    let f = g.write("convert-bias");
    let out = tiny::temp_dir("converted");
    te_models::convert::convert_gguf_to_hf(&f.path, &out, te_models::convert::OutputDtype::F32)
        .expect("convert");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (
            config["attention_bias"].as_bool(),
            config["mlp_bias"].as_bool()
        ),
        (Some(true), Some(true))
    );
    let tokens = [3u32, 17, 54, 8, 60, 41, 22];
    let logits = |source: ModelSource| {
        let m = load_model(&source).expect("load").model;
        let mut cache = m.new_cache(1, 16, 16, CacheLayout::Contiguous).unwrap();
        cache.pre_step(&[(0, tokens.len())]).unwrap();
        m.forward(&tokens, &mut cache, Logits::All).unwrap()
    };
    let a = logits(gguf_source(&f));
    let b = logits(ModelSource::HfDir(out.clone()));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "GGUF and converted logits differ by {diff}");
    // Without the biases the logits move: the comparison above is not vacuous.
    let plain = tiny_llama().write("convert-plain");
    let c = logits(gguf_source(&plain));
    let moved = a
        .iter()
        .zip(&c)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(moved > 1e-2, "biases move the logits by only {moved}");
    std::fs::remove_dir_all(&out).unwrap();
}
