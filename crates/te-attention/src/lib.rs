//! te-attention: scaled dot-product attention for inference, configured
//! like TransformerEngine's `DotProductAttention`.
//!
//! Q in bshd, sbhd or thd (`cu_seqlens_q`); K/V as tensors in any of the
//! three formats or read straight from a KV cache ([`te_kernels::KvCacheView`],
//! contiguous or paged); every TransformerEngine mask type, sliding windows,
//! GQA/MQA, `d_qk != d_v`, logit softcapping, and the natural-log LSE.
//!
//! Main types: [`DotProductAttention`] (configuration and entry points),
//! [`KvInput`], [`AttnMetadata`] (per-step lengths), [`AttnMaskType`],
//! [`AttentionError`]; [`merge`] combines partial results by LSE. The same
//! op runs on the GPU with [`DotProductAttention::forward_cuda`] ([`cuda`],
//! `kernels/attention.cu`). [`DotProductAttention::forward_nd`] ([`nd`])
//! takes Q, K, V and the outputs as `ndarray` views instead, with every
//! shape read from the views ([`ndarray`] is re-exported).
//!
//! ```text
//! s_ij  = softmax_scale * q_i · k_j        (then cap * tanh(s / cap))
//! keep j in [lo(i), hi(i)]                  (mask, window; see mask::KeyRange)
//! out_i = sum_j softmax_j(s_ij) v_j,  lse_i = ln sum_j exp(s_ij)
//! ```
//!
//! Invariants: te-attention never allocates KV storage (it reads what
//! te-cache owns); a query that sees no key has output 0 and lse -inf,
//! never NaN; every argument is validated before anything is written.

pub mod attention;
mod cpu;
pub mod cuda;
pub mod error;
pub mod mask;
pub mod merge;
pub mod nd;
mod simd;
mod tile_math;

pub use ndarray;

pub use attention::{AttnMetadata, AttnOutput, DotProductAttention, KvInput, Positions};
pub use cpu::AttentionWorkspace;
pub use error::AttentionError;
pub use mask::{AttnMaskType, KeyRange};
pub use merge::{merge_partial, merge_row};
