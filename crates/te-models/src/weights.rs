//! Model weights in f32, loaded through a [`TensorSource`] (GGUF or
//! safetensors) by one name mapping per file format.

use crate::config::{Architecture, ModelConfig};
use crate::ops::{Linear, WeightData};
use crate::{ModelError, Result};

/// Where tensors come from: a GGUF file or a Hugging Face safetensors
/// directory. Every tensor is returned dequantized to f32, row-major, with
/// its shape outermost first (`[out_features, in_features]` for a matrix).
pub trait TensorSource {
    /// Loads `name`; `ModelError::Tensor` naming it when missing or unreadable.
    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
    /// Whether the source has a tensor called `name`.
    fn contains(&self, name: &str) -> bool;
    /// Loads a matrix for a [`Linear`]: f32 by default; a GGUF source keeps
    /// block-quantized tensors as stored.
    fn load_matrix(&self, name: &str) -> Result<(Vec<usize>, WeightData)> {
        let (shape, data) = self.load(name)?;
        Ok((shape, WeightData::F32(data)))
    }
}

/// Tensor names of one file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameScheme {
    /// GGUF (`blk.N.attn_q.weight`, ...).
    Gguf,
    /// Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...).
    HuggingFace,
}

/// One transformer layer's weights. Norm weights are the effective
/// multipliers (Gemma's `1 + w` already applied).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// Pre-attention RMSNorm `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[h_q * d, hidden]`.
    pub q_proj: Linear,
    /// `[h_kv * d, hidden]`.
    pub k_proj: Linear,
    /// `[h_kv * d, hidden]`.
    pub v_proj: Linear,
    /// `[hidden, h_q * d]`.
    pub o_proj: Linear,
    /// Gemma 3 per-head norms `[d]`.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Gemma 2/3 post-attention norm `[hidden]`.
    pub post_attn_norm: Option<Vec<f32>>,
    /// Pre-MLP RMSNorm `[hidden]`.
    pub ffn_norm: Vec<f32>,
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
    /// Gemma 2/3 post-MLP norm `[hidden]`.
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// Token embedding `[vocab, hidden]` (also the output projection when tied).
    pub embed_tokens: Linear,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm `[hidden]`.
    pub final_norm: Vec<f32>,
    /// Output projection `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
}

/// Tensor names of one architecture in one file format, by role: the one
/// name mapping used to read weights ([`ModelWeights::load`]) and to write
/// them (`crate::convert`).
///
/// Layer roles: `attn_norm`, `q`, `k`, `v`, `o`, `q_norm`, `k_norm`,
/// `post_attn_norm`, `ffn_norm`, `gate`, `up`, `down`, `post_ffn_norm`.
/// Global roles: `embed`, `norm`, `lm_head`. An unknown role is a
/// programming error and panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorNames {
    pub scheme: NameScheme,
    pub arch: Architecture,
}

impl TensorNames {
    /// The name of layer `i`'s weight of role `what` (`blk.3.attn_q.weight`,
    /// `model.layers.3.self_attn.q_proj.weight`).
    pub fn layer(&self, i: usize, what: &str) -> String {
        match self.scheme {
            NameScheme::Gguf => {
                let n = match what {
                    "attn_norm" => "attn_norm",
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "q_norm" => "attn_q_norm",
                    "k_norm" => "attn_k_norm",
                    "post_attn_norm" => "post_attention_norm",
                    "ffn_norm" => "ffn_norm",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "post_ffn_norm" => "post_ffw_norm",
                    _ => unreachable!("unknown weight role {what}"),
                };
                format!("blk.{i}.{n}.weight")
            }
            NameScheme::HuggingFace => {
                let sandwich = matches!(self.arch, Architecture::Gemma2 | Architecture::Gemma3);
                let n = match what {
                    "attn_norm" => "input_layernorm",
                    "q" => "self_attn.q_proj",
                    "k" => "self_attn.k_proj",
                    "v" => "self_attn.v_proj",
                    "o" => "self_attn.o_proj",
                    "q_norm" => "self_attn.q_norm",
                    "k_norm" => "self_attn.k_norm",
                    "post_attn_norm" => "post_attention_layernorm",
                    // Llama and Gemma 1 call the pre-MLP norm
                    // `post_attention_layernorm`; Gemma 2/3 have both.
                    "ffn_norm" if sandwich => "pre_feedforward_layernorm",
                    "ffn_norm" => "post_attention_layernorm",
                    "gate" => "mlp.gate_proj",
                    "up" => "mlp.up_proj",
                    "down" => "mlp.down_proj",
                    "post_ffn_norm" => "post_feedforward_layernorm",
                    _ => unreachable!("unknown weight role {what}"),
                };
                format!("model.layers.{i}.{n}.weight")
            }
        }
    }

    /// The name of a weight outside the layers (`embed`, `norm`, `lm_head`).
    pub fn global(&self, what: &str) -> &'static str {
        match (self.scheme, what) {
            (NameScheme::Gguf, "embed") => "token_embd.weight",
            (NameScheme::Gguf, "norm") => "output_norm.weight",
            (NameScheme::Gguf, "lm_head") => "output.weight",
            (NameScheme::HuggingFace, "embed") => "model.embed_tokens.weight",
            (NameScheme::HuggingFace, "norm") => "model.norm.weight",
            (NameScheme::HuggingFace, "lm_head") => "lm_head.weight",
            _ => unreachable!("unknown weight role {what}"),
        }
    }
}

fn expect_shape(name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(ModelError::Tensor {
            tensor: name.to_string(),
            reason: format!("has shape {got:?}, expected {expected:?}"),
        });
    }
    Ok(())
}

impl ModelWeights {
    /// Loads every weight the config needs from `src`, checking shapes.
    ///
    /// `norm_offset` is added to every norm weight: 1.0 for Gemma weights in
    /// Hugging Face files (which store `w` of `(1 + w)`), 0.0 otherwise
    /// (GGUF Gemma files store `1 + w` already; see tests/refs/README.md).
    pub fn load(
        src: &dyn TensorSource,
        scheme: NameScheme,
        cfg: &ModelConfig,
        norm_offset: f32,
    ) -> Result<Self> {
        let names = TensorNames {
            scheme,
            arch: cfg.architecture,
        };
        let (hidden, d) = (cfg.hidden_size, cfg.head_dim);
        let (hq, hkv, ffn) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
        );
        let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
            let (shape, mut data) = src.load(name)?;
            expect_shape(name, &shape, &[len])?;
            if norm_offset != 0.0 {
                data.iter_mut().for_each(|w| *w += norm_offset);
            }
            Ok(data)
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Linear> {
            let (shape, data) = src.load_matrix(name)?;
            expect_shape(name, &shape, &[rows, cols])?;
            Linear::new(name, data, rows, cols)
        };
        let optional = |present: bool, name: String, len: usize| -> Result<Option<Vec<f32>>> {
            if present {
                vector(&name, len).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let n = |what: &str| names.layer(i, what);
            layers.push(LayerWeights {
                attn_norm: vector(&n("attn_norm"), hidden)?,
                q_proj: matrix(&n("q"), hq * d, hidden)?,
                k_proj: matrix(&n("k"), hkv * d, hidden)?,
                v_proj: matrix(&n("v"), hkv * d, hidden)?,
                o_proj: matrix(&n("o"), hidden, hq * d)?,
                q_norm: optional(cfg.qk_norm, n("q_norm"), d)?,
                k_norm: optional(cfg.qk_norm, n("k_norm"), d)?,
                post_attn_norm: optional(cfg.sandwich_norms, n("post_attn_norm"), hidden)?,
                ffn_norm: vector(&n("ffn_norm"), hidden)?,
                gate_proj: matrix(&n("gate"), ffn, hidden)?,
                up_proj: matrix(&n("up"), ffn, hidden)?,
                down_proj: matrix(&n("down"), hidden, ffn)?,
                post_ffn_norm: optional(cfg.sandwich_norms, n("post_ffn_norm"), hidden)?,
            });
        }
        let embed_tokens = matrix(names.global("embed"), cfg.vocab_size, hidden)?;
        let lm_head_name = names.global("lm_head");
        let lm_head = if !cfg.tie_word_embeddings || src.contains(lm_head_name) {
            Some(matrix(lm_head_name, cfg.vocab_size, hidden)?)
        } else {
            None
        };
        Ok(ModelWeights {
            embed_tokens,
            layers,
            final_norm: vector(names.global("norm"), hidden)?,
            lm_head,
        })
    }
}
