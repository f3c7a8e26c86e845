//! Hugging Face model directories: `config.json` (+ `generation_config.json`
//! for EOS ids, read by te-formats) into a [`ModelConfig`].

use std::path::Path;

use te_formats::hf_config::{field, hf_config_from_text, load_hf_config, token_ids, HfConfig};
use te_kernels::rope::{RopeConvention, RopeScaling};

use crate::config::{plausible_layers, Activation, Architecture, ModelConfig};
use crate::{ModelError, Result};

/// Reads `dir/config.json` (and `generation_config.json` if present).
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    let raw = load_hf_config(dir)?;
    let cfg = config_from_raw(&raw)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Resolves the text of a Hugging Face `config.json` (`path` is named in
/// JSON errors) into a [`ModelConfig`], not yet validated.
pub fn config_from_json_text(path: &Path, text: &str) -> Result<ModelConfig> {
    config_from_raw(&hf_config_from_text(path, text)?)
}

fn config_from_raw(raw: &HfConfig) -> Result<ModelConfig> {
    let model_type = field(raw.model_type.clone(), "model_type")?;
    let architecture = Architecture::parse(&model_type).ok_or_else(|| ModelError::Config {
        field: "model_type".into(),
        reason: format!("unknown model_type `{model_type}` (supported: llama, mistral, gemma, gemma2, gemma3, gemma3_text)"),
    })?;
    config_from_hf(architecture, raw)
}

fn config_from_hf(architecture: Architecture, raw: &HfConfig) -> Result<ModelConfig> {
    let gemma = architecture.is_gemma();
    let hidden_size = field(raw.hidden_size, "hidden_size")?;
    let num_attention_heads = field(raw.num_attention_heads, "num_attention_heads")?;
    let num_hidden_layers = plausible_layers(
        "num_hidden_layers",
        field(raw.num_hidden_layers, "num_hidden_layers")?,
    )?;
    let head_dim = raw
        .head_dim
        .unwrap_or(hidden_size / num_attention_heads.max(1));
    let rope_theta = raw.rope_theta.unwrap_or(10000.0) as f32;
    let rope_scaling = match &raw.rope_scaling {
        None => RopeScaling::None,
        Some(s) => {
            let kind = s
                .rope_type
                .as_deref()
                .or(s.kind.as_deref())
                .unwrap_or("default");
            let factor = || field(s.factor, "rope_scaling.factor");
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: factor()? },
                "llama3" => RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: field(s.low_freq_factor, "rope_scaling.low_freq_factor")?,
                    high_freq_factor: field(s.high_freq_factor, "rope_scaling.high_freq_factor")?,
                    original_max_position_embeddings: field(
                        s.original_max_position_embeddings,
                        "rope_scaling.original_max_position_embeddings",
                    )?,
                },
                other => {
                    return Err(ModelError::Config {
                        field: "rope_scaling.rope_type".into(),
                        reason: format!(
                            "unsupported `{other}` (supported: default, linear, llama3)"
                        ),
                    })
                }
            }
        }
    };
    let act = raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
        .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
    let hidden_activation = match act {
        "silu" | "swish" => Activation::Silu,
        // Gemma 1 configs say `gelu` but the reference implementation uses
        // the tanh approximation (Gemma model card / HF `hidden_activation`).
        "gelu_pytorch_tanh" | "gelu_tanh" | "gelu" => Activation::GeluTanh,
        other => {
            return Err(ModelError::Config {
                field: "hidden_act".into(),
                reason: format!("unsupported activation `{other}`"),
            })
        }
    };
    let scale_base = match architecture {
        Architecture::Gemma2 | Architecture::Gemma3 => {
            field(raw.query_pre_attn_scalar, "query_pre_attn_scalar")? as f32
        }
        _ => head_dim as f32,
    };
    let layer_windows = match architecture {
        Architecture::Llama | Architecture::Gemma => vec![None; num_hidden_layers],
        Architecture::Gemma2 | Architecture::Gemma3 => {
            let w = field(raw.sliding_window, "sliding_window")?;
            match &raw.layer_types {
                Some(types) => types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(Some(w)),
                        "full_attention" => Ok(None),
                        other => Err(ModelError::Config {
                            field: "layer_types".into(),
                            reason: format!("unknown layer type `{other}`"),
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?,
                None if architecture == Architecture::Gemma2 => (0..num_hidden_layers)
                    .map(|i| (i % 2 == 0).then_some(w))
                    .collect(),
                None => {
                    let pattern = raw.sliding_window_pattern.unwrap_or(6).max(1);
                    (0..num_hidden_layers)
                        .map(|i| ((i + 1) % pattern != 0).then_some(w))
                        .collect()
                }
            }
        }
    };
    let eos_token_ids = token_ids(&raw.eos_token_id, "eos_token_id")?;
    let bos_token_id = token_ids(&raw.bos_token_id, "bos_token_id")?
        .first()
        .copied();
    Ok(ModelConfig {
        architecture,
        vocab_size: field(raw.vocab_size, "vocab_size")?,
        hidden_size,
        intermediate_size: field(raw.intermediate_size, "intermediate_size")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
        head_dim,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(8192),
        rope_theta,
        rope_local_base_freq: match architecture {
            Architecture::Gemma3 => raw.rope_local_base_freq.unwrap_or(10000.0) as f32,
            _ => rope_theta,
        },
        rope_scaling,
        rope_convention: RopeConvention::HalfSplit,
        hidden_activation,
        softmax_scale: 1.0 / scale_base.sqrt(),
        attn_logit_softcapping: match architecture {
            Architecture::Gemma2 => raw.attn_logit_softcapping.map(|c| c as f32),
            _ => None,
        },
        final_logit_softcapping: match architecture {
            Architecture::Gemma2 => raw.final_logit_softcapping.map(|c| c as f32),
            _ => None,
        },
        layer_windows,
        scale_embedding: gemma,
        qk_norm: architecture == Architecture::Gemma3,
        sandwich_norms: matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
        attention_bias: raw.attention_bias.unwrap_or(false),
        mlp_bias: raw.mlp_bias.unwrap_or(false),
        bos_token_id,
        eos_token_ids,
    })
}
