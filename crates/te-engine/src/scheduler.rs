//! The scheduler: which sequences run in the next step and how many of
//! their tokens, over a paged KV pool of fixed capacity. It owns the
//! waiting queue, the running batch and the KV cache's bookkeeping
//! (te-cache's `InferenceParams`), and knows nothing of models, sampling
//! or text: each sequence carries the caller's data `T` along.
//!
//! - **Admission** ([`Scheduler::admit`]): waiting sequences join, front
//!   first, while a batch slot is free and the pool has the pages of the
//!   sequence's tokens plus one page per running sequence (room for the
//!   decoders' next pages). An admitted sequence takes the registered
//!   pages its tokens begin with (prefix hits).
//! - **Chunking** ([`Scheduler::schedule`]): one token for each decoder,
//!   then prompt chunks of at most `prefill_chunk` tokens within the
//!   step's budget of `max_step_tokens`.
//! - **Preemption**: when the pool cannot take the step, the most recently
//!   admitted sequence is released and goes back to the front of the queue
//!   with every token it has, to be recomputed (vLLM's recompute
//!   preemption); a lone sequence that fills the pool alone is handed back
//!   to the caller ([`Schedule::PoolFull`]).
//! - **Context parallelism**: with a [`ContextParallel`] rank the fullest
//!   rank decides (minima over the ranks), so every rank schedules alike.
//! - **Drafts** (speculative decoding): a decoding sequence may carry
//!   drafted tokens ([`SeqState::draft`]); it is then fed its last token
//!   and the draft as one chunk (budget allowing), drafts are dropped
//!   before anyone is preempted for their pages, and
//!   [`Scheduler::advance`] rolls the cache back past the rejected ones.
//!
//! Every cache operation is transactional (a failed `pre_step` changes
//! nothing), so a refused step leaves the bookkeeping as it was.

use std::collections::VecDeque;

use crate::{EngineError, Result};
use te_cache::{InferenceParams, KvStorage};
use te_models::context_parallel::ContextParallel;

/// One sequence as the scheduler sees it, with the caller's `data`.
#[derive(Debug)]
pub struct SeqState<T> {
    /// The request's id (the cache's sequence id).
    pub id: u64,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens in the cache (0 while waiting).
    pub fed: usize,
    /// Prompt tokens served from shared pages at the first admission.
    pub cached_prompt_tokens: usize,
    /// The caller's state of this sequence (sampler, text, limits).
    pub data: T,
    /// Prefix-cache salt (see `Request::cache_salt`).
    pub cache_salt: Option<Vec<u8>>,
    /// Drafted tokens to verify after the last token (speculative
    /// decoding; set by the caller before [`Scheduler::schedule`], only on
    /// a [`decoding`](Self::decoding) sequence). The scheduler may shorten
    /// or drop it; [`Scheduler::advance`] clears it.
    pub draft: Vec<u32>,
    /// Admission order (preemption takes the latest).
    admitted: u64,
    /// Entered the cache since its (latest) admission.
    started: bool,
    /// Whether the first admission happened (prefix hits count once).
    was_admitted: bool,
}

impl<T> SeqState<T> {
    /// A new sequence of `prompt` tokens, not yet admitted.
    pub fn new(id: u64, prompt: Vec<u32>, data: T) -> Self {
        SeqState {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            fed: 0,
            cached_prompt_tokens: 0,
            data,
            cache_salt: None,
            draft: Vec::new(),
            admitted: 0,
            started: false,
            was_admitted: false,
        }
    }

    /// Whether this step's feed of `n` tokens reaches the sequence's last
    /// token (the step then picks its next token).
    pub fn completes_with(&self, n: usize) -> bool {
        n > 0 && self.fed + n >= self.tokens.len()
    }

    /// Whether the sequence is decoding: in the cache with every token but
    /// the last one fed (the next step feeds one token, or it and a draft).
    pub fn decoding(&self) -> bool {
        self.started && self.fed + 1 == self.tokens.len()
    }
}

/// The scheduler's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences running together at most.
    pub max_batch_size: usize,
    /// Longest prompt chunk fed for one sequence in one step.
    pub prefill_chunk: usize,
    /// Most tokens fed in one step, all sequences together (at least one
    /// token per running sequence is always fed).
    pub max_step_tokens: usize,
    /// Share the pages of common prompt prefixes (where the cache allows).
    pub prefix_caching: bool,
}

/// What the next step runs.
#[derive(Debug)]
pub enum Schedule<T> {
    /// Nothing runs.
    Idle,
    /// `feed[i]` tokens of running sequence `i` (0: it waits this step);
    /// the cache has planned the step.
    Step { feed: Vec<usize> },
    /// The only running sequence does not fit the whole pool: it was
    /// released and leaves.
    PoolFull(SeqState<T>),
}

/// Counters of the scheduler's decisions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Sequences preempted (freed and queued for recompute).
    pub preemptions: usize,
    /// Prompt tokens served from shared pages (first admissions).
    pub prefix_hit_tokens: usize,
}

/// Admission, chunking, preemption and prefix hits over one KV cache.
pub struct Scheduler<S: KvStorage, T> {
    config: SchedulerConfig,
    cache: InferenceParams<S>,
    /// This rank of a context-parallel group.
    cp: Option<ContextParallel>,
    /// A layer of the full-attention pool (its pages are the capacity).
    full_layer: usize,
    /// Tokens per page of that pool.
    page_size: usize,
    kv_capacity_tokens: usize,
    waiting: VecDeque<SeqState<T>>,
    running: Vec<SeqState<T>>,
    admissions: u64,
    stats: SchedulerStats,
}

impl<S: KvStorage, T> Scheduler<S, T> {
    /// A scheduler over `cache` (a paged cache: its full-attention pool's
    /// pages are the capacity).
    ///
    /// Errors: a config value of 0; a cache without pages.
    pub fn new(cache: InferenceParams<S>, config: SchedulerConfig) -> Result<Self> {
        for (name, v) in [
            ("max_batch_size", config.max_batch_size),
            ("prefill_chunk", config.prefill_chunk),
            ("max_step_tokens", config.max_step_tokens),
        ] {
            if v == 0 {
                return Err(EngineError::Setting {
                    setting: name,
                    reason: "must be at least 1".into(),
                });
            }
        }
        let full_layer = (0..cache.num_layers())
            .find(|&l| cache.ring_len(l).is_none())
            .unwrap_or(0);
        let page_size = cache.page_size(full_layer)?;
        let kv_capacity_tokens =
            (cache.pages_in_use(full_layer)? + cache.pages_free(full_layer)?) * page_size;
        Ok(Scheduler {
            config,
            cache,
            cp: None,
            full_layer,
            page_size,
            kv_capacity_tokens,
            waiting: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// Makes this scheduler rank `cp.cp_rank()` of a context-parallel group
    /// (prefix sharing then stays off).
    pub fn set_context_parallel(&mut self, cp: ContextParallel) {
        self.config.prefix_caching = false;
        self.cp = Some(cp);
    }

    /// The context-parallel rank, if any.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }

    /// The context-parallel rank, if any, mutably.
    pub fn context_parallel_mut(&mut self) -> Option<&mut ContextParallel> {
        self.cp.as_mut()
    }

    /// The cache and the context-parallel rank, for the step's forward.
    pub fn cache_and_rank(&mut self) -> (&mut InferenceParams<S>, Option<&mut ContextParallel>) {
        (&mut self.cache, self.cp.as_mut())
    }

    /// The KV cache (its bookkeeping: pages in use, cached, free).
    pub fn cache(&self) -> &InferenceParams<S> {
        &self.cache
    }

    /// Whether prompts share prefix pages.
    pub fn prefix_caching(&self) -> bool {
        self.config.prefix_caching && self.cache.prefix_sharing()
    }

    /// KV capacity in tokens (whole pages of the full-attention pool).
    pub fn kv_capacity_tokens(&self) -> usize {
        self.kv_capacity_tokens
    }

    /// KV tokens held now (pages in use times page size).
    pub fn kv_tokens_in_use(&self) -> usize {
        self.cache.pages_in_use(self.full_layer).unwrap_or(0) * self.page_size
    }

    /// Pages of the full-attention pool: in use, and in use plus free.
    pub fn kv_pages(&self) -> (usize, usize) {
        let l = self.full_layer;
        let in_use = self.cache.pages_in_use(l).unwrap_or(0);
        (in_use, in_use + self.cache.pages_free(l).unwrap_or(0))
    }

    /// Counters so far.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// The running sequences, in batch order.
    pub fn running(&self) -> &[SeqState<T>] {
        &self.running
    }

    /// The running sequences, mutably (their `data` and generated tokens;
    /// the scheduler's own fields stay private).
    pub fn running_mut(&mut self) -> &mut [SeqState<T>] {
        &mut self.running
    }

    /// Sequences waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any sequence is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a new sequence at the back.
    pub fn enqueue(&mut self, seq: SeqState<T>) {
        self.waiting.push_back(seq);
    }

    /// Removes sequence `id`, waiting or running (its pages freed at once).
    /// `None` when the scheduler does not hold it.
    ///
    /// Errors: the cache refused the release (an internal invariant).
    pub fn abort(&mut self, id: u64) -> Result<Option<SeqState<T>>> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            return self.finish(i).map(Some);
        }
        Ok(self
            .waiting
            .iter()
            .position(|s| s.id == id)
            .and_then(|i| self.waiting.remove(i)))
    }

    /// Removes running sequence `i` (it finished), freeing its pages.
    ///
    /// Errors: the cache refused the release (an internal invariant).
    pub fn finish(&mut self, i: usize) -> Result<SeqState<T>> {
        let seq = self.running.remove(i);
        self.release(seq.id)?;
        Ok(seq)
    }

    /// Admits waiting sequences (front first) while a batch slot is free
    /// and the pool has the pages of the sequence's tokens plus one page
    /// per running sequence; then starts the admitted sequences in the
    /// cache, taking shared prefix pages where they match.
    ///
    /// Errors: a failed rank of a context-parallel group.
    pub fn admit(&mut self) -> Result<()> {
        if self.waiting.is_empty() {
            self.start_sequences();
            return Ok(());
        }
        let ps = self.page_size;
        let mut free = self.cache.pages_free(self.full_layer).unwrap_or(0);
        let mut ranks = 1;
        if let Some(cp) = self.cp.as_mut() {
            // The fullest rank decides, so every rank decides the same.
            let mut v = [free as u64];
            te_ring::all_reduce_min(cp.comm(), "free kv pages", &mut v)?;
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

    /// Plans the next step in the cache: the feed of every running
    /// sequence, preempting the latest admitted while the pool cannot take
    /// it.
    ///
    /// Errors: a cache error other than a full pool; a failed rank.
    pub fn schedule(&mut self) -> Result<Schedule<T>> {
        loop {
            let feed = self.plan_feed();
            let steps: Vec<(u64, usize)> = self
                .running
                .iter()
                .zip(&feed)
                .filter(|(_, &n)| n > 0)
                .map(|(s, &n)| (s.id, n))
                .collect();
            if steps.is_empty() {
                return Ok(Schedule::Idle);
            }
            if self.try_pre_step(&steps)? {
                // Drafts the budget cut short are shortened to their feed.
                for (s, &n) in self.running.iter_mut().zip(&feed) {
                    if !s.draft.is_empty() {
                        s.draft.truncate(n.saturating_sub(1));
                    }
                }
                return Ok(Schedule::Step { feed });
            }
            if self.running.iter().any(|s| !s.draft.is_empty()) {
                // Drafts give way before anyone is preempted.
                for s in &mut self.running {
                    s.draft.clear();
                }
                continue;
            }
            if self.running.len() > 1 {
                self.preempt_latest();
            } else {
                // A lone sequence fills the whole pool.
                let seq = self.running.pop().expect("one running");
                self.release(seq.id)?;
                return Ok(Schedule::PoolFull(seq));
            }
        }
    }

    /// The tokens of a scheduled step in thd order (`feed` from
    /// [`Schedule::Step`]: a sequence's own unfed tokens, then its draft),
    /// and whether any sequence is still in its prompt.
    pub fn step_tokens(&self, feed: &[usize]) -> (Vec<u32>, bool) {
        let mut tokens = Vec::new();
        let mut prefill = false;
        for (s, &n) in self.running.iter().zip(feed) {
            let own = n.min(s.tokens.len() - s.fed);
            tokens.extend_from_slice(&s.tokens[s.fed..s.fed + own]);
            tokens.extend_from_slice(&s.draft[..n - own]);
            prefill |= n > 0 && s.tokens.len() - s.fed > 1;
        }
        (tokens, prefill)
    }

    /// Records that the step of `feed` ran: each fed sequence's cached
    /// length grows by its feed less its `rejected[i]` drafted tokens,
    /// which are rolled back out of the cache (the caller has appended the
    /// accepted ones to its tokens), drafts are cleared, and full pages of
    /// tokens are registered for prefix reuse.
    ///
    /// Errors: the cache refused a rollback or a registration (an internal
    /// invariant).
    pub fn advance(&mut self, feed: &[usize], rejected: &[usize]) -> Result<()> {
        let sharing = self.config.prefix_caching;
        for ((seq, &n), &r) in self.running.iter_mut().zip(feed).zip(rejected) {
            seq.draft.clear();
            if n == 0 {
                continue;
            }
            seq.fed += n - r;
            if r > 0 {
                self.cache.truncate(seq.id, seq.fed)?;
            }
            if sharing {
                self.cache.register_prefix(seq.id, &seq.tokens[..seq.fed])?;
            }
        }
        Ok(())
    }

    /// Preempts every running sequence (a failed step: all of them are
    /// recomputed later).
    pub fn preempt_all(&mut self) {
        while !self.running.is_empty() {
            self.preempt_latest();
        }
    }

    /// Plans `steps` in the cache: `Ok(false)` when a pool lacks the pages
    /// (on any rank, with context parallelism: then no rank plans it).
    fn try_pre_step(&mut self, steps: &[(u64, usize)]) -> Result<bool> {
        let full = |r: std::result::Result<(), te_cache::CacheError>| match r {
            Ok(()) => Ok(true),
            Err(te_cache::CacheError::CacheFull { .. }) => Ok(false),
            Err(e) => Err(EngineError::from(e)),
        };
        let Some(cp) = self.cp.as_mut() else {
            return full(self.cache.pre_step(steps));
        };
        let placed = cp.place(steps);
        let local = cp.local_steps(&placed);
        let mut fits = [u64::from(full(self.cache.check_step_shard(&local))?)];
        te_ring::all_reduce_min(cp.comm(), "step fits", &mut fits)?;
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
        let ps = self.page_size;
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
                    .attach_salted_prefix(
                        seq.id,
                        &seq.tokens,
                        seq.tokens.len() - 1,
                        seq.cache_salt.as_deref(),
                    )
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
    fn release(&mut self, id: u64) -> Result<()> {
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
            if s.decoding() {
                *f = 1;
                budget -= 1;
            }
        }
        // Drafts, within what is left (at most a prompt chunk per step).
        for (f, s) in feed.iter_mut().zip(&self.running) {
            if *f == 1 && !s.draft.is_empty() {
                let extra = s.draft.len().min(budget).min(self.config.prefill_chunk - 1);
                *f += extra;
                budget -= extra;
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
        seq.draft.clear();
        seq.started = false;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }
}
