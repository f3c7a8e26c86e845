//! Perplexity over a token stream in fixed windows, as llama.cpp's
//! `llama-perplexity` computes it (`perplexity()` in its
//! `tools/perplexity/perplexity.cpp`, default mode):
//!
//! 1. The whole text is tokenized once (BOS added if the model adds one).
//! 2. It is cut into `n_chunks = floor(n_tokens / ctx)` non-overlapping
//!    windows of exactly `ctx` tokens; the tail shorter than `ctx` is dropped.
//! 3. When the model adds BOS (`bos = Some(id)`), the first token of every
//!    window is replaced by BOS (each window is evaluated as a fresh
//!    sequence that starts like a prompt).
//! 4. Each window runs as its own sequence from position 0, with logits at
//!    every position ([`Logits::All`]).
//! 5. Only the second half is scored, so every scored token has at least
//!    `ctx/2` tokens of context: with `first = ctx / 2` (integer division),
//!    the logits at positions `j = first .. ctx - 2` predict the tokens at
//!    `j + 1`; that is `ctx - 1 - first` tokens per window.
//! 6. `NLL = -log_softmax(logits_j)[token_{j+1}]`, computed in f64 from the
//!    f32 logits; `PPL = exp(sum NLL / count)` over all scored tokens so far
//!    (the running value after each window, the final one at the end).
//!
//! Several windows run together as one ragged thd step ([`perplexity`]'s
//! `batch_windows`); this changes nothing in the result.

use te_cache::CacheLayout;

use crate::{EngineError, Result};
use te_models::model::{Logits, Model};

/// Settings of [`perplexity`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerplexityParams {
    /// Window length in tokens (llama.cpp `-c`); at least 3 so that each
    /// window scores a token, at most the model's context.
    pub ctx: usize,
    /// BOS id to put first in every window, when the model adds BOS.
    pub bos: Option<u32>,
    /// Windows run together in one forward step (at least 1).
    pub batch_windows: usize,
}

/// Result of [`perplexity`].
#[derive(Clone, Debug, PartialEq)]
pub struct PerplexityResult {
    /// `exp(nll_mean)`.
    pub ppl: f64,
    /// Mean negative log-likelihood per scored token, natural log (nats).
    pub nll_mean: f64,
    /// Windows evaluated.
    pub windows: usize,
    /// Tokens scored (`windows * (ctx - 1 - ctx/2)`).
    pub scored_tokens: usize,
    /// The running PPL after each window.
    pub running_ppl: Vec<f64>,
}

/// The windows of step 2 and 3 of the module doc: `floor(len / ctx)`
/// slices of `ctx` tokens, the first token replaced by `bos` when given.
pub fn windows(tokens: &[u32], ctx: usize, bos: Option<u32>) -> Vec<Vec<u32>> {
    if ctx == 0 {
        return vec![];
    }
    tokens
        .chunks_exact(ctx)
        .map(|w| {
            let mut w = w.to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            w
        })
        .collect()
}

/// Sum of `-log_softmax(row)[target]` in f64 over the scored positions of
/// one window: `logits: [ctx, vocab]` for `window: [ctx]`.
fn window_nll(logits: &[f32], window: &[u32], vocab: usize) -> f64 {
    let ctx = window.len();
    let first = ctx / 2;
    let mut sum = 0.0f64;
    for j in first..ctx - 1 {
        let row = &logits[j * vocab..(j + 1) * vocab];
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
        let lse = max
            + row
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        sum += lse - row[window[j + 1] as usize] as f64;
    }
    sum
}

/// Perplexity of `model` on `tokens` (the whole tokenized text), as the
/// module doc describes. `on_window(done, total, running_ppl)` is called
/// after each window.
///
/// Errors: `ctx` below 3 or above the model's context, `batch_windows`
/// zero, fewer than `ctx` tokens (naming the counts), and any error of the
/// forward pass.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    params: &PerplexityParams,
    mut on_window: impl FnMut(usize, usize, f64),
) -> Result<PerplexityResult> {
    let ctx = params.ctx;
    let max_ctx = model.config.max_position_embeddings;
    if ctx < 3 || ctx > max_ctx {
        return Err(EngineError::Setting {
            setting: "ctx",
            reason: format!("{ctx} must be between 3 and the model's context {max_ctx}"),
        });
    }
    if params.batch_windows == 0 {
        return Err(EngineError::Setting {
            setting: "batch_windows",
            reason: "must be at least 1".into(),
        });
    }
    let all = windows(tokens, ctx, params.bos);
    if all.is_empty() {
        return Err(EngineError::TooFewTokens {
            tokens: tokens.len(),
            ctx,
        });
    }
    let vocab = model.config.vocab_size;
    let batch = params.batch_windows.min(all.len());
    let mut cache = model.new_cache(batch, ctx, ctx, CacheLayout::Contiguous)?;
    let per_window = ctx - 1 - ctx / 2;
    let (mut nll_sum, mut count) = (0.0f64, 0usize);
    let mut running_ppl = Vec::with_capacity(all.len());
    for group in all.chunks(batch) {
        let steps: Vec<(u64, usize)> = (0..group.len() as u64).map(|id| (id, ctx)).collect();
        cache.pre_step(&steps)?;
        let flat: Vec<u32> = group.concat();
        // logits: [group.len() * ctx, vocab], window b at rows b*ctx..(b+1)*ctx.
        let logits = model.forward(&flat, &mut cache, Logits::All)?;
        for (b, window) in group.iter().enumerate() {
            nll_sum += window_nll(
                &logits[b * ctx * vocab..(b + 1) * ctx * vocab],
                window,
                vocab,
            );
            count += per_window;
            let ppl = (nll_sum / count as f64).exp();
            running_ppl.push(ppl);
            on_window(running_ppl.len(), all.len(), ppl);
        }
        for &(id, _) in &steps {
            cache.release(id)?;
        }
    }
    let nll_mean = nll_sum / count as f64;
    Ok(PerplexityResult {
        ppl: nll_mean.exp(),
        nll_mean,
        windows: all.len(),
        scored_tokens: count,
        running_ppl,
    })
}

/// Windows per step so that the step's logits (`windows * ctx * vocab`
/// f32) stay within about 512 MiB; at least 1.
pub fn default_batch_windows(ctx: usize, vocab: usize) -> usize {
    const LOGITS_BUDGET: usize = 1 << 27; // f32 values
    (LOGITS_BUDGET / (ctx * vocab).max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_drop_the_tail_and_put_bos_first() {
        let t: Vec<u32> = (10..21).collect(); // 11 tokens
        assert_eq!(
            windows(&t, 4, None),
            vec![vec![10, 11, 12, 13], vec![14, 15, 16, 17]]
        );
        assert_eq!(
            windows(&t, 4, Some(2)),
            vec![vec![2, 11, 12, 13], vec![2, 15, 16, 17]]
        );
        assert!(windows(&t, 12, None).is_empty());
    }

    #[test]
    fn window_nll_scores_the_second_half_by_hand() {
        // ctx 4, vocab 2: first = 2, only j = 2 predicts token[3] = 1.
        // Row 2 logits [0, ln 3]: p(1) = 3/4, NLL = ln(4/3).
        let window = [0, 0, 0, 1];
        let logits = [9.0, 9.0, 9.0, 9.0, 0.0, 3f32.ln(), 5.0, -5.0];
        let nll = window_nll(&logits, &window, 2);
        assert!((nll - (4.0f64 / 3.0).ln()).abs() < 1e-7, "{nll}");
    }
}
