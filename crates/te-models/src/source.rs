//! What a `--model` argument names: a GGUF file, a Hugging Face
//! directory or a known model (te-formats' [`te_formats::hub`], fetched on
//! first use), or `random:<preset or config.json>` (seeded random weights,
//! [`crate::random`]).

use std::path::{Path, PathBuf};

use te_formats::hub::{resolve_files, ModelFiles};

use crate::random::RandomModel;
use crate::Result;

/// Where a model's weights, config and tokenizer come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A single GGUF file (weights, config and tokenizer in one).
    Gguf(PathBuf),
    /// A Hugging Face model directory (`config.json`, `*.safetensors`,
    /// `tokenizer.json`).
    HfDir(PathBuf),
    /// Seeded random weights for a preset or `config.json`
    /// (`random:...`), with a byte tokenizer.
    Random(RandomModel),
}

impl ModelSource {
    /// The file or directory named in messages (a random model's spec).
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
            ModelSource::Random(r) => Path::new(&r.spec),
        }
    }
}

/// Resolves a `--model` argument: `random:...` parses a random-weight
/// spec ([`RandomModel::parse`]; nothing is generated until it is
/// loaded); anything else is [`resolve_files`] (paths checked, known
/// models fetched on first use).
///
/// Errors: a bad random spec; [`te_formats::FormatError::Resolve`] naming
/// the spec.
pub fn resolve_model(spec: &str) -> Result<ModelSource> {
    if spec.starts_with("random:") {
        return RandomModel::parse(spec).map(ModelSource::Random);
    }
    Ok(match resolve_files(spec)? {
        ModelFiles::Gguf(p) => ModelSource::Gguf(p),
        ModelFiles::HfDir(p) => ModelSource::HfDir(p),
    })
}
