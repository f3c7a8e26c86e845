//! Llama 2, Llama 3.x, SmolLM2, TinyLlama (Hugging Face `llama`; GGUF
//! `llama`, which Mistral's GGUF files say too): RMSNorm before
//! attention and MLP, SwiGLU, no softcaps, every layer global. GGUF llama
//! files store the Q/K rows permuted for interleaved RoPE (llama.cpp's
//! converter), so their rotation is interleaved; Hugging Face weights
//! rotate half-split. Attention scale 1/sqrt(head_dim).

use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, Specifics};

/// The Llama family.
pub static LLAMA: Family = Family {
    name: "llama",
    hf_model_types: &["llama"],
    hf_model_type: "llama",
    hf_class: "LlamaForCausalLM",
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
    from_hf: |_, _| Ok(Specifics::default()),
    from_gguf: |_, _| Ok(Specifics::default()),
};
