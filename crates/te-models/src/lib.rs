//! te-models: the model definition of te-rs: the families (Llama, Gemma
//! 1/2/3; [`family`], one file each), their configs, weights and
//! validation, the one transformer layer over device ops, and the
//! per-device step ([`runner`]: CPU, CUDA, context-parallel rank).
//!
//! Main types: [`source::resolve_model`] (a `--model` argument to files,
//! fetching known models), [`loader::load_model`], [`model::Model`] (the
//! forward over one thd step of an `InferenceParams` cache),
//! [`runner::Runner`] (where the steps run). te-engine's `Engine` drives
//! the model.
//!
//! Invariants: every architecture is one [`family`] file mapped onto the
//! one [`layer::Layer`] (config and tensor names); `Model` and
//! `Workspace` name no CUDA type; a model
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
