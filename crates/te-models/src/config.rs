//! The resolved model config: one plain struct (no `Option` left that the
//! forward pass would have to interpret) for every family.
//!
//! Built from a Hugging Face `config.json` ([`crate::hf`]) or from GGUF
//! metadata ([`crate::gguf_model`]): each reads the fields every family
//! shares ([`Common`]) and asks the family ([`crate::family`]) for the
//! rest; field names follow Hugging Face.

use te_kernels::rope::{RopeConvention, RopeScaling};

use crate::family::{Shared, Specifics};

pub use crate::family::Architecture;
pub use te_kernels::activation::Activation;

/// Everything the forward pass needs, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    /// Context length the model was trained for (RoPE table size).
    pub max_position_embeddings: usize,
    /// RoPE base of global (full-attention) layers.
    pub rope_theta: f32,
    /// RoPE base of sliding-window layers (Gemma 3: 10000); equal to
    /// `rope_theta` where the family has no separate local base.
    pub rope_local_base_freq: f32,
    pub rope_scaling: RopeScaling,
    /// Per-frequency divisors `[head_dim / 2]` of the inverse frequencies
    /// after `rope_scaling` (GGUF `rope_freqs.weight`, llama.cpp's form of
    /// Llama 3.1's scaling: `θ_i = pos * inv_freq_i / rope_freqs[i]`).
    pub rope_freq_factors: Option<Vec<f32>>,
    /// How the Q/K weights expect to be rotated: interleaved for GGUF llama
    /// files (their rows are permuted), half-split for Hugging Face weights
    /// and Gemma.
    pub rope_convention: RopeConvention,
    pub hidden_activation: Activation,
    /// Attention softmax scale (1/sqrt(head_dim), or
    /// 1/sqrt(query_pre_attn_scalar) on Gemma 2/3).
    pub softmax_scale: f32,
    /// Gemma 2 attention-logit softcap.
    pub attn_logit_softcapping: Option<f32>,
    /// Gemma 2 final-logit softcap.
    pub final_logit_softcapping: Option<f32>,
    /// Per layer: `Some(W)` = sliding-window layer seeing W keys including
    /// itself (window `(W - 1, 0)`), `None` = global.
    pub layer_windows: Vec<Option<usize>>,
    /// Multiply the embedding by sqrt(hidden_size) (Gemma), rounded to the
    /// activation dtype (f32 here).
    pub scale_embedding: bool,
    /// Gemma 3 per-head RMSNorm of q and k.
    pub qk_norm: bool,
    /// Gemma 2/3 norms after attention and after the MLP.
    pub sandwich_norms: bool,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k, v and o projections (Hugging Face
    /// `attention_bias`; in GGUF, the presence of `blk.N.attn_output.bias`).
    pub attention_bias: bool,
    /// Biases on the q, k and v projections without o (Qwen2; in GGUF,
    /// the presence of `blk.N.attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// Biases on the gate, up and down projections (Hugging Face
    /// `mlp_bias`; in GGUF, the presence of `blk.N.ffn_*.bias`).
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The config fields every family reads the same way (from GGUF metadata
/// or `config.json`), before the family's own ([`Specifics`]).
#[derive(Clone, Debug)]
pub struct Common {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub shared: Shared,
    pub intermediate_size: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_freq_factors: Option<Vec<f32>>,
    pub rope_convention: RopeConvention,
    pub hidden_activation: Activation,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub qkv_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// The config of `c`'s family from the shared fields and the family's
    /// values (its defaults where they are `None`), not yet validated.
    pub fn resolve(c: Common, s: Specifics) -> ModelConfig {
        let fam = c.architecture.family();
        let sh = c.shared;
        ModelConfig {
            architecture: c.architecture,
            vocab_size: c.vocab_size,
            hidden_size: sh.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: sh.num_hidden_layers,
            num_attention_heads: sh.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: sh.head_dim,
            rms_norm_eps: c.rms_norm_eps,
            max_position_embeddings: c.max_position_embeddings,
            rope_theta: c.rope_theta,
            rope_local_base_freq: s.rope_local_base_freq.unwrap_or(c.rope_theta),
            rope_scaling: c.rope_scaling,
            rope_freq_factors: c.rope_freq_factors,
            rope_convention: c.rope_convention,
            hidden_activation: c.hidden_activation,
            softmax_scale: 1.0 / s.softmax_scale_base.unwrap_or(sh.head_dim as f32).sqrt(),
            attn_logit_softcapping: s.attn_logit_softcapping,
            final_logit_softcapping: s.final_logit_softcapping,
            layer_windows: s
                .layer_windows
                .unwrap_or_else(|| vec![None; sh.num_hidden_layers]),
            scale_embedding: fam.scale_embedding,
            qk_norm: fam.qk_norm,
            sandwich_norms: fam.sandwich_norms,
            tie_word_embeddings: c.tie_word_embeddings,
            attention_bias: c.attention_bias,
            qkv_bias: c.qkv_bias || fam.qkv_bias,
            mlp_bias: c.mlp_bias,
            bos_token_id: c.bos_token_id,
            eos_token_ids: c.eos_token_ids,
        }
    }
}

/// Largest size or count a config field may hold (2^24): larger values are
/// corrupt files, refused before anything is allocated for them.
pub const MAX_CONFIG_SIZE: usize = 1 << 24;

/// `v` if it is a plausible size for `field` (1..=[`MAX_CONFIG_SIZE`]),
/// else a config error naming the field.
pub fn plausible_size(field: &str, v: usize) -> crate::Result<usize> {
    if v == 0 || v > MAX_CONFIG_SIZE {
        return Err(crate::ModelError::Config {
            field: field.to_string(),
            reason: format!("{v} is not in 1..={MAX_CONFIG_SIZE}"),
        });
    }
    Ok(v)
}

/// Largest `head_dim` accepted (released models use at most 256): the
/// RoPE tables and every layer's KV cache take `head_dim` values per
/// position, so a crafted config's `head_dim` could otherwise ask for GiBs
/// before any weight is compared with it.
pub const MAX_HEAD_DIM: usize = 1024;

/// Most layers a model may have (far above any released model): the
/// per-layer config and the tensor list are sized by it before the file's
/// tensors are compared with it.
pub const MAX_LAYERS: usize = 1 << 14;

/// `v` if it is a plausible layer count for `field` (1..=[`MAX_LAYERS`]).
pub fn plausible_layers(field: &str, v: usize) -> crate::Result<usize> {
    if v == 0 || v > MAX_LAYERS {
        return Err(crate::ModelError::Config {
            field: field.to_string(),
            reason: format!("{v} layers is not in 1..={MAX_LAYERS}"),
        });
    }
    Ok(v)
}

impl ModelConfig {
    /// Whether the layer matrix of role `role` (`q`, `k`, `v`, `o`,
    /// `gate`, `up`, `down`) has a bias.
    pub fn has_bias(&self, role: &str) -> bool {
        match role {
            "q" | "k" | "v" => self.attention_bias || self.qkv_bias,
            "o" => self.attention_bias,
            _ => self.mlp_bias,
        }
    }

    /// Query heads per KV head.
    pub fn kv_group(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Checks the relations between fields; errors name the field.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |field: &str, reason: String| {
            Err(crate::ModelError::Config {
                field: field.to_string(),
                reason,
            })
        };
        plausible_layers("num_hidden_layers", self.num_hidden_layers)?;
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            plausible_size(field, v)?;
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            );
        }
        if self.head_dim > MAX_HEAD_DIM {
            return bad(
                "head_dim",
                format!(
                    "{} is over {MAX_HEAD_DIM} (the RoPE tables and KV cache take 4 bytes \
                     per head_dim per position)",
                    self.head_dim
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("{} is odd (RoPE needs pairs)", self.head_dim),
            );
        }
        if self.layer_windows.len() != self.num_hidden_layers {
            return bad(
                "layer_types",
                format!(
                    "{} entries for {} layers",
                    self.layer_windows.len(),
                    self.num_hidden_layers
                ),
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return bad(
                "rms_norm_eps",
                format!("{} must be a finite number >= 0", self.rms_norm_eps),
            );
        }
        for (field, base) in [
            ("rope_theta", self.rope_theta),
            ("rope_local_base_freq", self.rope_local_base_freq),
        ] {
            if !(base.is_finite() && base > 1.0) {
                return bad(field, format!("{base} must be a finite number > 1"));
            }
        }
        if !(self.softmax_scale.is_finite() && self.softmax_scale > 0.0) {
            return bad(
                "query_pre_attn_scalar",
                format!(
                    "gives attention scale {}; it must be > 0",
                    self.softmax_scale
                ),
            );
        }
        for (field, cap) in [
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            if let Some(c) = cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
                return bad(field, format!("{c} must be > 0"));
            }
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !positive(factor) {
                    return bad("rope_scaling.factor", format!("{factor} must be > 0"));
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                for (field, v) in [
                    ("rope_scaling.factor", factor),
                    ("rope_scaling.low_freq_factor", low_freq_factor),
                ] {
                    if !positive(v) {
                        return bad(field, format!("{v} must be > 0"));
                    }
                }
                if !(high_freq_factor > low_freq_factor && high_freq_factor.is_finite()) {
                    return bad(
                        "rope_scaling.high_freq_factor",
                        format!("{high_freq_factor} must exceed low_freq_factor {low_freq_factor}"),
                    );
                }
                if original_max_position_embeddings == 0 {
                    return bad(
                        "rope_scaling.original_max_position_embeddings",
                        "0 must be at least 1".into(),
                    );
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                for (field, v) in [
                    ("rope_scaling.factor", factor),
                    ("rope_scaling.beta_fast", beta_fast),
                    ("rope_scaling.beta_slow", beta_slow),
                    ("rope_scaling.attention_factor", attention_factor),
                ] {
                    if !positive(v) {
                        return bad(field, format!("{v} must be > 0"));
                    }
                }
                if original_max_position_embeddings == 0 {
                    return bad(
                        "rope_scaling.original_max_position_embeddings",
                        "0 must be at least 1".into(),
                    );
                }
            }
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 || f.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return bad(
                    "rope_freqs",
                    format!(
                        "needs head_dim / 2 = {} finite positive factors, has {}",
                        self.head_dim / 2,
                        f.len()
                    ),
                );
            }
        }
        if self.layer_windows.contains(&Some(0)) {
            return bad("sliding_window", "0 must be at least 1".into());
        }
        let out_of_vocab = |id: &u32| *id as usize >= self.vocab_size;
        if let Some(id) = self.bos_token_id.filter(out_of_vocab) {
            return bad(
                "bos_token_id",
                format!("{id} is outside the vocabulary of {}", self.vocab_size),
            );
        }
        if let Some(id) = self.eos_token_ids.iter().find(|id| out_of_vocab(id)) {
            return bad(
                "eos_token_id",
                format!("{id} is outside the vocabulary of {}", self.vocab_size),
            );
        }
        Ok(())
    }
}
