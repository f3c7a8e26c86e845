//! What the engine hands back: per-request events (tokens with their text
//! deltas, the finish with its reason and token counts).

use crate::request::RequestId;

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

/// The log-probabilities of one generated token under the model's raw
/// logits (before penalties, bias, temperature or truncation: OpenAI's
/// definition): `ln softmax(l)_i = l_i - lse(l)`, with the log-sum-exp
/// accumulated in f64 (see [`crate::sampling`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f64,
    /// The most likely tokens, `(id, log-probability)`, most likely first
    /// (lower id first among equals; NaN logits never listed).
    pub top: Vec<(u32, f64)>,
}

impl TokenLogprobs {
    /// The log-probability of `chosen` and the `top` most likely tokens
    /// of `logits: [vocab]` (fewer when the vocabulary is smaller).
    pub fn of(logits: &[f32], chosen: u32, top: usize) -> Self {
        let lse = log_sum_exp(logits);
        let lp = |l: f32| {
            if l.is_nan() {
                f64::NEG_INFINITY
            } else if lse == f64::INFINITY {
                // The +inf logits share the mass evenly.
                if l == f32::INFINITY {
                    -(logits.iter().filter(|&&x| x == f32::INFINITY).count() as f64).ln()
                } else {
                    f64::NEG_INFINITY
                }
            } else {
                l as f64 - lse
            }
        };
        // The `top` largest by (logit desc, id asc), by insertion into a
        // short sorted list.
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if l.is_nan() || (best.len() == top && l <= best[top - 1].1) {
                    continue;
                }
                let at = best.partition_point(|&(_, b)| b >= l);
                best.insert(at, (i as u32, l));
                best.truncate(top);
            }
        }
        TokenLogprobs {
            logprob: logits
                .get(chosen as usize)
                .map_or(f64::NEG_INFINITY, |&l| lp(l)),
            top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
        }
    }
}

/// `ln Σ exp(l_i)` over the non-NaN logits, in f64: `m + ln Σ exp(l_i - m)`
/// with `m` their max (`+inf` if some logit is, `-inf` if all are or there
/// are none).
fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    if !m.is_finite() {
        return m;
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - m).exp())
        .sum();
    m + sum.ln()
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
