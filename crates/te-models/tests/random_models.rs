//! Random-weight models (`random:<preset>`, `te_models::random`): every
//! tiny preset's logits against the independent float64 forward of
//! `tiny/mod.rs`, over the weights the random source generated and a
//! config the test reads from the preset's `config.json` text itself (not
//! through te-models' parser); seeds; bf16 storage; and the big presets
//! described without generating their weights.

mod tiny;

use std::collections::BTreeMap;

use serde_json::Value;
use te_cache::CacheLayout;
use te_formats::TensorSource;
use te_models::loader::load_model;
use te_models::model::Logits;
use te_models::random::{RandomModel, PRESETS};
use te_models::source::{resolve_model, ModelSource};
use tiny::{assert_rows_match, chunked, run_schedule, Family, RopeScaling, Spec, WindowEncoding};

const TINY: [&str; 8] = [
    "tiny-llama",
    "tiny-llama3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma",
    "tiny-gemma2",
    "tiny-gemma3",
];

fn random(spec: &str) -> RandomModel {
    match resolve_model(spec).expect("resolves") {
        ModelSource::Random(r) => r,
        other => panic!("{spec} resolved to {other:?}"),
    }
}

/// The reference's [`Spec`] read straight from a preset's `config.json`
/// with Hugging Face's defaults and layer rules (Gemma 2: even layers
/// slide; Gemma 3: layer i slides unless `(i + 1) % pattern == 0`;
/// Mistral: every layer when `sliding_window` is set; Qwen: layers `i >=
/// max_window_layers` when `use_sliding_window`).
fn spec_of(config_json: &str) -> Spec {
    let c: Value = serde_json::from_str(config_json).unwrap();
    let n = |f: &str| c[f].as_u64().unwrap_or_else(|| panic!("{f}")) as usize;
    let f = |f: &str| c[f].as_f64();
    let family = match c["model_type"].as_str().unwrap() {
        "llama" => Family::Llama,
        "mistral" => Family::Mistral,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "gemma" => Family::Gemma,
        "gemma2" => Family::Gemma2,
        "gemma3_text" => Family::Gemma3,
        other => panic!("model_type {other}"),
    };
    let layers = n("num_hidden_layers");
    let sliding_layers = match family {
        Family::Llama | Family::Gemma => vec![false; layers],
        Family::Mistral => vec![c["sliding_window"].is_u64(); layers],
        Family::Qwen2 | Family::Qwen3 => (0..layers)
            .map(|i| c["use_sliding_window"] == true && i >= n("max_window_layers"))
            .collect(),
        Family::Gemma2 => (0..layers).map(|i| i % 2 == 0).collect(),
        Family::Gemma3 => (0..layers)
            .map(|i| (i + 1) % n("sliding_window_pattern") != 0)
            .collect(),
    };
    let s = &c["rope_scaling"];
    let rope_scaling = match s["rope_type"].as_str().or(s["type"].as_str()) {
        None => None,
        Some("linear") => Some(RopeScaling::Linear {
            factor: s["factor"].as_f64().unwrap(),
        }),
        Some("llama3") => Some(RopeScaling::Llama3 {
            factor: s["factor"].as_f64().unwrap(),
            low_freq_factor: s["low_freq_factor"].as_f64().unwrap(),
            high_freq_factor: s["high_freq_factor"].as_f64().unwrap(),
            original_max_position_embeddings: s["original_max_position_embeddings"]
                .as_u64()
                .unwrap() as usize,
        }),
        Some("yarn") => Some(RopeScaling::Yarn {
            factor: s["factor"].as_f64().unwrap(),
            original_max_position_embeddings: s["original_max_position_embeddings"]
                .as_u64()
                .unwrap() as usize,
        }),
        Some(other) => panic!("rope_type {other}"),
    };
    Spec {
        family,
        vocab_size: n("vocab_size"),
        hidden_size: n("hidden_size"),
        intermediate_size: n("intermediate_size"),
        num_hidden_layers: layers,
        num_attention_heads: n("num_attention_heads"),
        num_key_value_heads: n("num_key_value_heads"),
        head_dim: c["head_dim"]
            .as_u64()
            .map_or(n("hidden_size") / n("num_attention_heads"), |d| d as usize),
        rms_norm_eps: f("rms_norm_eps").unwrap(),
        rope_theta: f("rope_theta").unwrap(),
        rope_local_base_freq: f("rope_local_base_freq"),
        rope_scaling,
        max_position_embeddings: n("max_position_embeddings"),
        tie_word_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(matches!(
            family,
            Family::Gemma | Family::Gemma2 | Family::Gemma3
        )),
        query_pre_attn_scalar: f("query_pre_attn_scalar"),
        attn_logit_softcapping: f("attn_logit_softcapping"),
        final_logit_softcapping: f("final_logit_softcapping"),
        sliding_window: c["sliding_window"].as_u64().map(|w| w as usize),
        sliding_layers,
        window_encoding: WindowEncoding::Implicit,
        ..Spec::llama()
    }
}

/// Every tensor of the random model as f64, by Hugging Face name.
fn weights_of(r: &RandomModel) -> BTreeMap<String, Vec<f64>> {
    let cfg = r.load_config().unwrap();
    let src = r.tensors(&cfg);
    src.stored_tensors()
        .into_iter()
        .map(|t| {
            let (_, v) = src.load(&t.name).unwrap();
            (t.name, v.into_iter().map(f64::from).collect())
        })
        .collect()
}

/// A fixed prompt of byte tokens longer than every tiny window.
fn prompt(r: &RandomModel) -> Vec<u32> {
    r.tokenizer()
        .unwrap()
        .encode("Random weights, real math.", false)
        .unwrap()
}

fn check_against_reference(spec: &str) {
    let r = random(spec);
    let RandomModel {
        config: te_models::random::RandomConfig::Preset(preset),
        ..
    } = &r
    else {
        panic!("{spec} is not a preset");
    };
    let reference_spec = spec_of(preset.config_json);
    let tokens = prompt(&r);
    assert!(
        tokens.len() > 12,
        "{spec}: prompt of {} tokens",
        tokens.len()
    );
    let want = tiny::reference_logits(&reference_spec, &weights_of(&r), &tokens);
    let model = load_model(&ModelSource::Random(r.clone())).unwrap().model;
    for (what, steps) in [
        ("one prefill", chunked(tokens.len(), &[tokens.len()])),
        ("prefill 5 then decode", chunked(tokens.len(), &[5, 1])),
    ] {
        let got = run_schedule(
            &model,
            CacheLayout::Contiguous,
            std::slice::from_ref(&tokens),
            &steps,
            Logits::All,
        )
        .unwrap();
        assert_rows_match(
            &got,
            std::slice::from_ref(&want),
            true,
            &format!("{spec} {what}"),
        );
    }
}

#[test]
fn tiny_llama_matches_f64_reference() {
    check_against_reference("random:tiny-llama");
    check_against_reference("random:tiny-llama?seed=11");
}

#[test]
fn tiny_llama3_matches_f64_reference() {
    check_against_reference("random:tiny-llama3?seed=12");
}

#[test]
fn tiny_mistral_matches_f64_reference() {
    check_against_reference("random:tiny-mistral?seed=13");
}

#[test]
fn tiny_qwen2_matches_f64_reference() {
    check_against_reference("random:tiny-qwen2?seed=14");
}

#[test]
fn tiny_qwen3_matches_f64_reference() {
    check_against_reference("random:tiny-qwen3?seed=15");
}

#[test]
fn tiny_gemma_matches_f64_reference() {
    check_against_reference("random:tiny-gemma?seed=3");
}

#[test]
fn tiny_gemma2_matches_f64_reference() {
    check_against_reference("random:tiny-gemma2?seed=4");
}

#[test]
fn tiny_gemma3_matches_f64_reference() {
    check_against_reference("random:tiny-gemma3?seed=5");
}

/// bf16 storage: the matrices stay bf16 in the model (the BF16 row path)
/// and the reference gets the same rounded values from `load`.
#[test]
fn bf16_tiny_gemma3_matches_f64_reference_on_rounded_weights() {
    check_against_reference("random:tiny-gemma3?dtype=bf16&seed=6");
}

/// Unit-scale weights give unit-scale logits: neither vanishing (all
/// tokens equally likely) nor blowing up.
#[test]
fn tiny_logits_are_finite_and_spread() {
    for name in TINY {
        let r = random(&format!("random:{name}"));
        let model = load_model(&ModelSource::Random(r.clone())).unwrap().model;
        let tokens = prompt(&r);
        let mut cache = model
            .new_cache(1, tokens.len(), tokens.len(), CacheLayout::Contiguous)
            .unwrap();
        cache.pre_step(&[(0, tokens.len())]).unwrap();
        let logits = model.forward(&tokens, &mut cache, Logits::Last).unwrap();
        let n = logits.len() as f64;
        let mean = logits.iter().map(|&l| l as f64).sum::<f64>() / n;
        let std = (logits
            .iter()
            .map(|&l| (l as f64 - mean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        assert!(logits.iter().all(|l| l.is_finite()), "{name}");
        assert!((0.1..10.0).contains(&std), "{name}: logit std {std}");
    }
}

#[test]
fn seeds_pick_the_weights() {
    let a = weights_of(&random("random:tiny-gemma2"));
    let again = weights_of(&random("random:tiny-gemma2?seed=0"));
    let b = weights_of(&random("random:tiny-gemma2?seed=1"));
    assert_eq!(a, again, "the default seed is 0");
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, values) in &a {
        assert_ne!(values, &b[name], "{name} is the same under seeds 0 and 1");
    }
    // Two tensors of one model are not copies of each other either.
    assert_ne!(
        a["model.layers.0.self_attn.q_proj.weight"][..64],
        a["model.layers.1.self_attn.q_proj.weight"][..64]
    );
}

/// The full-size presets are described from their config alone: parameter
/// counts from the published shapes, computed here by hand, in well under
/// a second each (no weight is generated).
#[test]
fn big_presets_are_inspected_without_their_weights() {
    // Parameters of one Llama-style model from its sizes.
    let params = |vocab: u64, hid: u64, ffn: u64, layers: u64, hq: u64, hkv: u64, d: u64| {
        let attn = hid * hq * d * 2 + hid * hkv * d * 2;
        let mlp = 3 * hid * ffn;
        (vocab, layers * (attn + mlp), hid)
    };
    for (name, (embed_rows, layer_params, hid), untied, norms_per_layer, qk) in [
        (
            "gemma-7b",
            params(256000, 3072, 24576, 28, 16, 16, 256),
            false,
            2,
            false,
        ),
        (
            "llama-3-8b",
            params(128256, 4096, 14336, 32, 32, 8, 128),
            true,
            2,
            false,
        ),
        (
            "gemma-3-1b",
            params(262144, 1152, 6912, 26, 4, 1, 256),
            false,
            4,
            true,
        ),
    ] {
        let start = std::time::Instant::now();
        let info = te_models::inspect::inspect(&resolve_model(&format!("random:{name}")).unwrap())
            .unwrap();
        let layers = info.config.num_hidden_layers as u64;
        let embed = embed_rows * hid * if untied { 2 } else { 1 };
        let norms = layers * norms_per_layer * hid + hid + if qk { layers * 2 * 256 } else { 0 };
        assert_eq!(info.parameters, embed + layer_params + norms, "{name}");
        assert_eq!(
            info.weights_stored_bytes,
            2 * info.parameters,
            "{name}: bf16"
        );
        assert_eq!(info.format, "random");
        assert!(info.problems.is_empty(), "{name}: {:?}", info.problems);
        assert!(
            start.elapsed().as_secs_f64() < 5.0,
            "{name}: {:?}",
            start.elapsed()
        );
    }
}

#[test]
fn every_preset_is_listed_in_errors() {
    let e = resolve_model("random:gemma-8b").unwrap_err().to_string();
    for p in PRESETS {
        assert!(e.contains(p.name), "{e}");
    }
}

/// `random:<config.json>`: a Hugging Face config file gives the same model
/// as the preset it was copied from.
#[test]
fn config_file_gives_the_preset_model() {
    let dir = tiny::temp_dir("random-config");
    let path = dir.join("config.json");
    let preset = PRESETS.iter().find(|p| p.name == "tiny-gemma3").unwrap();
    std::fs::write(&path, preset.config_json).unwrap();
    let file = random(&format!("random:{}?dtype=f32&seed=2", path.display()));
    assert_eq!(
        file.load_config().unwrap(),
        random("random:tiny-gemma3").load_config().unwrap()
    );
    // Tensor values depend on seed and name only, not on where the config came from.
    assert_eq!(
        weights_of(&file),
        weights_of(&random("random:tiny-gemma3?seed=2"))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
