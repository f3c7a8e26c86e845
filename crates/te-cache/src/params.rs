//! `InferenceParams`: sequence bookkeeping for continuous batching
//! (TransformerEngine's `pre_step` then per-layer `step`) over a
//! [`KvStorage`]: the sequence table, the page pools with reference counts,
//! the prefix index and the step plan.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use te_kernels::{
    save_kv_cpu_reusing, DType, Element, KvCacheLayout, KvCacheView, KvStep, QkvFormat,
};

use crate::error::CacheError;
use crate::pool::PagePool;
use crate::prefix::{page_key, root_key, PrefixIndex};
use crate::storage::{HostKvStorage, KvStorage};

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

/// The geometry of a KV cache, fixed at construction
/// ([`InferenceParams::new`], [`InferenceParams::with_storage`]): the
/// arguments of TransformerEngine's `InferenceParams`, with Hugging Face's
/// names where TransformerEngine has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    /// Most sequences held at a time (and run per step), in sequences
    /// (TransformerEngine `max_batch_size`).
    pub max_batch_size: usize,
    /// Most tokens per sequence, in tokens: positions `0..max_seqlen`
    /// (TransformerEngine `max_sequence_length`).
    pub max_seqlen: usize,
    /// Transformer layers, each with its own K and V storage (Hugging Face
    /// `num_hidden_layers`).
    pub num_layers: usize,
    /// Key/value heads per layer, `h_kv` (TransformerEngine `num_heads_kv`,
    /// Hugging Face `num_key_value_heads`).
    pub num_heads_kv: usize,
    /// Elements per key head, `d_k` (TransformerEngine `head_dim_k`).
    pub head_dim_k: usize,
    /// Elements per value head, `d_v` (TransformerEngine `head_dim_v`).
    pub head_dim_v: usize,
    /// Element type of the stored keys and values.
    pub dtype: DType,
    /// Contiguous slots or a page pool (rows per page and pages per layer).
    pub layout: CacheLayout,
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
    /// Most tokens the sequence ever held: positions up to here were
    /// written, so on a ring position `p` is intact only if
    /// `p + ring_len >= written` (a rollback does not unwrite the ring).
    written: usize,
    /// Physical pages per pool, in logical order.
    pages: Vec<Vec<i32>>,
    /// Prefix keys of the leading pages of the prefix pool whose keys are
    /// known (registered by this sequence or shared from the index), one
    /// per page, in order (kept so that [`InferenceParams::truncate`] can
    /// shorten the chain).
    keys: Vec<u128>,
    /// The key the chain starts from: its salt's root key.
    root: u128,
}

/// The metadata of one step, computed once by
/// [`InferenceParams::pre_step`] and borrowed by every layer
/// ([`InferenceParams::plan`] hands out a shared handle).
///
/// With `b` sequences in the step, in the order given to `pre_step`:
/// `cu_seqlens_q: [b + 1]`, `cu_seqlens_kv: [b + 1]`, `start_positions: [b]`,
/// `cache_seqlens: [b]` (all i32), and per page pool a page table
/// `[b, width]` (i32 physical page ids, unused entries 0) whose `width` is
/// the most pages any sequence of the step holds in that pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    seq_ids: Vec<u64>,
    cu_seqlens_q: Vec<i32>,
    cu_seqlens_kv: Vec<i32>,
    start_positions: Vec<i32>,
    cache_seqlens: Vec<i32>,
    max_seqlen_q: usize,
    max_seqlen_kv: usize,
    /// Per pool: `[b, widths[p]]`.
    page_tables: Vec<Vec<i32>>,
    widths: Vec<usize>,
}

impl StepPlan {
    /// Sequences `b` in the step.
    pub fn batch_size(&self) -> usize {
        self.seq_ids.len()
    }

    /// `[b]` sequence ids in batch order.
    pub fn seq_ids(&self) -> &[u64] {
        &self.seq_ids
    }

    /// Tokens `t` fed this step, all sequences together (`cu_seqlens_q[b]`).
    pub fn num_tokens(&self) -> usize {
        self.cu_seqlens_q.last().map_or(0, |&t| t as usize)
    }

    /// `[b + 1]` i32 cumulative step lengths.
    pub fn cu_seqlens_q(&self) -> &[i32] {
        &self.cu_seqlens_q
    }

    /// `[b + 1]` i32 cumulative key lengths `cache_seqlens` (all positions,
    /// even on ring layers).
    pub fn cu_seqlens_kv(&self) -> &[i32] {
        &self.cu_seqlens_kv
    }

    /// `[b]` i32 tokens cached before this step = position of each
    /// sequence's first new token (RoPE offset).
    pub fn start_positions(&self) -> &[i32] {
        &self.start_positions
    }

    /// `[b]` i32 tokens cached after this step (`start_positions + step_len`).
    pub fn cache_seqlens(&self) -> &[i32] {
        &self.cache_seqlens
    }

    /// Longest step length.
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }

    /// Longest `cache_seqlens` entry.
    pub fn max_seqlen_kv(&self) -> usize {
        self.max_seqlen_kv
    }

    /// Empties the plan, keeping its allocations.
    fn clear(&mut self, num_pools: usize) {
        self.seq_ids.clear();
        self.cu_seqlens_q.clear();
        self.cu_seqlens_q.push(0);
        self.cu_seqlens_kv.clear();
        self.cu_seqlens_kv.push(0);
        self.start_positions.clear();
        self.cache_seqlens.clear();
        self.max_seqlen_q = 0;
        self.max_seqlen_kv = 0;
        self.page_tables.resize_with(num_pools, Vec::new);
        self.widths.resize(num_pools, 0);
    }
}

/// The KV cache of a model for many sequences generated together
/// (continuous batching), modeled on TransformerEngine's `InferenceParams`.
///
/// Use per generation step:
/// 1. [`pre_step`](Self::pre_step) with `(seq_id, step_len)` for every
///    sequence that runs this step, in batch order: a new id joins with its
///    first chunk, a known id continues (prefill chunk, one-token decode or
///    several tokens). It computes the [`StepPlan`] (`cu_seqlens_q`,
///    `cu_seqlens_kv`, `start_positions`, page tables) once for all layers.
/// 2. Per layer, [`step`](Self::step) with this step's keys and values: it
///    saves them and returns the [`KvCacheView`] attention reads (keys at
///    positions `0..cache_seqlens[b]`, or the last `ring_len` of them on a
///    sliding-window layer). The plan is read through [`plan`](Self::plan),
///    a shared handle that outlives the borrow of `step`.
/// 3. [`release`](Self::release) a finished sequence to free its pages.
///
/// Storage per layer: contiguous `[max_batch_size, max_seqlen, h_kv, d]`;
/// paged `[total_num_pages, page_size, h_kv, d]`; sliding-window layers a
/// ring of `ring_len` rows per sequence (see
/// [`set_sliding_window`](Self::set_sliding_window)). The cache holds at
/// most `max_batch_size` sequences at a time. Storage sits behind
/// [`KvStorage`] (host memory: [`HostKvStorage`], the default); everything
/// else here is bookkeeping any storage reuses.
///
/// **Prefix sharing** (paged caches without sliding-window rings): full
/// pages are registered under a key naming their tokens and every token
/// before them ([`register_prefix`](Self::register_prefix)); a new
/// sequence whose tokens start with registered pages holds the same
/// physical pages ([`attach_prefix`](Self::attach_prefix), reference
/// counted). Pages are never written while shared or registered: a step
/// that would write into one copies it to a page of its own first
/// (copy-on-write). Registered pages that no sequence holds stay cached
/// until an allocation needs them, least recently released first.
///
/// Every error leaves the cache exactly as it was.
#[derive(Clone, PartialEq)]
pub struct InferenceParams<S = HostKvStorage> {
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
    /// The prefix index of pool 0 when sharing is possible (paged, one pool,
    /// no ring), else `None`.
    prefix: Option<PrefixIndex>,
    sequences: BTreeMap<u64, Sequence>,
    plan: Option<Arc<StepPlan>>,
    storage: S,
    /// Reused (cache row, source row) pairs of the KV-save op.
    save_scratch: Vec<(u64, u64)>,
}

impl<S> std::fmt::Debug for InferenceParams<S> {
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

impl InferenceParams<HostKvStorage> {
    /// An empty cache of `shape.num_layers` full-attention layers in host
    /// memory; all storage is allocated here (zeros).
    ///
    /// Errors: as [`with_storage`](Self::with_storage).
    pub fn new(shape: CacheShape) -> Result<Self, CacheError> {
        Self::with_storage(shape, HostKvStorage::new(shape.dtype, shape.num_layers))
    }
}

impl<S: KvStorage> InferenceParams<S> {
    /// Saves this step's keys and values of `layer` and returns the view
    /// attention reads.
    ///
    /// `k: [.., h_kv, d_k]`, `v: [.., h_kv, d_v]` in `qkv_format`:
    /// thd `[t, h, d]` with `t = cu_seqlens_q[b]`; bshd `[b, max_seqlen_q, h, d]`;
    /// sbhd `[max_seqlen_q, b, h, d]` (padding rows are ignored). Token `i`
    /// of sequence `b` is stored at position `start_positions[b] + i`.
    ///
    /// Saving is te-kernels' KV-save op ([`te_kernels::save_kv_cpu`]); it
    /// allocates nothing once the cache has run a step of this size.
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
        let t = plan.num_tokens();
        let h = self.num_heads_kv;
        for (arg, tensor, d) in [("k", k, self.head_dim_k), ("v", v, self.head_dim_v)] {
            let expected = match qkv_format {
                QkvFormat::Thd => [t, h, d, 1],
                QkvFormat::Bshd => [batch, s, h, d],
                QkvFormat::Sbhd => [s, batch, h, d],
            };
            if tensor.len() != expected.iter().product::<usize>() {
                let rank = if qkv_format == QkvFormat::Thd { 3 } else { 4 };
                return Err(CacheError::ShapeMismatch {
                    arg,
                    expected: expected[..rank].to_vec(),
                    got: tensor.len(),
                });
            }
        }
        let p = self.layer_pool[layer];
        let layout = layout_of(&self.pools[p], plan, p, h, self.head_dim_k, self.head_dim_v);
        let Some((k_cache, v_cache)) = self
            .storage
            .as_host_mut()
            .ok_or_else(not_host)?
            .layer_mut::<T>(layer)
        else {
            unreachable!("dtype checked above");
        };
        let kv_step = KvStep {
            format: qkv_format,
            cu_seqlens: &plan.cu_seqlens_q,
            max_seqlen: s,
        };
        save_kv_cpu_reusing(
            k,
            v,
            k_cache,
            v_cache,
            &layout,
            &kv_step,
            &mut self.save_scratch,
        )?;
        self.view(layer)
    }

    /// The view of `layer` for the planned step, without saving anything
    /// (what [`step`](Self::step) returns).
    ///
    /// `k_cache: [num_pages, page_size, h_kv, d_k]`, `v_cache: [.., d_v]`,
    /// `layout.page_table: [b, max_pages_per_seq]` (this step's width),
    /// `layout.cache_seqlens: [b]`, `layout.ring_len` set on sliding-window
    /// layers.
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
        let Some((k_cache, v_cache)) = self
            .storage
            .as_host()
            .ok_or_else(not_host)?
            .layer::<T>(layer)
        else {
            unreachable!("dtype checked above");
        };
        Ok(KvCacheView {
            k_cache,
            v_cache,
            layout,
        })
    }

    /// Bytes of K and V storage allocated in host memory, over all layers
    /// (0 for device storage).
    pub fn memory_allocated(&self) -> usize {
        self.storage.as_host().map_or(0, HostKvStorage::elements) * self.dtype.size_in_bytes()
    }

    /// The page-table layout of `layer` for the planned step (what
    /// [`view`](Self::view) returns with the tensors) and the storage,
    /// mutable: for device storage, whose KV save and attention address
    /// the tensors themselves.
    ///
    /// Errors: no step planned, `layer` out of range.
    pub fn step_storage(
        &mut self,
        layer: usize,
    ) -> Result<(KvCacheLayout<'_>, &mut S), CacheError> {
        self.check_layer(layer)?;
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
        Ok((layout, &mut self.storage))
    }
}

/// The error of a host-memory operation on device storage.
fn not_host() -> CacheError {
    CacheError::InvalidArgument {
        arg: "storage",
        reason: "the cache is not in host memory (this op is the CPU KV save / view)".into(),
    }
}

impl<S: KvStorage> InferenceParams<S> {
    /// An empty cache of `shape.num_layers` full-attention layers over
    /// `storage`, which is allocated here through [`KvStorage::allocate`].
    ///
    /// Errors: any size 0, a paged `page_size` or `total_num_pages` of 0,
    /// `max_batch_size * max_seqlen` or `total_num_pages` above `i32::MAX`
    /// (cu_seqlens and page ids are i32), storage size overflowing usize.
    pub fn with_storage(shape: CacheShape, storage: S) -> Result<Self, CacheError> {
        let CacheShape {
            max_batch_size,
            max_seqlen,
            num_layers,
            num_heads_kv,
            head_dim_k,
            head_dim_v,
            dtype,
            layout,
        } = shape;
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
            prefix: None,
            sequences: BTreeMap::new(),
            plan: None,
            storage,
            save_scratch: Vec::new(),
        };
        params.rebuild_pools();
        for layer in 0..num_layers {
            params.allocate_layer(layer)?;
        }
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
    /// the layer keeps full storage and no step limit applies. A cache with
    /// a ring shares no prefixes.
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
        let old = (
            self.windows.clone(),
            self.layer_pool.clone(),
            self.pools.clone(),
            self.prefix.clone(),
        );
        self.windows[layer] = Some(SlidingWindow {
            window,
            max_step_len,
        });
        self.rebuild_pools();
        if let Err(e) = self.allocate_layer(layer) {
            (self.windows, self.layer_pool, self.pools, self.prefix) = old;
            return Err(e);
        }
        self.plan = None;
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
    /// new positions are allocated (a shared or registered page about to be
    /// written is first copied to a page of the sequence's own). Example: a
    /// new sequence of 3 tokens and a sequence with 5 cached decoding 1 give
    /// `cu_seqlens_q = [0, 3, 4]`, `start_positions = [0, 5]`,
    /// `cu_seqlens_kv = [0, 3, 9]`.
    ///
    /// Errors (nothing changes): more than `max_batch_size` entries, a
    /// repeated `seq_id`, `step_len` 0, a sequence growing past
    /// `max_seqlen`, a step longer than a sliding layer's `max_step_len`,
    /// more than `max_batch_size` sequences held, a pool without enough free
    /// pages (`CacheFull` with pages needed and free).
    pub fn pre_step(&mut self, steps: &[(u64, usize)]) -> Result<(), CacheError> {
        self.check(steps, false)?;
        self.commit(steps);
        Ok(())
    }

    /// Whether [`pre_step`](Self::pre_step) would accept `steps`: the same
    /// errors, nothing changes either way.
    pub fn check_step(&self, steps: &[(u64, usize)]) -> Result<(), CacheError> {
        self.check(steps, false)
    }

    /// A context-parallel rank's [`pre_step`](Self::pre_step): a sequence
    /// may take 0 tokens (this rank holds none of its new tokens, but its
    /// cached keys are attended this step), so every sequence of the step
    /// is in the plan, in the same order on every rank.
    pub fn pre_step_shard(&mut self, steps: &[(u64, usize)]) -> Result<(), CacheError> {
        self.check(steps, true)?;
        self.commit(steps);
        Ok(())
    }

    /// Whether [`pre_step_shard`](Self::pre_step_shard) would accept
    /// `steps` (nothing changes).
    pub fn check_step_shard(&self, steps: &[(u64, usize)]) -> Result<(), CacheError> {
        self.check(steps, true)
    }

    /// The validation of a step: every error of [`pre_step`](Self::pre_step).
    fn check(&self, steps: &[(u64, usize)], empty_ok: bool) -> Result<(), CacheError> {
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
            if step_len == 0 && !empty_ok {
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
                .map(|&(seq_id, step_len)| self.pages_needed(p, seq_id, step_len))
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
        Ok(())
    }

    /// Commits validated `steps` ([`check`](Self::check)): takes pages,
    /// advances the sequences and builds the plan. Reuses the last plan's
    /// buffers when no layer still holds it.
    fn commit(&mut self, steps: &[(u64, usize)]) {
        let num_pools = self.pools.len();
        let mut plan = self
            .plan
            .take()
            .and_then(|a| Arc::try_unwrap(a).ok())
            .unwrap_or_default();
        plan.clear(num_pools);
        for &(seq_id, step_len) in steps {
            let seq = self.sequences.entry(seq_id).or_insert_with(|| Sequence {
                cached: 0,
                written: 0,
                pages: vec![Vec::new(); num_pools],
                keys: Vec::new(),
                root: 0,
            });
            let start = seq.cached;
            seq.cached += step_len;
            seq.written = seq.written.max(seq.cached);
            for (p, pool) in self.pools.iter_mut().enumerate() {
                let pages = &mut seq.pages[p];
                // Copy-on-write: the page the step starts writing in, when
                // another sequence holds it or the prefix index names it.
                if pool.ring_len.is_none() && !start.is_multiple_of(pool.page_size) {
                    let slot = start / pool.page_size;
                    let old = pages[slot];
                    let registered = registered(&self.prefix, p, old);
                    if pool.refs(old) > 1 || registered {
                        let new = take_page(pool, &mut self.prefix);
                        let ps = pool.page_size;
                        for (layer, _) in
                            self.layer_pool.iter().enumerate().filter(|(_, &q)| q == p)
                        {
                            self.storage
                                .copy_rows(layer, old as usize * ps, new as usize * ps, ps);
                        }
                        pool.unshare(old, registered);
                        pages[slot] = new;
                    }
                }
                let need = pool.pages_for(seq.cached);
                while pages.len() < need {
                    pages.push(take_page(pool, &mut self.prefix));
                }
                plan.widths[p] = plan.widths[p].max(pages.len());
            }
            plan.seq_ids.push(seq_id);
            let b = plan.seq_ids.len() - 1;
            plan.cu_seqlens_q
                .push(plan.cu_seqlens_q[b] + step_len as i32);
            plan.cu_seqlens_kv
                .push(plan.cu_seqlens_kv[b] + seq.cached as i32);
            plan.start_positions.push(start as i32);
            plan.cache_seqlens.push(seq.cached as i32);
            plan.max_seqlen_q = plan.max_seqlen_q.max(step_len);
            plan.max_seqlen_kv = plan.max_seqlen_kv.max(seq.cached);
        }
        for p in 0..num_pools {
            let width = plan.widths[p];
            let table = &mut plan.page_tables[p];
            table.clear();
            table.resize(steps.len() * width, 0);
            for (b, &(seq_id, _)) in steps.iter().enumerate() {
                let pages = &self.sequences[&seq_id].pages[p];
                table[b * width..][..pages.len()].copy_from_slice(pages);
            }
        }
        self.plan = Some(Arc::new(plan));
    }

    /// Pages of pool `p` that `(seq_id, step_len)` takes: new pages for the
    /// new positions, plus one for a copy-on-write.
    fn pages_needed(&self, p: usize, seq_id: u64, step_len: usize) -> usize {
        let pool = &self.pools[p];
        let Some(seq) = self.sequences.get(&seq_id) else {
            return pool.pages_for(step_len);
        };
        let held = seq.pages[p].len();
        let grow = pool.pages_for(seq.cached + step_len) - held;
        let cow = pool.ring_len.is_none() && !seq.cached.is_multiple_of(pool.page_size) && {
            let old = seq.pages[p][seq.cached / pool.page_size];
            pool.refs(old) > 1 || registered(&self.prefix, p, old)
        };
        grow + usize::from(cow)
    }

    /// The plan of the last successful `pre_step` (`None` before the first,
    /// and after a `release` of one of its sequences). A shared handle: hold
    /// it across the layers of a step; drop it before the next `pre_step` so
    /// that its buffers are reused.
    pub fn plan(&self) -> Option<Arc<StepPlan>> {
        self.plan.clone()
    }

    /// Whether this cache shares prefixes: paged, and no layer keeps a
    /// sliding-window ring (a ring overwrites its pages as it turns).
    pub fn prefix_sharing(&self) -> bool {
        self.prefix.is_some()
    }

    /// Starts sequence `seq_id` on the longest run of registered full pages
    /// that `tokens` begins with, covering at most `max_tokens` tokens, and
    /// returns how many tokens it starts with cached (0 without prefix
    /// sharing, or when nothing matches: the sequence is then simply
    /// empty). Call it before the sequence's first `pre_step`; pass
    /// `max_tokens = tokens.len() - 1` so that at least one token is
    /// computed (its logits are needed). When `max_tokens` ends inside a
    /// shared page, that page is copied on the first write.
    ///
    /// Errors (nothing changes): `seq_id` already held, the cache already
    /// holding `max_batch_size` sequences.
    pub fn attach_prefix(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        max_tokens: usize,
    ) -> Result<usize, CacheError> {
        self.attach_salted_prefix(seq_id, tokens, max_tokens, None)
    }

    /// [`InferenceParams::attach_prefix`] for a sequence with `salt`: it
    /// shares pages only with sequences of the same salt (`None` is a salt
    /// of its own); the salt is the root of the sequence's page-key chain.
    ///
    /// Errors: as [`InferenceParams::attach_prefix`].
    pub fn attach_salted_prefix(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        max_tokens: usize,
        salt: Option<&[u8]>,
    ) -> Result<usize, CacheError> {
        if self.sequences.contains_key(&seq_id) {
            return Err(CacheError::DuplicateSequence { seq_id });
        }
        if self.sequences.len() == self.max_batch_size {
            return Err(CacheError::TooManySequences {
                seq_id,
                live: self.sequences.len(),
                max_batch_size: self.max_batch_size,
            });
        }
        let num_pools = self.pools.len();
        let root = root_key(salt);
        let mut seq = Sequence {
            cached: 0,
            written: 0,
            pages: vec![Vec::new(); num_pools],
            keys: Vec::new(),
            root,
        };
        if let Some(ix) = &self.prefix {
            let pool = &mut self.pools[0];
            let ps = pool.page_size;
            let limit = max_tokens.min(tokens.len()).min(self.max_seqlen);
            let candidates = (tokens.len() / ps).min(limit.div_ceil(ps));
            let mut key = root;
            for page_tokens in tokens.chunks_exact(ps).take(candidates) {
                key = page_key(key, page_tokens);
                let Some(page) = ix.get(key) else { break };
                pool.share(page);
                seq.pages[0].push(page);
                if seq.pages[0].len() * ps <= limit {
                    // Wholly cached: the sequence's key chain covers it.
                    seq.keys.push(key);
                }
            }
            seq.cached = (seq.pages[0].len() * ps).min(limit);
            seq.written = seq.cached;
        }
        let hit = seq.cached;
        self.sequences.insert(seq_id, seq);
        Ok(hit)
    }

    /// Registers the full pages of `seq_id` that hold `tokens[..cached]`
    /// (`tokens` = the sequence's tokens so far, at least
    /// `cached_tokens(seq_id)` of them) in the prefix index, so later
    /// sequences starting with the same tokens can share them. Pages already
    /// registered are skipped; a no-op without prefix sharing.
    ///
    /// Errors: unknown `seq_id`, `tokens` shorter than the cached tokens.
    pub fn register_prefix(&mut self, seq_id: u64, tokens: &[u32]) -> Result<(), CacheError> {
        let seq = self
            .sequences
            .get_mut(&seq_id)
            .ok_or(CacheError::UnknownSequence { seq_id })?;
        if tokens.len() < seq.cached {
            return Err(invalid(
                "tokens",
                format!(
                    "sequence {seq_id} has {} cached tokens, {} tokens given",
                    seq.cached,
                    tokens.len()
                ),
            ));
        }
        let Some(ix) = self.prefix.as_mut() else {
            return Ok(());
        };
        let ps = self.pools[0].page_size;
        for i in seq.keys.len()..seq.cached / ps {
            let parent = seq.keys.last().copied().unwrap_or(seq.root);
            let key = page_key(parent, &tokens[i * ps..(i + 1) * ps]);
            ix.insert(key, seq.pages[0][i]);
            seq.keys.push(key);
        }
        Ok(())
    }

    /// Ends sequence `seq_id` and lets go of its pages (registered ones stay
    /// cached for prefix reuse). If it is part of the planned step, the plan
    /// is dropped (call `pre_step` again).
    /// Errors: unknown `seq_id`.
    pub fn release(&mut self, seq_id: u64) -> Result<(), CacheError> {
        let seq = self
            .sequences
            .remove(&seq_id)
            .ok_or(CacheError::UnknownSequence { seq_id })?;
        for (p, (pool, pages)) in self.pools.iter_mut().zip(&seq.pages).enumerate() {
            for &page in pages.iter().rev() {
                pool.unshare(page, registered(&self.prefix, p, page));
            }
        }
        self.drop_plan_naming(seq_id);
        Ok(())
    }

    /// Rolls sequence `seq_id` back to its first `new_len` tokens: the keys
    /// and values of positions `new_len..cached` are dropped (rejected
    /// speculative tokens), pages no longer needed are given back, and the
    /// next step continues at position `new_len`.
    ///
    /// Pages stay consistent with sharing: a dropped page that is
    /// registered keeps describing the prefix it was registered under (its
    /// rows were never written after registration) and stays cached for
    /// reuse; the page the sequence now ends inside, when shared or
    /// registered, is copied before the next write (copy-on-write, as for
    /// any step). On a sliding-window ring the positions a later query
    /// still sees must not have been overwritten by positions written since
    /// (dropped now, or by an earlier rollback): the rollback is refused
    /// when `max(0, new_len + 1 - window) + ring_len < written`, `written`
    /// the most tokens the sequence ever held (so a rollback of at most
    /// `max_step_len` tokens right after a step always fits). If the sequence is in the planned step, the
    /// plan is dropped (call `pre_step` again).
    ///
    /// Errors (nothing changes): unknown `seq_id`, `new_len` above the
    /// cached tokens, a rollback deeper than a ring keeps.
    pub fn truncate(&mut self, seq_id: u64, new_len: usize) -> Result<(), CacheError> {
        let seq = self
            .sequences
            .get(&seq_id)
            .ok_or(CacheError::UnknownSequence { seq_id })?;
        let (cached, written) = (seq.cached, seq.written);
        if new_len > cached {
            return Err(invalid(
                "new_len",
                format!("sequence {seq_id} holds {cached} tokens, cannot truncate to {new_len}"),
            ));
        }
        for (layer, window) in self.windows.iter().enumerate() {
            let ring = self.pools[self.layer_pool[layer]].ring_len;
            if let (Some(w), Some(ring_len)) = (window, ring) {
                let earliest_needed = (new_len + 1).saturating_sub(w.window);
                if earliest_needed + ring_len < written {
                    return Err(CacheError::RollbackPastRing {
                        seq_id,
                        written,
                        new_len,
                        layer,
                        ring_len,
                    });
                }
            }
        }

        // Validated: commit.
        let seq = self.sequences.get_mut(&seq_id).expect("checked above");
        seq.cached = new_len;
        for (p, pool) in self.pools.iter_mut().enumerate() {
            let keep = pool.pages_for(new_len);
            for page in seq.pages[p].drain(keep..).rev() {
                pool.unshare(page, registered(&self.prefix, p, page));
            }
        }
        if self.prefix.is_some() {
            seq.keys.truncate(new_len / self.pools[0].page_size);
        }
        self.drop_plan_naming(seq_id);
        Ok(())
    }

    /// Drops the planned step if it names `seq_id` (its sequence changed:
    /// `pre_step` must plan again).
    fn drop_plan_naming(&mut self, seq_id: u64) {
        if self
            .plan
            .as_ref()
            .is_some_and(|p| p.seq_ids.contains(&seq_id))
        {
            self.plan = None;
        }
    }

    /// Drops every cached (unreferenced, registered) page from the prefix
    /// index, so they become free.
    pub fn clear_prefix_cache(&mut self) {
        if let Some(ix) = self.prefix.as_mut() {
            let pool = &mut self.pools[0];
            for page in 0..pool.num_pages as i32 {
                if pool.refs(page) == 0 && ix.is_registered(page) {
                    ix.remove(page);
                    pool.uncache(page);
                }
            }
        }
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
        let source = source.clone();
        // The copy's pages hold the same prefix under the same keys (its
        // salt's chain): registering continues after them.
        let mut copy = Sequence {
            cached: source.cached,
            written: source.written,
            pages: Vec::with_capacity(self.pools.len()),
            keys: source.keys.clone(),
            root: source.root,
        };
        for pool in self.pools.iter_mut() {
            let mut pages = Vec::new();
            for _ in 0..source.pages[copy.pages.len()].len() {
                pages.push(take_page(pool, &mut self.prefix));
            }
            copy.pages.push(pages);
        }
        for (layer, &p) in self.layer_pool.iter().enumerate() {
            let ps = self.pools[p].page_size;
            for (&from, &to) in source.pages[p].iter().zip(&copy.pages[p]) {
                self.storage
                    .copy_rows(layer, from as usize * ps, to as usize * ps, ps);
            }
        }
        self.sequences.insert(dst, copy);
        Ok(())
    }

    /// The storage.
    pub fn storage(&self) -> &S {
        &self.storage
    }

    /// Pages kept for prefix reuse that no sequence holds (counted as free
    /// by [`pages_free`](Self::pages_free)).
    pub fn pages_cached(&self) -> usize {
        self.prefix
            .as_ref()
            .map_or(0, |_| self.pools[0].pages_cached())
    }

    /// Sequences holding physical `page` of `layer`'s pool (its reference
    /// count). Errors: `layer` out of range; panics on a page id outside the
    /// pool.
    pub fn page_refs(&self, layer: usize, page: i32) -> Result<u32, CacheError> {
        self.check_layer(layer)?;
        Ok(self.pools[self.layer_pool[layer]].refs(page))
    }

    /// Checks the internal invariants: every page referenced, cached or free
    /// exactly once; reference counts equal the number of sequences holding
    /// each page; cached pages registered. For tests.
    pub fn check_consistency(&self) -> Result<(), String> {
        for (p, pool) in self.pools.iter().enumerate() {
            pool.check().map_err(|e| format!("pool {p}: {e}"))?;
            let mut refs = vec![0u32; pool.num_pages];
            for seq in self.sequences.values() {
                for &page in &seq.pages[p] {
                    refs[page as usize] += 1;
                }
                if seq.pages[p].len() != pool.pages_for(seq.cached) {
                    return Err(format!(
                        "pool {p}: a sequence holds the wrong number of pages"
                    ));
                }
            }
            for (page, &r) in refs.iter().enumerate() {
                if pool.refs(page as i32) != r {
                    return Err(format!(
                        "pool {p}: page {page} has {} references, {r} sequences hold it",
                        pool.refs(page as i32)
                    ));
                }
            }
        }
        if let Some(ix) = &self.prefix {
            let pool = &self.pools[0];
            let registered = (0..pool.num_pages as i32)
                .filter(|&q| ix.is_registered(q))
                .count();
            if registered != ix.len() {
                return Err("prefix index and page keys disagree".into());
            }
            let unregistered_cached = (0..pool.num_pages as i32)
                .filter(|&q| pool.refs(q) == 0 && !ix.is_registered(q))
                .count();
            if unregistered_cached + pool.pages_cached() != pool.num_pages - pool.pages_in_use() {
                return Err("a cached page is not registered".into());
            }
        }
        Ok(())
    }

    /// The geometry the cache was built with.
    pub fn shape(&self) -> CacheShape {
        CacheShape {
            max_batch_size: self.max_batch_size,
            max_seqlen: self.max_seqlen,
            num_layers: self.windows.len(),
            num_heads_kv: self.num_heads_kv,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
            dtype: self.dtype,
            layout: self.layout,
        }
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

    /// Recomputes `pools` (one per distinct geometry, first use first),
    /// `layer_pool` and the prefix index from `windows`; all pages free.
    fn rebuild_pools(&mut self) {
        let mut pools: Vec<PagePool> = Vec::new();
        let mut layer_pool = Vec::with_capacity(self.windows.len());
        for window in &self.windows {
            let pool = match window {
                Some(w) => self.window_pool(*w),
                None => self.full_pool(),
            };
            let index = match pools.iter().position(|q| q.same_geometry(&pool)) {
                Some(i) => i,
                None => {
                    pools.push(pool);
                    pools.len() - 1
                }
            };
            layer_pool.push(index);
        }
        let paged = matches!(self.layout, CacheLayout::Paged { .. });
        self.prefix = (paged && pools.len() == 1 && pools[0].ring_len.is_none())
            .then(|| PrefixIndex::new(pools[0].num_pages));
        self.pools = pools;
        self.layer_pool = layer_pool;
    }

    /// Allocates `layer`'s storage for its pool.
    fn allocate_layer(&mut self, layer: usize) -> Result<(), CacheError> {
        let pool = &self.pools[self.layer_pool[layer]];
        let rows = pool
            .num_pages
            .checked_mul(pool.page_size)
            .ok_or_else(|| invalid("total_num_pages", "cache size overflows usize"))?;
        let h = self.num_heads_kv;
        self.storage
            .allocate(layer, rows, h * self.head_dim_k, h * self.head_dim_v)
    }
}

/// Takes a page from `pool` (referenced once); a cached page it evicts
/// leaves the prefix index.
fn take_page(pool: &mut PagePool, prefix: &mut Option<PrefixIndex>) -> i32 {
    let (page, evicted) = pool.take();
    if let (Some(e), Some(ix)) = (evicted, prefix.as_mut()) {
        ix.remove(e);
    }
    page
}

/// Whether `page` of pool `p` is registered in the prefix index (only pool
/// 0 has one).
fn registered(prefix: &Option<PrefixIndex>, p: usize, page: i32) -> bool {
    p == 0 && prefix.as_ref().is_some_and(|ix| ix.is_registered(page))
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
        max_pages_per_seq: plan.widths[p],
        cache_seqlens: &plan.cache_seqlens,
        ring_len: pool.ring_len,
    }
}
