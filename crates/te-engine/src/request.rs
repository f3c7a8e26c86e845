//! Requests as the engine takes them: the prompt, limits, sampling and
//! stop settings, and the typed reasons a request is refused.

use crate::constraint::TokenConstraint;
use crate::sampling::SamplingParams;

/// Identifies a request for the engine's lifetime (never reused).
pub type RequestId = u64;

/// One prompt to continue.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids (BOS included when the model wants one).
    pub prompt_tokens: Vec<u32>,
    /// Most tokens to generate (0: the request finishes at once with
    /// `length`).
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going past EOS (llama.cpp's `--ignore-eos`).
    pub ignore_eos: bool,
    /// Stop when the text contains one of these (non-empty) strings; the
    /// text is cut before it. Needs an engine with a tokenizer.
    pub stop: Vec<String>,
    /// Leave special tokens (BOS, EOS, chat markers) out of the text.
    pub skip_special_tokens: bool,
    /// The grammar the generated tokens must follow (structured outputs,
    /// tool calls), if any ([`crate::constraint`]).
    pub constraint: Option<TokenConstraint>,
    /// Prefix-cache salt: the request shares cached prompt pages only with
    /// requests of the same salt (`None` is a salt of its own). A server
    /// gives each client (API key, or the request's `cache_salt`) its own,
    /// so one cannot probe what another's prompts were.
    pub cache_salt: Option<Vec<u8>>,
    /// Per-request bounds on speculative decoding (default: the engine's
    /// setting).
    pub draft: DraftLimits,
}

/// A request's bounds on speculative decoding, llama.cpp server's
/// `speculative.n_max` and `speculative.n_min`. They only narrow the
/// engine's setting ([`crate::EngineConfig::speculative`]): an engine
/// without drafting ignores them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DraftLimits {
    /// Most tokens drafted per verification (0: no drafting for this
    /// request); above the engine's own maximum it is that maximum.
    pub n_max: Option<usize>,
    /// Drafts shorter than this are not verified (plain decode instead);
    /// at most `n_max` (0 counts as 1).
    pub n_min: Option<usize>,
}

impl Request {
    /// A greedy request for `max_new_tokens` after `prompt_tokens`, no stop
    /// strings, special tokens left out of the text, no cache salt, the engine's drafting.
    pub fn new(prompt_tokens: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            prompt_tokens,
            max_new_tokens,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop: Vec::new(),
            skip_special_tokens: true,
            constraint: None,
            cache_salt: None,
            draft: DraftLimits::default(),
        }
    }
}

/// Why a request was refused by [`crate::Engine::add_request`]; `field` names the
/// request field at fault.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A field's value is out of range or inconsistent.
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// The request would never fit: prompt plus one generated token is
    /// longer than the model's context or the whole KV pool.
    #[error("prompt_tokens: {tokens} tokens plus one generated do not fit the {limit} tokens of the {what}")]
    TooLong {
        tokens: usize,
        limit: usize,
        what: &'static str,
    },
    /// [`crate::Engine::abort`] named a request the engine does not hold.
    #[error("unknown request {0}")]
    Unknown(RequestId),
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> RequestError {
    RequestError::Invalid {
        field,
        reason: reason.into(),
    }
}
