//! Gemma 3 text (Hugging Face `gemma3`, `gemma3_text`; GGUF `gemma3`):
//! Gemma 2's block without softcaps, plus per-head RMSNorm of q and k;
//! five sliding-window layers to one global (layer `i` slides when
//! `(i + 1) % sliding_window_pattern != 0`, pattern 6 by default; GGUF:
//! `i % 6 < 5`; or Hugging Face `layer_types`), the sliding layers rotating
//! with their own base `rope_local_base_freq` (10000) and no scaling, and
//! the attention scale 1/sqrt(query_pre_attn_scalar).

use te_formats::hf_config::{field, HfConfig};
use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, GgufKeys, Shared, Specifics};
use super::gemma2::{gguf_scale_base, gguf_window, hf_layer_types};
use crate::Result;

/// The Gemma 3 family.
pub static GEMMA3: Family = Family {
    name: "gemma3",
    hf_model_types: &["gemma3", "gemma3_text"],
    hf_model_type: "gemma3_text",
    hf_class: "Gemma3ForCausalLM",
    activation: Activation::GeluTanh,
    default_tie_word_embeddings: true,
    gguf_rope_convention: RopeConvention::HalfSplit,
    hf_norm_offset: 1.0,
    scale_embedding: true,
    qk_norm: true,
    qkv_bias: false,
    sandwich_norms: true,
    hf_use_sliding_window: false,
    local_rope_unscaled: true,
    from_hf,
    from_gguf,
};

/// The local layers' RoPE base where the file names none.
const LOCAL_BASE: f32 = 10000.0;

fn from_hf(raw: &HfConfig, s: &Shared) -> Result<Specifics> {
    let scale = field(raw.query_pre_attn_scalar, "query_pre_attn_scalar")? as f32;
    let w = field(raw.sliding_window, "sliding_window")?;
    let windows = match &raw.layer_types {
        Some(types) => hf_layer_types(types, w)?,
        None => {
            let pattern = raw.sliding_window_pattern.unwrap_or(6).max(1);
            (0..s.num_hidden_layers)
                .map(|i| ((i + 1) % pattern != 0).then_some(w))
                .collect()
        }
    };
    Ok(Specifics {
        softmax_scale_base: Some(scale),
        layer_windows: Some(windows),
        rope_local_base_freq: Some(raw.rope_local_base_freq.map_or(LOCAL_BASE, |b| b as f32)),
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
    })
}

fn from_gguf(k: &GgufKeys<'_>, s: &Shared) -> Result<Specifics> {
    let w = gguf_window(k)?;
    Ok(Specifics {
        softmax_scale_base: gguf_scale_base(s),
        layer_windows: Some(
            (0..s.num_hidden_layers)
                .map(|i| (i % 6 < 5).then_some(w))
                .collect(),
        ),
        rope_local_base_freq: Some(LOCAL_BASE),
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
    })
}
