//! te-models: Llama and Gemma (1/2/3) models for te-rs, loaded from GGUF
//! files or Hugging Face directories, with their tokenizers, and batched
//! ragged generation with sampling.
//!
//! Main types: [`source::resolve_model`] (a `--model` argument to files,
//! fetching known models), [`loader::load_model`], [`model::Model`] (the
//! forward over one thd step of an `InferenceParams` cache),
//! [`te_tokenizer::Tokenizer`]. te-engine's `Engine` (continuous batching:
//! requests join and leave at any step, paged KV memory with preemption
//! and prefix sharing) and `generate` (a batch run through the engine)
//! drive the model.
//!
//! Invariants: every architecture is a config mapping ([`config`]) and a
//! weight-name mapping ([`weights`]) onto the one [`layer::Layer`]; a model
//! loads only after [`validate`] found its config, tensors, metadata and
//! tokenizer consistent (no tensor missing, misshapen or left unused);
//! GGUF block-quantized weights stay as stored (read in place from the
//! file map) and are decoded inside the matrix kernels ([`ops::Linear`]),
//! other weights are f32; errors name the file, tensor or field at fault.

pub mod config;
pub mod context_parallel;
pub mod convert;
pub mod cuda;
pub mod device;
pub mod error;
pub mod family;
pub mod gguf_model;
pub mod hf;
pub mod inspect;
pub mod layer;
pub mod loader;
pub mod model;
pub mod ops;
pub mod random;
pub mod runner;
pub mod source;
pub mod validate;
pub mod weights;

pub use error::{ModelError, Result};
