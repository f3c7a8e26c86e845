//! The error type of every te-kernels op.

/// An op's argument was invalid; nothing was written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// A tensor's length or shape does not match what the other arguments imply.
    #[error("{op}: argument `{arg}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        op: &'static str,
        arg: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// A scalar or index argument is out of its valid range.
    #[error("{op}: invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        op: &'static str,
        arg: &'static str,
        reason: String,
    },
    /// A token's position is past the end of the RoPE frequency table.
    #[error("{op}: sequence {seq} reaches position {position}, past the RoPE table's {max_positions} positions")]
    PositionOutOfRange {
        op: &'static str,
        seq: usize,
        position: usize,
        max_positions: usize,
    },
    /// A stored tensor's data does not fit its declared type and shape.
    #[error("tensor `{tensor}`: {reason}")]
    Tensor { tensor: String, reason: String },
    /// A GGML tensor type this crate cannot decode.
    #[error("tensor `{tensor}`: unsupported GGUF tensor type ({type_name})")]
    UnsupportedQuantization { tensor: String, type_name: String },
    /// The CUDA driver, NVRTC or a launch failed, or no GPU is present.
    #[error("cuda: {0}")]
    Cuda(String),
}
