//! The families added after Llama and Gemma (Qwen2, Qwen3, Mistral, Llama
//! 3.x): tiny random checkpoints against the independent float64 forward
//! of `tiny/mod.rs`, loaded from a Hugging Face directory and from a GGUF
//! file written here the way llama.cpp's converter lays one out (its
//! tensor names and metadata keys; Q/K rows permuted for interleaved RoPE
//! on `llama`/`mistral`, kept on `qwen2`/`qwen3`; Llama 3.1 scaling as a
//! `rope_freqs.weight` tensor), over every feeding mode. Each feature is
//! shown to move the reference logits, so that a model ignoring it fails.

mod tiny;
mod tiny_gguf;

use te_models::family::NameScheme;
use te_models::model::Model;
use te_models::weights::ModelWeights;
use tiny::{
    assert_feature_bites, check_all_modes, check_model_all_modes, Checkpoint, Family, RopeScaling,
    Spec, WindowEncoding,
};
use tiny_gguf::{Gguf, TempFile, Tensor, Value};

/// GGUF's name of a Hugging Face tensor name (llama.cpp's converter).
fn gguf_name(hf: &str) -> String {
    let global = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = global.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, rest) = rest.split_once('.').unwrap();
    let (stem, kind) = rest.rsplit_once('.').unwrap();
    let role = match stem {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{role}.{kind}")
}

/// llama.cpp's Q/K permutation: within each head of `d` rows, GGUF row
/// `2i` is Hugging Face row `i` and row `2i + 1` is row `i + d/2`.
fn permute_rows(v: &[f64], d: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0.0; v.len()];
    for head in 0..v.len() / (d * cols) {
        for i in 0..d / 2 {
            for (gguf, hf) in [(2 * i, i), (2 * i + 1, i + d / 2)] {
                let (dst, src) = ((head * d + gguf) * cols, (head * d + hf) * cols);
                out[dst..dst + cols].copy_from_slice(&v[src..src + cols]);
            }
        }
    }
    out
}

/// `ck` as a GGUF file of architecture `arch` (F32 tensors), with `extra`
/// metadata, loaded as te-models loads a GGUF model.
fn gguf_of(ck: &Checkpoint, arch: &str, extra: &[(&str, Value)]) -> (TempFile, Model) {
    try_gguf_of(ck, arch, extra).expect("load the GGUF file")
}

/// [`gguf_of`], errors returned.
fn try_gguf_of(
    ck: &Checkpoint,
    arch: &str,
    extra: &[(&str, Value)],
) -> te_models::Result<(TempFile, Model)> {
    let s = &ck.spec;
    let interleaved = matches!(arch, "llama" | "mistral");
    let mut g = Gguf::default();
    let key = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Value::U32(v as u32);
    g.set("general.architecture", Value::Str(arch.into()))
        .set(&key("block_count"), u(s.num_hidden_layers))
        .set(&key("context_length"), u(s.max_position_embeddings))
        .set(&key("embedding_length"), u(s.hidden_size))
        .set(&key("feed_forward_length"), u(s.intermediate_size))
        .set(&key("attention.head_count"), u(s.num_attention_heads))
        .set(&key("attention.head_count_kv"), u(s.num_key_value_heads))
        .set(&key("attention.key_length"), u(s.head_dim))
        .set(&key("attention.value_length"), u(s.head_dim))
        .set(&key("rope.dimension_count"), u(s.head_dim))
        .set(&key("rope.freq_base"), Value::F32(s.rope_theta as f32))
        .set(
            &key("attention.layer_norm_rms_epsilon"),
            Value::F32(s.rms_norm_eps as f32),
        );
    for (k, v) in extra {
        g.set(&key(k), v.clone());
    }
    for (name, values) in &ck.weights {
        let shape: Vec<usize> = if name.ends_with(".bias") || name.contains("norm") {
            vec![values.len()]
        } else {
            let rows = if name.contains("q_proj") {
                s.num_attention_heads * s.head_dim
            } else if name.contains("k_proj") || name.contains("v_proj") {
                s.num_key_value_heads * s.head_dim
            } else if name.contains("o_proj") || name.contains("down_proj") {
                s.hidden_size
            } else if name.contains("gate_proj") || name.contains("up_proj") {
                s.intermediate_size
            } else {
                s.vocab_size
            };
            vec![rows, values.len() / rows]
        };
        let qk = name.contains("q_proj") || name.contains("k_proj");
        let values = if interleaved && qk {
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            permute_rows(values, s.head_dim, cols)
        } else {
            values.clone()
        };
        g.tensors.push(Tensor {
            name: gguf_name(name),
            dims: shape.iter().rev().map(|&x| x as u64).collect(),
            ty: 0,
            data: values
                .iter()
                .flat_map(|v| (*v as f32).to_le_bytes())
                .collect(),
        });
    }
    if let Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    }) = s.rope_scaling
    {
        // llama.cpp's converter: one divisor per frequency, in f32.
        let d = s.head_dim;
        let old = original_max_position_embeddings as f32;
        let (factor, low, high) = (
            factor as f32,
            low_freq_factor as f32,
            high_freq_factor as f32,
        );
        let factors: Vec<f32> = (0..d / 2)
            .map(|i| {
                let freq = 1.0 / (s.rope_theta as f32).powf((2 * i) as f32 / d as f32);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect();
        g.tensors.push(Tensor {
            name: "rope_freqs.weight".into(),
            dims: vec![(d / 2) as u64],
            ty: 0,
            data: factors.iter().flat_map(|f| f.to_le_bytes()).collect(),
        });
    }
    // The tiny llama's gpt2 tokenizer (64 tokens), for `te convert`.
    if s.vocab_size == tiny_gguf::VOCAB {
        for (k, v) in tiny_gguf::tiny_llama().kvs {
            if k.starts_with("tokenizer.") {
                g.set(&k, v);
            }
        }
    }
    let file = g.write(arch);
    let gguf = te_formats::gguf::GgufFile::open(&file.path)?;
    let cfg = te_models::gguf_model::config_from_gguf(&gguf)?;
    let weights = ModelWeights::load(&gguf, NameScheme::Gguf, &cfg, 0.0)?;
    Ok((file, Model::new(cfg, weights)?))
}

#[test]
fn qwen2_biases_yarn_and_windows_match_f64_reference() {
    let ck = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        sliding_window: Some(5),
        sliding_layers: vec![false, true],
        window_encoding: WindowEncoding::UseSlidingWindow(1),
        ..Spec::qwen2()
    });
    let cfg = &ck.load().expect("load").config;
    assert!(cfg.qkv_bias && !cfg.attention_bias && cfg.tie_word_embeddings);
    assert_eq!(cfg.layer_windows, vec![None, Some(5)]);
    assert_feature_bites(&ck, 20, "q/k/v biases", |s| s.family = Family::Llama);
    assert_feature_bites(&ck, 20, "yarn", |s| s.rope_scaling = None);
    assert_feature_bites(&ck, 20, "sliding window", |s| {
        s.sliding_layers = vec![false; 2]
    });
    check_all_modes(&ck, 20);
    // GGUF: llama.cpp runs qwen2 without a window; the reference here
    // has none either.
    let no_window = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        ..Spec::qwen2()
    });
    let (_file, model) = gguf_of(
        &no_window,
        "qwen2",
        &[
            ("rope.scaling.type", Value::Str("yarn".into())),
            ("rope.scaling.factor", Value::F32(4.0)),
            ("rope.scaling.original_context_length", Value::U32(8)),
        ],
    );
    assert!(model.config.qkv_bias && !model.config.attention_bias);
    check_model_all_modes(&no_window, &model, 20, "GGUF");
}

#[test]
fn qwen3_qk_norms_and_head_dim_match_f64_reference() {
    let ck = Checkpoint::write(Spec::qwen3());
    let cfg = &ck.load().expect("load").config;
    assert!(cfg.qk_norm && !cfg.qkv_bias && !cfg.tie_word_embeddings);
    assert_eq!(cfg.head_dim, 24);
    assert_feature_bites(&ck, 20, "q/k norms", |s| s.family = Family::Llama);
    check_all_modes(&ck, 20);
    let (_file, model) = gguf_of(&ck, "qwen3", &[]);
    check_model_all_modes(&ck, &model, 20, "GGUF");
}

#[test]
fn mistral_sliding_window_matches_f64_reference() {
    let ck = Checkpoint::write(Spec::mistral());
    assert_eq!(
        ck.load().expect("load").config.layer_windows,
        vec![Some(5); 2]
    );
    assert_feature_bites(&ck, 20, "sliding window", |s| {
        s.sliding_layers = vec![false; 2]
    });
    check_all_modes(&ck, 20);
    // A GGUF labelled `mistral` with its window key; permuted Q/K rows.
    let (_file, model) = gguf_of(
        &ck,
        "mistral",
        &[("attention.sliding_window", Value::U32(5))],
    );
    check_model_all_modes(&ck, &model, 20, "GGUF");
}

/// Mistral 7B v0.2+ (no window), as llama.cpp writes it: GGUF `llama`.
#[test]
fn mistral_without_window_as_gguf_llama_matches_f64_reference() {
    let ck = Checkpoint::write(Spec {
        sliding_window: None,
        sliding_layers: vec![false; 2],
        ..Spec::mistral()
    });
    check_all_modes(&ck, 20);
    let (_file, model) = gguf_of(&ck, "llama", &[]);
    check_model_all_modes(&ck, &model, 20, "GGUF");
}

/// Llama 3.1 scaling: `rope_scaling` in `config.json`, and the same as a
/// GGUF `rope_freqs.weight` tensor (llama.cpp's form), both against the
/// reference's Hugging Face `_compute_llama3_parameters`.
#[test]
fn llama3_rope_freqs_give_the_llama3_frequencies() {
    let ck = Checkpoint::write(Spec {
        rope_theta: 500000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }),
        tie_word_embeddings: true,
        seed: 24,
        ..Spec::llama()
    });
    assert_feature_bites(&ck, 24, "llama3 rope scaling", |s| s.rope_scaling = None);
    check_all_modes(&ck, 24);
    let (_file, model) = gguf_of(&ck, "llama", &[]);
    assert!(model.config.rope_freq_factors.is_some());
    assert_eq!(
        model.config.rope_scaling,
        te_kernels::rope::RopeScaling::None
    );
    check_model_all_modes(&ck, &model, 24, "GGUF rope_freqs");
}

/// What a family does not run is refused at load, naming it.
#[test]
fn unsupported_variants_are_refused_naming_the_field() {
    // GGUF, through the loader (validation included), with a tokenizer.
    let ck = Checkpoint::write(Spec {
        vocab_size: tiny_gguf::VOCAB,
        ..Spec::qwen2()
    });
    // The file with `extra` metadata: read as tests read GGUF here, then
    // loaded as `te` loads it.
    let load = |extra: &[(&str, Value)]| {
        let (file, _) = try_gguf_of(&ck, "qwen2", extra).map_err(|e| e.to_string())?;
        te_models::loader::load_model(&te_models::source::ModelSource::Gguf(file.path.clone()))
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(load(&[]), Ok(()));
    for (extra, needle) in [
        (("expert_count", Value::U32(8)), "mixture-of-experts"),
        (
            ("rope.dimension_count", Value::U32(8)),
            "rope.dimension_count",
        ),
        (
            ("rope.scaling.type", Value::Str("longrope".into())),
            "longrope",
        ),
    ] {
        let err = load(&[extra]).expect_err(needle);
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let ck = Checkpoint::write(Spec::qwen2());
    for (field, value, needle) in [
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 0.0}),
            "rope_scaling.factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0, "beta_fast": -1.0}),
            "rope_scaling.beta_fast",
        ),
        (
            "layer_types",
            serde_json::json!(["full_attention", "full_attention", "full_attention"]),
            "3 entries for 2 layers",
        ),
        (
            "layer_types",
            serde_json::json!(["full_attention", "bogus"]),
            "bogus",
        ),
        ("num_experts", serde_json::json!(8), "mixture-of-experts"),
        (
            "partial_rotary_factor",
            serde_json::json!(0.5),
            "partial_rotary_factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "longrope", "factor": 2.0}),
            "longrope",
        ),
    ] {
        let path = ck.dir.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let original = c.clone();
        c[field] = value;
        std::fs::write(&path, c.to_string()).unwrap();
        let err = ck.load().err().map(|e| e.to_string()).unwrap_or_default();
        std::fs::write(&path, original.to_string()).unwrap();
        assert!(
            err.contains(needle) && err.contains(field),
            "{field}: {err:?}"
        );
    }
}

/// A batch beside our sequence: its name, the chunk sizes of the batch's
/// first and second sequence, when each joins, and which one is ours.
type BatchCase<'a> = (&'a str, [&'a [usize]; 2], [usize; 2], usize);

/// Batch invariance on every family: a sequence fed the same chunks
/// (a 7-token prefill, then decode; or chunks of 5, 3, then decode) gets
/// the same logits bits alone in a contiguous cache as inside a ragged
/// batch with another sequence that joins later, prefills beside its
/// decode, or sits before it in the batch, in a paged cache.
#[test]
fn logits_are_bit_identical_alone_and_in_ragged_batches() {
    use te_models::model::Logits;
    use tiny::{chunked, paged, prompts, ragged, run_schedule, Rows};
    let specs = [
        Spec {
            rope_scaling: Some(RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 8,
            }),
            sliding_window: Some(5),
            sliding_layers: vec![false, true],
            window_encoding: WindowEncoding::UseSlidingWindow(1),
            ..Spec::qwen2()
        },
        Spec::qwen3(),
        Spec::mistral(),
        Spec::llama(),
    ];
    let bits = |rows: &Rows| -> Vec<(usize, Vec<u32>)> {
        rows.iter()
            .map(|(pos, r)| (*pos, r.iter().map(|x| x.to_bits()).collect()))
            .collect()
    };
    for spec in specs {
        let ck = Checkpoint::write(spec);
        let model = ck.load().expect("load");
        let p = prompts(&ck, 18);
        let (a, b) = (p[0].len(), p[1].len());
        for sizes in [&[7usize, 1][..], &[5, 3, 1]] {
            let alone = run_schedule(
                &model,
                te_cache::CacheLayout::Contiguous,
                &p[..1],
                &chunked(a, sizes),
                Logits::All,
            )
            .unwrap();
            let want = bits(&alone[0]);
            let cases: [BatchCase; 3] = [
                ("other joins later", [sizes, &[b]], [0, 2], 0),
                ("other prefills beside", [sizes, &[4, 1]], [0, 1], 0),
                ("ours second", [&[3, 1], sizes], [0, 0], 1),
            ];
            for (what, chunk_sizes, joins, ours) in cases {
                let (order, lens) = if ours == 0 {
                    (vec![p[0].clone(), p[1].clone()], [a, b])
                } else {
                    (vec![p[1].clone(), p[0].clone()], [b, a])
                };
                let steps = ragged(&lens, &chunk_sizes, &joins);
                let rows = run_schedule(&model, paged(3), &order, &steps, Logits::All).unwrap();
                assert!(
                    bits(&rows[ours]) == want,
                    "{:?} chunks {sizes:?}, {what}: logits differ from alone",
                    ck.spec.family
                );
            }
        }
    }
}

/// A model to convert: its spec, GGUF architecture and extra metadata.
type ConvertCase<'a> = (Spec, &'a str, &'a [(&'a str, Value)]);

/// `te convert` (GGUF to a Hugging Face directory) for each new family:
/// the directory loads as the same family and matches the float64
/// reference in every feeding mode (Q/K rows un-permuted for `mistral`,
/// `rope_freqs` written back as Llama 3.1's `rope_scaling`, biases and q/k
/// norms carried).
#[test]
fn converted_directories_match_f64_reference() {
    // Llama 3.1's own parameters: `te convert` recognises released ones.
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let yarn = [
        ("rope.scaling.type", Value::Str("yarn".into())),
        ("rope.scaling.factor", Value::F32(4.0)),
        ("rope.scaling.original_context_length", Value::U32(8)),
    ];
    let window = [("attention.sliding_window", Value::U32(5))];
    let cases: [ConvertCase; 4] = [
        (
            Spec {
                rope_scaling: Some(RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position_embeddings: 8,
                }),
                ..Spec::qwen2()
            },
            "qwen2",
            &yarn,
        ),
        (Spec::qwen3(), "qwen3", &[]),
        (Spec::mistral(), "mistral", &window),
        (
            Spec {
                rope_theta: 500000.0,
                rope_scaling: Some(llama3),
                ..Spec::llama()
            },
            "llama",
            &[],
        ),
    ];
    for (spec, arch, extra) in cases {
        let ck = Checkpoint::write(Spec {
            vocab_size: tiny_gguf::VOCAB,
            ..spec
        });
        let (file, _) = gguf_of(&ck, arch, extra);
        let out = tiny::temp_dir(&format!("convert-{arch}"));
        te_models::convert::convert_gguf_to_hf(
            &file.path,
            &out,
            te_models::convert::OutputDtype::F32,
        )
        .unwrap_or_else(|e| panic!("{arch}: {e}"));
        let model = tiny::load_dir(&out).expect("load the converted directory");
        assert_eq!(model.config.architecture.name(), arch);
        check_model_all_modes(&ck, &model, 20, "converted");
        std::fs::remove_dir_all(&out).unwrap();
    }
}
