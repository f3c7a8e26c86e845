//! `InferenceParams`: sequence bookkeeping and KV storage for continuous
//! batching (TransformerEngine's `pre_step` then per-layer `step`).

use std::collections::{BTreeMap, HashSet};

use te_kernels::{save_kv_cpu, DType, Element, KvCacheLayout, KvCacheView, KvStep, QkvFormat};

use crate::error::CacheError;
use crate::pool::PagePool;
use crate::storage::Storage;

/// How a layer's keys and values are laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// One slot of `max_seqlen` rows per sequence:
    /// `[max_batch_size, max_seqlen, h_kv, d]` per layer (TransformerEngine's
    /// non-paged cache). The view has `page_size = max_seqlen` and
    /// `page_table[b]` = the batch slot of sequence `b`.
    Contiguous,
    /// A pool of `total_num_pages` pages of `page_size` rows per layer:
    /// `[total_num_pages, page_size, h_kv, d]`; pages are allocated as
    /// sequences grow and returned by [`InferenceParams::release`].
    Paged {
        page_size: usize,
        total_num_pages: usize,
    },
}

/// A sliding-window override of one layer (see
/// [`InferenceParams::set_sliding_window`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Keys a query sees, itself included (Hugging Face `sliding_window`;
    /// attention window `(window - 1, 0)`).
    pub window: usize,
    /// Longest step (tokens of one sequence in one `pre_step`) the ring holds.
    pub max_step_len: usize,
}

/// One live sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sequence {
    /// Tokens seen so far (this step's included once `pre_step` ran).
    cached: usize,
    /// Physical pages per pool, in logical order.
    pages: Vec<Vec<i32>>,
}

/// The metadata of the step planned by the last `pre_step`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StepPlan {
    seq_ids: Vec<u64>,
    /// `[b + 1]`: cumulative step lengths.
    cu_seqlens_q: Vec<i32>,
    /// `[b + 1]`: cumulative `cache_seqlens`.
    cu_seqlens_kv: Vec<i32>,
    /// `[b]`: tokens cached before this step.
    start_positions: Vec<i32>,
    /// `[b]`: tokens cached after this step.
    cache_seqlens: Vec<i32>,
    max_seqlen_q: usize,
    max_seqlen_kv: usize,
    /// Per pool: `[b, max_pages_per_seq]`, unused entries 0.
    page_tables: Vec<Vec<i32>>,
}

/// The KV cache of a model for many sequences generated together
/// (continuous batching), modeled on TransformerEngine's `InferenceParams`.
///
/// Use per generation step:
/// 1. [`pre_step`](Self::pre_step) with `(seq_id, step_len)` for every
///    sequence that runs this step, in batch order: a new id joins with its
///    first chunk, a known id continues (prefill chunk, one-token decode or
///    several tokens). It computes `cu_seqlens_q`, `cu_seqlens_kv`,
///    `start_positions` and the page tables once for all layers.
/// 2. Per layer, [`step`](Self::step) with this step's keys and values: it
///    saves them and returns the [`KvCacheView`] attention reads (keys at
///    positions `0..cache_seqlens[b]`, or the last `ring_len` of them on a
///    sliding-window layer). Read the step metadata afterwards through
///    [`view`](Self::view) and the accessors (the view borrows `self`).
/// 3. [`release`](Self::release) a finished sequence to free its pages.
///
/// Storage per layer: contiguous `[max_batch_size, max_seqlen, h_kv, d]`;
/// paged `[total_num_pages, page_size, h_kv, d]`; sliding-window layers a
/// ring of `ring_len` rows per sequence (see
/// [`set_sliding_window`](Self::set_sliding_window)). The cache holds at
/// most `max_batch_size` sequences at a time.
///
/// Every error leaves the cache exactly as it was.
#[derive(Clone, PartialEq)]
pub struct InferenceParams {
    max_batch_size: usize,
    max_seqlen: usize,
    num_heads_kv: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    dtype: DType,
    layout: CacheLayout,
    /// `[num_layers]` sliding-window overrides.
    windows: Vec<Option<SlidingWindow>>,
    /// `[num_layers]` index into `pools`.
    layer_pool: Vec<usize>,
    /// One pool per distinct page geometry used by some layer.
    pools: Vec<PagePool>,
    sequences: BTreeMap<u64, Sequence>,
    plan: Option<StepPlan>,
    /// `[num_layers]`, each `[num_pages, page_size, h_kv, d_k]`.
    k_cache: Vec<Storage>,
    /// `[num_layers]`, each `[num_pages, page_size, h_kv, d_v]`.
    v_cache: Vec<Storage>,
}

impl std::fmt::Debug for InferenceParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InferenceParams")
            .field("max_batch_size", &self.max_batch_size)
            .field("max_seqlen", &self.max_seqlen)
            .field("num_layers", &self.windows.len())
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .field("windows", &self.windows)
            .field("sequences", &self.sequences.len())
            .finish_non_exhaustive()
    }
}

fn invalid(arg: &'static str, reason: impl Into<String>) -> CacheError {
    CacheError::InvalidArgument {
        arg,
        reason: reason.into(),
    }
}

impl InferenceParams {
    /// An empty cache of `num_layers` full-attention layers; all storage is
    /// allocated here (zeros).
    ///
    /// Errors: any size 0, a paged `page_size` or `total_num_pages` of 0,
    /// `max_batch_size * max_seqlen` or `total_num_pages` above `i32::MAX`
    /// (cu_seqlens and page ids are i32), storage size overflowing usize.
    pub fn new(
        max_batch_size: usize,
        max_seqlen: usize,
        num_layers: usize,
        num_heads_kv: usize,
        head_dim_k: usize,
        head_dim_v: usize,
        dtype: DType,
        layout: CacheLayout,
    ) -> Result<Self, CacheError> {
        for (arg, value) in [
            ("max_batch_size", max_batch_size),
            ("max_seqlen", max_seqlen),
            ("num_layers", num_layers),
            ("num_heads_kv", num_heads_kv),
            ("head_dim_k", head_dim_k),
            ("head_dim_v", head_dim_v),
        ] {
            if value == 0 {
                return Err(invalid(arg, "must be at least 1"));
            }
        }
        if max_batch_size
            .checked_mul(max_seqlen)
            .is_none_or(|t| t > i32::MAX as usize)
        {
            return Err(invalid(
                "max_seqlen",
                format!("max_batch_size * max_seqlen = {max_batch_size} * {max_seqlen} exceeds i32::MAX"),
            ));
        }
        if let CacheLayout::Paged {
            page_size,
            total_num_pages,
        } = layout
        {
            if page_size == 0 {
                return Err(invalid("page_size", "must be at least 1"));
            }
            if total_num_pages == 0 || total_num_pages > i32::MAX as usize {
                return Err(invalid(
                    "total_num_pages",
                    format!("{total_num_pages} is not in 1..=i32::MAX"),
                ));
            }
        }
        let mut params = Self {
            max_batch_size,
            max_seqlen,
            num_heads_kv,
            head_dim_k,
            head_dim_v,
            dtype,
            layout,
            windows: vec![None; num_layers],
            layer_pool: Vec::new(),
            pools: Vec::new(),
            sequences: BTreeMap::new(),
            plan: None,
            k_cache: Vec::new(),
            v_cache: Vec::new(),
        };
        params.rebuild_pools();
        let pool = params.pools[0].clone();
        let (k_len, v_len) = params.storage_lens(&pool)?;
        params.k_cache = vec![Storage::zeros(dtype, k_len); num_layers];
        params.v_cache = vec![Storage::zeros(dtype, v_len); num_layers];
        Ok(params)
    }

    /// Makes `layer` a sliding-window layer: it keeps only a ring of the
    /// last `ring_len` positions of each sequence, enough for attention with
    /// window `window` (keys per query, itself included) at steps of up to
    /// `max_step_len` tokens:
    /// `ring_len = round_up(window - 1 + max_step_len, page_size)`
    /// (contiguous: no rounding). A step's first query needs the `window - 1`
    /// keys before it and all the step's keys are saved before attention
    /// runs, hence `window - 1 + step_len` positions.
    ///
    /// Memory of such a layer: `max_batch_size * ring_len` rows (contiguous
    /// and paged alike: the ring's pages, at most `ring_len / page_size` per
    /// sequence, come from a pool of its own and are reused as the ring
    /// turns). Gemma 3 (5 of 6 layers sliding, window 512) at
    /// `max_seqlen = 32768` with `max_step_len = 512` and 16-token pages:
    /// rings of 1024 rows, so the cache costs
    /// `(5 * 1024 + 32768) / (6 * 32768) = 0.19` of a full one (the limit is
    /// 1/6, the global layers). If the ring would be as long as a full layer,
    /// the layer keeps full storage and no step limit applies.
    ///
    /// Then `pre_step` refuses steps longer than `max_step_len`.
    /// Errors: the cache holds sequences, `layer` out of range, `window` or
    /// `max_step_len` 0.
    pub fn set_sliding_window(
        &mut self,
        layer: usize,
        window: usize,
        max_step_len: usize,
    ) -> Result<(), CacheError> {
        self.check_layer(layer)?;
        if !self.sequences.is_empty() {
            return Err(CacheError::NotEmpty {
                op: "set_sliding_window",
                live: self.sequences.len(),
            });
        }
        if window == 0 {
            return Err(invalid("window", "must be at least 1"));
        }
        if max_step_len == 0 {
            return Err(invalid("max_step_len", "must be at least 1"));
        }
        let mut next = self.clone_config();
        next.windows[layer] = Some(SlidingWindow {
            window,
            max_step_len,
        });
        next.rebuild_pools();
        let pool = next.pools[next.layer_pool[layer]].clone();
        let (k_len, v_len) = next.storage_lens(&pool)?;
        // Validated: commit.
        self.windows = next.windows;
        self.layer_pool = next.layer_pool;
        self.pools = next.pools;
        self.plan = None;
        self.k_cache[layer] = Storage::zeros(self.dtype, k_len);
        self.v_cache[layer] = Storage::zeros(self.dtype, v_len);
        Ok(())
    }

    /// Plans the next step: `steps[b] = (seq_id, step_len)` in batch order.
    /// An unknown `seq_id` joins the cache (its first chunk starts at
    /// position 0); a known one continues where it stopped. Sequences not
    /// named keep their cache and simply do not run this step.
    ///
    /// Afterwards `cu_seqlens_q = [0, cumsum(step_len)]`,
    /// `start_positions[b]` = tokens cached before the step,
    /// `cache_seqlens[b] = start_positions[b] + step_len[b]`,
    /// `cu_seqlens_kv = [0, cumsum(cache_seqlens)]`, and pages covering the
    /// new positions are allocated. Example: a new sequence of 3 tokens and
    /// a sequence with 5 cached decoding 1 give `cu_seqlens_q = [0, 3, 4]`,
    /// `start_positions = [0, 5]`, `cu_seqlens_kv = [0, 3, 9]`.
    ///
    /// Errors (nothing changes): more than `max_batch_size` entries, a
    /// repeated `seq_id`, `step_len` 0, a sequence growing past
    /// `max_seqlen`, a step longer than a sliding layer's `max_step_len`,
    /// more than `max_batch_size` sequences held, a pool without enough free
    /// pages (`CacheFull` with pages needed and free).
    pub fn pre_step(&mut self, steps: &[(u64, usize)]) -> Result<(), CacheError> {
        if steps.len() > self.max_batch_size {
            return Err(CacheError::BatchTooLarge {
                batch: steps.len(),
                max_batch_size: self.max_batch_size,
            });
        }
        let mut seen = HashSet::with_capacity(steps.len());
        let mut live = self.sequences.len();
        for &(seq_id, step_len) in steps {
            if !seen.insert(seq_id) {
                return Err(CacheError::DuplicateSequence { seq_id });
            }
            if step_len == 0 {
                return Err(CacheError::EmptyStep { seq_id });
            }
            let cached = self.cached_tokens(seq_id);
            if step_len > self.max_seqlen - cached {
                return Err(CacheError::ExceedsMaxSeqlen {
                    seq_id,
                    cached,
                    step_len,
                    max_seqlen: self.max_seqlen,
                });
            }
            for (layer, window) in self.windows.iter().enumerate() {
                let ringed = self.pools[self.layer_pool[layer]].ring_len.is_some();
                if let (Some(w), true) = (window, ringed) {
                    if step_len > w.max_step_len {
                        return Err(CacheError::StepExceedsWindowRing {
                            seq_id,
                            step_len,
                            layer,
                            max_step_len: w.max_step_len,
                        });
                    }
                }
            }
            if !self.sequences.contains_key(&seq_id) {
                if live == self.max_batch_size {
                    return Err(CacheError::TooManySequences {
                        seq_id,
                        live,
                        max_batch_size: self.max_batch_size,
                    });
                }
                live += 1;
            }
        }
        for (p, pool) in self.pools.iter().enumerate() {
            let pages_needed: usize = steps
                .iter()
                .map(|&(seq_id, step_len)| {
                    let held = self.sequences.get(&seq_id).map_or(0, |s| s.pages[p].len());
                    pool.pages_for(self.cached_tokens(seq_id) + step_len) - held
                })
                .sum();
            if pages_needed > pool.pages_free() {
                return Err(CacheError::CacheFull {
                    layer: self.layer_pool.iter().position(|&q| q == p).unwrap_or(0),
                    page_size: pool.page_size,
                    pages_needed,
                    pages_free: pool.pages_free(),
                });
            }
        }

        // Validated: commit.
        let batch = steps.len();
        let mut plan = StepPlan {
            seq_ids: Vec::with_capacity(batch),
            cu_seqlens_q: vec![0],
            cu_seqlens_kv: vec![0],
            start_positions: Vec::with_capacity(batch),
            cache_seqlens: Vec::with_capacity(batch),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            page_tables: self
                .pools
                .iter()
                .map(|pool| vec![0; batch * pool.max_pages_per_seq])
                .collect(),
        };
        let num_pools = self.pools.len();
        for (b, &(seq_id, step_len)) in steps.iter().enumerate() {
            let seq = self.sequences.entry(seq_id).or_insert_with(|| Sequence {
                cached: 0,
                pages: vec![Vec::new(); num_pools],
            });
            let start = seq.cached;
            seq.cached += step_len;
            for (p, pool) in self.pools.iter_mut().enumerate() {
                pool.grow(&mut seq.pages[p], pool.pages_for(seq.cached));
                let row = &mut plan.page_tables[p][b * pool.max_pages_per_seq..];
                row[..seq.pages[p].len()].copy_from_slice(&seq.pages[p]);
            }
            plan.seq_ids.push(seq_id);
            plan.cu_seqlens_q
                .push(plan.cu_seqlens_q[b] + step_len as i32);
            plan.cu_seqlens_kv
                .push(plan.cu_seqlens_kv[b] + seq.cached as i32);
            plan.start_positions.push(start as i32);
            plan.cache_seqlens.push(seq.cached as i32);
            plan.max_seqlen_q = plan.max_seqlen_q.max(step_len);
            plan.max_seqlen_kv = plan.max_seqlen_kv.max(seq.cached);
        }
        self.plan = Some(plan);
        Ok(())
    }

    /// Saves this step's keys and values of `layer` and returns the view
    /// attention reads.
    ///
    /// `k: [.., h_kv, d_k]`, `v: [.., h_kv, d_v]` in `qkv_format`:
    /// thd `[t, h, d]` with `t = cu_seqlens_q[b]`; bshd `[b, max_seqlen_q, h, d]`;
    /// sbhd `[max_seqlen_q, b, h, d]` (padding rows are ignored). Token `i`
    /// of sequence `b` is stored at position `start_positions[b] + i`.
    ///
    /// Saving is te-kernels' [`save_kv_cpu`].
    ///
    /// Errors (nothing written): no step planned, `layer` out of range, `T`
    /// not the cache dtype, `k` or `v` of the wrong length.
    pub fn step<T: Element>(
        &mut self,
        layer: usize,
        k: &[T],
        v: &[T],
        qkv_format: QkvFormat,
    ) -> Result<KvCacheView<'_, T>, CacheError> {
        self.check_layer(layer)?;
        self.check_dtype::<T>("k")?;
        let plan = self.plan.as_ref().ok_or(CacheError::NoStep)?;
        let batch = plan.seq_ids.len();
        let s = plan.max_seqlen_q;
        let t = plan.cu_seqlens_q[batch] as usize;
        let h = self.num_heads_kv;
        for (arg, tensor, d) in [("k", k, self.head_dim_k), ("v", v, self.head_dim_v)] {
            let expected = match qkv_format {
                QkvFormat::Thd => vec![t, h, d],
                QkvFormat::Bshd => vec![batch, s, h, d],
                QkvFormat::Sbhd => vec![s, batch, h, d],
            };
            if tensor.len() != expected.iter().product::<usize>() {
                return Err(CacheError::ShapeMismatch {
                    arg,
                    expected,
                    got: tensor.len(),
                });
            }
        }
        let pool = &self.pools[self.layer_pool[layer]];
        let layout = layout_of(
            pool,
            plan,
            self.layer_pool[layer],
            h,
            self.head_dim_k,
            self.head_dim_v,
        );
        let (k_cache, v_cache) = (&mut self.k_cache[layer], &mut self.v_cache[layer]);
        let (Some(k_cache), Some(v_cache)) = (k_cache.as_mut_slice(), v_cache.as_mut_slice())
        else {
            unreachable!("dtype checked above");
        };
        let kv_step = KvStep {
            format: qkv_format,
            cu_seqlens: &plan.cu_seqlens_q,
            max_seqlen: s,
        };
        save_kv_cpu(k, v, k_cache, v_cache, &layout, &kv_step)?;
        self.view(layer)
    }

    /// The view of `layer` for the planned step, without saving anything
    /// (what [`step`](Self::step) returns).
    ///
    /// `k_cache: [num_pages, page_size, h_kv, d_k]`, `v_cache: [.., d_v]`,
    /// `layout.page_table: [b, max_pages_per_seq]`, `layout.cache_seqlens:
    /// [b]`, `layout.ring_len` set on sliding-window layers.
    /// Errors: no step planned, `layer` out of range, `T` not the cache dtype.
    pub fn view<T: Element>(&self, layer: usize) -> Result<KvCacheView<'_, T>, CacheError> {
        self.check_layer(layer)?;
        self.check_dtype::<T>("T")?;
        let plan = self.plan.as_ref().ok_or(CacheError::NoStep)?;
        let p = self.layer_pool[layer];
        let layout = layout_of(
            &self.pools[p],
            plan,
            p,
            self.num_heads_kv,
            self.head_dim_k,
            self.head_dim_v,
        );
        match (
            self.k_cache[layer].as_slice(),
            self.v_cache[layer].as_slice(),
        ) {
            (Some(k_cache), Some(v_cache)) => Ok(KvCacheView {
                k_cache,
                v_cache,
                layout,
            }),
            _ => unreachable!("dtype checked above"),
        }
    }

    /// Ends sequence `seq_id` and returns its pages. If it is part of the
    /// planned step, the plan is dropped (call `pre_step` again).
    /// Errors: unknown `seq_id`.
    pub fn release(&mut self, seq_id: u64) -> Result<(), CacheError> {
        let seq = self
            .sequences
            .remove(&seq_id)
            .ok_or(CacheError::UnknownSequence { seq_id })?;
        for (pool, pages) in self.pools.iter_mut().zip(&seq.pages) {
            pool.give_back(pages);
        }
        if self
            .plan
            .as_ref()
            .is_some_and(|p| p.seq_ids.contains(&seq_id))
        {
            self.plan = None;
        }
        Ok(())
    }

    /// Starts sequence `dst` as a copy of `src` (shared prompt for parallel
    /// sampling or beam search): `dst` gets pages of its own holding the same
    /// keys and values and the same `cached_tokens`. The copy is of what is
    /// stored now, so fork between steps (after every layer's `step`).
    ///
    /// Errors (nothing changes): unknown `src`, `dst` already held, the cache
    /// already holding `max_batch_size` sequences, a pool without enough
    /// free pages.
    pub fn fork(&mut self, src: u64, dst: u64) -> Result<(), CacheError> {
        let source = self
            .sequences
            .get(&src)
            .ok_or(CacheError::UnknownSequence { seq_id: src })?;
        if self.sequences.contains_key(&dst) {
            return Err(CacheError::DuplicateSequence { seq_id: dst });
        }
        if self.sequences.len() == self.max_batch_size {
            return Err(CacheError::TooManySequences {
                seq_id: dst,
                live: self.sequences.len(),
                max_batch_size: self.max_batch_size,
            });
        }
        for (p, pool) in self.pools.iter().enumerate() {
            if source.pages[p].len() > pool.pages_free() {
                return Err(CacheError::CacheFull {
                    layer: self.layer_pool.iter().position(|&q| q == p).unwrap_or(0),
                    page_size: pool.page_size,
                    pages_needed: source.pages[p].len(),
                    pages_free: pool.pages_free(),
                });
            }
        }

        // Validated: commit.
        let mut copy = Sequence {
            cached: source.cached,
            pages: Vec::with_capacity(self.pools.len()),
        };
        for (pool, src_pages) in self.pools.iter_mut().zip(&source.pages) {
            let mut pages = Vec::new();
            pool.grow(&mut pages, src_pages.len());
            copy.pages.push(pages);
        }
        let (row_k, row_v) = (
            self.num_heads_kv * self.head_dim_k,
            self.num_heads_kv * self.head_dim_v,
        );
        for (layer, &p) in self.layer_pool.iter().enumerate() {
            let ps = self.pools[p].page_size;
            for (&from, &to) in source.pages[p].iter().zip(&copy.pages[p]) {
                let (from, to) = (from as usize * ps, to as usize * ps);
                self.k_cache[layer].copy_rows(from, to, ps, row_k);
                self.v_cache[layer].copy_rows(from, to, ps, row_v);
            }
        }
        self.sequences.insert(dst, copy);
        Ok(())
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Memory layout chosen at construction.
    pub fn layout(&self) -> CacheLayout {
        self.layout
    }

    /// Most sequences held (and run per step).
    pub fn max_batch_size(&self) -> usize {
        self.max_batch_size
    }

    /// Most tokens per sequence.
    pub fn max_seqlen(&self) -> usize {
        self.max_seqlen
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.windows.len()
    }

    /// The sliding-window override of `layer`, if any (`None` also for an
    /// out-of-range layer).
    pub fn sliding_window(&self, layer: usize) -> Option<SlidingWindow> {
        self.windows.get(layer).copied().flatten()
    }

    /// Rows kept per sequence on `layer` when it is a ring (sliding window
    /// shorter than a full layer), else `None`.
    pub fn ring_len(&self, layer: usize) -> Option<usize> {
        self.layer_pool
            .get(layer)
            .and_then(|&p| self.pools[p].ring_len)
    }

    /// Whether the cache holds `seq_id`.
    pub fn contains(&self, seq_id: u64) -> bool {
        self.sequences.contains_key(&seq_id)
    }

    /// Ids of the sequences held, ascending.
    pub fn sequence_ids(&self) -> Vec<u64> {
        self.sequences.keys().copied().collect()
    }

    /// Tokens seen by sequence `seq_id` (0 for an unknown id), this step's
    /// included once `pre_step` ran.
    pub fn cached_tokens(&self, seq_id: u64) -> usize {
        self.sequences.get(&seq_id).map_or(0, |s| s.cached)
    }

    /// Sum of [`cached_tokens`](Self::cached_tokens) over held sequences.
    pub fn tokens_cached(&self) -> usize {
        self.sequences.values().map(|s| s.cached).sum()
    }

    /// Pages of `layer`'s pool in use: `sum over sequences of
    /// min(ceil(cached / page_size), ring_len / page_size)` (contiguous: one
    /// slot per sequence). Layers of the same geometry share a pool.
    /// Errors: `layer` out of range.
    pub fn pages_in_use(&self, layer: usize) -> Result<usize, CacheError> {
        self.check_layer(layer)?;
        Ok(self.pools[self.layer_pool[layer]].pages_in_use())
    }

    /// Free pages of `layer`'s pool. Errors: `layer` out of range.
    pub fn pages_free(&self, layer: usize) -> Result<usize, CacheError> {
        self.check_layer(layer)?;
        Ok(self.pools[self.layer_pool[layer]].pages_free())
    }

    /// Rows per page of `layer` (contiguous: `max_seqlen`, or `ring_len` on
    /// a ring layer). Errors: `layer` out of range.
    pub fn page_size(&self, layer: usize) -> Result<usize, CacheError> {
        self.check_layer(layer)?;
        Ok(self.pools[self.layer_pool[layer]].page_size)
    }

    /// Bytes of K and V storage in pages in use, over all layers.
    pub fn memory_in_use(&self) -> usize {
        let row_bytes =
            self.num_heads_kv * (self.head_dim_k + self.head_dim_v) * self.dtype.size_in_bytes();
        self.layer_pool
            .iter()
            .map(|&p| self.pools[p].pages_in_use() * self.pools[p].page_size * row_bytes)
            .sum()
    }

    /// Bytes of K and V storage allocated, over all layers.
    pub fn memory_allocated(&self) -> usize {
        let elems: usize = self
            .k_cache
            .iter()
            .chain(&self.v_cache)
            .map(Storage::len)
            .sum();
        elems * self.dtype.size_in_bytes()
    }

    /// Sequences `b` in the planned step (0 if none).
    pub fn batch_size(&self) -> usize {
        self.plan.as_ref().map_or(0, |p| p.seq_ids.len())
    }

    /// `[b]` sequence ids of the planned step, in batch order.
    pub fn seq_ids(&self) -> &[u64] {
        self.plan.as_ref().map_or(&[], |p| &p.seq_ids)
    }

    /// `[b]` step lengths (new tokens) of the planned step.
    pub fn step_lens(&self) -> Vec<usize> {
        self.cu_seqlens_q()
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .collect()
    }

    /// `[b + 1]` i32 cumulative step lengths (`[]` before any `pre_step`).
    pub fn cu_seqlens_q(&self) -> &[i32] {
        self.plan.as_ref().map_or(&[], |p| &p.cu_seqlens_q)
    }

    /// `[b + 1]` i32 cumulative key lengths `cache_seqlens` (all positions,
    /// even on ring layers).
    pub fn cu_seqlens_kv(&self) -> &[i32] {
        self.plan.as_ref().map_or(&[], |p| &p.cu_seqlens_kv)
    }

    /// `[b]` i32 tokens cached before this step = position of each
    /// sequence's first new token (RoPE offset).
    pub fn start_positions(&self) -> &[i32] {
        self.plan.as_ref().map_or(&[], |p| &p.start_positions)
    }

    /// `[b]` i32 tokens cached after this step (`start_positions + step_len`).
    pub fn cache_seqlens(&self) -> &[i32] {
        self.plan.as_ref().map_or(&[], |p| &p.cache_seqlens)
    }

    /// Longest step length of the planned step.
    pub fn max_seqlen_q(&self) -> usize {
        self.plan.as_ref().map_or(0, |p| p.max_seqlen_q)
    }

    /// Longest `cache_seqlens` entry of the planned step.
    pub fn max_seqlen_kv(&self) -> usize {
        self.plan.as_ref().map_or(0, |p| p.max_seqlen_kv)
    }

    fn check_layer(&self, layer: usize) -> Result<(), CacheError> {
        if layer < self.windows.len() {
            Ok(())
        } else {
            Err(CacheError::LayerOutOfRange {
                layer,
                num_layers: self.windows.len(),
            })
        }
    }

    fn check_dtype<T: Element>(&self, arg: &'static str) -> Result<(), CacheError> {
        if T::DTYPE == self.dtype {
            Ok(())
        } else {
            Err(CacheError::DTypeMismatch {
                arg,
                expected: self.dtype,
                got: T::DTYPE,
            })
        }
    }

    /// A copy of the configuration without storage or sequences.
    fn clone_config(&self) -> Self {
        Self {
            windows: self.windows.clone(),
            layer_pool: self.layer_pool.clone(),
            pools: self.pools.clone(),
            sequences: BTreeMap::new(),
            plan: None,
            k_cache: Vec::new(),
            v_cache: Vec::new(),
            ..*self
        }
    }

    /// The pool geometry of a full-attention layer.
    fn full_pool(&self) -> PagePool {
        match self.layout {
            CacheLayout::Contiguous => PagePool::new(self.max_seqlen, 1, None, self.max_batch_size),
            CacheLayout::Paged {
                page_size,
                total_num_pages,
            } => PagePool::new(
                page_size,
                self.max_seqlen.div_ceil(page_size),
                None,
                total_num_pages,
            ),
        }
    }

    /// The pool geometry of a layer with `window`: a ring, or full storage
    /// when the ring would not be shorter.
    fn window_pool(&self, w: SlidingWindow) -> PagePool {
        let full = self.full_pool();
        let needed = (w.window - 1).saturating_add(w.max_step_len);
        let ring_len = match self.layout {
            CacheLayout::Contiguous => needed,
            CacheLayout::Paged { page_size, .. } => {
                needed.div_ceil(page_size).saturating_mul(page_size)
            }
        };
        if ring_len >= full.max_pages_per_seq * full.page_size {
            return full;
        }
        match self.layout {
            CacheLayout::Contiguous => {
                PagePool::new(ring_len, 1, Some(ring_len), self.max_batch_size)
            }
            CacheLayout::Paged { page_size, .. } => {
                let pages_per_ring = ring_len / page_size;
                PagePool::new(
                    page_size,
                    pages_per_ring,
                    Some(ring_len),
                    self.max_batch_size * pages_per_ring,
                )
            }
        }
    }

    /// Recomputes `pools` (one per distinct geometry, first use first) and
    /// `layer_pool` from `windows`; all pages free.
    fn rebuild_pools(&mut self) {
        let mut pools: Vec<PagePool> = Vec::new();
        let mut layer_pool = Vec::with_capacity(self.windows.len());
        for window in &self.windows {
            let pool = match window {
                Some(w) => self.window_pool(*w),
                None => self.full_pool(),
            };
            let index = match pools.iter().position(|q| *q == pool) {
                Some(i) => i,
                None => {
                    pools.push(pool);
                    pools.len() - 1
                }
            };
            layer_pool.push(index);
        }
        self.pools = pools;
        self.layer_pool = layer_pool;
    }

    /// Elements of one layer's K and V storage in `pool`.
    fn storage_lens(&self, pool: &PagePool) -> Result<(usize, usize), CacheError> {
        let rows = pool.num_pages.checked_mul(pool.page_size);
        let len = |d: usize| {
            rows.and_then(|r| r.checked_mul(self.num_heads_kv))
                .and_then(|r| r.checked_mul(d))
                .ok_or_else(|| invalid("total_num_pages", "cache size overflows usize"))
        };
        Ok((len(self.head_dim_k)?, len(self.head_dim_v)?))
    }
}

/// The layout of the planned step in pool `p`.
fn layout_of<'a>(
    pool: &PagePool,
    plan: &'a StepPlan,
    p: usize,
    num_heads_kv: usize,
    head_dim_k: usize,
    head_dim_v: usize,
) -> KvCacheLayout<'a> {
    KvCacheLayout {
        num_heads_kv,
        head_dim_k,
        head_dim_v,
        page_size: pool.page_size,
        page_table: &plan.page_tables[p],
        max_pages_per_seq: pool.max_pages_per_seq,
        cache_seqlens: &plan.cache_seqlens,
        ring_len: pool.ring_len,
    }
}
