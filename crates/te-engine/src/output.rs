//! What the engine hands back: per-request events (tokens with their text
//! deltas, the finish with its reason and token counts).

use crate::request::RequestId;
use crate::sampling::TokenLogprobs;

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end token (EOS or end-of-turn; it is the last
    /// generated token).
    Eos,
    /// `max_new_tokens` reached, the model's context is full, or the
    /// sequence alone fills the KV pool.
    Length,
    /// A stop string appeared in the text.
    Stop,
    /// [`crate::Engine::abort`] (or a dropped receiver under [`crate::Engine::run`]).
    Abort,
}

impl FinishReason {
    /// `"eos"`, `"length"`, `"stop"` or `"abort"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from shared pages (first
    /// admission only; a recompute after preemption is not counted).
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
}

/// What a step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it releases (may be empty: an
    /// incomplete character or a possible stop string is held back).
    Token {
        id: RequestId,
        token: u32,
        text: String,
        /// With [`crate::sampling::SamplingParams::logprobs`]: the token's
        /// log-probabilities.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request is done; `text` is what was still held back (empty after
    /// a stop string). No event follows for this id.
    Finished {
        id: RequestId,
        reason: FinishReason,
        text: String,
        usage: Usage,
    },
}

impl Event {
    /// The request this event belongs to.
    pub fn id(&self) -> RequestId {
        match self {
            Event::Token { id, .. } | Event::Finished { id, .. } => *id,
        }
    }
}
