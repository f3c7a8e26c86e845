//! The error type of te-engine: each variant names the setting, request,
//! rank or step at fault; model and cache errors pass through unchanged.

use te_cache::CacheError;
use te_models::ModelError;
use te_ring::RingError;

use crate::request::RequestError;

/// Running the engine (or a batch through it) failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An engine or evaluation setting is out of range (`reason` follows
    /// the setting's name: "must be at least 1").
    #[error("{setting} {reason}")]
    Setting {
        setting: &'static str,
        reason: String,
    },
    /// A text too short for one perplexity window of `ctx` tokens.
    #[error("the text has {tokens} tokens; perplexity needs at least ctx = {ctx}")]
    TooFewTokens { tokens: usize, ctx: usize },
    /// Request `index` of a batch ([`crate::generate::generate`]) was
    /// refused; nothing ran.
    #[error("request {index}: {error}")]
    Request { index: usize, error: RequestError },
    /// A rank of a context-parallel group failed or disagreed.
    #[error("context parallelism: {0}")]
    ContextParallel(#[from] RingError),
    /// Context parallelism was asked of a model on a GPU.
    #[error("context parallelism runs on the CPU only (--device cpu)")]
    ContextParallelOnGpu,
    /// A step's forward pass failed; its sequences were queued for
    /// recompute.
    #[error("generation step of {tokens} tokens failed: {source}")]
    Step { tokens: usize, source: ModelError },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Result alias of te-engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
