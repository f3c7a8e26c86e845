//! Speculative decoding: a decoding sequence proposes a draft of tokens,
//! the target model scores the draft as one chunk of `k + 1` rows inside
//! the ordinary step, and the sequence keeps the longest prefix the model
//! agrees with plus the model's own next token; te-cache's `truncate`
//! rolls the rest back. Two sources ([`DraftSource`]): **prompt lookup**
//! (the tokens that followed an earlier occurrence of the sequence's
//! latest `n` tokens in its prompt and output so far, the one that agrees
//! with the sequence's end furthest back: [`lookup`]) and a **draft
//! model** ([`crate::Engine::with_draft_model`]: its greedy tokens, from
//! its own KV cache in the same engine).
//!
//! # What stays the same
//!
//! Each verified position's token is chosen by the sequence's own
//! [`crate::sampling::Sampler`] from that position's logits row, exactly as
//! a plain decode step would choose it, and the row's logits are
//! bit-identical to plain decode's (te's rows do not depend on the batch or
//! on the step's other rows). A drafted token is accepted when the chosen
//! token equals it; the first differing token is kept as the model's own
//! and the rest of the draft dropped.
//!
//! - **Greedy**: the tokens are bit-identical to plain greedy decoding.
//! - **Sampled**: with a point-mass proposal `q = δ(x)` (prompt lookup,
//!   and a draft model's greedy tokens: both a function of the context),
//!   standard speculative sampling (accept `x` with probability
//!   `min(1, p(x)/q(x)) = p(x)`, else draw from the normalised residual
//!   `max(0, p - q)`, i.e. `p` without `x`) gives each token the law `p`;
//!   drawing `y ~ p` and accepting iff `y = x` (keeping `y` otherwise) is
//!   that same rule: `P(y = x) = p(x)`, and given `y != x`, `y` has law
//!   `p(y) / (1 - p(x))`. The engine draws with the plain sampler, one draw
//!   per position, so a seeded sampled request gives even the same tokens
//!   as without drafting.
//!
//! # How long a draft
//!
//! `draft_max: Some(k)` drafts `k` tokens whenever the source has them
//! (prompt lookup: when the lookup finds them; a draft model: at every
//! step). By default the length is adaptive and cost-aware: each
//! sequence keeps an estimate `alpha` of the probability that a drafted
//! token is accepted (an exponential average over verified positions;
//! while not drafting, over whether the lookup's first token would have
//! been the model's), and the engine keeps the cost `c(rows)` of its decode steps
//! (the measured mean of each row count, and a linear fit `a + b * rows`
//! for counts not measured yet: a step's cost is not linear, a CPU's
//! product kernels change path past a few rows). A draft of `k` tokens is
//! expected to yield `sum_{i=1..k} alpha^i` extra tokens and to add
//! `c(B + k) - c(B)` seconds, which the step's `B` sequences all wait
//! for; the engine drafts the `k` that maximises
//! `sum alpha^i - B * (c(B + k) - c(B)) / c(B)` when that is positive,
//! and does not draft otherwise (free text, where lookups rarely hold,
//! then runs as plain decode). Each sequence chooses as if its rows were
//! the step's only extra ones, so the step then caps every prompt-lookup
//! draft at the one length `K` that maximises the step's total gain
//! with all of them counted (`joint_cap`; a CPU step's cost jumps where
//! its product kernels change path). A draft model's drafts also cost its own
//! `k` sequential steps, which every sequence of the step waits for, and
//! one batched draft step serves all drafting sequences, so the engine
//! picks one `k` for them (`model_draft_len`: the measured draft step
//! cost enters as `k · d / c(B)`, `c` leaving the draft model's time
//! out), at most [`MODEL_DRAFT_DEFAULT`], once a plain step of `B` rows
//! has measured `c(B)`; a draft-model sequence that stops drafting has no
//! free lookup to learn from, so its `alpha` drifts back toward its prior
//! (0.8) and it tries again.

use std::collections::HashMap;

use te_cache::{CacheError, CacheLayout, InferenceParams};
use te_models::cuda::KvStore;
use te_models::model::{Model, StepOutput};
use te_models::runner::Runner;

use crate::request::DraftLimits;
use crate::sampling::argmax;
use crate::EngineError;

/// Drafts longer than this are never proposed by the adaptive length.
pub const ADAPTIVE_DRAFT_MAX: usize = 16;

/// Where drafted tokens come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup: the continuation of an earlier occurrence of the
    /// latest `n` tokens in the prompt and output so far, the longest
    /// match ([`lookup`]).
    Ngram(usize),
    /// A draft model's greedy tokens (the engine's draft model,
    /// [`crate::Engine::with_draft_model`]): `draft_max` of them per
    /// verification, or without it the adaptive length, at most
    /// [`MODEL_DRAFT_DEFAULT`].
    Model,
}

/// Longest draft of a draft model without `draft_max` (the adaptive
/// length's bound: each drafted token costs the draft model a step, and
/// its drafts fail in bursts that the per-token `alpha` does not see:
/// allowed 8, the 0.5B drafting for the 1.5B chose 8 at `alpha` ≈ 0.96 and
/// kept 3.5 a verification, 17.6 tokens/s against 20.1 with 4).
pub const MODEL_DRAFT_DEFAULT: usize = 4;

/// Speculative decoding settings of an engine (every request it runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub source: DraftSource,
    /// `Some(k)`: draft `k` tokens whenever the source has them; `None`:
    /// the adaptive, cost-aware length (module doc), at most
    /// [`ADAPTIVE_DRAFT_MAX`].
    pub draft_max: Option<usize>,
    /// Drafts shorter than this are not verified (plain decode instead).
    pub draft_min: usize,
}

impl SpeculativeConfig {
    /// Prompt lookup of `n`-grams with the adaptive length.
    pub fn ngram(n: usize) -> Self {
        SpeculativeConfig {
            source: DraftSource::Ngram(n),
            draft_max: None,
            draft_min: 1,
        }
    }

    /// Checks ranges; the error names the setting.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |setting, reason: &str| {
            Err(EngineError::Setting {
                setting,
                reason: reason.into(),
            })
        };
        if self.source == DraftSource::Ngram(0) {
            return bad("draft_ngram", "must be at least 1");
        }
        if self.draft_min == 0 {
            return bad("draft_min", "must be at least 1");
        }
        if self.draft_max == Some(0) {
            return bad("draft_max", "must be at least 1");
        }
        if self.draft_max.is_some_and(|k| k < self.draft_min) {
            return bad("draft_max", "must be at least draft_min");
        }
        Ok(())
    }
}

/// How far back [`lookup`] measures a match (tokens): occurrences that
/// agree with the sequence's end over this many tokens count as equal.
pub const LOOKUP_MATCH_MAX: usize = 64;

/// Prompt lookup: the `max` tokens that followed the earlier occurrence of
/// the final `n` tokens of `tokens` whose agreement with the sequence's
/// end reaches furthest back (the longest common suffix, measured up to
/// [`LOOKUP_MATCH_MAX`] or `n` tokens, whichever is more; the latest among
/// equals). An occurrence may overlap the final tokens, but not be them.
/// The continuation is copied as LZ77 copies a match: where it reaches
/// the end of `tokens` it goes on with the tokens it has proposed, so a
/// repeating run keeps repeating (`a b a b` proposes `a b a b ...`).
/// Empty when there is no occurrence.
///
/// The longest match finds where an edit stands in the text it rewrites:
/// the latest occurrence of a short n-gram is often a recurring phrase
/// (`record.get(`) at another place. On the code-editing workload of
/// `cargo xtask bench speculative` (Qwen2.5-Coder 1.5B's greedy answer,
/// n = 3), replaying the engine's adaptive length over the token stream
/// accepted 75% of the drafted tokens with the latest occurrence and 87%
/// with the longest match.
pub fn lookup(tokens: &[u32], n: usize, max: usize) -> Vec<u32> {
    let len = tokens.len();
    if n == 0 || max == 0 || len <= n {
        return Vec::new();
    }
    let pattern = &tokens[len - n..];
    let cap = LOOKUP_MATCH_MAX.max(n);
    // Tokens of `tokens[..end]`'s end that agree with `tokens`'s, up to `cap`.
    let agree = |end: usize| {
        tokens[..end]
            .iter()
            .rev()
            .zip(tokens.iter().rev())
            .take(cap)
            .take_while(|(a, b)| a == b)
            .count()
    };
    // Latest start first; the occurrence at len - n is the pattern itself.
    let mut best: Option<(usize, usize)> = None;
    for i in (0..len - n).rev() {
        if &tokens[i..i + n] != pattern {
            continue;
        }
        let m = agree(i + n);
        if best.is_none_or(|(_, b)| m > b) {
            best = Some((i, m));
            if m == cap {
                break;
            }
        }
    }
    let Some((i, _)) = best else {
        return Vec::new();
    };
    let mut draft: Vec<u32> = Vec::with_capacity(max);
    for j in i + n..i + n + max {
        let t = if j < len { tokens[j] } else { draft[j - len] };
        draft.push(t);
    }
    draft
}

/// The engine's estimate of what a step of `rows` rows costs: a decayed
/// mean of the measured decode steps of each row count (up to
/// [`MEASURED_ROWS`]), and a decayed least-squares fit `seconds = a + b *
/// rows` for the counts not measured yet. A step's cost is not linear in
/// its rows (a CPU's few-row product kernels give way to a panel path
/// past a few rows, at a higher cost per row), so each count's own mean
/// wins where there is one.
#[derive(Clone, Debug)]
pub(crate) struct CostModel {
    /// Decayed sums of 1, x, x², y, x·y (x = rows, y = seconds).
    sums: [f64; 5],
    /// Mean seconds of the steps of `r + 1` rows (`None`: none yet).
    by_rows: [Option<f64>; MEASURED_ROWS],
}

/// Row counts whose steps are measured one by one.
const MEASURED_ROWS: usize = 64;
/// Weight of one step in its row count's mean.
const ROWS_RATE: f64 = 0.3;

/// The extra cost of one row relative to a one-row step, assumed until
/// the steps so far vary enough in size to fit one.
const PRIOR_ROW_COST: f64 = 0.1;
/// Decay per step of the cost fit's sums.
const COST_DECAY: f64 = 0.99;

/// `extra[k - 1]`: the cost of `k` more rows relative to the step without
/// them, for `k` in `1..=ADAPTIVE_DRAFT_MAX` ([`CostModel::extra_costs`]).
pub(crate) type ExtraCosts = [f64; ADAPTIVE_DRAFT_MAX];

impl CostModel {
    pub(crate) fn new() -> Self {
        CostModel {
            sums: [0.0; 5],
            by_rows: [None; MEASURED_ROWS],
        }
    }

    /// Records a decode step of `rows` rows that took `seconds`.
    pub(crate) fn record(&mut self, rows: usize, seconds: f64) {
        let x = rows as f64;
        for (s, v) in self
            .sums
            .iter_mut()
            .zip([1.0, x, x * x, seconds, x * seconds])
        {
            *s = *s * COST_DECAY + v;
        }
        if let Some(m) = rows.checked_sub(1).and_then(|i| self.by_rows.get_mut(i)) {
            *m = Some(m.map_or(seconds, |m| m + ROWS_RATE * (seconds - m)));
        }
    }

    /// The linear fit `(a, b)`, once the steps vary enough in size.
    fn fit(&self) -> Option<(f64, f64)> {
        let [n, sx, sxx, sy, sxy] = self.sums;
        let var = n * sxx - sx * sx;
        // Too little spread in step sizes (n * var of x below ~1/4 step²).
        if n < 4.0 || var < 0.25 * n * n {
            return None;
        }
        let b = ((n * sxy - sx * sy) / var).max(0.0);
        let a = ((sy - b * sx) / n).max(1e-9);
        Some((a, b))
    }

    /// The cost of `k` more rows relative to a step of `batch` rows, for
    /// each `k` in `1..=ADAPTIVE_DRAFT_MAX` ([`CostModel::extra_cost`]).
    pub(crate) fn extra_costs(&self, batch: usize) -> ExtraCosts {
        std::array::from_fn(|i| self.extra_cost(batch, i + 1))
    }

    /// The cost of `more` rows relative to a step of `batch` rows: from
    /// the measured means of both row counts where there are both, else
    /// from the linear fit (`more * b / (a + b * batch)`), else from
    /// [`PRIOR_ROW_COST`].
    pub(crate) fn extra_cost(&self, batch: usize, more: usize) -> f64 {
        match (self.measured(batch), self.measured(batch + more)) {
            (Some(c0), Some(c1)) if c0 > 0.0 => ((c1 - c0) / c0).max(0.0),
            _ => match self.fit() {
                Some((a, b)) => more as f64 * b / (a + b * batch as f64),
                None => {
                    more as f64 * PRIOR_ROW_COST / (1.0 + PRIOR_ROW_COST * (batch as f64 - 1.0))
                }
            },
        }
    }

    /// The estimated seconds of a step of `rows` rows (its measured mean,
    /// else the fit's), or `None` before the steps allow either.
    pub(crate) fn seconds(&self, rows: usize) -> Option<f64> {
        self.measured(rows)
            .or_else(|| self.fit().map(|(a, b)| a + b * rows as f64))
    }

    /// The measured mean of the steps of `rows` rows.
    fn measured(&self, rows: usize) -> Option<f64> {
        rows.checked_sub(1).and_then(|i| *self.by_rows.get(i)?)
    }
}

/// One sequence's drafting state.
#[derive(Clone, Debug)]
pub(crate) struct Drafter {
    source: DraftSource,
    /// A fixed length (`draft_max` given): draft `cap` tokens whenever the
    /// source has them; else the adaptive length, at most `cap`.
    fixed: bool,
    /// Longest draft (the engine's and the request's bounds).
    cap: usize,
    /// Shortest draft verified.
    min: usize,
    /// Estimated probability that a drafted token is accepted.
    alpha: f64,
    /// The lookup's first token when the last step did not draft (its
    /// outcome still updates `alpha`).
    shadow: Option<u32>,
}

/// Starting estimate of `alpha`.
const PRIOR_ALPHA: f64 = 0.5;
/// Weight of one observation in `alpha`.
const ALPHA_RATE: f64 = 0.15;
/// Starting estimate of `alpha` with a draft model, which is also where
/// the estimate returns to while the sequence does not draft. A draft
/// step of the 0.5B costs about 0.38 of the 1.5B's (25 against 67 ms,
/// 2 threads), so a drafted token pays only from `alpha` ≈ 0.55; starting
/// at [`PRIOR_ALPHA`], a code completion's first rejected drafts (its
/// docstring) stopped drafting for good.
const MODEL_PRIOR_ALPHA: f64 = 0.8;
/// How far a draft model's `alpha` moves back toward
/// [`MODEL_PRIOR_ALPHA`] in a step it does not draft (from 0.45 it drafts
/// again after about 13 steps).
const IDLE_RATE: f64 = 0.04;

/// The common length of the adaptive draft-model drafts of a step
/// (`seqs`: each sequence's drafter and room), in a step of `batch`
/// sequences: the `k` that maximises `sum_s yield_s(k) - batch ·
/// (verify(k) + (d(n + sum_s alpha_s^k) + (k - 1) · d(n)) / c(batch))`,
/// where `verify(k)` is the relative cost of the drafted rows in the
/// target's step (`target`), `d(r)` the seconds of a draft-model step of
/// `r` rows (`draft`; its first round feeds the `n` drafting sequences'
/// last tokens, and the last drafted token of each whose whole draft was
/// accepted, expected `sum_s alpha_s^k`, interpolated between row
/// counts) and `c(batch)` of the target's step without drafts:
/// all `batch` sequences wait for the draft model's `k` sequential steps
/// as for the extra rows. 0 when no length gains, and while no step of `batch` rows
/// without drafts has been measured (that step measures it); other costs
/// not measured yet count as the fit's or the prior row cost
/// (verification) and as free (drafting), so the next steps draft and
/// measure.
pub(crate) fn model_draft_len(
    seqs: &[(&Drafter, usize)],
    batch: usize,
    target: &CostModel,
    draft: &CostModel,
) -> usize {
    // The yardstick, a step of `batch` rows without drafts, is measured
    // first (one plain step; when every step drafted, the fit through
    // the drafted steps alone, past the few-row kernels, made the extra
    // rows look cheap: 8 sequences drafted at 0.89x of plain).
    let Some(c) = target.measured(batch) else {
        return 0;
    };
    let longest = seqs.iter().map(|(d, room)| d.cap.min(*room)).max();
    // Seconds of a draft step of `rows` rows, relative to `c`.
    let step = |rows: usize| match draft.seconds(rows) {
        Some(d) if c > 0.0 => d / c,
        _ => 0.0,
    };
    let (mut best, mut best_gain) = (0, 0.0);
    for k in 1..=longest.unwrap_or(0) {
        let mut yield_ = 0.0;
        let mut whole = 0.0;
        let mut rows = 0;
        for (d, room) in seqs {
            let n = k.min(d.cap.min(*room));
            yield_ += d.expected_yield(n);
            whole += d.alpha.powi(n as i32);
            rows += n;
        }
        // The next first round feeds each sequence its last token, and
        // also its last drafted one where the whole draft was accepted
        // (the others were fed while drafting): `n + whole` rows expected,
        // between two measured counts.
        let (lo, frac) = (whole.floor(), whole.fract());
        let at = seqs.len() + lo as usize;
        let first = step(at) + frac * (step(at + 1) - step(at));
        let drafting = first + (k - 1) as f64 * step(seqs.len());
        let gain = yield_ - batch as f64 * (target.extra_cost(batch, rows) + drafting);
        if gain > best_gain {
            (best, best_gain) = (k, gain);
        }
    }
    best
}

/// The common cap on a step's prompt-lookup drafts (`drafts`: each
/// sequence's drafter and the length it proposed, in a step of `batch`
/// sequences): each sequence chose its length as if its rows were the
/// step's only extra ones, but the step carries them all. The cap `K`
/// maximises `sum_s yield_s(min(k_s, K)) - batch · extra(sum_s min(k_s,
/// K))` over the adaptive drafters (rows of fixed-length ones count as
/// already there); 0 when no cap gains. At batch 1 it keeps the one
/// draft's length, its own best.
pub(crate) fn joint_cap(drafts: &[(&Drafter, usize)], batch: usize, cost: &CostModel) -> usize {
    let fixed: usize = drafts.iter().filter(|(d, _)| d.fixed).map(|(_, k)| k).sum();
    let base = cost.extra_cost(batch, fixed);
    let longest = drafts
        .iter()
        .filter(|(d, _)| !d.fixed)
        .map(|(_, k)| *k)
        .max();
    let (mut best, mut best_gain) = (0, 0.0);
    for cap in 1..=longest.unwrap_or(0) {
        let (mut yield_, mut rows) = (0.0, fixed);
        for (d, k) in drafts.iter().filter(|(d, _)| !d.fixed) {
            let n = (*k).min(cap);
            yield_ += d.expected_yield(n);
            rows += n;
        }
        let gain = yield_ - batch as f64 * (cost.extra_cost(batch, rows) - base);
        if gain > best_gain {
            (best, best_gain) = (cap, gain);
        }
    }
    best
}

impl Drafter {
    /// The drafter of a request under the engine's `config`, narrowed by
    /// the request's `limits` (`None`: the request drafts nothing).
    pub(crate) fn new(config: SpeculativeConfig, limits: DraftLimits) -> Option<Self> {
        let engine_max = config.draft_max.unwrap_or(match config.source {
            DraftSource::Ngram(_) => ADAPTIVE_DRAFT_MAX,
            DraftSource::Model => MODEL_DRAFT_DEFAULT,
        });
        let cap = limits.n_max.map_or(engine_max, |n| n.min(engine_max));
        if cap == 0 {
            return None;
        }
        Some(Drafter {
            source: config.source,
            fixed: config.draft_max.is_some(),
            cap,
            min: limits.n_min.unwrap_or(config.draft_min).clamp(1, cap),
            alpha: match config.source {
                DraftSource::Ngram(_) => PRIOR_ALPHA,
                DraftSource::Model => MODEL_PRIOR_ALPHA,
            },
            shadow: None,
        })
    }

    /// The draft for a sequence of `tokens` (its last token not yet fed)
    /// that may take at most `room` more tokens, in a step of `batch`
    /// sequences to which `k` more rows add `extra[k - 1]` of its cost.
    pub(crate) fn propose(
        &mut self,
        tokens: &[u32],
        room: usize,
        batch: usize,
        extra: &ExtraCosts,
    ) -> Vec<u32> {
        self.shadow = None;
        let DraftSource::Ngram(n) = self.source else {
            return Vec::new();
        };
        let mut found = lookup(tokens, n, self.cap.min(room));
        let k = if self.fixed {
            found.len()
        } else {
            self.best_len(found.len(), batch, extra)
        };
        if k < self.min {
            self.shadow = found.first().copied();
            return Vec::new();
        }
        found.truncate(k);
        found
    }

    /// Cuts `draft` (this drafter's proposal) to the step's common `cap`
    /// ([`joint_cap`]; a fixed length keeps its draft); a draft cut below
    /// the shortest verified is dropped, its first token kept to learn
    /// from as when the lookup's proposal is not drafted.
    pub(crate) fn cap(&mut self, draft: &mut Vec<u32>, cap: usize) {
        if self.fixed || draft.len() <= cap {
            return;
        }
        if cap < self.min {
            self.shadow = draft.first().copied();
            draft.clear();
        } else {
            draft.truncate(cap);
        }
    }

    /// The length of a draft model's draft with `room` tokens left, when
    /// the adaptive length chose `adaptive` for the step (a fixed length
    /// ignores it; 0: none).
    pub(crate) fn model_len(&self, room: usize, adaptive: usize) -> usize {
        let k = self.cap.min(room);
        let k = if self.fixed { k } else { k.min(adaptive) };
        if k < self.min {
            0
        } else {
            k
        }
    }

    /// `sum_{i=1..k} alpha^i`: the drafted tokens a draft of `k` is
    /// expected to add (module doc).
    fn expected_yield(&self, k: usize) -> f64 {
        let (mut total, mut p) = (0.0, 1.0);
        for _ in 0..k {
            p *= self.alpha;
            total += p;
        }
        total
    }

    /// The draft length in `0..=available` with the largest expected gain
    /// (module doc); 0 when none gains.
    fn best_len(&self, available: usize, batch: usize, extra: &ExtraCosts) -> usize {
        let (mut best, mut best_gain) = (0, 0.0);
        let (mut yield_, mut p) = (0.0, 1.0);
        for (k, cost) in (1..=available).zip(extra) {
            p *= self.alpha;
            yield_ += p;
            let gain = yield_ - batch as f64 * cost;
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        best
    }

    /// Records a verification: `accepted` of `drafted` tokens kept.
    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        for _ in 0..accepted {
            self.observe(true);
        }
        if accepted < drafted {
            self.observe(false);
        }
    }

    /// Records the token a step without a draft produced. A draft model
    /// has no free guess to check it against, so its estimate instead
    /// drifts back toward [`MODEL_PRIOR_ALPHA`] ([`IDLE_RATE`] a step), and a
    /// sequence that stopped drafting tries again now and then.
    pub(crate) fn record_plain(&mut self, token: u32) {
        if let Some(s) = self.shadow.take() {
            self.observe(s == token);
        } else if self.source == DraftSource::Model {
            self.alpha += IDLE_RATE * (MODEL_PRIOR_ALPHA - self.alpha);
        }
    }

    fn observe(&mut self, accepted: bool) {
        self.alpha += ALPHA_RATE * (f64::from(u8::from(accepted)) - self.alpha);
    }
}

/// A draft model in the engine: its own runner (CPU) and paged KV cache,
/// and how many tokens of each sequence that cache holds. Its drafts are
/// its greedy tokens, so the proposal `q` is a point mass given the
/// context and the engine's verification (module doc) is exact
/// speculative sampling.
pub(crate) struct DraftModel<'a> {
    model: &'a Model,
    runner: Runner,
    cache: InferenceParams<KvStore>,
    /// Tokens of each sequence in `cache`.
    fed: HashMap<u64, usize>,
    /// Longest feed of one sequence in one draft step.
    chunk: usize,
    /// Seconds of the draft steps by their rows ([`model_draft_len`]).
    cost: CostModel,
    /// Whether sequences share the pages of a common prompt prefix, as
    /// the target's cache does (the engine's prefix caching).
    sharing: bool,
}

/// What [`DraftModel::draft`] is asked for one sequence.
pub(crate) struct DraftWant<'t> {
    pub id: u64,
    /// The sequence's tokens (its last one not yet fed to the target).
    pub tokens: &'t [u32],
    /// The request's `cache_salt` (prefix pages are shared only within a
    /// salt).
    pub salt: Option<&'t [u8]>,
    /// Tokens to draft.
    pub k: usize,
}

/// The draft model's KV pool: `kv_tokens` tokens in pages of
/// `page_size`, for `max_batch_size` sequences fed at most `chunk` tokens
/// a step.
pub(crate) struct DraftPool {
    pub kv_tokens: usize,
    pub page_size: usize,
    pub max_batch_size: usize,
    pub chunk: usize,
}

/// A sequence [`DraftModel::catch_up`] feeds: its id, the tokens the
/// target has computed (without its last one) and its `cache_salt`.
pub(crate) struct CatchUp<'t> {
    pub id: u64,
    pub tokens: &'t [u32],
    pub salt: Option<&'t [u8]>,
}

impl<'a> DraftModel<'a> {
    /// A draft model with the KV pool `limits`; `sharing`: prompts share
    /// their common prefix pages (the engine's prefix caching).
    ///
    /// Errors: the cache cannot be built.
    pub(crate) fn new(
        model: &'a Model,
        limits: DraftPool,
        sharing: bool,
    ) -> Result<Self, EngineError> {
        let DraftPool {
            kv_tokens,
            page_size,
            max_batch_size,
            chunk,
        } = limits;
        let runner = Runner::new(None);
        let cache = runner.new_cache(
            model,
            max_batch_size,
            model.config.max_position_embeddings,
            chunk,
            CacheLayout::Paged {
                page_size,
                total_num_pages: kv_tokens.div_ceil(page_size).max(1),
            },
        )?;
        Ok(DraftModel {
            model,
            runner,
            cache,
            fed: HashMap::new(),
            chunk,
            cost: CostModel::new(),
            sharing,
        })
    }

    /// Enters sequence `id` (computed `tokens` so far, `salt`) into the
    /// draft cache on the registered pages its tokens begin with, when
    /// sharing and not entered yet; a sequence entered without sharing
    /// starts empty at its first step.
    ///
    /// Errors: the cache refused the sequence (an internal invariant: the
    /// draft cache holds as many sequences as the engine runs).
    fn enter(&mut self, id: u64, tokens: &[u32], salt: Option<&[u8]>) -> Result<(), EngineError> {
        if !self.sharing || tokens.len() < 2 || self.fed.contains_key(&id) {
            return Ok(());
        }
        // At least one token left to compute: its row drafts.
        let hit = self
            .cache
            .attach_salted_prefix(id, tokens, tokens.len() - 1, salt)?;
        self.fed.insert(id, hit);
        Ok(())
    }

    /// Registers the full pages of `id`'s fed tokens, `tokens[..fed]`
    /// (never drafted ones), for later sequences to share.
    ///
    /// Errors: the cache refused (an internal invariant).
    fn register(&mut self, id: u64, tokens: &[u32]) -> Result<(), EngineError> {
        let fed = self.fed.get(&id).copied().unwrap_or(0);
        if self.sharing && fed <= tokens.len() {
            self.cache.register_prefix(id, &tokens[..fed])?;
        }
        Ok(())
    }

    /// The drafts of `wants` (empty where none): each sequence's cache is
    /// first caught up with its tokens (a sequence more than a chunk
    /// behind only catches up this step), then `k` greedy tokens are
    /// generated, all sequences batched in each draft step. A full draft
    /// pool is emptied (drafts resume as sequences catch up again).
    ///
    /// Errors: a failing draft forward.
    pub(crate) fn draft(&mut self, wants: &[DraftWant<'_>]) -> Result<Vec<Vec<u32>>, EngineError> {
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        for w in wants.iter().filter(|w| w.k > 0) {
            self.enter(w.id, w.tokens, w.salt)?;
        }
        // Round 0 catches up and drafts the first token; later rounds one.
        let behind = |w: &DraftWant<'_>| self.fed.get(&w.id).copied().unwrap_or(0) < w.tokens.len();
        let mut active: Vec<usize> = (0..wants.len())
            .filter(|&i| wants[i].k > 0 && behind(&wants[i]))
            .collect();
        let mut round = 0;
        while !active.is_empty() {
            let mut steps = Vec::with_capacity(active.len());
            let mut tokens = Vec::new();
            for &i in &active {
                let w = &wants[i];
                let feed: &[u32] = if round == 0 {
                    self.behind(w.id, w.tokens)
                } else {
                    &drafts[i][drafts[i].len() - 1..]
                };
                steps.push((w.id, feed.len()));
                tokens.extend_from_slice(feed);
            }
            // Each sequence's greedy token.
            let start = std::time::Instant::now();
            let Some(picks) = self.feed(&steps, &tokens)? else {
                return Ok(vec![Vec::new(); wants.len()]);
            };
            self.cost
                .record(tokens.len(), start.elapsed().as_secs_f64());
            let mut next = Vec::with_capacity(active.len());
            for (b, (&i, &(id, n))) in active.iter().zip(&steps).enumerate() {
                let fed = *self.fed.entry(id).and_modify(|f| *f += n).or_insert(n);
                if round == 0 {
                    self.register(id, wants[i].tokens)?;
                }
                // Caught up: the row of the sequence's last token drafts.
                if fed >= wants[i].tokens.len() {
                    drafts[i].push(picks[b]);
                    if drafts[i].len() < wants[i].k {
                        next.push(i);
                    }
                }
            }
            active = next;
            round += 1;
        }
        Ok(drafts)
    }

    /// The measured cost of this draft model's draft steps.
    pub(crate) fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// Feeds each sequence of `seqs` up to a chunk of the tokens its cache
    /// lacks, all in one batched step, drafting nothing: a prompt reaches
    /// the draft cache in the steps that prefill it into the target's (so
    /// its time counts as prefill, not decode). Callers pass the tokens
    /// the target has computed, without a sequence's last one, which the
    /// first draft round feeds to draft from; following the target, a
    /// prompt that shares its prefix with one still being computed waits
    /// as the target's does, and then starts on its pages.
    ///
    /// Errors: a failing draft forward.
    pub(crate) fn catch_up(&mut self, seqs: &[CatchUp<'_>]) -> Result<(), EngineError> {
        for s in seqs {
            self.enter(s.id, s.tokens, s.salt)?;
        }
        let mut steps = Vec::with_capacity(seqs.len());
        let mut tokens = Vec::new();
        for s in seqs {
            let feed = self.behind(s.id, s.tokens);
            if !feed.is_empty() {
                steps.push((s.id, feed.len()));
                tokens.extend_from_slice(feed);
            }
        }
        if steps.is_empty() || self.feed(&steps, &tokens)?.is_none() {
            return Ok(());
        }
        for &(id, n) in &steps {
            *self.fed.entry(id).or_insert(0) += n;
        }
        for s in seqs {
            if steps.iter().any(|&(id, _)| id == s.id) {
                self.register(s.id, s.tokens)?;
            }
        }
        Ok(())
    }

    /// The next tokens of `tokens` that sequence `id`'s cache lacks, at
    /// most a chunk.
    fn behind<'t>(&self, id: u64, tokens: &'t [u32]) -> &'t [u32] {
        let fed = self.fed.get(&id).copied().unwrap_or(0).min(tokens.len());
        &tokens[fed..(fed + self.chunk).min(tokens.len())]
    }

    /// One draft forward of `steps` (id, tokens fed) over `tokens`: each
    /// sequence's greedy next token, or `None` when the draft pool was
    /// full (it is emptied; drafts resume as sequences catch up again).
    ///
    /// Errors: a failing draft forward (the draft cache is emptied).
    fn feed(
        &mut self,
        steps: &[(u64, usize)],
        tokens: &[u32],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        match self.cache.pre_step(steps) {
            Ok(()) => {}
            Err(CacheError::CacheFull { .. }) => {
                self.clear()?;
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
        let vocab = self.model.config.vocab_size;
        let out = self
            .runner
            .step(self.model, tokens, &mut self.cache, false)
            .map_err(|source| EngineError::Step {
                tokens: tokens.len(),
                source,
            });
        match out {
            Ok(StepOutput::Logits(l)) => Ok(Some(l.chunks_exact(vocab).map(argmax).collect())),
            Ok(StepOutput::Tokens(_)) => unreachable!("a CPU runner returns logits"),
            Err(e) => {
                self.clear()?;
                Err(e)
            }
        }
    }

    /// Sequence `id` keeps `valid` tokens (its accepted ones): the draft
    /// cache forgets any beyond them.
    ///
    /// Errors: the cache refused the rollback (an internal invariant).
    pub(crate) fn accept(&mut self, id: u64, valid: usize) -> Result<(), EngineError> {
        if let Some(fed) = self.fed.get_mut(&id) {
            if *fed > valid {
                self.cache.truncate(id, valid)?;
                *fed = valid;
            }
        }
        Ok(())
    }

    /// Releases every sequence for which `live` is false.
    ///
    /// Errors: the cache refused a release (an internal invariant).
    pub(crate) fn retain(&mut self, live: impl Fn(u64) -> bool) -> Result<(), EngineError> {
        let gone: Vec<u64> = self.fed.keys().copied().filter(|&id| !live(id)).collect();
        for id in gone {
            self.fed.remove(&id);
            self.cache.release(id)?;
        }
        Ok(())
    }

    /// Releases every sequence.
    fn clear(&mut self) -> Result<(), EngineError> {
        self.retain(|_| false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_prompts_start_on_the_registered_pages_of_their_salt() {
        let m = te_models::loader::load_model(
            &te_models::source::resolve_model("random:tiny-llama").unwrap(),
        )
        .unwrap();
        let pool = || DraftPool {
            kv_tokens: 256,
            page_size: 8,
            max_batch_size: 4,
            chunk: 64,
        };
        let prompt: Vec<u32> = (0..30).map(|i| 3 + i % 7).collect();
        let seq = |id, salt| CatchUp {
            id,
            tokens: &prompt,
            salt,
        };
        for sharing in [true, false] {
            let mut dm = DraftModel::new(&m.model, pool(), sharing).unwrap();
            dm.catch_up(&[seq(1, None)]).unwrap();
            assert_eq!(dm.fed[&1], 30);
            // Sharing: sequence 2 starts on sequence 1's three full pages
            // (24 of the 29 tokens that may be cached: one is left to
            // compute); sequence 3, of another salt, on none.
            dm.enter(2, &prompt, None).unwrap();
            dm.enter(3, &prompt, Some(b"other")).unwrap();
            let fed = |dm: &DraftModel<'_>, id| dm.fed.get(&id).copied();
            if sharing {
                assert_eq!((fed(&dm, 2), fed(&dm, 3)), (Some(24), Some(0)));
            } else {
                assert_eq!((fed(&dm, 2), fed(&dm, 3)), (None, None));
            }
            dm.catch_up(&[seq(1, None), seq(2, None), seq(3, Some(b"other"))])
                .unwrap();
            for id in [1, 2, 3] {
                assert_eq!(dm.fed[&id], 30, "sharing {sharing}, sequence {id}");
                assert_eq!(dm.cache.cached_tokens(id), 30);
            }
            dm.cache.check_consistency().unwrap();
        }
    }

    /// Extra costs of `row_cost` per row.
    fn flat(row_cost: f64) -> ExtraCosts {
        std::array::from_fn(|i| (i + 1) as f64 * row_cost)
    }

    #[test]
    fn lookup_takes_the_longest_then_latest_occurrence() {
        // "1 2" occurs at 0 and 3, both matching the end over 2 tokens;
        // the latest is at 3, and its continuation runs past the end into
        // what it proposed.
        let t = [1, 2, 7, 1, 2, 8, 9, 1, 2];
        assert_eq!(lookup(&t, 2, 6), [8, 9, 1, 2, 8, 9]);
        assert_eq!(lookup(&t, 2, 2), [8, 9]);
        assert!(lookup(&t, 3, 5).is_empty());
        // Overlapping occurrence: "5 5" at 1; the run keeps repeating.
        assert_eq!(lookup(&[5, 5, 5], 2, 4), [5, 5, 5, 5]);
        assert_eq!(lookup(&[3, 4, 3, 4], 1, 5), [3, 4, 3, 4, 3]);
        assert!(lookup(&[5], 1, 4).is_empty());
        assert!(lookup(&t, 0, 4).is_empty());
        // "1 2" occurs at 1 and 5; the one at 1 follows a 5 as the end
        // does (a match of 3 tokens against 2), so its continuation wins.
        let t = [5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2];
        assert_eq!(lookup(&t, 2, 3), [7, 6, 1]);
        // A match is measured up to LOOKUP_MATCH_MAX tokens: beyond it
        // the latest wins. Two copies of a 70-token run, the first
        // agreeing with the end over 71 tokens, the second over 70.
        let run: Vec<u32> = (100..170).collect();
        let t: Vec<u32> = [&[2], &run[..], &[1, 5], &run[..], &[3, 2], &run[..]].concat();
        assert_eq!(lookup(&t, 3, 1), [3]);
        // Shorter than the cap: the earlier copy matches one token more.
        let t: Vec<u32> = [&[9], &run[..20], &[1, 8], &run[..20], &[2, 9], &run[..20]].concat();
        assert_eq!(lookup(&t, 3, 1), [1]);
    }

    #[test]
    fn adaptive_length_backs_off_when_drafts_fail() {
        let mut d = Drafter::new(SpeculativeConfig::ngram(1), DraftLimits::default()).unwrap();
        let t = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 1];
        assert!(!d.propose(&t, 100, 1, &flat(0.1)).is_empty());
        for _ in 0..30 {
            d.record(4, 0);
        }
        assert!(
            d.propose(&t, 100, 1, &flat(0.1)).is_empty(),
            "alpha {}",
            d.alpha
        );
        // The lookup's first token keeps being right: drafting resumes
        // and, accepted, lengthens.
        let mut lengths = Vec::new();
        for _ in 0..40 {
            let k = d.propose(&t, 100, 1, &flat(0.1)).len();
            lengths.push(k);
            if k == 0 {
                d.record_plain(2);
            } else {
                d.record(k, k);
            }
        }
        assert!(
            lengths[0] == 0 && lengths.windows(2).all(|w| w[0] <= w[1]),
            "{lengths:?}"
        );
        assert_eq!(d.propose(&t, 100, 1, &flat(0.1)).len(), ADAPTIVE_DRAFT_MAX);
        // A fixed length ignores the estimate.
        let fixed = SpeculativeConfig {
            draft_max: Some(3),
            ..SpeculativeConfig::ngram(1)
        };
        let mut d = Drafter::new(fixed, DraftLimits::default()).unwrap();
        d.alpha = 0.0;
        assert_eq!(d.propose(&t, 100, 1, &flat(0.1)), vec![2, 3, 4]);
        assert_eq!(d.propose(&t, 2, 1, &flat(0.1)), vec![2, 3]);
    }

    #[test]
    fn request_limits_narrow_the_engine_setting() {
        let t = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 1];
        let limits = |n_max, n_min| DraftLimits { n_max, n_min };
        let adaptive = SpeculativeConfig::ngram(1);
        let fixed = SpeculativeConfig {
            draft_max: Some(3),
            ..adaptive
        };
        // n_max 0: this request does not draft.
        assert!(Drafter::new(adaptive, limits(Some(0), None)).is_none());
        assert!(Drafter::new(fixed, limits(Some(0), Some(1))).is_none());
        // Below the engine's fixed length: that many; above it: the
        // engine's.
        let propose = |config, l| {
            Drafter::new(config, l)
                .unwrap()
                .propose(&t, 100, 1, &flat(0.1))
        };
        assert_eq!(propose(fixed, limits(Some(2), None)), [2, 3]);
        assert_eq!(propose(fixed, limits(Some(10), None)), [2, 3, 4]);
        // n_min above what there is room for: no draft.
        let mut d = Drafter::new(fixed, limits(None, Some(3))).unwrap();
        assert!(d.propose(&t, 2, 1, &flat(0.1)).is_empty());
        assert_eq!(d.propose(&t, 3, 1, &flat(0.1)), [2, 3, 4]);
        // The adaptive length, sure of acceptance, drafts up to n_max.
        let mut d = Drafter::new(adaptive, limits(Some(5), None)).unwrap();
        d.alpha = 1.0;
        assert_eq!(d.propose(&t, 100, 1, &flat(0.1)), [2, 3, 4, 5, 6]);
        // A draft model's length likewise.
        let model = SpeculativeConfig {
            source: DraftSource::Model,
            ..adaptive
        };
        let d = Drafter::new(model, limits(Some(2), None)).unwrap();
        assert_eq!((d.model_len(100, 16), d.model_len(1, 16)), (2, 1));
        let d = Drafter::new(model, DraftLimits::default()).unwrap();
        assert_eq!(d.model_len(100, 16), MODEL_DRAFT_DEFAULT);
        // The adaptive length bounds it; a fixed length does not.
        assert_eq!((d.model_len(100, 3), d.model_len(100, 0)), (3, 0));
        let d = Drafter::new(
            SpeculativeConfig {
                draft_max: Some(4),
                ..model
            },
            DraftLimits::default(),
        )
        .unwrap();
        assert_eq!(d.model_len(100, 0), 4);
    }

    /// Records steps costing `a + b * rows` seconds for 1..=64 rows.
    fn linear_costs(a: f64, b: f64) -> CostModel {
        let mut c = CostModel::new();
        for rows in 1..=64 {
            c.record(rows, a + b * rows as f64);
        }
        c
    }

    #[test]
    fn draft_model_length_weighs_its_own_steps() {
        let model = SpeculativeConfig {
            source: DraftSource::Model,
            ..SpeculativeConfig::ngram(1)
        };
        let drafter = |alpha| {
            let mut d = Drafter::new(model, DraftLimits::default()).unwrap();
            d.alpha = alpha;
            d
        };
        // Target: 0.1 s plus 0.01 a row; draft steps 0.02 s plus 0.001 a
        // row. One sequence sure of acceptance: gain(k) = k - (0.01 k +
        // 0.022 + 0.021 (k - 1)) / 0.11 (the first round feeds the last
        // drafted token too), largest at the longest draft.
        let target = linear_costs(0.1, 0.01);
        let cheap = linear_costs(0.02, 0.001);
        let sure = drafter(1.0);
        assert_eq!(
            model_draft_len(&[(&sure, 100)], 1, &target, &cheap),
            MODEL_DRAFT_DEFAULT
        );
        // Room narrows it.
        assert_eq!(model_draft_len(&[(&sure, 3)], 1, &target, &cheap), 3);
        // By hand, alpha = 0.5, batch 1 (the first round feeds 1 + 0.5 and
        // 1 + 0.25 rows): gain(1) = 0.5 - (0.01 + 0.0215) / 0.11 = 0.214;
        // gain(2) = 0.75 - (0.02 + 0.02125 + 0.021) / 0.11 = 0.184.
        let half = drafter(0.5);
        assert_eq!(model_draft_len(&[(&half, 100)], 1, &target, &cheap), 1);
        // Draft steps dear per row (0.001 s plus 0.04 a row): one row a
        // round would pay (0.5 - (0.01 + 0.041) / 0.11 = 0.036), but the
        // first round feeds 1.5 rows: 0.5 - (0.01 + 0.061) / 0.11 = -0.145,
        // and k = 2: 0.75 - (0.02 + 0.051 + 0.041) / 0.11 = -0.27.
        let steep = linear_costs(0.001, 0.04);
        assert_eq!(model_draft_len(&[(&half, 100)], 1, &target, &steep), 0);
        // A draft step as dear as the target's: nothing gains.
        let dear = linear_costs(0.1, 0.01);
        assert_eq!(model_draft_len(&[(&half, 100)], 1, &target, &dear), 0);
        // Eight sequences at alpha 0.5 all wait for every draft step and
        // every extra row: gain(1) = 8 · 0.5 - 8 · (8 · 0.01 + 0.032) /
        // 0.18 = -0.98 (the first round feeds 8 + 4 rows expected), so no draft,
        // where one sequence alone drafts.
        let eight = vec![(&half, 100); 8];
        assert_eq!(model_draft_len(&eight, 8, &target, &cheap), 0);
        // Nothing measured: a plain step first, to measure the yardstick;
        // then unmeasured extra rows cost the prior and draft steps are
        // free, so the next steps draft.
        let mut new = CostModel::new();
        assert_eq!(model_draft_len(&[(&sure, 100)], 1, &new, &new), 0);
        new.record(1, 0.1);
        assert!(model_draft_len(&[(&sure, 100)], 1, &new, &CostModel::new()) > 0);
        // A sequence that stops drafting drifts back toward drafting.
        let mut d = drafter(0.0);
        for _ in 0..200 {
            d.record_plain(7);
        }
        assert!((d.alpha - MODEL_PRIOR_ALPHA).abs() < 0.01, "{}", d.alpha);
    }

    /// Eight sequences each sure enough (alpha 0.9) to draft 7 tokens
    /// alone, in a step whose cost jumps by 0.5 s past 16 rows: together
    /// they would pass the jump at any cap over 1. By hand, c(8) = 0.18:
    /// cap 1 gains 8 · (0.9 - 0.08 / 0.18) = 3.64; cap 2, 24 rows, 8 ·
    /// (1.71 - 0.66 / 0.18) < 0; cap 7, 64 rows, 8 · (4.70 - 1.06 / 0.18)
    /// < 0. Alone (batch 1) the proposal stands.
    #[test]
    fn prompt_lookup_drafts_share_one_cap() {
        let mut d = Drafter::new(SpeculativeConfig::ngram(2), DraftLimits::default()).unwrap();
        d.alpha = 0.9;
        let mut jump = CostModel::new();
        for rows in 1..=64 {
            let step = if rows > 16 { 0.6 } else { 0.1 };
            jump.record(rows, step + 0.01 * rows as f64);
        }
        // Alone at batch 8, extra(8, k) = 0.01 k / 0.18 up to k = 8:
        // best at 7 (1.59 against 1.57 at 8).
        assert_eq!(d.best_len(8, 8, &jump.extra_costs(8)), 7);
        assert_eq!(joint_cap(&[(&d, 7); 8], 8, &jump), 1);
        assert_eq!(joint_cap(&[(&d, 7)], 1, &linear_costs(0.1, 0.01)), 7);
        // Cut below the shortest verified: dropped, its first token kept.
        let mut draft = vec![5, 6, 7];
        d.min = 2;
        d.cap(&mut draft, 1);
        assert!(draft.is_empty());
        assert_eq!(d.shadow, Some(5));
        let mut draft = vec![5, 6, 7];
        d.cap(&mut draft, 2);
        assert_eq!(draft, [5, 6]);
    }

    #[test]
    fn cost_fit_recovers_a_linear_cost() {
        let mut c = CostModel::new();
        assert!((c.extra_costs(1)[0] - PRIOR_ROW_COST).abs() < 1e-12);
        for i in 0..50 {
            let rows = 1 + i % 5;
            c.record(rows, 0.2 + 0.01 * rows as f64);
        }
        // Measured counts (1..=5 rows): (c(1 + k) - c(1)) / c(1) =
        // 0.01 k / 0.21; beyond them the fit's b / (a + b) = 0.01 / 0.21
        // per row.
        let extra = c.extra_costs(1);
        for (k, e) in (1..).zip(extra) {
            assert!((e - 0.01 * k as f64 / 0.21).abs() < 1e-9, "k {k}: {e}");
        }
    }

    #[test]
    fn measured_row_counts_override_the_fit() {
        // Steps cost 0.1 + 0.01 * rows, except from 7 rows on, which cost
        // 0.3 more (a kernel's path changes). Seen: 1..=6 rows and 8 rows.
        let cost = |rows: usize| 0.1 + 0.01 * rows as f64 + if rows >= 7 { 0.3 } else { 0.0 };
        let mut c = CostModel::new();
        for i in 0..40 {
            let rows = [1, 2, 3, 4, 5, 6, 8][i % 7];
            c.record(rows, cost(rows));
        }
        let extra = c.extra_costs(1);
        // 7 more rows (8 in all) measured: its true relative cost.
        assert!((extra[6] - (cost(8) - cost(1)) / cost(1)).abs() < 1e-9);
        assert!((extra[4] - (cost(6) - cost(1)) / cost(1)).abs() < 1e-9);
        // The draft stops before the cliff: with alpha = 0.7 the 6th and
        // 7th tokens' expected yield does not pay for the jump.
        let mut d = Drafter::new(SpeculativeConfig::ngram(1), DraftLimits::default()).unwrap();
        d.alpha = 0.7;
        let k = d.best_len(7, 1, &extra);
        assert!(k <= 5, "{k}: {extra:?}");
        // Without the cliff (a hundredth of a step per row) it drafts all 7.
        assert_eq!(d.best_len(7, 1, &flat(0.01)), 7);
    }
}
