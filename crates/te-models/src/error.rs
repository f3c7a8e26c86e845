//! The error type of te-models: every variant names the file, tensor or
//! field at fault.

use std::path::PathBuf;

/// Loading or running a model failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading a file failed.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file is not in the format it claims, is truncated, or declares
    /// counts or sizes that cannot be right.
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    /// A config or metadata field is missing or has a bad value.
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    /// A weight tensor is missing, or has the wrong shape or dtype.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor { tensor: String, reason: String },
    /// A model's files disagree with themselves or with what te-rs runs
    /// (missing, unused or misshapen tensors, metadata contradicting the
    /// tensors, a tokenizer with ids outside the vocabulary): every problem
    /// found, each naming its tensors and fields ([`crate::validate`]).
    #[error("{}", invalid_message(path, problems))]
    Invalid {
        /// The model file or directory.
        path: PathBuf,
        /// One line per problem.
        problems: Vec<String>,
    },
    /// The architecture is not one te-rs runs.
    #[error("unsupported architecture `{name}` (supported: {supported})")]
    UnsupportedArchitecture {
        /// GGUF `general.architecture`.
        name: String,
        /// The registered families, comma-separated.
        supported: String,
    },
    /// A GGUF tensor type te-rs cannot dequantize.
    #[error("tensor `{tensor}`: unsupported GGUF tensor type ({type_name})")]
    UnsupportedQuantization { tensor: String, type_name: String },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Resolving or fetching a model failed.
    #[error("model `{model}`: {reason}")]
    Resolve { model: String, reason: String },
    /// A token id outside the model's vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocabulary { token: u32, vocab_size: usize },
    /// `op` ran with no step planned in the cache (`pre_step` first).
    #[error("{op}: no step planned (call pre_step first)")]
    NoStepPlanned { op: &'static str },
    /// `op` was given `given` tokens for a step planned with `planned`.
    #[error("{op}: {given} tokens given, the planned step has {planned}")]
    StepTokens {
        op: &'static str,
        given: usize,
        planned: usize,
    },
    /// [`crate::model::Model::forward_tails`] was asked for logit rows the
    /// step does not have.
    #[error("logit tails: {0}")]
    LogitTails(String),
    /// A lock shared between threads (named) was poisoned by a panic.
    #[error("the {0} lock is poisoned")]
    Poisoned(&'static str),
    /// A `--device` value that names no device.
    #[error("--device `{0}`: expected cpu, cuda, cuda:N or auto")]
    UnknownDevice(String),
    /// Text or chat messages that cannot be encoded as asked (a model
    /// without a chat template, ...).
    #[error("{0}")]
    Input(String),
    /// A rank of a context-parallel group failed or disagreed.
    #[error("context parallelism: {0}")]
    ContextParallel(te_ring::RingError),
    /// An op below (kernel, attention, cache) rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] te_kernels::KernelError),
    #[error(transparent)]
    Attention(#[from] te_attention::AttentionError),
    #[error(transparent)]
    Cache(#[from] te_cache::CacheError),
    /// The CUDA path failed: a library that does not load (named), no
    /// device, a driver, cuBLAS or launch error.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Problems listed in an [`ModelError::Invalid`] message at most (the
/// rest are counted).
const MAX_LISTED_PROBLEMS: usize = 6;

fn invalid_message(path: &std::path::Path, problems: &[String]) -> String {
    match problems {
        [] => format!("{}: invalid model", path.display()),
        [one] => format!("{}: {one}", path.display()),
        many => {
            let mut s = format!("{}: {} problems: ", path.display(), many.len());
            s.push_str(&many[..many.len().min(MAX_LISTED_PROBLEMS)].join("; "));
            if many.len() > MAX_LISTED_PROBLEMS {
                s.push_str(&format!("; and {} more", many.len() - MAX_LISTED_PROBLEMS));
            }
            s
        }
    }
}

/// A file read's error as the same kind of te-models error (the same
/// message).
impl From<te_formats::FormatError> for ModelError {
    fn from(e: te_formats::FormatError) -> Self {
        use te_formats::FormatError as F;
        match e {
            F::Io { path, error } => ModelError::Io { path, error },
            F::Format { path, reason } => ModelError::Format { path, reason },
            F::Config { field, reason } => ModelError::Config { field, reason },
            F::Tensor { tensor, reason } => ModelError::Tensor { tensor, reason },
            F::UnsupportedQuantization { tensor, type_name } => {
                ModelError::UnsupportedQuantization { tensor, type_name }
            }
            F::Resolve { model, reason } => ModelError::Resolve { model, reason },
        }
    }
}

/// A tokenizer's error as the same kind of te-models error (the same
/// message).
impl From<te_tokenizer::TokenizerError> for ModelError {
    fn from(e: te_tokenizer::TokenizerError) -> Self {
        use te_tokenizer::TokenizerError as T;
        match e {
            T::Io { path, error } => ModelError::Io { path, error },
            T::Format { path, reason } => ModelError::Format { path, reason },
            T::Config { field, reason } => ModelError::Config { field, reason },
            T::Tokenizer(reason) => ModelError::Tokenizer(reason),
            T::Input(reason) => ModelError::Input(reason),
            e @ T::TooLong { .. } => ModelError::Input(e.to_string()),
        }
    }
}

/// Result alias of te-models.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
