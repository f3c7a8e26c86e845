//! te-kernels: ops on buffers with no model knowledge, on CPU (rayon) and
//! CUDA (NVRTC-compiled sources from the crate's `kernels/`): rotary
//! position embedding (RoPE), the KV-cache save, thd<->bshd, GGUF's
//! quantized block formats and their per-ISA decoders, the CPU matrix
//! products, activations and RMSNorm; plus the layout types every other
//! crate shares.
//!
//! Shape alphabet, used in every doc comment of the workspace:
//! `b` batch (sequences), `s` sequence length, `h` heads, `d` head dim,
//! `t` = sum of the sequences' lengths (packed tokens).
//! - `bshd` = `[b, s, h, d]`, `sbhd` = `[s, b, h, d]`,
//! - `thd` = `[t, h, d]` with `cu_seqlens: [b + 1] i32`, `cu_seqlens[0] = 0`.
//!   Sequences `[a, b, b, c, c, c]` give `cu_seqlens = [0, 1, 3, 6]`.
//!
//! Main types: [`QkvFormat`], [`Element`] (f32, f16, bf16 storage; f32 math),
//! [`KvCacheView`] (what the KV-save op writes and attention reads),
//! [`RopeTable`] (cos/sin built once per RoPE base, shared across layers).
//!
//! Ops (CPU here; the same arguments on CUDA in [`cuda`]):
//! - [`apply_rope_cpu`] / [`apply_rope_cpu_out`]: RoPE in place / out of place;
//! - [`save_kv_cpu`]: a step's new K and V into a contiguous or paged cache;
//! - [`convert_thd_to_bshd`] / [`convert_bshd_to_thd`].
//!
//! CPU only, exact in any batch (a row's result never depends on the rows
//! beside it): [`matmul`] (`x · Wᵀ` over f32 or [`quant`] blocks),
//! [`activation`] (SiLU, GELU-tanh), [`norm`] (RMSNorm, residual add).
//!
//! The same CPU ops take `ndarray` views in [`nd`] (shapes and strides read
//! from the views, sliced and permuted views accepted); [`ndarray`] is
//! re-exported so callers use the same version, and so is [`half`], whose
//! `f16` and `bf16` are element types ([`Element`]).
//!
//! Invariants: te-kernels knows nothing of models, caches' bookkeeping or
//! attention; every op validates its arguments up front and returns
//! [`KernelError`] naming the offending argument, never panics on bad input.

pub mod activation;
mod cu_seqlens;
pub mod cuda;
pub mod element;
pub mod error;
pub mod format;
pub mod int8;
pub mod kv_save;
pub mod kv_view;
pub mod lanes;
pub mod matmul;
pub mod nd;
pub mod norm;
pub mod quant;
pub mod rope;
mod shared_mut;

pub use half;
pub use ndarray;

pub use element::{DType, Element};
pub use error::KernelError;
pub use format::QkvFormat;
pub use kv_save::{
    convert_bshd_to_thd, convert_thd_to_bshd, save_kv_cpu, save_kv_cpu_reusing, ConvertArgs, KvStep,
};
pub use kv_view::{KvCacheLayout, KvCacheView};
pub use rope::{
    apply_rope_cpu, apply_rope_cpu_out, RopeArgs, RopeConvention, RopeFreqs, RopeScaling,
    RopeTable, TensorStrides,
};
