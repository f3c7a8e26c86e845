//! Choosing the next token from logits: greedy, or sampling with
//! repetition penalty, temperature, top-k, top-p and min-p (applied in that
//! order, as llama.cpp's default sampler chain does), from a seeded RNG.

use rand::{Rng, SeedableRng};

/// Sampling settings of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax, lowest id on ties); otherwise logits are divided
    /// by the temperature before the softmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability sum
    /// reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely (0 = off).
    pub min_p: f32,
    /// CTRL-style repetition penalty over the prompt and generated tokens:
    /// positive logits divided by it, negative multiplied (1 = off).
    pub repetition_penalty: f32,
    /// RNG seed; each sequence gets its own RNG seeded with it, so a
    /// sequence samples the same tokens batched or alone.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the error names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty {} must be > 0",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// One sequence's sampler: its settings and RNG.
pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = rand::rngs::StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// Picks the next token from `logits: [vocab]`; `history` holds the
    /// prompt and generated tokens (for the repetition penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &tok in history {
                if seen.insert(tok) {
                    if let Some(l) = logits.get_mut(tok as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(&logits);
        }
        // Candidates sorted by logit, descending (ties: lower id first).
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.gen::<f32>() * total;
        for i in 0..keep {
            r -= probs[i];
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
