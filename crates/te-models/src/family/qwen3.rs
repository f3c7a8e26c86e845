//! Dense Qwen3 (Hugging Face `qwen3`, `Qwen3ForCausalLM`; GGUF `qwen3`):
//! Llama's block with a per-head RMSNorm of q and k (weights `[head_dim]`,
//! used as stored) before half-split RoPE, no q/k/v biases (unless
//! `attention_bias`), and `head_dim` from the config (128 on every size,
//! not hidden / heads). Sliding windows as Qwen2 (`use_sliding_window`,
//! off in released configs). The MoE models (`qwen3_moe`) are another
//! architecture, not run.

use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use super::descriptor::{Family, Specifics};
use super::qwen2::qwen_from_hf;

/// The Qwen3 family.
pub static QWEN3: Family = Family {
    name: "qwen3",
    hf_model_types: &["qwen3"],
    hf_model_type: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    activation: Activation::Silu,
    default_tie_word_embeddings: false,
    gguf_rope_convention: RopeConvention::HalfSplit,
    hf_norm_offset: 0.0,
    scale_embedding: false,
    qk_norm: true,
    qkv_bias: false,
    sandwich_norms: false,
    hf_use_sliding_window: true,
    local_rope_unscaled: false,
    from_hf: qwen_from_hf,
    from_gguf: |_, _| Ok(Specifics::default()),
};
