//! The error type of ring attention.

use te_attention::AttentionError;

/// A ring-attention call failed; this rank's outputs are not written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RingError {
    /// An argument is invalid (`arg` names it).
    #[error("ring_attention: invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A tensor's length does not match the lengths and heads.
    #[error("ring_attention: argument `{arg}` has {got} elements, expected {expected}")]
    ShapeMismatch {
        arg: &'static str,
        expected: usize,
        got: usize,
    },
    /// The attention op rejected a block (its message names the argument).
    #[error("ring_attention: {0}")]
    Attention(#[from] AttentionError),
    /// A communicator could not be set up (e.g. MPI initialized twice).
    #[error("ring_attention: setting up the communicator: {reason}")]
    Setup { reason: String },
    /// A peer rank hung up or sent a block of the wrong size.
    #[error("ring_attention: rank {cp_rank}: {reason}")]
    Communication { cp_rank: usize, reason: String },
}
