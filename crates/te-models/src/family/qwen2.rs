//! Qwen2 and Qwen2.5 with their Coder and Math variants (Hugging Face
//! `qwen2`, `Qwen2ForCausalLM`; GGUF `qwen2`): Llama's block with biases
//! on the q, k and v projections (none on o), half-split RoPE (GGUF qwen2
//! files keep Hugging Face's Q/K rows: llama.cpp rotates them NeoX-style)
//! with the base from the file (1e6 on Qwen2.5), SwiGLU, tied or untied
//! output. A sliding window applies only with `use_sliding_window`, to the
//! layers from `max_window_layers` on (Hugging Face's `layer_types`);
//! released Qwen2.5 configs leave it off.

use te_formats::hf_config::HfConfig;
use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, Shared, Specifics};
use super::gemma2::hf_layer_types;
use crate::Result;

/// The Qwen2 family.
pub static QWEN2: Family = Family {
    name: "qwen2",
    hf_model_types: &["qwen2"],
    hf_model_type: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    activation: Activation::Silu,
    default_tie_word_embeddings: false,
    gguf_rope_convention: RopeConvention::HalfSplit,
    hf_norm_offset: 0.0,
    scale_embedding: false,
    qk_norm: false,
    qkv_bias: true,
    sandwich_norms: false,
    hf_use_sliding_window: true,
    local_rope_unscaled: false,
    from_hf: qwen_from_hf,
    from_gguf: |_, _| Ok(Specifics::default()),
};

/// Qwen2's and Qwen3's Hugging Face specifics: their sliding windows.
pub(super) fn qwen_from_hf(raw: &HfConfig, s: &Shared) -> Result<Specifics> {
    Ok(Specifics {
        layer_windows: qwen_windows(raw, s)?,
        ..Specifics::default()
    })
}

/// Qwen2/Qwen3 sliding windows as Hugging Face's configs set them: the
/// window is `sliding_window` only with `use_sliding_window` true (else
/// none, whatever else is written); `layer_types`, when given (and always
/// checked), says which layers slide; without it layers `i >=
/// max_window_layers` do. `None`: every layer global.
fn qwen_windows(raw: &HfConfig, s: &Shared) -> Result<Option<Vec<Option<usize>>>> {
    let window = raw.sliding_window.filter(|_| raw.use_sliding_window == Some(true));
    if let Some(types) = &raw.layer_types {
        let slides = hf_layer_types(types, 1)?;
        return Ok(Some(
            slides.into_iter().map(|w| w.and(window)).collect(),
        ));
    }
    Ok(window.map(|w| {
        let first = raw.max_window_layers.unwrap_or(0);
        (0..s.num_hidden_layers)
            .map(|i| (i >= first).then_some(w))
            .collect()
    }))
}
