//! Gemma 2 (Hugging Face and GGUF `gemma2`): Gemma's block with norms
//! after attention and after the MLP too (`pre_feedforward_layernorm`,
//! `post_feedforward_layernorm`), attention and final logit softcapping,
//! sliding-window layers alternating with global ones (even layers slide,
//! or Hugging Face `layer_types`), and the attention scale
//! 1/sqrt(query_pre_attn_scalar) (GGUF stores no such key: llama.cpp uses
//! 1/sqrt(head_dim), except the 27B models' hidden / heads).

use te_formats::hf_config::{field, HfConfig};
use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, GgufKeys, Shared, Specifics};
use crate::{ModelError, Result};

/// The Gemma 2 family.
pub static GEMMA2: Family = Family {
    name: "gemma2",
    hf_model_types: &["gemma2"],
    hf_model_type: "gemma2",
    hf_class: "Gemma2ForCausalLM",
    activation: Activation::GeluTanh,
    default_tie_word_embeddings: true,
    gguf_rope_convention: RopeConvention::HalfSplit,
    hf_norm_offset: 1.0,
    scale_embedding: true,
    qk_norm: false,
    qkv_bias: false,
    sandwich_norms: true,
    hf_use_sliding_window: false,
    local_rope_unscaled: false,
    from_hf,
    from_gguf,
};

fn from_hf(raw: &HfConfig, s: &Shared) -> Result<Specifics> {
    let scale = field(raw.query_pre_attn_scalar, "query_pre_attn_scalar")? as f32;
    let w = field(raw.sliding_window, "sliding_window")?;
    let windows = match &raw.layer_types {
        Some(types) => hf_layer_types(types, w)?,
        None => (0..s.num_hidden_layers)
            .map(|i| (i % 2 == 0).then_some(w))
            .collect(),
    };
    Ok(Specifics {
        softmax_scale_base: Some(scale),
        layer_windows: Some(windows),
        attn_logit_softcapping: raw.attn_logit_softcapping.map(|c| c as f32),
        final_logit_softcapping: raw.final_logit_softcapping.map(|c| c as f32),
        rope_local_base_freq: None,
    })
}

fn from_gguf(k: &GgufKeys<'_>, s: &Shared) -> Result<Specifics> {
    let w = gguf_window(k)?;
    Ok(Specifics {
        softmax_scale_base: gguf_scale_base(s),
        layer_windows: Some(
            (0..s.num_hidden_layers)
                .map(|i| (i % 2 == 0).then_some(w))
                .collect(),
        ),
        attn_logit_softcapping: k.opt_f32("attn_logit_softcapping")?,
        final_logit_softcapping: k.opt_f32("final_logit_softcapping")?,
        rope_local_base_freq: None,
    })
}

/// Hugging Face `layer_types`: `sliding_attention` layers get window `w`.
pub(super) fn hf_layer_types(types: &[String], w: usize) -> Result<Vec<Option<usize>>> {
    types
        .iter()
        .map(|t| match t.as_str() {
            "sliding_attention" => Ok(Some(w)),
            "full_attention" => Ok(None),
            other => Err(ModelError::Config {
                field: "layer_types".into(),
                reason: format!("unknown layer type `{other}`"),
            }),
        })
        .collect()
}

/// `<arch>.attention.sliding_window`, required.
pub(super) fn gguf_window(k: &GgufKeys<'_>) -> Result<usize> {
    k.opt_usize("attention.sliding_window")?
        .ok_or_else(|| ModelError::Config {
            field: k.key("attention.sliding_window"),
            reason: "missing".into(),
        })
}

/// llama.cpp's attention scale for Gemma 2/3 GGUF files: 1/sqrt(head_dim),
/// except the 27B models, whose query_pre_attn_scalar is hidden / heads.
pub(super) fn gguf_scale_base(s: &Shared) -> Option<f32> {
    matches!(s.hidden_size, 4608 | 5376).then(|| (s.hidden_size / s.num_attention_heads) as f32)
}
