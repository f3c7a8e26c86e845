//! Gemma (1) (Hugging Face and GGUF `gemma`): GeGLU with the tanh GELU
//! (Gemma 1 configs say `gelu`, the reference uses the tanh
//! approximation), RMSNorm multiplying by `1 + w` (Hugging Face stores
//! `w`), the embedding scaled by sqrt(hidden_size), tied embeddings by
//! default, half-split RoPE in both formats, every layer global, scale
//! 1/sqrt(head_dim).

use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, Specifics};

/// The Gemma family.
pub static GEMMA: Family = Family {
    name: "gemma",
    hf_model_types: &["gemma"],
    hf_model_type: "gemma",
    hf_class: "GemmaForCausalLM",
    activation: Activation::GeluTanh,
    default_tie_word_embeddings: true,
    gguf_rope_convention: RopeConvention::HalfSplit,
    hf_norm_offset: 1.0,
    scale_embedding: true,
    qk_norm: false,
    qkv_bias: false,
    sandwich_norms: false,
    hf_use_sliding_window: false,
    local_rope_unscaled: false,
    from_hf: |_, _| Ok(Specifics::default()),
    from_gguf: |_, _| Ok(Specifics::default()),
};
