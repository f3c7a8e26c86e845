//! The error type of [`crate::InferenceParams`].

use te_kernels::{DType, KernelError};

/// Why an `InferenceParams` call was refused. Every error leaves the cache
/// exactly as it was before the call (bookkeeping and stored keys/values).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CacheError {
    /// A constructor or configuration argument is out of range.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument { arg: &'static str, reason: String },
    /// A paged pool has fewer free pages than this step needs.
    #[error(
        "cache full: this step needs {pages_needed} more pages of {page_size} tokens \
         (layer {layer}'s pool), {pages_free} free"
    )]
    CacheFull {
        /// A layer using the pool that ran out.
        layer: usize,
        page_size: usize,
        pages_needed: usize,
        pages_free: usize,
    },
    /// `release` or `fork` named a sequence the cache does not hold.
    #[error("unknown sequence id {seq_id}")]
    UnknownSequence { seq_id: u64 },
    /// A sequence id appears twice in one `pre_step`, or `fork` targets a live id.
    #[error("duplicate sequence id {seq_id}")]
    DuplicateSequence { seq_id: u64 },
    /// A step of length 0 was requested.
    #[error("sequence {seq_id}: step_len must be at least 1")]
    EmptyStep { seq_id: u64 },
    /// A sequence would grow past `max_seqlen`.
    #[error(
        "sequence {seq_id}: {cached} cached + step_len {step_len} exceeds max_seqlen {max_seqlen}"
    )]
    ExceedsMaxSeqlen {
        seq_id: u64,
        cached: usize,
        step_len: usize,
        max_seqlen: usize,
    },
    /// A step is longer than a sliding-window layer's ring was sized for
    /// (split the prefill into chunks of at most `max_step_len`).
    #[error(
        "sequence {seq_id}: step_len {step_len} exceeds max_step_len {max_step_len} \
         of sliding-window layer {layer}"
    )]
    StepExceedsWindowRing {
        seq_id: u64,
        step_len: usize,
        layer: usize,
        max_step_len: usize,
    },
    /// `truncate` would drop positions a sliding-window ring has already
    /// overwritten with the ones being dropped.
    #[error(
        "sequence {seq_id}: cannot roll back to {new_len} tokens: layer {layer}'s \
         sliding-window ring of {ring_len} rows, written up to position {written}, \
         no longer holds the positions the next query needs"
    )]
    RollbackPastRing {
        seq_id: u64,
        /// Most tokens the sequence ever held.
        written: usize,
        new_len: usize,
        layer: usize,
        ring_len: usize,
    },
    /// More sequences in one step than `max_batch_size`.
    #[error("batch of {batch} sequences exceeds max_batch_size {max_batch_size}")]
    BatchTooLarge { batch: usize, max_batch_size: usize },
    /// Admitting a new sequence would make the cache hold more than
    /// `max_batch_size` sequences.
    #[error(
        "sequence {seq_id}: cannot join, the cache already holds {live} sequences \
         (max_batch_size {max_batch_size})"
    )]
    TooManySequences {
        seq_id: u64,
        live: usize,
        max_batch_size: usize,
    },
    /// A layer index is not below `num_layers`.
    #[error("layer {layer} out of range (num_layers {num_layers})")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    /// `step` or `view` was called with no planned step (call `pre_step`).
    #[error("no step planned: call pre_step first")]
    NoStep,
    /// Configuration changes need an empty cache.
    #[error("{op}: the cache must hold no sequences (it holds {live})")]
    NotEmpty { op: &'static str, live: usize },
    /// K or V has the wrong number of elements for this step.
    #[error("argument `{arg}` has {got} elements, expected shape {expected:?}")]
    ShapeMismatch {
        arg: &'static str,
        expected: Vec<usize>,
        got: usize,
    },
    /// K/V element type differs from the cache's storage dtype.
    #[error("argument `{arg}` has dtype {got}, the cache stores {expected}")]
    DTypeMismatch {
        arg: &'static str,
        expected: DType,
        got: DType,
    },
    /// The KV-save kernel refused its arguments.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}
