//! Batched ragged generation with continuous batching.
//!
//! Many prompts of different lengths run together as one thd batch through
//! [`InferenceParams`](te_cache::InferenceParams), with no padding: each step feeds every active
//! sequence either its next prompt chunk (chunked prefill) or its last
//! sampled token, sequences finish independently (EOS, max new tokens, or
//! the caller's stop), and waiting requests join as soon as a slot frees.
//! A sequence gets the same tokens batched as alone.

use std::collections::VecDeque;

use te_cache::CacheLayout;

use crate::model::{Logits, Model};
use crate::sampling::{Sampler, SamplingParams};
use crate::{ModelError, Result};

/// One prompt to continue.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Prompt token ids (BOS included when the model wants one).
    pub prompt_tokens: Vec<u32>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going past EOS (llama.cpp's `--ignore-eos`).
    pub ignore_eos: bool,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an EOS token (included in the output).
    Eos,
    /// `max_new_tokens` reached, or the model's context is full.
    Length,
    /// The caller's callback asked to stop (e.g. a stop string).
    Stop,
}

impl FinishReason {
    /// `"eos"`, `"length"` or `"stop"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// What one request produced.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationOutput {
    /// Generated token ids only.
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
}

/// What the per-token callback tells the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    Stop,
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct GenerationConfig {
    /// Sequences run together at most.
    pub max_batch_size: usize,
    /// Longest prompt chunk fed for one sequence in one step.
    pub prefill_chunk: usize,
    /// Most tokens fed in one step, all sequences together (at least one
    /// token per active sequence is always fed).
    pub max_step_tokens: usize,
    /// Tokens per KV-cache page.
    pub page_size: usize,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_batch_size: 16,
            prefill_chunk: 512,
            max_step_tokens: 2048,
            page_size: 16,
        }
    }
}

struct Active {
    request: usize,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens already in the cache.
    fed: usize,
    /// Most tokens this sequence may reach (prompt + max new, capped by the context).
    limit: usize,
    sampler: Sampler,
}

/// Runs every request to completion, calling `on_token(request_index,
/// token)` for each generated token as soon as it is chosen.
///
/// Errors: an empty prompt, a prompt as long as the model's context or
/// longer (naming the request), invalid sampling settings, and any error of
/// the forward pass. Requests are validated before anything runs.
pub fn generate(
    model: &Model,
    requests: &[GenerationRequest],
    config: &GenerationConfig,
    mut on_token: impl FnMut(usize, u32) -> Control,
) -> Result<Vec<GenerationOutput>> {
    let ctx = model.config.max_position_embeddings;
    for (i, r) in requests.iter().enumerate() {
        if r.prompt_tokens.is_empty() {
            return Err(ModelError::Request(format!("prompt {i} is empty")));
        }
        if r.prompt_tokens.len() >= ctx {
            return Err(ModelError::Request(format!(
                "prompt {i} has {} tokens; the model's context is {ctx} tokens",
                r.prompt_tokens.len()
            )));
        }
        r.sampling
            .validate()
            .map_err(|e| ModelError::Request(format!("prompt {i}: {e}")))?;
    }
    if config.max_batch_size == 0 || config.prefill_chunk == 0 || config.page_size == 0 {
        return Err(ModelError::Request(
            "max_batch_size, prefill_chunk and page_size must be at least 1".into(),
        ));
    }
    let limit =
        |r: &GenerationRequest| (r.prompt_tokens.len().saturating_add(r.max_new_tokens)).min(ctx);
    let mut outputs: Vec<Option<GenerationOutput>> = vec![None; requests.len()];
    // Requests that generate nothing finish before they start.
    let mut pending: VecDeque<usize> = VecDeque::new();
    for (i, r) in requests.iter().enumerate() {
        if r.max_new_tokens == 0 {
            outputs[i] = Some(GenerationOutput {
                tokens: vec![],
                finish_reason: FinishReason::Length,
            });
        } else {
            pending.push_back(i);
        }
    }
    let max_seqlen = pending
        .iter()
        .map(|&i| limit(&requests[i]))
        .max()
        .unwrap_or(1);
    let batch = config.max_batch_size.min(pending.len()).max(1);
    let pages_per_seq = max_seqlen.div_ceil(config.page_size);
    let mut cache = model.new_cache(
        batch,
        max_seqlen,
        config.prefill_chunk,
        CacheLayout::Paged {
            page_size: config.page_size,
            total_num_pages: batch * pages_per_seq,
        },
    )?;
    let eos = &model.config.eos_token_ids;
    let mut active: Vec<Active> = Vec::new();
    while !pending.is_empty() || !active.is_empty() {
        while active.len() < batch {
            let Some(i) = pending.pop_front() else { break };
            let r = &requests[i];
            active.push(Active {
                request: i,
                tokens: r.prompt_tokens.clone(),
                prompt_len: r.prompt_tokens.len(),
                fed: 0,
                limit: limit(r),
                sampler: Sampler::new(r.sampling.clone()),
            });
        }
        // Plan the step: decoders first (1 token each), then prompt chunks
        // within the token budget.
        let mut budget = config.max_step_tokens.max(active.len());
        let mut feed = vec![0usize; active.len()];
        for (f, a) in feed.iter_mut().zip(&active) {
            if a.tokens.len() - a.fed == 1 {
                *f = 1;
                budget -= 1;
            }
        }
        for (f, a) in feed.iter_mut().zip(&active) {
            let left = a.tokens.len() - a.fed;
            if left > 1 {
                *f = left.min(config.prefill_chunk).min(budget.max(1));
                budget = budget.saturating_sub(*f);
            }
        }
        let mut steps = Vec::new();
        let mut tokens = Vec::new();
        let mut running = Vec::new();
        for (idx, (a, &n)) in active.iter().zip(&feed).enumerate() {
            if n > 0 {
                steps.push((a.request as u64, n));
                tokens.extend_from_slice(&a.tokens[a.fed..a.fed + n]);
                running.push(idx);
            }
        }
        cache.pre_step(&steps)?;
        let logits = model.forward(&tokens, &mut cache, Logits::Last)?;
        let vocab = model.config.vocab_size;
        let mut finished = Vec::new();
        for (row, &idx) in running.iter().enumerate() {
            let a = &mut active[idx];
            a.fed += feed[idx];
            if a.fed < a.tokens.len() {
                continue; // mid-prompt chunk: no token yet
            }
            let tok = a
                .sampler
                .sample(&logits[row * vocab..(row + 1) * vocab], &a.tokens);
            a.tokens.push(tok);
            let control = on_token(a.request, tok);
            let reason = if control == Control::Stop {
                Some(FinishReason::Stop)
            } else if !requests[a.request].ignore_eos && eos.contains(&tok) {
                Some(FinishReason::Eos)
            } else if a.tokens.len() >= a.limit {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                finished.push((idx, reason));
            }
        }
        for &(idx, reason) in finished.iter().rev() {
            let a = active.remove(idx);
            cache.release(a.request as u64)?;
            outputs[a.request] = Some(GenerationOutput {
                tokens: a.tokens[a.prompt_len..].to_vec(),
                finish_reason: reason,
            });
        }
    }
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every request finishes"))
        .collect())
}
