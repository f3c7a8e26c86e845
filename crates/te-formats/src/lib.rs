//! te-formats: model files as stored, no math: GGUF v2/v3 ([`gguf`]),
//! safetensors directories ([`safetensors`]), Hugging Face `config.json`
//! ([`hf_config`]), stored tensors behind one trait ([`TensorSource`]) and
//! the known models fetched from the Python package index ([`hub`]).
//!
//! Main types: [`gguf::GgufFile`] (memory-mapped, bounds-checked),
//! [`safetensors::SafetensorsSource`], [`hf_config::HfConfig`] (the fields
//! as written; a model family interprets them), [`WeightData`] (f32, or
//! GGUF blocks read in place from the file map).
//!
//! Invariants: nothing here knows a model family; every read is checked
//! against the file's size before it happens; errors ([`FormatError`])
//! name the file, tensor or field at fault.

pub mod error;
pub mod gguf;
pub mod hf_config;
pub mod hub;
pub mod safetensors;
pub mod tensor;

pub use error::{FormatError, Result};
pub use tensor::{StoredTensor, TensorSource, WeightBytes, WeightData};
