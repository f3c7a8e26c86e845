//! Hugging Face model directories: `config.json` (+ `generation_config.json`
//! for EOS ids, read by te-formats) into a [`ModelConfig`].

use std::path::Path;

use te_formats::hf_config::{field, hf_config_from_text, load_hf_config, token_ids, HfConfig};
use te_kernels::rope::{RopeConvention, RopeScaling};

use crate::config::{plausible_layers, Activation, Common, ModelConfig};
use crate::family::{self, Shared};
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

/// `max_position_embeddings` when `config.json` has none.
const DEFAULT_CONTEXT: usize = 8192;

/// The context the model runs: `max_position_embeddings`, or with YaRN
/// `original_max_position_embeddings * factor` when that is longer (the
/// context YaRN is set up for: Qwen2.5's `factor` 4 over 32768 gives
/// 131072).
fn context(max_position_embeddings: Option<usize>, scaling: RopeScaling) -> usize {
    let base = max_position_embeddings.unwrap_or(DEFAULT_CONTEXT);
    match scaling {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            ..
        } => base.max((original_max_position_embeddings as f64 * factor) as usize),
        _ => base,
    }
}

fn config_from_raw(raw: &HfConfig) -> Result<ModelConfig> {
    let model_type = field(raw.model_type.clone(), "model_type")?;
    let architecture = family::by_hf_model_type(&model_type).ok_or_else(|| ModelError::Config {
        field: "model_type".into(),
        reason: format!(
            "unknown model_type `{model_type}` (supported: {})",
            family::hf_model_types()
        ),
    })?;
    let fam = architecture.family();
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
                "yarn" => {
                    let factor = factor()?;
                    let mscale = |m: f64| RopeScaling::yarn_mscale(factor, m);
                    let attention_factor = match (s.attention_factor, s.mscale, s.mscale_all_dim) {
                        (Some(a), _, _) => a,
                        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            mscale(m) / mscale(all)
                        }
                        _ => mscale(1.0),
                    };
                    RopeScaling::Yarn {
                        factor,
                        original_max_position_embeddings: s
                            .original_max_position_embeddings
                            .or(raw.max_position_embeddings)
                            .unwrap_or(DEFAULT_CONTEXT),
                        beta_fast: s.beta_fast.unwrap_or(32.0),
                        beta_slow: s.beta_slow.unwrap_or(1.0),
                        attention_factor,
                        truncate: s.truncate.unwrap_or(true),
                    }
                }
                other => {
                    return Err(ModelError::Config {
                        field: "rope_scaling.rope_type".into(),
                        reason: format!(
                            "unsupported `{other}` (supported: default, linear, llama3, yarn)"
                        ),
                    })
                }
            }
        }
    };
    let hidden_activation = match raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
    {
        None => fam.activation,
        Some("silu" | "swish") => Activation::Silu,
        // Gemma 1 configs say `gelu` but the reference implementation uses
        // the tanh approximation (Gemma model card / HF `hidden_activation`).
        Some("gelu_pytorch_tanh" | "gelu_tanh" | "gelu") => Activation::GeluTanh,
        Some(other) => {
            return Err(ModelError::Config {
                field: "hidden_act".into(),
                reason: format!("unsupported activation `{other}`"),
            })
        }
    };
    if let Some(p) = raw.partial_rotary_factor.filter(|p| *p != 1.0) {
        return Err(ModelError::Config {
            field: "partial_rotary_factor".into(),
            reason: format!("{p}: te-rs rotates the whole head (1.0) only"),
        });
    }
    for (name, experts) in [
        ("num_experts", raw.num_experts),
        ("num_local_experts", raw.num_local_experts),
    ] {
        if let Some(n) = experts.filter(|n| *n > 0) {
            return Err(ModelError::Config {
                field: name.into(),
                reason: format!("{n} experts: mixture-of-experts models are not supported"),
            });
        }
    }
    let shared = Shared {
        hidden_size,
        num_attention_heads,
        num_hidden_layers,
        head_dim,
    };
    let specifics = (fam.from_hf)(raw, &shared)?;
    let eos_token_ids = token_ids(&raw.eos_token_id, "eos_token_id")?;
    let bos_token_id = token_ids(&raw.bos_token_id, "bos_token_id")?
        .first()
        .copied();
    Ok(ModelConfig::resolve(
        Common {
            architecture,
            vocab_size: field(raw.vocab_size, "vocab_size")?,
            shared,
            intermediate_size: field(raw.intermediate_size, "intermediate_size")?,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            max_position_embeddings: context(raw.max_position_embeddings, rope_scaling),
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            rope_convention: RopeConvention::HalfSplit,
            hidden_activation,
            tie_word_embeddings: raw
                .tie_word_embeddings
                .unwrap_or(fam.default_tie_word_embeddings),
            attention_bias: raw.attention_bias.unwrap_or(false),
            qkv_bias: false,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            bos_token_id,
            eos_token_ids,
        },
        specifics,
    ))
}
