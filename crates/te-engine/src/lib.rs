//! te-engine: the generation engine every front end drives (`te generate`,
//! `te serve`, benches, context-parallel ranks): requests join and leave at
//! any step, KV memory follows the tokens (paged, with recompute
//! preemption and shared prompt prefixes), each step runs one ragged batch
//! through the model, and sequences sample, detokenize and stop
//! independently.
//!
//! Main types: [`Engine`] (`add_request`, `step`, `abort`), built on
//! [`scheduler::Scheduler`] (admission, chunking, preemption, prefix hits;
//! testable without a model), [`EngineHandle`] (the engine on a thread of
//! its own),
//! [`sampling::Sampler`], [`speculative`] (drafts from prompt lookup or a
//! draft model, verified inside the step), [`generate::generate`] (a batch of requests run
//! to completion), [`perplexity`].
//!
//! Invariants: a request's tokens are the same alone and in any batch
//! (each sequence its own sampler and RNG; the model's rows are
//! batch-invariant); a rejected request disturbs no other; a failed step
//! leaves every cache operation undone.

pub mod constraint;
pub mod driver;
pub mod engine;
pub mod error;
pub mod generate;
pub mod output;
pub mod perplexity;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
mod text;

pub use driver::{channel, Command, EngineHandle, EngineStopped};
pub use engine::{Engine, EngineConfig, EngineSnapshot, EngineStats, RankKv};
pub use error::{EngineError, Result};
pub use output::{Event, FinishReason, Usage};
pub use request::{DraftLimits, Request, RequestError, RequestId};
pub use sampling::TokenLogprobs;
