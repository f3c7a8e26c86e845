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
//! ## Driving it from several threads
//!
//! The engine is single-threaded state (its compute is parallel inside a
//! step). A multi-threaded caller, such as an HTTP server, gives it a
//! thread of its own and talks to it through [`EngineHandle`]: create the
//! pair with [`channel`], run [`Engine::run`] on the engine's thread (a
//! `std::thread::scope` thread when the model is borrowed), and call
//! [`EngineHandle::submit`] / [`EngineHandle::abort`] from any thread. Each
//! request's events arrive on its own receiver; dropping a receiver aborts
//! the request at the next step. `run` returns once every handle is dropped
//! and all work is done.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use rayon::prelude::*;

use te_cache::{CacheLayout, InferenceParams};

use te_models::context_parallel::ContextParallel;
use te_models::cuda::{CudaModel, KvStore};
use te_models::model::{Model, StepOutput};
use te_models::runner::Runner;
use te_models::{ModelError, Result};
use te_tokenizer::{DecodeStream, Tokenizer};

use crate::sampling::{Sampler, SamplingParams};

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
}

impl Request {
    /// A greedy request for `max_new_tokens` after `prompt_tokens`, no stop
    /// strings, special tokens left out of the text.
    pub fn new(prompt_tokens: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            prompt_tokens,
            max_new_tokens,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop: Vec::new(),
            skip_special_tokens: true,
        }
    }
}

/// Why a request was refused by [`Engine::add_request`]; `field` names the
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
    /// [`Engine::abort`] named a request the engine does not hold.
    #[error("unknown request {0}")]
    Unknown(RequestId),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> RequestError {
    RequestError::Invalid {
        field,
        reason: reason.into(),
    }
}

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
    /// [`Engine::abort`] (or a dropped receiver under [`Engine::run`]).
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
/// [`EngineHandle::snapshot`]: a server's metrics).
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

/// One request inside the engine.
struct Seq<'a> {
    id: RequestId,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new_tokens: usize,
    ignore_eos: bool,
    stop: Vec<String>,
    /// Tokens in the cache (0 while waiting).
    fed: usize,
    /// Most tokens the sequence may reach (prompt + max new, capped by the
    /// context).
    limit: usize,
    sampler: Sampler,
    decoder: Option<DecodeStream<'a>>,
    /// Text decoded so far, and how much of it was sent.
    text: String,
    sent: usize,
    cached_prompt_tokens: usize,
    /// Admission order (preemption takes the latest).
    admitted: u64,
    /// Entered the cache since its (latest) admission.
    started: bool,
    /// Whether the first admission happened (prefix hits count once).
    was_admitted: bool,
}

/// The continuous-batching generation engine over one [`Model`] (see the
/// module doc).
pub struct Engine<'a> {
    model: &'a Model,
    tokenizer: Option<&'a Tokenizer>,
    config: EngineConfig,
    /// On the model's device (host memory, or the GPU's).
    cache: InferenceParams<KvStore>,
    /// The device the steps run on, with its reused buffers.
    runner: Runner,
    /// A layer of the full-attention pool (its pages are the capacity).
    full_layer: usize,
    kv_capacity_tokens: usize,
    waiting: VecDeque<Seq<'a>>,
    running: Vec<Seq<'a>>,
    /// Events produced between steps (aborts, zero-token requests).
    pending: Vec<Event>,
    next_id: RequestId,
    admissions: u64,
    stats: EngineStats,
    /// This rank of a context-parallel group.
    cp: Option<ContextParallel>,
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
            ("max_batch_size", config.max_batch_size),
            ("prefill_chunk", config.prefill_chunk),
            ("max_step_tokens", config.max_step_tokens),
            ("page_size", config.page_size),
            ("kv_cache_tokens", config.kv_cache_tokens.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(ModelError::Request(format!("{name} must be at least 1")));
            }
        }
        let tokens = config
            .kv_cache_tokens
            .unwrap_or_else(|| Self::default_kv_cache_tokens(model));
        let total_num_pages = tokens.div_ceil(config.page_size);
        let runner = Runner::new(config.gpu.clone());
        let cache = runner.new_cache(
            model,
            config.max_batch_size,
            model.config.max_position_embeddings,
            config.prefill_chunk,
            CacheLayout::Paged {
                page_size: config.page_size,
                total_num_pages,
            },
        )?;
        let full_layer = (0..cache.num_layers())
            .find(|&l| cache.ring_len(l).is_none())
            .unwrap_or(0);
        let kv_capacity_tokens = (cache.pages_in_use(full_layer)?
            + cache.pages_free(full_layer)?)
            * cache.page_size(full_layer)?;
        Ok(Engine {
            model,
            tokenizer,
            config,
            cache,
            runner,
            full_layer,
            kv_capacity_tokens,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: Vec::new(),
            next_id: 0,
            admissions: 0,
            stats: EngineStats::default(),
            cp: None,
        })
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
            return Err(ModelError::Request(
                "context parallelism runs on the CPU only (--device cpu)".into(),
            ));
        }
        let config = EngineConfig {
            prefix_caching: false,
            ..config
        };
        let mut engine = Self::new(model, tokenizer, config.clone())?;
        let settings = format!("{:?} {config:?}", model.config);
        let words = [te_ring::call_tag(&settings, [])];
        te_ring::agree(cp.comm(), "model and engine settings", &words)
            .map_err(|e| ModelError::Request(format!("context parallelism: {e}")))?;
        engine.cp = Some(cp);
        Ok(engine)
    }

    /// The context-parallel rank, if any.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
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
        let Some(cp) = self.cp.as_mut() else {
            return Ok(None);
        };
        let all = te_ring::all_gather(cp.comm(), "kv per rank", &[], &mine)
            .map_err(|e| ModelError::Request(format!("context parallelism: {e}")))?;
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
        self.kv_capacity_tokens
    }

    /// KV tokens held now (pages in use times page size).
    pub fn kv_tokens_in_use(&self) -> usize {
        let l = self.full_layer;
        self.cache.pages_in_use(l).unwrap_or(0) * self.cache.page_size(l).unwrap_or(0)
    }

    /// The KV cache (its bookkeeping: pages in use, cached, free).
    pub fn cache(&self) -> &InferenceParams<KvStore> {
        &self.cache
    }

    /// Whether prompts share prefix pages in this engine.
    pub fn prefix_caching(&self) -> bool {
        self.config.prefix_caching && self.cache.prefix_sharing()
    }

    /// Counters so far.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Requests running (admitted, holding KV pages).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Gauges and counters now.
    pub fn snapshot(&self) -> EngineSnapshot {
        let l = self.full_layer;
        let in_use = self.cache.pages_in_use(l).unwrap_or(0);
        EngineSnapshot {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_pages_in_use: in_use,
            kv_pages_total: in_use + self.cache.pages_free(l).unwrap_or(0),
            stats: self.stats.clone(),
        }
    }

    /// Whether any request is unfinished or any event is not yet returned.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.pending.is_empty()
    }

    /// Validates `request` alone and queues it; it joins the running batch
    /// at the next step its pages are free.
    ///
    /// Errors (nothing queued): an empty prompt, a token id outside the
    /// vocabulary, a prompt that leaves no room for one generated token in
    /// the context or the whole KV pool, invalid sampling settings, an empty
    /// stop string, stop strings without a tokenizer.
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
        let limit = self.kv_capacity_tokens * self.cp.as_ref().map_or(1, |cp| cp.cp_size());
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
        let seq = Seq {
            id,
            limit: n.saturating_add(request.max_new_tokens).min(ctx),
            tokens: request.prompt_tokens,
            prompt_len: n,
            max_new_tokens: request.max_new_tokens,
            ignore_eos: request.ignore_eos,
            stop: request.stop,
            fed: 0,
            sampler: Sampler::new(request.sampling),
            decoder: self
                .tokenizer
                .map(|t| t.decode_stream(request.skip_special_tokens)),
            text: String::new(),
            sent: 0,
            cached_prompt_tokens: 0,
            admitted: 0,
            started: false,
            was_admitted: false,
        };
        if seq.max_new_tokens == 0 {
            self.pending
                .push(finished(&seq, FinishReason::Length, String::new()));
        } else {
            self.waiting.push_back(seq);
        }
        Ok(id)
    }

    /// Ends request `id` now: its KV pages are freed at once and a
    /// `Finished` event with reason `abort` comes with the next step.
    ///
    /// Errors: `id` is not waiting or running (unknown or already finished).
    pub fn abort(&mut self, id: RequestId) -> std::result::Result<(), RequestError> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(id)
                .expect("a running sequence is held by the cache");
            seq
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i).expect("index in range")
        } else {
            return Err(RequestError::Unknown(id));
        };
        self.pending
            .push(finished(&seq, FinishReason::Abort, String::new()));
        Ok(())
    }

    /// Runs one scheduler step: admits waiting requests whose pages are
    /// free, feeds every running sequence its next prompt chunk or its last
    /// token (preempting the latest admitted when pages run out), runs the
    /// model once, samples, and returns the events (plus those of aborts and
    /// zero-token requests since the last step). With nothing to do it
    /// returns no events.
    ///
    /// Errors: a failure of the forward pass. The sequences of the failed
    /// step are then queued for recompute (nothing is lost); the error
    /// names the step.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let result = self.step_inner();
        if let (Err(e), Some(cp)) = (&result, self.cp.as_mut()) {
            // The other ranks fail too, naming this one.
            cp.abort(&e.to_string());
        }
        result
    }

    fn step_inner(&mut self) -> Result<Vec<Event>> {
        let mut events = std::mem::take(&mut self.pending);
        self.admit()?;
        if self.running.is_empty() {
            return Ok(events);
        }
        let feed = loop {
            let feed = self.plan_feed();
            let steps: Vec<(u64, usize)> = self
                .running
                .iter()
                .zip(&feed)
                .filter(|(_, &n)| n > 0)
                .map(|(s, &n)| (s.id, n))
                .collect();
            if steps.is_empty() {
                return Ok(events);
            }
            if self.try_pre_step(&steps)? {
                break feed;
            } else {
                {
                    if self.running.len() > 1 {
                        self.preempt_latest();
                    } else {
                        // A lone sequence fills the whole pool.
                        let seq = self.running.pop().expect("one running");
                        self.release(seq.id)?;
                        events.push(self.finish(seq, FinishReason::Length));
                        return Ok(events);
                    }
                }
            }
        };
        let mut tokens = Vec::new();
        let mut prefill = false;
        for (s, &n) in self.running.iter().zip(&feed) {
            tokens.extend_from_slice(&s.tokens[s.fed..s.fed + n]);
            prefill |= n > 0 && s.tokens.len() - s.fed > 1;
        }
        let start = Instant::now();
        let vocab = self.model.config.vocab_size;
        // Plain greedy everywhere: the device may pick the tokens itself.
        let greedy = self.running.iter().all(|s| s.sampler.is_plain_greedy());
        let forward = match (self.cp.as_mut(), self.runner.cpu_workspace()) {
            (Some(cp), Some(ws)) => self
                .model
                .forward_context_parallel(&tokens, &mut self.cache, cp, ws)
                .map(StepOutput::Logits),
            (Some(_), None) => Err(ModelError::Request(
                "context parallelism runs on the CPU only".into(),
            )),
            (None, _) => self
                .runner
                .step(self.model, &tokens, &mut self.cache, greedy),
        };
        let out = match forward {
            Ok(l) => l,
            Err(e) => {
                // Recompute everyone of this step later.
                while !self.running.is_empty() {
                    self.preempt_latest();
                }
                return Err(ModelError::Request(format!(
                    "generation step of {} tokens failed: {e}",
                    tokens.len()
                )));
            }
        };
        // Each fed sequence's row of the output, and the token it takes
        // (None: mid-prompt chunk). The sequences sample in parallel: each
        // reads its own row with its own sampler and RNG, so the tokens do
        // not depend on the order (at 32 sequences one pass over Gemma 3's
        // 262,144 logits each was ~3% of a decode step).
        let mut picks: Vec<Option<u32>> = vec![None; self.running.len()];
        {
            let mut row = 0;
            let mut jobs = Vec::new();
            for ((seq, &n), pick) in self.running.iter_mut().zip(&feed).zip(&mut picks) {
                if n == 0 {
                    continue;
                }
                let this_row = row;
                row += 1;
                if seq.fed + n >= seq.tokens.len() {
                    jobs.push((seq, this_row, pick));
                }
            }
            match &out {
                StepOutput::Logits(logits) => {
                    let sample = |(seq, r, pick): (&mut Seq<'_>, usize, &mut Option<u32>)| {
                        let row = &logits[r * vocab..(r + 1) * vocab];
                        *pick = Some(seq.sampler.sample(row, &seq.tokens));
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
                        *pick = Some(ids[r]);
                    }
                }
            }
        }
        let mut finished_idx = Vec::new();
        for (i, ((seq, &n), pick)) in self.running.iter_mut().zip(&feed).zip(picks).enumerate() {
            if n == 0 {
                continue;
            }
            seq.fed += n;
            if self.config.prefix_caching {
                self.cache.register_prefix(seq.id, &seq.tokens[..seq.fed])?;
            }
            let Some(tok) = pick else {
                continue; // mid-prompt chunk: no token yet
            };
            seq.tokens.push(tok);
            self.stats.generated_tokens += 1;
            let (text, stopped) = seq.push_text(tok);
            events.push(Event::Token {
                id: seq.id,
                token: tok,
                text,
            });
            let reason = if stopped {
                Some(FinishReason::Stop)
            } else if !seq.ignore_eos && self.model.config.eos_token_ids.contains(&tok) {
                Some(FinishReason::Eos)
            } else if seq.tokens.len() >= seq.limit {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(r) = reason {
                finished_idx.push((i, r));
            }
        }
        let elapsed = start.elapsed().as_secs_f64();
        if prefill {
            self.stats.prefill_tokens += tokens.len();
            self.stats.prefill_s += elapsed;
        } else {
            self.stats.decode_tokens += tokens.len();
            self.stats.decode_s += elapsed;
        }
        self.stats.peak_kv_tokens = self.stats.peak_kv_tokens.max(self.kv_tokens_in_use());
        self.stats.peak_kv_bytes = self.stats.peak_kv_bytes.max(self.cache.memory_in_use());
        if let Some(cp) = &self.cp {
            self.stats.peak_rank_kv_tokens = self.stats.peak_rank_kv_tokens.max(cp.held_tokens());
        }
        for &(i, reason) in finished_idx.iter().rev() {
            let seq = self.running.remove(i);
            self.release(seq.id)?;
            events.push(self.finish(seq, reason));
        }
        Ok(events)
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

    /// The engine loop for a multi-threaded caller (see the module doc):
    /// takes commands from the [`EngineHandle`]s of `commands`, steps while
    /// there is work, sends each request's events to its receiver, and
    /// returns when every handle is dropped and all work is done. A request
    /// whose receiver is dropped is aborted.
    ///
    /// Errors: a failing step (after which every open request receives a
    /// `Finished` event with reason `abort`).
    pub fn run(&mut self, commands: mpsc::Receiver<Command>) -> Result<()> {
        let mut sinks: std::collections::HashMap<RequestId, mpsc::Sender<Event>> =
            std::collections::HashMap::new();
        let mut open = true;
        loop {
            // Block for a command only when idle.
            if !self.has_work() && open {
                match commands.recv() {
                    Ok(cmd) => self.apply(cmd, &mut sinks),
                    Err(_) => open = false,
                }
            }
            loop {
                match commands.try_recv() {
                    Ok(cmd) => self.apply(cmd, &mut sinks),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if !self.has_work() {
                if open {
                    continue;
                }
                return Ok(());
            }
            let events = match self.step() {
                Ok(ev) => ev,
                Err(e) => {
                    let ids: Vec<RequestId> = sinks.keys().copied().collect();
                    for id in ids {
                        let _ = self.abort(id);
                    }
                    for ev in std::mem::take(&mut self.pending) {
                        if let Some(tx) = sinks.get(&ev.id()) {
                            let _ = tx.send(ev);
                        }
                    }
                    return Err(e);
                }
            };
            for ev in events {
                let id = ev.id();
                let done = matches!(ev, Event::Finished { .. });
                let delivered = sinks.get(&id).is_some_and(|tx| tx.send(ev).is_ok());
                if done {
                    sinks.remove(&id);
                } else if !delivered {
                    // The caller went away: free its sequence now.
                    sinks.remove(&id);
                    let _ = self.abort(id);
                }
            }
        }
    }

    fn apply(
        &mut self,
        cmd: Command,
        sinks: &mut std::collections::HashMap<RequestId, mpsc::Sender<Event>>,
    ) {
        match cmd {
            Command::Submit {
                request,
                events,
                reply,
            } => {
                let result = self.add_request(request);
                if let Ok(id) = result {
                    sinks.insert(id, events);
                }
                let _ = reply.send(result);
            }
            Command::Abort(id) => {
                let _ = self.abort(id);
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(self.snapshot());
            }
        }
    }

    /// Admits waiting requests (front first) while a batch slot is free and
    /// the pool has the pages of the request's tokens plus one page per
    /// running sequence (room for the decoders' next pages); then starts
    /// the admitted sequences in the cache ([`Self::start_sequences`]).
    fn admit(&mut self) -> Result<()> {
        let ps = self.config.page_size;
        if self.waiting.is_empty() {
            self.start_sequences();
            return Ok(());
        }
        let mut free = self.cache.pages_free(self.full_layer).unwrap_or(0);
        let mut ranks = 1;
        if let Some(cp) = self.cp.as_mut() {
            // The fullest rank decides, so every rank decides the same.
            let mut v = [free as u64];
            te_ring::all_reduce_min(cp.comm(), "free kv pages", &mut v)
                .map_err(|e| ModelError::Request(format!("context parallelism: {e}")))?;
            free = v[0] as usize;
            ranks = cp.cp_size();
        }
        while self.running.len() < self.config.max_batch_size {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            // A rank's share of the prompt (one page more for the uneven
            // split), plus one page per running sequence.
            let share = seq.tokens.len().div_ceil(ranks);
            let need = share.div_ceil(ps) + usize::from(ranks > 1) + self.running.len();
            if need > free && !self.running.is_empty() {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            self.admissions += 1;
            seq.admitted = self.admissions;
            seq.started = false;
            self.running.push(seq);
        }
        self.start_sequences();
        Ok(())
    }

    /// Plans `steps` in the cache: `Ok(false)` when a pool lacks the pages
    /// (on any rank, with context parallelism: then no rank plans it).
    fn try_pre_step(&mut self, steps: &[(u64, usize)]) -> Result<bool> {
        let full = |r: std::result::Result<(), te_cache::CacheError>| match r {
            Ok(()) => Ok(true),
            Err(te_cache::CacheError::CacheFull { .. }) => Ok(false),
            Err(e) => Err(ModelError::from(e)),
        };
        let Some(cp) = self.cp.as_mut() else {
            return full(self.cache.pre_step(steps));
        };
        let placed = cp.place(steps);
        let local = cp.local_steps(&placed);
        let mut fits = [u64::from(full(self.cache.check_step_shard(&local))?)];
        te_ring::all_reduce_min(cp.comm(), "step fits", &mut fits)
            .map_err(|e| ModelError::Request(format!("context parallelism: {e}")))?;
        if fits[0] == 0 {
            return Ok(false);
        }
        self.cache.pre_step_shard(&local)?;
        cp.commit(placed);
        Ok(true)
    }

    /// Enters admitted sequences into the cache, taking shared prefix pages
    /// where they match. A sequence whose first page of tokens equals that
    /// of a sequence still computing its prompt waits a step, so that it
    /// shares the other's pages instead of computing them again (requests
    /// that arrive together with a common prefix).
    fn start_sequences(&mut self) {
        let ps = self.config.page_size;
        let sharing = self.prefix_caching();
        for i in 0..self.running.len() {
            if self.running[i].started {
                continue;
            }
            let seq = &self.running[i];
            if sharing && seq.tokens.len() > ps {
                let first = &seq.tokens[..ps];
                let busy = self.running.iter().any(|o| {
                    o.started
                        && o.fed < o.prompt_len
                        && o.tokens.len() > ps
                        && &o.tokens[..ps] == first
                });
                if busy {
                    continue;
                }
            }
            let hit = if sharing {
                self.cache
                    .attach_prefix(seq.id, &seq.tokens, seq.tokens.len() - 1)
                    .expect("an admitted sequence is not yet in the cache")
            } else {
                0
            };
            let seq = &mut self.running[i];
            seq.started = true;
            seq.fed = hit;
            if !seq.was_admitted {
                seq.cached_prompt_tokens = hit.min(seq.prompt_len);
                self.stats.prefix_hit_tokens += seq.cached_prompt_tokens;
                seq.was_admitted = true;
            }
        }
    }

    /// Releases `id` from the cache if it entered it.
    fn release(&mut self, id: RequestId) -> Result<()> {
        if self.cache.contains(id) {
            self.cache.release(id)?;
        }
        if let Some(cp) = self.cp.as_mut() {
            cp.release(id);
        }
        Ok(())
    }

    /// Tokens fed to each running sequence this step: one for decoders,
    /// then prompt chunks within the step's token budget.
    fn plan_feed(&self) -> Vec<usize> {
        let mut budget = self.config.max_step_tokens.max(self.running.len());
        let mut feed = vec![0usize; self.running.len()];
        for (f, s) in feed.iter_mut().zip(&self.running) {
            if s.started && s.tokens.len() - s.fed == 1 {
                *f = 1;
                budget -= 1;
            }
        }
        for (f, s) in feed.iter_mut().zip(&self.running) {
            let left = s.tokens.len() - s.fed;
            if s.started && left > 1 {
                *f = left.min(self.config.prefill_chunk).min(budget.max(1));
                budget = budget.saturating_sub(*f);
            }
        }
        feed
    }

    /// Frees the most recently admitted running sequence and puts it back at
    /// the front of the queue, to be recomputed.
    fn preempt_latest(&mut self) {
        let i = (0..self.running.len())
            .max_by_key(|&i| self.running[i].admitted)
            .expect("a running sequence");
        let mut seq = self.running.remove(i);
        self.release(seq.id)
            .expect("a running sequence is held by the cache");
        seq.fed = 0;
        seq.started = false;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// The `Finished` event of `seq`, releasing its held-back text.
    fn finish(&mut self, mut seq: Seq<'a>, reason: FinishReason) -> Event {
        let rest = if reason == FinishReason::Stop {
            String::new()
        } else {
            seq.text[seq.sent..].to_string()
        };
        seq.sent = seq.text.len();
        finished(&seq, reason, rest)
    }
}

impl Seq<'_> {
    /// Decodes `tok` into the text; returns the text that may be sent now
    /// and whether a stop string appeared (the text then ends before it).
    /// A token the tokenizer cannot decode (a model vocabulary padded past
    /// the tokenizer's) adds no text.
    fn push_text(&mut self, tok: u32) -> (String, bool) {
        let Some(decoder) = self.decoder.as_mut() else {
            return (String::new(), false);
        };
        if let Ok(Some(piece)) = decoder.step(tok) {
            self.text.push_str(&piece);
        }
        // Text already sent holds no stop string nor the start of one (that
        // would have been held back), so search the rest.
        let from = self.sent;
        if let Some(pos) = self
            .stop
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
            .min()
        {
            self.text.truncate(pos);
            let out = self.text[self.sent.min(pos)..].to_string();
            self.sent = self.text.len();
            return (out, true);
        }
        // Hold back the longest tail that is a prefix of a stop string.
        let mut hold = 0;
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if k <= hold {
                    break;
                }
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let end = (self.text.len() - hold).max(self.sent);
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
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

/// A command for [`Engine::run`], sent by an [`EngineHandle`].
pub enum Command {
    /// Add a request; its events go to `events`, the result of
    /// `add_request` to `reply`.
    Submit {
        request: Request,
        events: mpsc::Sender<Event>,
        reply: mpsc::Sender<std::result::Result<RequestId, RequestError>>,
    },
    /// Abort a request (unknown ids are ignored).
    Abort(RequestId),
    /// Send [`Engine::snapshot`] to the sender.
    Snapshot(mpsc::Sender<EngineSnapshot>),
}

/// The thread-safe side of [`Engine::run`]: cheap to clone, usable from
/// any thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
}

/// A handle and the receiver [`Engine::run`] takes.
pub fn channel() -> (EngineHandle, mpsc::Receiver<Command>) {
    let (tx, rx) = mpsc::channel();
    (EngineHandle { tx }, rx)
}

/// The engine loop has stopped (its thread ended or failed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine has stopped")]
pub struct EngineStopped;

impl EngineHandle {
    /// Submits `request`; blocks until the engine has validated it (at most
    /// one step). Returns its id and the receiver of its events, or the
    /// validation error.
    ///
    /// Errors: the outer error when the engine loop has stopped.
    #[allow(clippy::type_complexity)]
    pub fn submit(
        &self,
        request: Request,
    ) -> std::result::Result<
        std::result::Result<(RequestId, mpsc::Receiver<Event>), RequestError>,
        EngineStopped,
    > {
        let (events, rx) = mpsc::channel();
        let (reply, reply_rx) = mpsc::channel();
        self.tx
            .send(Command::Submit {
                request,
                events,
                reply,
            })
            .map_err(|_| EngineStopped)?;
        let result = reply_rx.recv().map_err(|_| EngineStopped)?;
        Ok(result.map(|id| (id, rx)))
    }

    /// The engine's [`EngineSnapshot`]; blocks until the engine takes the
    /// command (at most one step).
    ///
    /// Errors: the engine loop has stopped.
    pub fn snapshot(&self) -> std::result::Result<EngineSnapshot, EngineStopped> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Command::Snapshot(reply))
            .map_err(|_| EngineStopped)?;
        rx.recv().map_err(|_| EngineStopped)
    }

    /// Asks the engine to abort `id` at its next step.
    ///
    /// Errors: the engine loop has stopped.
    pub fn abort(&self, id: RequestId) -> std::result::Result<(), EngineStopped> {
        self.tx.send(Command::Abort(id)).map_err(|_| EngineStopped)
    }
}
