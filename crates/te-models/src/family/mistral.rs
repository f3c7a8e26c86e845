//! Mistral (Hugging Face `mistral`, `MistralForCausalLM`): Llama's block
//! with an optional sliding window on every layer (`sliding_window`: a
//! query sees itself and the `sliding_window - 1` keys before it; `null`
//! on Mistral 7B v0.2 and later, 4096 on v0.1). llama.cpp's converter
//! writes Mistral as GGUF `llama` (Q/K rows permuted, no window key), so
//! those files load as the Llama family, without a window, as llama.cpp
//! runs them; a GGUF that says `mistral` reads
//! `mistral.attention.sliding_window` when present.

use te_formats::hf_config::HfConfig;
use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, GgufKeys, Shared, Specifics};
use crate::Result;

/// The Mistral family.
pub static MISTRAL: Family = Family {
    name: "mistral",
    hf_model_types: &["mistral"],
    hf_model_type: "mistral",
    hf_class: "MistralForCausalLM",
    activation: Activation::Silu,
    default_tie_word_embeddings: false,
    gguf_rope_convention: RopeConvention::Interleaved,
    hf_norm_offset: 0.0,
    scale_embedding: false,
    qk_norm: false,
    qkv_bias: false,
    sandwich_norms: false,
    hf_use_sliding_window: false,
    local_rope_unscaled: false,
    from_hf,
    from_gguf,
};

/// `window` on every layer, or every layer global.
fn every_layer(window: Option<usize>, s: &Shared) -> Specifics {
    Specifics {
        layer_windows: window.map(|w| vec![Some(w); s.num_hidden_layers]),
        ..Specifics::default()
    }
}

fn from_hf(raw: &HfConfig, s: &Shared) -> Result<Specifics> {
    Ok(every_layer(raw.sliding_window, s))
}

fn from_gguf(k: &GgufKeys<'_>, s: &Shared) -> Result<Specifics> {
    Ok(every_layer(k.opt_usize("attention.sliding_window")?, s))
}
