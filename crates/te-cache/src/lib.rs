//! te-cache: [`InferenceParams`], the KV cache that lets many sequences of
//! different lengths be generated together (continuous batching), modeled on
//! TransformerEngine's `InferenceParams` without its limits.
//!
//! Per step: [`InferenceParams::pre_step`] with `(seq_id, step_len)` per
//! sequence (any length: prefill, prefill chunk, decode, several tokens;
//! sequences join and leave between steps), then per layer
//! [`InferenceParams::step`] saves the step's K/V and returns the
//! [`te_kernels::KvCacheView`] attention reads; [`InferenceParams::release`]
//! ends a sequence; [`InferenceParams::fork`] copies one (shared prompts).
//!
//! Main types: [`InferenceParams`], [`CacheLayout`] (contiguous or paged),
//! [`SlidingWindow`] (per-layer ring of the last positions), [`CacheError`].
//!
//! Invariants:
//! - bookkeeping: pages in use in a pool = sum over held sequences of
//!   `min(ceil(cached / page_size), ring_len / page_size)`; a contiguous cache
//!   is a pool of `max_batch_size` pages of `max_seqlen` (or `ring_len`) rows;
//! - every error leaves the cache exactly as it was;
//! - te-cache owns storage and bookkeeping only: it never computes attention.

mod error;
mod params;
mod pool;
mod storage;

pub use error::CacheError;
pub use params::{CacheLayout, InferenceParams, SlidingWindow};
