//! The generation engine every front end drives (`te generate`, servers,
//! benches): requests join and leave at any step, KV memory follows the
//! tokens, and each step runs one ragged batch.
//!
//! ```text
//! add_request ──> waiting ──admit──> running ──step()──> Token / Finished events
//!                    ^                  │
//!                    └──── preempt ─────┘ (pages run out: recompute later)
//! ```
//!
//! Each step is `schedule -> runner.step -> update`: the
//! [`crate::scheduler::Scheduler`] picks the sequences and their tokens
//! (admission, chunking, preemption, prefix hits), the model's
//! `te_models::runner::Runner` computes the step on its device, and the
//! engine samples, detokenizes, checks stops and emits events.
//!
//! - **Requests** are validated alone ([`Engine::add_request`]); a bad one
//!   gets a [`RequestError`] naming the field and disturbs nobody.
//!   [`Engine::abort`] frees a request's pages at once.
//! - **Memory**: one paged KV pool of a fixed capacity
//!   ([`EngineConfig::kv_cache_tokens`]). A waiting request is admitted
//!   when the pages of its prompt are free; when a running sequence needs a
//!   page and none is free, the most recently admitted sequence is
//!   preempted: its pages are freed and it goes back to the front of the
//!   queue with the tokens generated so far, to be recomputed (vLLM's
//!   recompute preemption). Its sampler and text state are kept, so its
//!   output is what it would have been without the preemption.
//! - **Prefix sharing**: prompts that begin with the same whole pages of
//!   tokens share them (te-cache's prefix index); pages of finished
//!   sequences stay reusable until their memory is needed. Models with
//!   sliding-window layers (Gemma 2/3) keep their rings and share nothing:
//!   a ring overwrites its pages as it turns.
//! - **One plan per step**: `pre_step` builds the step's [`te_cache::StepPlan`],
//!   which every layer borrows; the forward reuses one
//!   `Workspace` (`te_models::layer::Workspace`, held by the engine's
//!   `te_models::runner::Runner`).
//! - **Text**: each token event carries its text delta: UTF-8-complete,
//!   with any tail that may still become a stop string held back until it
//!   can no longer match; a stop string ends the request with
//!   [`FinishReason::Stop`] and its text cut before the stop string.
//!
//! - **Context parallelism** ([`Engine::with_context_parallel`]): every
//!   rank of a group runs an engine on the same requests; each rank's pool
//!   holds its shard of every sequence ([`te_models::context_parallel`]).
//!   Admission and preemption decide on the fullest rank (a minimum of
//!   free pages over the ranks; a step goes ahead only when every rank's
//!   cache can take its part), so every rank makes the same decisions and
//!   samples the same tokens. Prefix sharing is off.
//!
//! - **Speculative decoding** ([`EngineConfig::speculative`]: prompt
//!   lookup, or a draft model with [`Engine::with_draft_model`];
//!   [`crate::speculative`]): a decoding sequence's drafted tokens
//!   are verified as one chunk of `k + 1` rows inside the ordinary step
//!   (beside other sequences' decode and prefill), the accepted ones and
//!   the model's own next token are emitted one by one through the same
//!   stop / EOS / length checks, and the cache is rolled back past the
//!   rejected ones. Greedy tokens are bit-identical to plain decoding;
//!   sampled ones keep the distribution (and, for prompt lookup, the
//!   seeded tokens). Drafting runs on the CPU without context
//!   parallelism; elsewhere requests decode plainly.
//!
//! The engine is single-threaded state (its compute is parallel inside a
//! step); [`crate::driver`] runs it on a thread of its own for
//! multi-threaded callers.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::{EngineError, Result};
use te_cache::{CacheLayout, InferenceParams};
use te_models::context_parallel::ContextParallel;
use te_models::cuda::{CudaModel, KvStore};
use te_models::model::{Model, StepOutput};
use te_models::runner::Runner;
use te_tokenizer::Tokenizer;

use crate::output::{Event, FinishReason, Usage};
use crate::request::{invalid, DraftLimits, Request, RequestError, RequestId};
use crate::sampling::{Sampler, TokenLogprobs};
use crate::scheduler::{Schedule, Scheduler, SchedulerConfig, SeqState};
use crate::speculative::{
    joint_cap, model_draft_len, CatchUp, CostModel, DraftModel, DraftPool, DraftSource, DraftWant,
    Drafter, SpeculativeConfig,
};
use crate::text::TextState;

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences running together at most.
    pub max_batch_size: usize,
    /// Longest prompt chunk fed for one sequence in one step.
    pub prefill_chunk: usize,
    /// Most tokens fed in one step, all sequences together (at least one
    /// token per running sequence is always fed).
    pub max_step_tokens: usize,
    /// Tokens per KV-cache page.
    pub page_size: usize,
    /// Capacity of the KV pool in tokens, all sequences together (rounded
    /// up to whole pages); `None`: [`Engine::default_kv_cache_tokens`].
    pub kv_cache_tokens: Option<usize>,
    /// Share the pages of common prompt prefixes (where the model allows).
    pub prefix_caching: bool,
    /// The model's weights on a GPU (`CudaModel::upload`) to run the steps
    /// there; `None`: the CPU.
    pub gpu: Option<Arc<CudaModel>>,
    /// Speculative decoding of every request (`None`: plain decoding).
    /// Drafting runs on the CPU without context parallelism; elsewhere
    /// the setting is ignored.
    pub speculative: Option<SpeculativeConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_size: 16,
            prefill_chunk: 512,
            max_step_tokens: 2048,
            page_size: 16,
            kv_cache_tokens: None,
            prefix_caching: true,
            gpu: None,
            speculative: None,
        }
    }
}

/// Counters over the engine's lifetime (`te generate --stats`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests accepted by `add_request`.
    pub requests: usize,
    /// Prompt tokens of those requests.
    pub prompt_tokens: usize,
    /// Prompt tokens served from shared pages.
    pub prefix_hit_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Tokens computed in steps that held some prompt (prefill), and the
    /// seconds those steps took.
    pub prefill_tokens: usize,
    pub prefill_s: f64,
    /// Tokens generated in decode-only steps, and their seconds.
    pub decode_tokens: usize,
    pub decode_s: f64,
    /// Most KV tokens held at once (pages in use times page size, in the
    /// full-attention pool).
    pub peak_kv_tokens: usize,
    /// Sequences preempted (freed and queued for recompute).
    pub preemptions: usize,
    /// Context parallelism: most tokens whose K/V this rank held at once.
    pub peak_rank_kv_tokens: usize,
    /// Most bytes of KV pages in use at once, every layer's pool together.
    pub peak_kv_bytes: usize,
    /// Speculative decoding: tokens drafted and verified, the drafted
    /// tokens the model accepted, and the verifications (steps in which a
    /// sequence had a draft).
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    pub verifications: usize,
}

impl EngineStats {
    /// Accepted over drafted tokens (0 before any draft).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.draft_tokens as f64
        }
    }

    /// Accepted drafted tokens per verification (0 before any).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.verifications as f64
        }
    }
}

/// One rank's KV peaks ([`Engine::kv_per_rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankKv {
    /// [`EngineStats::peak_rank_kv_tokens`].
    pub tokens: usize,
    /// [`EngineStats::peak_kv_bytes`].
    pub bytes: usize,
}

/// The engine's gauges and counters at one moment ([`Engine::snapshot`],
/// [`crate::EngineHandle::snapshot`]: a server's metrics).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineSnapshot {
    /// Requests running (admitted, holding KV pages).
    pub running: usize,
    /// Requests waiting for admission (new or preempted).
    pub waiting: usize,
    /// KV pages in use and in the pool (the full-attention pool).
    pub kv_pages_in_use: usize,
    pub kv_pages_total: usize,
    /// Counters so far.
    pub stats: EngineStats,
}

/// The engine's state of one request, carried by the scheduler.
struct Gen<'a> {
    max_new_tokens: usize,
    ignore_eos: bool,
    /// Most tokens the sequence may reach (prompt + max new, capped by the
    /// context).
    limit: usize,
    sampler: Sampler,
    text: TextState<'a>,
    /// Speculative decoding state (`None`: plain decoding).
    drafter: Option<Drafter>,
}

type Seq<'a> = SeqState<Gen<'a>>;

/// The generation engine: requests, one paged KV pool, steps (see the
/// module doc).
pub struct Engine<'a> {
    model: &'a Model,
    tokenizer: Option<&'a Tokenizer>,
    /// Admission, chunking, preemption and prefix hits over the KV cache
    /// (on the runner's device: host memory, or the GPU's).
    sched: Scheduler<KvStore, Gen<'a>>,
    /// The device the steps run on, with its reused buffers.
    runner: Runner,
    /// Events produced between steps (aborts, zero-token requests).
    pending: Vec<Event>,
    next_id: RequestId,
    stats: EngineStats,
    /// Speculative decoding of every request, where it runs (CPU, no
    /// context parallelism).
    speculative: Option<SpeculativeConfig>,
    /// The measured cost of decode steps by rows (draft lengths).
    cost: CostModel,
    /// Longest feed of one sequence in one step.
    prefill_chunk: usize,
    /// The draft model of [`DraftSource::Model`] ([`Engine::with_draft_model`]).
    draft_model: Option<DraftModel<'a>>,
}

impl<'a> Engine<'a> {
    /// The default KV capacity: 32768 tokens, or the model's context if it
    /// is shorter (storage is allocated zeroed and only touched pages become
    /// resident memory).
    pub fn default_kv_cache_tokens(model: &Model) -> usize {
        model.config.max_position_embeddings.min(32768)
    }

    /// An engine over `model`. Without a `tokenizer` text deltas are empty
    /// and stop strings are refused.
    ///
    /// Errors: a config value of 0, a KV pool that cannot be built.
    pub fn new(
        model: &'a Model,
        tokenizer: Option<&'a Tokenizer>,
        config: EngineConfig,
    ) -> Result<Self> {
        for (name, v) in [
            ("page_size", config.page_size),
            ("kv_cache_tokens", config.kv_cache_tokens.unwrap_or(1)),
            ("max_batch_size", config.max_batch_size),
        ] {
            if v == 0 {
                return Err(EngineError::Setting {
                    setting: name,
                    reason: "must be at least 1".into(),
                });
            }
        }
        let tokens = config
            .kv_cache_tokens
            .unwrap_or_else(|| Self::default_kv_cache_tokens(model));
        let total_num_pages = tokens.div_ceil(config.page_size);
        if let Some(spec) = &config.speculative {
            spec.validate()?;
        }
        let runner = Runner::new(config.gpu.clone());
        let cache = runner.new_cache(
            model,
            config.max_batch_size,
            model.config.max_position_embeddings,
            config.prefill_chunk.max(1),
            CacheLayout::Paged {
                page_size: config.page_size,
                total_num_pages,
            },
        )?;
        let sched = Scheduler::new(
            cache,
            SchedulerConfig {
                max_batch_size: config.max_batch_size,
                prefill_chunk: config.prefill_chunk,
                max_step_tokens: config.max_step_tokens,
                prefix_caching: config.prefix_caching,
            },
        )?;
        Ok(Engine {
            model,
            tokenizer,
            sched,
            pending: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
            speculative: config.speculative.filter(|_| runner.is_cpu()),
            cost: CostModel::new(),
            prefill_chunk: config.prefill_chunk.max(1),
            runner,
            draft_model: None,
        })
    }

    /// An engine whose speculative decoding drafts with `draft`
    /// (`config.speculative` with [`DraftSource::Model`]): the draft model
    /// has its own KV pool of `kv_cache_tokens_draft` tokens (`None`: as
    /// many as the target's) and runs on the CPU beside the target.
    ///
    /// Errors: those of [`Engine::new`]; a draft model whose vocabulary
    /// size differs from the target's (callers with tokenizers also check
    /// that every token is the same); `config.speculative` not a draft
    /// model; a GPU config.
    pub fn with_draft_model(
        model: &'a Model,
        tokenizer: Option<&'a Tokenizer>,
        config: EngineConfig,
        draft: &'a Model,
        kv_cache_tokens_draft: Option<usize>,
    ) -> Result<Self> {
        let setting = |reason: String| EngineError::Setting {
            setting: "model_draft",
            reason,
        };
        if config.speculative.map(|s| s.source) != Some(DraftSource::Model) {
            return Err(setting(
                "the engine's speculative source is not the draft model".into(),
            ));
        }
        if config.gpu.is_some() {
            return Err(setting("a draft model runs on the CPU only".into()));
        }
        let (v, dv) = (model.config.vocab_size, draft.config.vocab_size);
        if v != dv {
            return Err(setting(format!(
                "the draft model's vocabulary has {dv} tokens, the target's {v}"
            )));
        }
        let kv = kv_cache_tokens_draft
            .or(config.kv_cache_tokens)
            .unwrap_or_else(|| Self::default_kv_cache_tokens(draft));
        let chunk = config.prefill_chunk.max(1);
        let (page_size, batch) = (config.page_size, config.max_batch_size);
        let mut engine = Self::new(model, tokenizer, config)?;
        let pool = DraftPool {
            kv_tokens: kv,
            page_size,
            max_batch_size: batch,
            chunk,
        };
        let sharing = engine.prefix_caching();
        engine.draft_model = Some(DraftModel::new(draft, pool, sharing)?);
        Ok(engine)
    }

    /// Rank `cp.cp_rank()` of a context-parallel engine group: call it on
    /// every rank with the same model, config and (later) requests, and
    /// step every rank's engine in lockstep (see the module doc).
    /// `config.kv_cache_tokens` is per rank; prefix caching is off.
    ///
    /// Errors: those of [`Engine::new`]; ranks whose model or config differ
    /// (an error on every rank, naming the first rank that differs); a
    /// failed rank.
    pub fn with_context_parallel(
        model: &'a Model,
        tokenizer: Option<&'a Tokenizer>,
        config: EngineConfig,
        mut cp: ContextParallel,
    ) -> Result<Self> {
        if config.gpu.is_some() {
            return Err(EngineError::ContextParallelOnGpu);
        }
        let config = EngineConfig {
            prefix_caching: false,
            speculative: None,
            ..config
        };
        let mut engine = Self::new(model, tokenizer, config.clone())?;
        let settings = format!("{:?} {config:?}", model.config);
        let words = [te_ring::call_tag(&settings, [])];
        te_ring::agree(cp.comm(), "model and engine settings", &words)?;
        engine.sched.set_context_parallel(cp);
        Ok(engine)
    }

    /// The context-parallel rank, if any.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.sched.context_parallel()
    }

    /// Context parallelism: every rank's KV peaks, in rank order (a
    /// collective: every rank calls it). `None` on a single rank.
    ///
    /// Errors: a failed rank.
    pub fn kv_per_rank(&mut self) -> Result<Option<Vec<RankKv>>> {
        let mine = [
            self.stats.peak_rank_kv_tokens as u64,
            self.stats.peak_kv_bytes as u64,
        ];
        let Some(cp) = self.sched.context_parallel_mut() else {
            return Ok(None);
        };
        let all = te_ring::all_gather(cp.comm(), "kv per rank", &[], &mine)?;
        Ok(Some(
            all.iter()
                .map(|v| RankKv {
                    tokens: v.first().copied().unwrap_or(0) as usize,
                    bytes: v.get(1).copied().unwrap_or(0) as usize,
                })
                .collect(),
        ))
    }

    /// The model.
    pub fn model(&self) -> &'a Model {
        self.model
    }

    /// KV capacity in tokens (whole pages of the full-attention pool).
    pub fn kv_capacity_tokens(&self) -> usize {
        self.sched.kv_capacity_tokens()
    }

    /// KV tokens held now (pages in use times page size).
    pub fn kv_tokens_in_use(&self) -> usize {
        self.sched.kv_tokens_in_use()
    }

    /// The KV cache (its bookkeeping: pages in use, cached, free).
    pub fn cache(&self) -> &InferenceParams<KvStore> {
        self.sched.cache()
    }

    /// Whether prompts share prefix pages in this engine.
    pub fn prefix_caching(&self) -> bool {
        self.sched.prefix_caching()
    }

    /// Counters so far.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Requests running (admitted, holding KV pages).
    pub fn num_running(&self) -> usize {
        self.sched.running().len()
    }

    /// Requests waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    /// Gauges and counters now.
    pub fn snapshot(&self) -> EngineSnapshot {
        let (kv_pages_in_use, kv_pages_total) = self.sched.kv_pages();
        EngineSnapshot {
            running: self.num_running(),
            waiting: self.num_waiting(),
            kv_pages_in_use,
            kv_pages_total,
            stats: self.stats.clone(),
        }
    }

    /// Whether any request is unfinished or any event is not yet returned.
    pub fn has_work(&self) -> bool {
        self.sched.has_work() || !self.pending.is_empty()
    }

    /// The events produced between steps, taken.
    pub(crate) fn take_pending(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.pending)
    }

    /// Validates `request` alone and queues it; it joins the running batch
    /// at the next step its pages are free.
    ///
    /// Errors (nothing queued): an empty prompt, a token id outside the
    /// vocabulary, a prompt that leaves no room for one generated token in
    /// the context or the whole KV pool, invalid sampling settings, an empty
    /// stop string, stop strings without a tokenizer, a
    /// `draft.n_min` above its `draft.n_max`.
    pub fn add_request(
        &mut self,
        request: Request,
    ) -> std::result::Result<RequestId, RequestError> {
        let c = &self.model.config;
        let n = request.prompt_tokens.len();
        if n == 0 {
            return Err(invalid("prompt_tokens", "the prompt is empty"));
        }
        if let Some(&bad) = request
            .prompt_tokens
            .iter()
            .find(|&&t| t as usize >= c.vocab_size)
        {
            return Err(invalid(
                "prompt_tokens",
                format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    c.vocab_size
                ),
            ));
        }
        let ctx = c.max_position_embeddings;
        if n >= ctx {
            return Err(RequestError::TooLong {
                tokens: n,
                limit: ctx,
                what: "model's context",
            });
        }
        // Context parallelism: the ranks' pools together.
        let ranks = self.sched.context_parallel().map_or(1, |cp| cp.cp_size());
        let limit = self.sched.kv_capacity_tokens() * ranks;
        if n >= limit {
            return Err(RequestError::TooLong {
                tokens: n,
                limit,
                what: "KV cache (--kv-cache-tokens)",
            });
        }
        request
            .sampling
            .validate()
            .map_err(|e| invalid("sampling", e))?;
        if request.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty"));
        }
        if let DraftLimits {
            n_max: Some(max),
            n_min: Some(min),
        } = request.draft
        {
            if min > max {
                return Err(invalid(
                    "speculative.n_min",
                    format!("{min} is above speculative.n_max ({max})"),
                ));
            }
        }
        if !request.stop.is_empty() && self.tokenizer.is_none() {
            return Err(invalid(
                "stop",
                "stop strings need an engine with a tokenizer",
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.stats.requests += 1;
        self.stats.prompt_tokens += n;
        let gen = Gen {
            max_new_tokens: request.max_new_tokens,
            ignore_eos: request.ignore_eos,
            limit: n.saturating_add(request.max_new_tokens).min(ctx),
            sampler: Sampler::new(request.sampling).with_constraint(request.constraint),
            text: TextState::new(
                self.tokenizer
                    .map(|t| t.decode_stream(request.skip_special_tokens)),
                request.stop,
            ),
            drafter: self
                .speculative
                .and_then(|c| Drafter::new(c, request.draft)),
        };
        let mut seq = SeqState::new(id, request.prompt_tokens, gen);
        seq.cache_salt = request.cache_salt;
        if seq.data.max_new_tokens == 0 {
            self.pending
                .push(finished(&seq, FinishReason::Length, String::new()));
        } else {
            self.sched.enqueue(seq);
        }
        Ok(id)
    }

    /// Ends request `id` now: its KV pages are freed at once and a
    /// `Finished` event with reason `abort` comes with the next step.
    ///
    /// Errors: `id` is not waiting or running (unknown or already finished).
    pub fn abort(&mut self, id: RequestId) -> std::result::Result<(), RequestError> {
        let seq = self
            .sched
            .abort(id)
            .expect("a running sequence is held by the cache")
            .ok_or(RequestError::Unknown(id))?;
        self.pending
            .push(finished(&seq, FinishReason::Abort, String::new()));
        Ok(())
    }

    /// Runs one step: the scheduler admits waiting requests whose pages are
    /// free and feeds every running sequence its next prompt chunk or its
    /// last token (preempting the latest admitted when pages run out), the
    /// runner computes the step, the sequences sample, and the events come
    /// back (plus those of aborts and zero-token requests since the last
    /// step). With nothing to do it returns no events.
    ///
    /// Errors: a failure of the forward pass. The sequences of the failed
    /// step are then queued for recompute (nothing is lost); the error
    /// names the step.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let result = self.step_inner();
        // The scheduler's counters, on every path out of the step
        // (preemptions and prefix hits happen before a step can stop early).
        let s = self.sched.stats();
        self.stats.preemptions = s.preemptions;
        self.stats.prefix_hit_tokens = s.prefix_hit_tokens;
        if let (Err(e), Some(cp)) = (&result, self.sched.context_parallel_mut()) {
            // The other ranks fail too, naming this one.
            cp.abort(&e.to_string());
        }
        result
    }

    fn step_inner(&mut self) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.pending);
        self.sched.admit()?;
        if self.sched.running().is_empty() {
            return Ok(events);
        }
        // A step's time includes its drafting (a draft model's steps); the
        // cost model's does not (the draft model's steps are costed apart,
        // `model_draft_len`).
        let start = Instant::now();
        self.propose_drafts()?;
        let verify_start = Instant::now();
        let feed = match self.sched.schedule()? {
            Schedule::Idle => return Ok(events),
            Schedule::PoolFull(seq) => {
                events.push(self.finish(seq, FinishReason::Length));
                return Ok(events);
            }
            Schedule::Step { feed } => feed,
        };
        let (tokens, prefill) = self.sched.step_tokens(&feed);
        let vocab = self.model.config.vocab_size;
        // Logit rows per fed sequence: its draft's and the one before it.
        let drafting = self.sched.running().iter().any(|s| !s.draft.is_empty());
        let tails: Vec<usize> = if drafting {
            self.sched
                .running()
                .iter()
                .zip(&feed)
                .filter(|(_, &n)| n > 0)
                .map(|(s, _)| 1 + s.draft.len())
                .collect()
        } else {
            Vec::new()
        };
        // Plain greedy everywhere: the device may pick the tokens itself.
        let greedy = self
            .sched
            .running()
            .iter()
            .all(|s| s.data.sampler.is_plain_greedy());
        let (cache, cp) = self.sched.cache_and_rank();
        let forward = match cp {
            Some(cp) => self
                .runner
                .step_context_parallel(self.model, &tokens, cache, cp),
            None if drafting => self
                .runner
                .step_tails(self.model, &tokens, cache, &tails)
                .map(StepOutput::Logits),
            None => self.runner.step(self.model, &tokens, cache, greedy),
        };
        let out = match forward {
            Ok(l) => l,
            Err(e) => {
                // Recompute everyone of this step later.
                self.sched.preempt_all();
                return Err(EngineError::Step {
                    tokens: tokens.len(),
                    source: e,
                });
            }
        };
        // Each fed sequence's rows of the output, and what it takes: the
        // number of its drafted tokens accepted and the model's own next
        // token (None: mid-prompt chunk). The sequences sample in
        // parallel: each reads its own rows with its own sampler and RNG,
        // so the tokens do not depend on the order (at 32 sequences one
        // pass over Gemma 3's 262,144 logits each was ~3% of a decode
        // step).
        let running = self.sched.running_mut();
        let mut picks: Vec<Option<Pick>> = (0..running.len()).map(|_| None).collect();
        {
            let mut row = 0;
            let mut jobs = Vec::new();
            for ((seq, &n), pick) in running.iter_mut().zip(&feed).zip(&mut picks) {
                if n == 0 {
                    continue;
                }
                let this_row = row;
                row += 1 + seq.draft.len();
                if seq.completes_with(n) {
                    jobs.push((seq, this_row, pick));
                }
            }
            match &out {
                StepOutput::Logits(logits) => {
                    let sample = |(seq, r, pick): (&mut Seq<'_>, usize, &mut Option<Pick>)| {
                        *pick = Some(verify(seq, &logits[r * vocab..], vocab));
                    };
                    // (One sequence: no hand-off to the pool.)
                    if jobs.len() > 1 {
                        jobs.into_par_iter().for_each(sample);
                    } else {
                        jobs.into_iter().for_each(sample);
                    }
                }
                StepOutput::Tokens(ids) => {
                    for (_, r, pick) in jobs {
                        *pick = Some(Pick {
                            accepted: 0,
                            token: ids[r],
                            logprobs: Vec::new(),
                        });
                    }
                }
            }
        }
        // Accepted drafted tokens join the sequences; the cache forgets the
        // rejected ones.
        let mut rejected = vec![0; picks.len()];
        for ((seq, pick), rej) in self
            .sched
            .running_mut()
            .iter_mut()
            .zip(&picks)
            .zip(&mut rejected)
        {
            let Some(Pick {
                accepted,
                token: tok,
                ..
            }) = *pick
            else {
                continue;
            };
            let drafted = seq.draft.len();
            *rej = drafted - accepted;
            if let Some(dm) = self.draft_model.as_mut() {
                dm.accept(seq.id, seq.tokens.len() + accepted)?;
            }
            seq.tokens.extend_from_slice(&seq.draft[..accepted]);
            if let Some(d) = seq.data.drafter.as_mut() {
                if drafted > 0 {
                    d.record(drafted, accepted);
                } else {
                    d.record_plain(tok);
                }
            }
            if drafted > 0 {
                self.stats.draft_tokens += drafted;
                self.stats.accepted_tokens += accepted;
                self.stats.verifications += 1;
            }
        }
        self.sched.advance(&feed, &rejected)?;
        let eos = &self.model.config.eos_token_ids;
        let mut finished_idx = Vec::new();
        let mut generated = 0;
        for (i, (seq, pick)) in self.sched.running_mut().iter_mut().zip(picks).enumerate() {
            let Some(Pick {
                accepted,
                token: tok,
                logprobs,
            }) = pick
            else {
                continue; // not fed, or a mid-prompt chunk: no token yet
            };
            let mut logprobs = logprobs.into_iter();
            seq.tokens.push(tok);
            // The new tokens one by one, as plain decoding would emit them.
            let first = seq.tokens.len() - 1 - accepted;
            for j in first..seq.tokens.len() {
                let tok = seq.tokens[j];
                generated += 1;
                let (text, stopped) = seq.data.text.push(tok);
                events.push(Event::Token {
                    id: seq.id,
                    token: tok,
                    text,
                    logprobs: logprobs.next(),
                });
                let reason = if stopped {
                    Some(FinishReason::Stop)
                } else if !seq.data.ignore_eos && eos.contains(&tok) {
                    Some(FinishReason::Eos)
                } else if j + 1 >= seq.data.limit {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if let Some(r) = reason {
                    // Tokens after the end are dropped.
                    seq.tokens.truncate(j + 1);
                    finished_idx.push((i, r));
                    break;
                }
            }
        }
        self.stats.generated_tokens += generated;
        if prefill {
            self.draft_catch_up(&finished_idx)?;
        }
        let elapsed = start.elapsed().as_secs_f64();
        if prefill {
            self.stats.prefill_tokens += tokens.len();
            self.stats.prefill_s += elapsed;
        } else {
            self.stats.decode_tokens += generated;
            self.stats.decode_s += elapsed;
            if self.speculative.is_some() {
                self.cost
                    .record(tokens.len(), verify_start.elapsed().as_secs_f64());
            }
        }
        self.stats.peak_kv_tokens = self.stats.peak_kv_tokens.max(self.kv_tokens_in_use());
        self.stats.peak_kv_bytes = self
            .stats
            .peak_kv_bytes
            .max(self.sched.cache().memory_in_use());
        if let Some(cp) = self.sched.context_parallel() {
            self.stats.peak_rank_kv_tokens = self.stats.peak_rank_kv_tokens.max(cp.held_tokens());
        }
        for &(i, reason) in finished_idx.iter().rev() {
            let seq = self.sched.finish(i)?;
            events.push(self.finish(seq, reason));
        }
        if let Some(dm) = self.draft_model.as_mut() {
            // Finished, aborted and preempted sequences leave the draft
            // cache (a preempted one catches up again when it decodes).
            let running: Vec<u64> = self.sched.running().iter().map(|s| s.id).collect();
            dm.retain(|id| running.contains(&id))?;
        }
        Ok(events)
    }

    /// Gives every decoding sequence its draft for the next step (none
    /// without speculative decoding, or with context parallelism): at most
    /// what its length limit and a step's chunk leave room for.
    ///
    /// Errors: a failing draft model step.
    fn propose_drafts(&mut self) -> Result<()> {
        if self.speculative.is_none() || self.sched.context_parallel().is_some() {
            return Ok(());
        }
        let batch = self.sched.running().len();
        let extra = self.cost.extra_costs(batch);
        let chunk = self.prefill_chunk;
        // The step's new tokens reach tokens.len() + draft + 1.
        let room = |seq: &Seq<'_>| {
            seq.data
                .limit
                .saturating_sub(seq.tokens.len() + 1)
                .min(chunk - 1)
        };
        if let Some(dm) = self.draft_model.as_mut() {
            let drafting: Vec<(&Drafter, usize)> = self
                .sched
                .running()
                .iter()
                .filter(|seq| seq.decoding())
                .filter_map(|seq| Some((seq.data.drafter.as_ref()?, room(seq))))
                .collect();
            let adaptive = model_draft_len(&drafting, batch, &self.cost, dm.cost());
            let wants: Vec<DraftWant<'_>> = self
                .sched
                .running()
                .iter()
                .map(|seq| DraftWant {
                    id: seq.id,
                    tokens: &seq.tokens,
                    salt: seq.cache_salt.as_deref(),
                    k: match &seq.data.drafter {
                        Some(d) if seq.decoding() => d.model_len(room(seq), adaptive),
                        _ => 0,
                    },
                })
                .collect();
            let drafts = dm.draft(&wants)?;
            for (seq, d) in self.sched.running_mut().iter_mut().zip(drafts) {
                seq.draft = d;
            }
            return Ok(());
        }
        for seq in self.sched.running_mut() {
            if !seq.decoding() {
                continue;
            }
            let room = room(seq);
            let Some(drafter) = seq.data.drafter.as_mut() else {
                continue;
            };
            seq.draft = drafter.propose(&seq.tokens, room, batch, &extra);
        }
        // Each chose its length alone; the step carries all of them.
        let proposed: Vec<(&Drafter, usize)> = self
            .sched
            .running()
            .iter()
            .filter_map(|seq| Some((seq.data.drafter.as_ref()?, seq.draft.len())))
            .filter(|(_, k)| *k > 0)
            .collect();
        if proposed.len() > 1 {
            let cap = joint_cap(&proposed, batch, &self.cost);
            for seq in self.sched.running_mut() {
                if let Some(drafter) = seq.data.drafter.as_mut() {
                    drafter.cap(&mut seq.draft, cap);
                }
            }
        }
        Ok(())
    }

    /// In a prefill step, the draft model (if any) is fed what it lacks of
    /// each drafting sequence's computed tokens but the last (the sequences at
    /// `finished`, indices into the running ones with their reasons, are
    /// left out), so that a prompt's draft prefill counts as prefill and
    /// the first decode step drafts at once.
    ///
    /// Errors: a failing draft model step.
    fn draft_catch_up(&mut self, finished: &[(usize, FinishReason)]) -> Result<()> {
        if self.sched.context_parallel().is_some() {
            return Ok(());
        }
        let Some(dm) = self.draft_model.as_mut() else {
            return Ok(());
        };
        // What the target has computed (so a prompt waiting for another's
        // shared prefix waits here too), without the last token.
        let seqs: Vec<CatchUp<'_>> = self
            .sched
            .running()
            .iter()
            .enumerate()
            .filter(|(i, s)| s.data.drafter.is_some() && !finished.iter().any(|f| f.0 == *i))
            .map(|(_, s)| CatchUp {
                id: s.id,
                tokens: &s.tokens[..s.fed.min(s.tokens.len().saturating_sub(1))],
                salt: s.cache_salt.as_deref(),
            })
            .collect();
        dm.catch_up(&seqs)
    }

    /// Runs until every request is done, passing each event to `on_event`.
    ///
    /// Errors: the first failing step.
    pub fn run_to_completion(&mut self, mut on_event: impl FnMut(Event)) -> Result<()> {
        while self.has_work() {
            for e in self.step()? {
                on_event(e);
            }
        }
        Ok(())
    }

    /// The `Finished` event of `seq`, releasing its held-back text.
    fn finish(&mut self, mut seq: Seq<'a>, reason: FinishReason) -> Event {
        let rest = if reason == FinishReason::Stop {
            String::new()
        } else {
            seq.data.text.rest()
        };
        finished(&seq, reason, rest)
    }
}

/// What a fed sequence takes from its logits rows.
struct Pick {
    /// Drafted tokens accepted.
    accepted: usize,
    /// The model's own token after them.
    token: u32,
    /// The log-probabilities of each new token (the accepted drafted ones,
    /// then `token`), when the request asks for them; else empty.
    logprobs: Vec<TokenLogprobs>,
}

/// Verifies `seq`'s draft against its logits rows `rows: [1 + draft, vocab]`
/// (a sequence without a draft: its one row): each position's token is
/// chosen by the sequence's sampler as plain decoding would choose it,
/// and the draft is accepted up to the first position whose token
/// differs from it (see [`crate::speculative`]).
fn verify(seq: &mut Seq<'_>, rows: &[f32], vocab: usize) -> Pick {
    let row = |j: usize| &rows[j * vocab..(j + 1) * vocab];
    let mut logprobs = Vec::new();
    // The history grows by the accepted tokens (for the penalties), then
    // is put back.
    let len = seq.tokens.len();
    let mut accepted = 0;
    let token = loop {
        let tok = seq.data.sampler.sample(row(accepted), &seq.tokens);
        logprobs.extend(seq.data.sampler.take_logprobs());
        if accepted == seq.draft.len() || tok != seq.draft[accepted] {
            break tok;
        }
        seq.tokens.push(tok);
        accepted += 1;
    };
    seq.tokens.truncate(len);
    Pick {
        accepted,
        token,
        logprobs,
    }
}

fn finished(seq: &Seq<'_>, reason: FinishReason, text: String) -> Event {
    Event::Finished {
        id: seq.id,
        reason,
        text,
        usage: Usage {
            prompt_tokens: seq.prompt_len,
            cached_prompt_tokens: seq.cached_prompt_tokens,
            generated_tokens: seq.tokens.len() - seq.prompt_len,
        },
    }
}
