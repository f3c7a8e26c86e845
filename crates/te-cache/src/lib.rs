//! te-cache: [`InferenceParams`], the KV cache that lets many sequences of
//! different lengths be generated together (continuous batching), modeled on
//! TransformerEngine's `InferenceParams` without its limits.
//!
//! Per step: [`InferenceParams::pre_step`] with `(seq_id, step_len)` per
//! sequence (any length: prefill, prefill chunk, decode, several tokens;
//! sequences join and leave between steps) builds one [`StepPlan`] that
//! every layer borrows; then per layer [`InferenceParams::step`] saves the
//! step's K/V and returns the [`te_kernels::KvCacheView`] attention reads;
//! [`InferenceParams::release`] ends a sequence; [`InferenceParams::fork`]
//! copies one; [`InferenceParams::truncate`] rolls one back (rejected
//! speculative tokens), giving pages back. Prompts that share a prefix share its pages
//! ([`InferenceParams::attach_prefix`], [`InferenceParams::register_prefix`]).
//!
//! Main types: [`InferenceParams`] (bookkeeping: sequence table, page pools
//! with reference counts, prefix index, step plan) over a [`KvStorage`]
//! ([`HostKvStorage`] in host memory; a device cache implements the trait
//! and reuses the bookkeeping), [`CacheShape`] (its geometry: batch,
//! sequence length, layers, heads, head dims, dtype, layout),
//! [`CacheLayout`] (contiguous or paged),
//! [`SlidingWindow`] (per-layer ring of the last positions), [`CacheError`].
//!
//! Invariants:
//! - bookkeeping: each page is held by `refs` sequences, or cached for
//!   prefix reuse, or free, exactly one of the three; a sequence with
//!   `cached` tokens holds `min(ceil(cached / page_size), ring_len /
//!   page_size)` pages of a pool; a contiguous cache is a pool of
//!   `max_batch_size` pages of `max_seqlen` (or `ring_len`) rows;
//! - a page that is shared or registered is never written (copy-on-write);
//! - every error leaves the cache exactly as it was;
//! - te-cache owns storage and bookkeeping only: it never computes attention.

mod error;
mod params;
mod pool;
mod prefix;
mod storage;

pub use error::CacheError;
pub use params::{CacheLayout, CacheShape, InferenceParams, SlidingWindow, StepPlan};
pub use storage::{HostKvStorage, KvStorage};
