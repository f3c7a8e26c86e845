//! The error type of [`crate::DotProductAttention`] and [`crate::merge`].

/// An argument of an attention op was invalid; nothing was written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttentionError {
    /// A tensor's length does not match what the other arguments imply.
    #[error("{op}: argument `{arg}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        op: &'static str,
        arg: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// A configuration value or scalar argument is out of its valid range.
    #[error("{op}: invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        op: &'static str,
        arg: &'static str,
        reason: String,
    },
    /// One sequence's lengths or offsets are invalid (`arg` names the
    /// cu_seqlens / cache field, `seq` the sequence).
    #[error("{op}: argument `{arg}`, sequence {seq}: {reason}")]
    InvalidSeqlens {
        op: &'static str,
        arg: &'static str,
        seq: usize,
        reason: String,
    },
    /// The CUDA driver, NVRTC or a launch failed, or no GPU is present
    /// (CUDA path only).
    #[error("{op}: cuda: {reason}")]
    Cuda { op: &'static str, reason: String },
}
