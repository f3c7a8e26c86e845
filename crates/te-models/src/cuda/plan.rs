//! The step plan on the device ([`DevicePlan`]): everything the CUDA
//! forward's launches read besides activations, weights and the cache,
//! built on the host once per step and uploaded in one copy per dtype into
//! device buffers that every layer borrows and later steps reuse.
//!
//! ```text
//! i32: [cu_seqlens_q (B + 1) | start_positions (B)]     RoPE
//! u32: [tokens (B)]                                      embedding
//! u64: [logit rows (n) | per pool: KV-save pairs [t, 2]] gather, KV save
//! i64: [per pool: attention metadata]                    attention
//! ```
//!
//! A pool is a group of layers with one cache layout (te-cache's page
//! pools: the full layers, each sliding window). With padding (a CUDA-graph
//! decode step, [`super::graph`]), `B` is the bucket: rows `b..B` are
//! padding sequences of one token at position 0 whose KV save is skipped
//! (`KV_SKIP`), whose attention reads the first real sequence's pages, and
//! whose outputs are ignored; page tables are widened to a power of two
//! of pages so the launch shapes stay fixed while sequences grow.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use te_attention::cuda::{CudaAttnLaunch, CudaAttnLens, CudaAttnScratch, CudaKvInput};
use te_attention::AttnMetadata;
use te_cache::{InferenceParams, StepPlan};
use te_kernels::cuda::{CudaDevice, KvSavePlan};
use te_kernels::{KvCacheLayout, KvStep, QkvFormat};

use super::libs::cuda_err;
use super::storage::KvStore;
use crate::model::Model;
use crate::{ModelError, Result};

/// One pool's part of the plan.
#[derive(Debug)]
struct PoolPlan {
    /// Identity of the pool's layout: its page table's address, ring and
    /// the layers' window.
    key: (usize, Option<usize>, Option<usize>),
    save: KvSavePlan,
    attn: Option<CudaAttnLaunch>,
    /// Offsets of its pairs in the u64 buffer and its metadata in the i64.
    pairs_at: usize,
    meta_at: usize,
}

/// A step's metadata on the host and on the device, plus the device
/// scratch the step's launches share (attention's split partials, the
/// GEMMs' bf16 activations). Device buffers grow, never shrink: a run of
/// steps of one shape allocates nothing after the first.
#[derive(Default)]
pub(crate) struct DevicePlan {
    /// Host: the (padded) batch `B` and the four arrays.
    batch: usize,
    i32s: Vec<i32>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) rows: Vec<usize>,
    u64s: Vec<u64>,
    i64s: Vec<i64>,
    pools: Vec<PoolPlan>,
    layer_pool: Vec<usize>,
    /// Device addresses of every layer's K and V cache (a graph replays
    /// against the tensors it was captured with).
    cache_ptrs: Vec<u64>,
    /// Device copies.
    d_i32: Option<CudaSlice<i32>>,
    d_u32: Option<CudaSlice<u32>>,
    d_u64: Option<CudaSlice<u64>>,
    d_i64: Option<CudaSlice<i64>>,
    /// Attention's split partials, reused by every layer.
    pub(crate) attn_scratch: CudaAttnScratch,
    /// The GEMMs' bf16 activations (swapped into [`super::ops::Cuda`] for the
    /// step, so a captured graph keeps the buffer it was captured with).
    pub(crate) x_bf16: Option<CudaSlice<bf16>>,
}

impl std::fmt::Debug for DevicePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlan")
            .field("batch", &self.batch)
            .field("pools", &self.pools.len())
            .finish_non_exhaustive()
    }
}

/// What must not change between a graph's capture and its replay: the
/// host arrays' lengths (the batch among them), every attention launch's
/// shape, the KV-save sizes and the cache tensors' addresses.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct PlanShape {
    lens: [usize; 4],
    attn: Vec<Option<CudaAttnLaunch>>,
    save_rows: Vec<usize>,
    cache_ptrs: Vec<u64>,
}

/// A layout's page table and lengths, padded to `batch` sequences of
/// `width` pages (padding sequences: one key, the first sequence's pages).
fn pad_layout(lay: &KvCacheLayout, batch: usize, width: usize) -> (Vec<i32>, Vec<i32>) {
    let (b, w) = (lay.batch(), lay.max_pages_per_seq);
    let mut table = vec![0; batch * width];
    for s in 0..batch {
        let src = s.min(b.saturating_sub(1));
        table[s * width..][..w].copy_from_slice(&lay.page_table[src * w..][..w]);
    }
    let mut lens = lay.cache_seqlens.to_vec();
    lens.resize(batch, 1);
    (table, lens)
}

/// Copies `host` into `slot` (allocated when absent or too short).
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    host: &[T],
) -> Result<()> {
    if slot.as_ref().is_none_or(|d| d.len() < host.len()) {
        *slot = Some(
            stream
                .alloc_zeros::<T>(host.len().max(1))
                .map_err(|e| cuda_err("alloc", e))?,
        );
    }
    if host.is_empty() {
        return Ok(());
    }
    let d = slot.as_mut().expect("allocated above");
    stream
        .memcpy_htod(host, &mut d.slice_mut(..host.len()))
        .map_err(|e| cuda_err("upload plan", e))
}

/// `slot`'s first `range` values (a view of a buffer uploaded this step).
fn view<T>(slot: &Option<CudaSlice<T>>, range: std::ops::Range<usize>) -> Result<CudaView<'_, T>> {
    slot.as_ref()
        .filter(|d| d.len() >= range.end)
        .map(|d| d.slice(range))
        .ok_or_else(|| ModelError::Cuda("the step plan was not uploaded".into()))
}

impl DevicePlan {
    /// Builds the host half for the step `plan` of `tokens: [t]` planned
    /// in `cache`, padded to `pad_to` sequences when given (a decode step
    /// of `b <= pad_to` one-token sequences). The rows that get logits are
    /// each sequence's last token.
    ///
    /// Errors: a host cache, a failed copy-on-write, invalid shapes (those
    /// of the KV save and attention).
    pub(crate) fn build(
        &mut self,
        model: &Model,
        dev: &CudaDevice,
        cache: &mut InferenceParams<KvStore>,
        plan: &StepPlan,
        tokens: &[u32],
        pad_to: Option<usize>,
    ) -> Result<()> {
        let c = &model.config;
        let b = plan.batch_size();
        let batch = pad_to.unwrap_or(b).max(b);
        let t = tokens.len() + (batch - b);
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        self.batch = batch;

        // cu_seqlens_q, start positions: padding rows 1 token at 0.
        let cu = plan.cu_seqlens_q();
        self.i32s.clear();
        self.i32s.extend_from_slice(cu);
        for i in 1..=batch - b {
            self.i32s.push(cu[b] + i as i32);
        }
        self.i32s.extend_from_slice(plan.start_positions());
        self.i32s.resize(2 * batch + 1, 0);
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.tokens.resize(t, 0);
        self.rows.clear();
        self.rows
            .extend(self.i32s[1..=batch].iter().map(|&e| e as usize - 1));
        self.u64s.clear();
        self.u64s.extend(self.rows.iter().map(|&r| r as u64));
        self.i64s.clear();
        self.pools.clear();
        self.layer_pool.clear();
        self.cache_ptrs.clear();

        let padded_cu = self.i32s[..=batch].to_vec();
        let kv_step = KvStep {
            format: QkvFormat::Thd,
            cu_seqlens: cu,
            max_seqlen: plan.max_seqlen_q(),
        };
        for layer in &model.layers {
            let (lay, storage) = cache.step_storage(layer.index)?;
            let KvStore::Cuda(storage) = storage else {
                return Err(ModelError::Cuda(
                    "the KV cache is in host memory; a CUDA model needs Runner::new_cache".into(),
                ));
            };
            storage.take_error()?;
            let (k_cache, v_cache) = storage.layer_mut(layer.index)?;
            let stream = dev.stream();
            self.cache_ptrs
                .extend([k_cache.device_ptr(stream).0, v_cache.device_ptr(stream).0]);
            let key = (lay.page_table.as_ptr() as usize, lay.ring_len, layer.window);
            if let Some(p) = self.pools.iter().position(|p| p.key == key) {
                self.layer_pool.push(p);
                continue;
            }
            let mut save = KvSavePlan::new(
                [t * hkv * d, t * hkv * d, k_cache.len(), v_cache.len()],
                &lay,
                &kv_step,
            )?;
            save.pad_rows(batch - b);
            let (width, splits) = match pad_to {
                Some(_) => {
                    let w = lay.max_pages_per_seq.next_power_of_two();
                    let keys = w * lay.page_size;
                    (
                        w,
                        Some(layer.attention.cuda_kv_splits(dev, batch, 1, keys)?),
                    )
                }
                None => (lay.max_pages_per_seq, None),
            };
            let (table, lens) = pad_layout(&lay, batch, width);
            let padded = KvCacheLayout {
                page_table: &table,
                max_pages_per_seq: width,
                cache_seqlens: &lens,
                ..lay
            };
            let meta = AttnMetadata {
                batch,
                max_seqlen_q: 0,
                max_seqlen_kv: 0,
                cu_seqlens_q: Some(&padded_cu),
                cu_seqlens_kv: None,
            };
            let kv = CudaKvInput::Cache {
                k_cache: k_cache.slice(..),
                v_cache: v_cache.slice(..),
                layout: padded,
            };
            let lens = CudaAttnLens {
                q: t * hq * d,
                out: t * hq * d,
                lse: None,
            };
            let attn = layer
                .attention
                .prepare_cuda(dev, lens, &kv, &meta, splits)?;
            let (pairs_at, meta_at) = (self.u64s.len(), self.i64s.len());
            self.u64s.extend_from_slice(save.pairs());
            if let Some(a) = &attn {
                self.i64s.extend_from_slice(a.meta());
            }
            self.layer_pool.push(self.pools.len());
            self.pools.push(PoolPlan {
                key,
                save,
                attn,
                pairs_at,
                meta_at,
            });
        }
        Ok(())
    }

    /// The shape a captured graph depends on.
    pub(crate) fn shape(&self) -> PlanShape {
        PlanShape {
            lens: [
                self.i32s.len(),
                self.tokens.len(),
                self.u64s.len(),
                self.i64s.len(),
            ],
            attn: self
                .pools
                .iter()
                .map(|p| p.attn.as_ref().map(CudaAttnLaunch::shape))
                .collect(),
            save_rows: self.pools.iter().map(|p| p.save.rows()).collect(),
            cache_ptrs: self.cache_ptrs.clone(),
        }
    }

    /// Copies the host half to the device: one copy per dtype, on
    /// `stream` (before the step's launches; never inside a capture).
    pub(crate) fn upload(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        upload(stream, &mut self.d_i32, &self.i32s)?;
        upload(stream, &mut self.d_u32, &self.tokens)?;
        upload(stream, &mut self.d_u64, &self.u64s)?;
        upload(stream, &mut self.d_i64, &self.i64s)
    }

    /// The host `cu_seqlens_q: [B + 1]` and `start_positions: [B]`.
    pub(crate) fn host_rope(&self) -> (&[i32], &[i32]) {
        self.i32s.split_at(self.batch + 1)
    }

    /// The device `cu_seqlens_q` and `start_positions`.
    pub(crate) fn rope_views(&self) -> Result<(CudaView<'_, i32>, CudaView<'_, i32>)> {
        let n = self.batch + 1;
        Ok((
            view(&self.d_i32, 0..n)?,
            view(&self.d_i32, n..n + self.batch)?,
        ))
    }

    /// The device tokens `[t]`.
    pub(crate) fn tokens_view(&self) -> Result<CudaView<'_, u32>> {
        view(&self.d_u32, 0..self.tokens.len())
    }

    /// The device logit rows `[n]` u64.
    pub(crate) fn rows_view(&self) -> Result<CudaView<'_, u64>> {
        view(&self.d_u64, 0..self.rows.len())
    }

    /// Layer `layer`'s KV save, its pairs on the device, its attention
    /// launch (none: no rows) and its metadata on the device.
    #[allow(clippy::type_complexity)]
    pub(crate) fn layer(
        &self,
        layer: usize,
    ) -> Result<(
        &KvSavePlan,
        CudaView<'_, u64>,
        Option<(&CudaAttnLaunch, CudaView<'_, i64>)>,
    )> {
        let p = self
            .layer_pool
            .get(layer)
            .map(|&p| &self.pools[p])
            .ok_or_else(|| ModelError::Cuda(format!("the step plan has no layer {layer}")))?;
        let pairs = view(&self.d_u64, p.pairs_at..p.pairs_at + p.save.pairs().len())?;
        let attn = match &p.attn {
            Some(a) => Some((a, view(&self.d_i64, p.meta_at..p.meta_at + a.meta().len())?)),
            None => None,
        };
        Ok((&p.save, pairs, attn))
    }
}
