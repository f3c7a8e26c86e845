//! The error type of te-tokenizer: every variant names the file, field or
//! input at fault.

use std::path::PathBuf;

use te_formats::FormatError;

/// Building or running a tokenizer or chat template failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Reading a file failed.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file is not in the format it claims.
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    /// A metadata field is missing or has a bad value.
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    /// Building the tokenizer, encoding, decoding or rendering a template
    /// failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The caller's text or messages cannot be encoded as asked (a model
    /// without a chat template, a message of an unknown role, ...).
    #[error("{0}")]
    Input(String),
    /// The text has more tokens than the caller allows; encoding stopped
    /// once that was certain.
    #[error("the text has at least {at_least} tokens, more than the {limit} allowed")]
    TooLong {
        /// A lower bound of the text's token count (> `limit`).
        at_least: usize,
        /// The caller's limit.
        limit: usize,
    },
}

/// A GGUF metadata read for the vocabulary, as the field or file it named.
impl From<FormatError> for TokenizerError {
    fn from(e: FormatError) -> Self {
        match e {
            FormatError::Io { path, error } => TokenizerError::Io { path, error },
            FormatError::Format { path, reason } => TokenizerError::Format { path, reason },
            FormatError::Config { field, reason } => TokenizerError::Config { field, reason },
            other => TokenizerError::Tokenizer(other.to_string()),
        }
    }
}

/// Result alias of te-tokenizer.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
