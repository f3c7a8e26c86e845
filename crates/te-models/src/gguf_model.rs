//! GGUF files as models: the config from GGUF metadata
//! (`<arch>.block_count`, ...) and the file as a [`TensorSource`].
//!
//! Facts not stored in GGUF come from the reference implementations (see
//! tests/refs/README.md): Gemma 3 layer `i` is sliding when `i % 6 < 5`
//! and its local layers use RoPE base 10000; Gemma 2 alternates, even
//! layers sliding; GGUF llama files store Q/K rows permuted so that
//! interleaved RoPE on them equals half-split RoPE on the original weights.

use te_kernels::rope::{RopeConvention, RopeScaling};

use crate::config::{plausible_layers, Activation, Architecture, ModelConfig};
use crate::{ModelError, Result};
use te_formats::gguf::GgufFile;

/// Whether some `blk.N.<role>.bias` tensor with `role` in `roles` exists
/// (llama.cpp's optional projection biases).
fn has_layer_bias(f: &GgufFile, roles: &[&str]) -> bool {
    f.tensors().iter().any(|t| {
        t.name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(_, role)| role.strip_suffix(".bias"))
            .is_some_and(|role| roles.contains(&role))
    })
}

/// Reads the model config from a GGUF file's metadata.
///
/// Errors: `general.architecture` not one of llama, gemma, gemma2, gemma3
/// (named); a required key missing or of the wrong type (named); Llama 3
/// `rope_freqs` scaling tensors (not supported yet).
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch_name = f.get_str("general.architecture")?.to_string();
    let architecture = Architecture::parse(&arch_name)
        .filter(|a| a.name() == arch_name)
        .ok_or(ModelError::UnsupportedArchitecture(arch_name.clone()))?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let get_usize = |k: &str| f.get_u64(&key(k)).map(|v| v as usize);
    let opt_usize = |k: &str| f.metadata(&key(k)).map(|_| get_usize(k)).transpose();
    let opt_f32 = |k: &str| f.metadata(&key(k)).map(|_| f.get_f32(&key(k))).transpose();

    let hidden_size = get_usize("embedding_length")?;
    let num_attention_heads = get_usize("attention.head_count")?;
    let num_hidden_layers = plausible_layers(&key("block_count"), get_usize("block_count")?)?;
    let head_dim =
        opt_usize("attention.key_length")?.unwrap_or(hidden_size / num_attention_heads.max(1));
    let vocab_size = match f.tensor_info("token_embd.weight") {
        Some(t) => t.shape()[0],
        None => {
            return Err(ModelError::Tensor {
                tensor: "token_embd.weight".into(),
                reason: format!("missing from {}", f.path().display()),
            })
        }
    };
    if f.tensor_info("rope_freqs.weight").is_some() {
        return Err(ModelError::Tensor {
            tensor: "rope_freqs.weight".into(),
            reason: "per-frequency RoPE scaling factors are not supported yet".into(),
        });
    }
    let rope_theta = opt_f32("rope.freq_base")?.unwrap_or(10000.0);
    let rope_scaling = match f.metadata(&key("rope.scaling.type")) {
        None => RopeScaling::None,
        Some(_) => match f.get_str(&key("rope.scaling.type"))? {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: f.get_f32(&key("rope.scaling.factor"))? as f64,
            },
            other => {
                return Err(ModelError::Config {
                    field: key("rope.scaling.type"),
                    reason: format!("unsupported `{other}` (supported: none, linear)"),
                })
            }
        },
    };
    let gemma = architecture.is_gemma();
    let window = opt_usize("attention.sliding_window")?;
    let need_window = || {
        window.ok_or_else(|| ModelError::Config {
            field: key("attention.sliding_window"),
            reason: "missing".into(),
        })
    };
    let layer_windows = match architecture {
        Architecture::Llama | Architecture::Gemma => vec![None; num_hidden_layers],
        Architecture::Gemma2 => {
            let w = need_window()?;
            (0..num_hidden_layers)
                .map(|i| (i % 2 == 0).then_some(w))
                .collect()
        }
        Architecture::Gemma3 => {
            let w = need_window()?;
            (0..num_hidden_layers)
                .map(|i| (i % 6 < 5).then_some(w))
                .collect()
        }
    };
    // llama.cpp's attention scale for Gemma 2/3 is 1/sqrt(head_dim), except
    // the 27B models whose query_pre_attn_scalar is hidden / heads.
    let scale_base = match architecture {
        Architecture::Gemma2 | Architecture::Gemma3 if matches!(hidden_size, 4608 | 5376) => {
            (hidden_size / num_attention_heads) as f32
        }
        _ => head_dim as f32,
    };
    let mut eos_token_ids = vec![];
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if f.metadata(k).is_some() {
            let id = f.get_u32(k)?;
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let bos_token_id = match f.metadata("tokenizer.ggml.bos_token_id") {
        Some(_) => Some(f.get_u32("tokenizer.ggml.bos_token_id")?),
        None => None,
    };
    let cfg = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size: get_usize("feed_forward_length")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: opt_usize("attention.head_count_kv")?.unwrap_or(num_attention_heads),
        head_dim,
        rms_norm_eps: opt_f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        max_position_embeddings: get_usize("context_length")?,
        rope_theta,
        rope_local_base_freq: if architecture == Architecture::Gemma3 {
            10000.0
        } else {
            rope_theta
        },
        rope_scaling,
        rope_convention: if gemma {
            RopeConvention::HalfSplit
        } else {
            RopeConvention::Interleaved
        },
        hidden_activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        softmax_scale: 1.0 / scale_base.sqrt(),
        attn_logit_softcapping: if architecture == Architecture::Gemma2 {
            opt_f32("attn_logit_softcapping")?
        } else {
            None
        },
        final_logit_softcapping: if architecture == Architecture::Gemma2 {
            opt_f32("final_logit_softcapping")?
        } else {
            None
        },
        layer_windows,
        scale_embedding: gemma,
        qk_norm: architecture == Architecture::Gemma3,
        sandwich_norms: matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3),
        tie_word_embeddings: f.tensor_info("output.weight").is_none(),
        attention_bias: has_layer_bias(f, &["attn_q", "attn_k", "attn_v", "attn_output"]),
        mlp_bias: has_layer_bias(f, &["ffn_gate", "ffn_up", "ffn_down"]),
        bos_token_id,
        eos_token_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}
