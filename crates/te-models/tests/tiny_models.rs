//! Tiny random-weight Hugging Face checkpoints of every architecture and
//! config variant, loaded through te-models and compared, logit by logit,
//! with an independent float64 forward pass written in the test
//! (`tiny/mod.rs`), over every way of feeding a prompt: one prefill,
//! chunked prefill, prefill then decode, token-by-token decode, contiguous
//! and paged caches, and a ragged two-sequence batch. Then bad Hugging Face
//! inputs, which must give errors naming the culprit, never a panic.

mod tiny;

use te_cache::CacheLayout;
use te_models::config::MAX_HEAD_DIM;
use te_models::model::Logits;
use tiny::{
    assert_feature_bites, assert_rows_match, check_all_modes, chunked, prompts, run_schedule,
    Checkpoint, RopeScaling, Spec, Storage, WindowEncoding,
};

// ------------------------------------------------------------ variants

#[test]
fn llama_gqa_untied_matches_f64_reference() {
    let ck = Checkpoint::write(Spec::llama());
    let cfg = &ck.load().expect("load").config;
    assert_eq!(cfg.kv_group(), 2);
    assert!(!cfg.tie_word_embeddings);
    check_all_modes(&ck, 20);
}

#[test]
fn llama3_rope_scaling_matches_f64_reference() {
    // d = 16, base 10000: wavelengths 6.3, 19.9, 62.8, ...; with 32 / 4 = 8
    // and 32 / 1 = 32 as the bounds, frequency 0 is kept, 1 is blended and
    // the rest are divided by 8.
    let ck = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }),
        seed: 11,
        ..Spec::llama()
    });
    assert_feature_bites(&ck, 24, "llama3 rope scaling", |s| s.rope_scaling = None);
    check_all_modes(&ck, 24);
}

#[test]
fn linear_rope_scaling_matches_f64_reference() {
    let ck = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }),
        seed: 12,
        ..Spec::llama()
    });
    assert_feature_bites(&ck, 20, "linear rope scaling", |s| s.rope_scaling = None);
    check_all_modes(&ck, 20);
}

#[test]
fn gemma_matches_f64_reference() {
    let ck = Checkpoint::write(Spec::gemma());
    let cfg = &ck.load().expect("load").config;
    assert!(cfg.tie_word_embeddings && cfg.scale_embedding);
    check_all_modes(&ck, 20);
}

#[test]
fn gemma2_softcaps_and_alternating_windows_match_f64_reference() {
    let ck = Checkpoint::write(Spec::gemma2());
    let cfg = &ck.load().expect("load").config;
    // Gemma 2's default: even layers slide.
    assert_eq!(cfg.layer_windows, vec![Some(4), None]);
    assert_feature_bites(&ck, 20, "attention softcap", |s| {
        s.attn_logit_softcapping = None
    });
    assert_feature_bites(&ck, 20, "final softcap", |s| {
        s.final_logit_softcapping = None
    });
    assert_feature_bites(&ck, 20, "sliding window", |s| {
        s.sliding_layers = vec![false; 2]
    });
    assert_feature_bites(&ck, 20, "query_pre_attn_scalar", |s| {
        s.query_pre_attn_scalar = None
    });
    check_all_modes(&ck, 20);
}

#[test]
fn gemma2_layer_types_match_f64_reference() {
    // Explicit layer_types, the other way round: layer 1 slides.
    let ck = Checkpoint::write(Spec {
        sliding_layers: vec![false, true],
        window_encoding: WindowEncoding::LayerTypes,
        seed: 13,
        ..Spec::gemma2()
    });
    assert_eq!(
        ck.load().expect("load").config.layer_windows,
        vec![None, Some(4)]
    );
    check_all_modes(&ck, 17);
}

/// The issue's check of Gemma 3's window: a 40-token prompt on a tiny
/// Gemma 3 with window 8, in one prefill, in chunks and token by token
/// (the sliding layer's ring in the cache wraps many times).
#[test]
fn gemma3_prompt_longer_than_window_matches_f64_reference() {
    let ck = Checkpoint::write(Spec::gemma3());
    let cfg = &ck.load().expect("load").config;
    assert_eq!(cfg.layer_windows, vec![Some(8), None]);
    assert!(cfg.qk_norm && cfg.sandwich_norms);
    assert_feature_bites(&ck, 40, "sliding window", |s| {
        s.sliding_layers = vec![false; 2]
    });
    assert_feature_bites(&ck, 40, "local rope base", |s| {
        s.rope_local_base_freq = None
    });
    check_all_modes(&ck, 40);
}

/// The RoPE tables start at 1024 positions and grow with the steps: a
/// 1100-token prompt in one prefill, in chunks across the boundary (paged)
/// and token by token past it still matches the f64 reference, which
/// computes each angle itself.
#[test]
fn gemma3_rope_tables_grow_past_their_first_size() {
    let ck = Checkpoint::write(Spec {
        max_position_embeddings: 4096,
        seed: 16,
        ..Spec::gemma3()
    });
    let model = ck.load().expect("load");
    assert_eq!(model.rope_positions(), 1024, "the tables' first size");
    let prompt = vec![prompts(&ck, 1100).swap_remove(0)];
    let reference = [ck.reference(&prompt[0])];
    let paged = CacheLayout::Paged {
        page_size: 16,
        total_num_pages: 70,
    };
    for (what, layout, sizes) in [
        ("one prefill", CacheLayout::Contiguous, &[1100][..]),
        ("chunks across 1024, paged", paged, &[700, 300, 60, 40]),
        ("decode past 1024", CacheLayout::Contiguous, &[1000, 1]),
    ] {
        let steps = chunked(1100, sizes);
        let rows = run_schedule(&model, layout, &prompt, &steps, Logits::All).expect(what);
        assert_rows_match(&rows, &reference, true, what);
        assert_eq!(model.rope_positions(), 2048, "{what}: grown to twice");
    }
}

/// RoPE tables are sized by the positions a run reaches, never by the
/// config's maximum (2^24 positions), a position past
/// `max_position_embeddings` is an error naming it, not a panic, and a
/// `head_dim` over [`MAX_HEAD_DIM`] (RoPE tables and KV cache of GiBs) is
/// refused naming the field.
#[test]
fn rope_tables_are_sized_by_the_run_not_the_config() {
    let ck = Checkpoint::write(Spec {
        max_position_embeddings: 1 << 24,
        seed: 17,
        ..Spec::gemma3()
    });
    let model = ck.load().expect("load");
    assert_eq!(model.rope_positions(), 1024, "the tables' first size");

    let ck = Checkpoint::write(Spec {
        max_position_embeddings: 16,
        seed: 18,
        ..Spec::gemma3()
    });
    let model = ck.load().expect("load");
    assert_eq!(model.rope_positions(), 16);
    let prompt = vec![prompts(&ck, 20).swap_remove(0)];
    let err = run_schedule(
        &model,
        CacheLayout::Contiguous,
        &prompt,
        &chunked(20, &[20]),
        Logits::All,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("position"), "{err}");

    let mut config = model.config.clone();
    config.head_dim = MAX_HEAD_DIM + 2;
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("head_dim") && err.contains("1026"), "{err}");
}

#[test]
fn gemma3_sliding_window_pattern_matches_f64_reference() {
    // sliding_window_pattern 2 on 2 layers: layer 0 slides, layer 1 is global.
    let ck = Checkpoint::write(Spec {
        window_encoding: WindowEncoding::Pattern(2),
        seed: 14,
        ..Spec::gemma3()
    });
    assert_eq!(
        ck.load().expect("load").config.layer_windows,
        vec![Some(8), None]
    );
    check_all_modes(&ck, 30);
}

#[test]
fn gemma3_linear_rope_scaling_applies_to_global_layers_only() {
    let ck = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Linear { factor: 8.0 }),
        rope_theta: 10000.0,
        rope_local_base_freq: Some(100.0),
        seed: 15,
        ..Spec::gemma3()
    });
    assert_feature_bites(&ck, 30, "global rope scaling", |s| s.rope_scaling = None);
    check_all_modes(&ck, 30);
}

/// Same base on both layer kinds: the sliding layer must still be unscaled
/// (Hugging Face builds Gemma 3's local rotary embedding with
/// `rope_scaling = default` whatever the bases).
#[test]
fn gemma3_rope_scaling_skips_local_layers_when_bases_agree() {
    let ck = Checkpoint::write(Spec {
        rope_scaling: Some(RopeScaling::Linear { factor: 8.0 }),
        rope_theta: 100.0,
        rope_local_base_freq: Some(100.0),
        seed: 18,
        ..Spec::gemma3()
    });
    check_all_modes(&ck, 30);
}

/// Issue 15: Llama-architecture checkpoints with `attention_bias` and
/// `mlp_bias` get their biases applied (they used to be dropped).
#[test]
fn llama_with_biases_matches_f64_reference() {
    let ck = Checkpoint::write(Spec {
        attention_bias: true,
        mlp_bias: true,
        seed: 19,
        ..Spec::llama()
    });
    let cfg = &ck.load().expect("load").config;
    assert!(cfg.attention_bias && cfg.mlp_bias);
    assert_feature_bites(&ck, 20, "attention biases", |s| s.attention_bias = false);
    assert_feature_bites(&ck, 20, "mlp biases", |s| s.mlp_bias = false);
    check_all_modes(&ck, 20);
}

/// Gemma checkpoints may set `attention_bias` too (Hugging Face's Gemma
/// config has the field): same handling.
#[test]
fn gemma3_with_attention_biases_matches_f64_reference() {
    let ck = Checkpoint::write(Spec {
        attention_bias: true,
        seed: 20,
        ..Spec::gemma3()
    });
    assert_feature_bites(&ck, 20, "attention biases", |s| s.attention_bias = false);
    check_all_modes(&ck, 20);
}

#[test]
fn bf16_gemma3_matches_f64_reference_on_rounded_weights() {
    let ck = Checkpoint::write(Spec {
        storage: Storage::BF16,
        seed: 16,
        ..Spec::gemma3()
    });
    check_all_modes(&ck, 25);
}

#[test]
fn f16_llama_matches_f64_reference_on_rounded_weights() {
    let ck = Checkpoint::write(Spec {
        storage: Storage::F16,
        seed: 17,
        ..Spec::llama()
    });
    check_all_modes(&ck, 20);
}

#[test]
fn sharded_checkpoints_match_f64_reference() {
    for spec in [Spec::llama(), Spec::gemma2()] {
        let ck = Checkpoint::write(Spec {
            shards: 2,
            seed: spec.seed + 20,
            ..spec
        });
        assert!(!ck.dir.join("model.safetensors").exists());
        check_all_modes(&ck, 15);
    }
}

// ---------------------------------------------------------- bad inputs

fn error_of<T>(r: te_models::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unknown_model_type_is_an_error_naming_model_type() {
    let ck = Checkpoint::write(Spec::llama());
    let path = ck.dir.join("config.json");
    let text = std::fs::read_to_string(&path).expect("read config");
    std::fs::write(&path, text.replace("\"llama\"", "\"llamazing\"")).expect("write config");
    let msg = error_of(te_models::hf::load_config(&ck.dir));
    assert!(
        msg.contains("model_type") && msg.contains("llamazing"),
        "{msg}"
    );
}

#[test]
fn missing_config_field_is_an_error_naming_it() {
    let ck = Checkpoint::write(Spec::gemma2());
    let path = ck.dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    config
        .as_object_mut()
        .expect("object")
        .remove("query_pre_attn_scalar");
    std::fs::write(&path, config.to_string()).expect("write");
    let msg = error_of(te_models::hf::load_config(&ck.dir));
    assert!(msg.contains("query_pre_attn_scalar"), "{msg}");
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let name = "model.layers.1.mlp.up_proj.weight";
    let ck = Checkpoint::write_with(Spec::llama(), |t| t.retain(|t| t.name != name));
    let msg = error_of(ck.load());
    assert!(msg.contains(name), "{msg}");
}

#[test]
fn missing_gemma3_qk_norm_is_an_error_naming_it() {
    let name = "model.layers.0.self_attn.k_norm.weight";
    let ck = Checkpoint::write_with(Spec::gemma3(), |t| t.retain(|t| t.name != name));
    let msg = error_of(ck.load());
    assert!(msg.contains(name), "{msg}");
}

#[test]
fn wrongly_shaped_tensor_is_an_error_naming_it() {
    let name = "model.layers.0.self_attn.q_proj.weight";
    let ck = Checkpoint::write_with(Spec::llama(), |tensors| {
        let t = tensors.iter_mut().find(|t| t.name == name).expect("q_proj");
        t.shape.reverse(); // [hidden, h_q * d]: same size, transposed
    });
    let msg = error_of(ck.load());
    assert!(msg.contains(name), "{msg}");
}

#[test]
fn wrongly_shaped_embedding_is_an_error_naming_it() {
    let name = "model.embed_tokens.weight";
    let ck = Checkpoint::write_with(Spec::gemma(), |tensors| {
        let t = tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("embedding");
        let hidden = t.shape[1];
        t.shape[0] -= 1; // one token short of vocab_size
        t.values.truncate(t.shape[0] * hidden);
    });
    let msg = error_of(ck.load());
    assert!(msg.contains(name), "{msg}");
}

/// A safetensors file: 8-byte little-endian header length, JSON header,
/// then `data_len` bytes of data.
fn raw_safetensors(header: &str, data_len: usize) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, data_len));
    bytes
}

/// Writes a llama config and `bytes` as `model.safetensors`; loading must
/// fail with an error naming that file.
fn assert_bad_safetensors_named(tag: &str, bytes: &[u8]) {
    let ck = Checkpoint::write(Spec::llama());
    let path = ck.dir.join("model.safetensors");
    std::fs::write(&path, bytes).expect("write");
    let msg = error_of(ck.load());
    assert!(msg.contains(&path.display().to_string()), "{tag}: {msg}");
}

#[test]
fn safetensors_header_with_data_offsets_past_the_file_is_an_error_naming_the_file() {
    let header =
        r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[53,32],"data_offsets":[0,6784]}}"#;
    assert_bad_safetensors_named("offsets past the end", &raw_safetensors(header, 16));
}

#[test]
fn safetensors_header_length_past_the_file_is_an_error_naming_the_file() {
    let mut bytes = raw_safetensors("{}", 0);
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert_bad_safetensors_named("header length past the end", &bytes);
}

#[test]
fn safetensors_shape_disagreeing_with_data_offsets_is_an_error_naming_the_file() {
    let header =
        r#"{"model.norm.weight":{"dtype":"F32","shape":[1000000],"data_offsets":[0,128]}}"#;
    assert_bad_safetensors_named("shape vs offsets", &raw_safetensors(header, 128));
}

#[test]
fn truncated_and_garbage_safetensors_are_errors_naming_the_file() {
    assert_bad_safetensors_named("4 bytes", &[1, 2, 3, 4]);
    assert_bad_safetensors_named("not JSON", &raw_safetensors("{not json", 8));
}

#[test]
fn missing_shard_is_an_error_naming_it() {
    let ck = Checkpoint::write(Spec {
        shards: 2,
        ..Spec::llama()
    });
    let shard = ck.dir.join("model-00002-of-00002.safetensors");
    std::fs::remove_file(&shard).expect("remove shard");
    let msg = error_of(ck.load());
    assert!(msg.contains("model-00002-of-00002.safetensors"), "{msg}");
}

#[test]
fn token_outside_the_vocabulary_is_an_error() {
    let ck = Checkpoint::write(Spec::llama());
    let model = ck.load().expect("load");
    let mut cache = model
        .new_cache(1, 8, 8, CacheLayout::Contiguous)
        .expect("cache");
    cache.pre_step(&[(0, 2)]).expect("pre_step");
    let vocab = ck.spec.vocab_size as u32;
    let msg = error_of(model.forward(&[1, vocab], &mut cache, Logits::All));
    assert!(msg.contains(&vocab.to_string()), "{msg}");
}
