//! GGUF files as models: the config from GGUF metadata
//! (`<arch>.block_count`, ...) and the file as a
//! [`TensorSource`].
//!
//! Facts not stored in GGUF (window patterns, local RoPE bases, the Q/K
//! row permutation of llama files) are the families' ([`crate::family`]).

use te_kernels::rope::RopeScaling;

use crate::config::{plausible_layers, Common, ModelConfig};
use crate::family::{self, GgufKeys, Shared};
use crate::{ModelError, Result};
use te_formats::gguf::GgufFile;
use te_formats::TensorSource;

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

/// Reads the model config from a GGUF file's metadata: the keys every
/// family shares here, the rest from the family ([`crate::family::Family::from_gguf`]).
///
/// Errors: `general.architecture` not a family te-rs runs (named); a
/// required key missing or of the wrong type (named); an unknown
/// `rope.scaling.type` (named). Mixtures of experts and partial rotary
/// (`<arch>.expert_count`, `<arch>.rope.dimension_count`) are refused by
/// [`crate::validate`], naming the file.
///
/// `rope_freqs.weight` (llama.cpp's Llama 3.1 scaling: one divisor per
/// frequency) is read into [`ModelConfig::rope_freq_factors`].
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch_name = f.get_str("general.architecture")?.to_string();
    let architecture =
        family::by_gguf_name(&arch_name).ok_or_else(|| ModelError::UnsupportedArchitecture {
            name: arch_name.clone(),
            supported: family::gguf_names(),
        })?;
    let fam = architecture.family();
    let k = GgufKeys {
        file: f,
        arch: &arch_name,
    };
    let key = |name: &str| k.key(name);

    let hidden_size = k.usize("embedding_length")?;
    let num_attention_heads = k.usize("attention.head_count")?;
    let num_hidden_layers = plausible_layers(&key("block_count"), k.usize("block_count")?)?;
    let head_dim = k
        .opt_usize("attention.key_length")?
        .unwrap_or(hidden_size / num_attention_heads.max(1));
    let vocab_size = match f.tensor_info("token_embd.weight") {
        Some(t) => t.shape()[0],
        None => {
            return Err(ModelError::Tensor {
                tensor: "token_embd.weight".into(),
                reason: format!("missing from {}", f.path().display()),
            })
        }
    };
    let rope_freq_factors = match f.tensor_info("rope_freqs.weight") {
        None => None,
        Some(_) => Some(f.load("rope_freqs.weight")?.1),
    };
    let rope_theta = k.opt_f32("rope.freq_base")?.unwrap_or(10000.0);
    let context_length = k.usize("context_length")?;
    let rope_scaling = match f.metadata(&key("rope.scaling.type")) {
        None => RopeScaling::None,
        Some(_) => match f.get_str(&key("rope.scaling.type"))? {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: f.get_f32(&key("rope.scaling.factor"))? as f64,
            },
            "yarn" => {
                let factor = f.get_f32(&key("rope.scaling.factor"))? as f64;
                let opt = |name: &str, default: f64| -> Result<f64> {
                    Ok(k.opt_f32(name)?.map_or(default, |v| v as f64))
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: k
                        .opt_usize("rope.scaling.original_context_length")?
                        .unwrap_or(context_length),
                    beta_fast: opt("rope.scaling.yarn_beta_fast", 32.0)?,
                    beta_slow: opt("rope.scaling.yarn_beta_slow", 1.0)?,
                    attention_factor: RopeScaling::yarn_mscale(factor, 1.0)
                        * opt("rope.scaling.attn_factor", 1.0)?,
                    truncate: true,
                }
            }
            other => {
                return Err(ModelError::Config {
                    field: key("rope.scaling.type"),
                    reason: format!("unsupported `{other}` (supported: none, linear, yarn)"),
                })
            }
        },
    };
    let shared = Shared {
        hidden_size,
        num_attention_heads,
        num_hidden_layers,
        head_dim,
    };
    let specifics = (fam.from_gguf)(&k, &shared)?;
    let mut eos_token_ids = vec![];
    for name in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if f.metadata(name).is_some() {
            let id = f.get_u32(name)?;
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let bos_token_id = match f.metadata("tokenizer.ggml.bos_token_id") {
        Some(_) => Some(f.get_u32("tokenizer.ggml.bos_token_id")?),
        None => None,
    };
    let cfg = ModelConfig::resolve(
        Common {
            architecture,
            vocab_size,
            shared,
            intermediate_size: k.usize("feed_forward_length")?,
            num_key_value_heads: k
                .opt_usize("attention.head_count_kv")?
                .unwrap_or(num_attention_heads),
            rms_norm_eps: k
                .opt_f32("attention.layer_norm_rms_epsilon")?
                .unwrap_or(1e-6),
            max_position_embeddings: context_length,
            rope_theta,
            rope_scaling,
            rope_freq_factors,
            rope_convention: fam.gguf_rope_convention,
            hidden_activation: fam.activation,
            tie_word_embeddings: f.tensor_info("output.weight").is_none(),
            attention_bias: has_layer_bias(f, &["attn_output"]),
            qkv_bias: has_layer_bias(f, &["attn_q", "attn_k", "attn_v"]),
            mlp_bias: has_layer_bias(f, &["ffn_gate", "ffn_up", "ffn_down"]),
            bos_token_id,
            eos_token_ids,
        },
        specifics,
    );
    cfg.validate()?;
    Ok(cfg)
}
