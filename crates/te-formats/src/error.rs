//! The error type of te-formats: every variant names the file, tensor,
//! field or model at fault.

use std::path::PathBuf;

use te_kernels::KernelError;

/// Reading a model file failed.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
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
    /// A tensor is missing, or its data does not fit its type and shape.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor { tensor: String, reason: String },
    /// A GGUF tensor type te-rs cannot dequantize.
    #[error("tensor `{tensor}`: unsupported GGUF tensor type ({type_name})")]
    UnsupportedQuantization { tensor: String, type_name: String },
    /// Resolving or fetching a model failed.
    #[error("model `{model}`: {reason}")]
    Resolve { model: String, reason: String },
}

/// A block decoder's rejection, as the tensor it was reading.
impl From<KernelError> for FormatError {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::Tensor { tensor, reason } => FormatError::Tensor { tensor, reason },
            KernelError::UnsupportedQuantization { tensor, type_name } => {
                FormatError::UnsupportedQuantization { tensor, type_name }
            }
            other => FormatError::Tensor {
                tensor: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

/// Result alias of te-formats.
pub type Result<T, E = FormatError> = std::result::Result<T, E>;
