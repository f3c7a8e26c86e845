//! The per-device step: [`Runner`] owns what one device's steps reuse
//! (the CPU workspace, or the CUDA runner with its uploaded weights and
//! buffers), makes the KV cache in that device's memory, and runs a step
//! of the one model code there. `Model` and `Workspace` name no CUDA
//! type; this is the one place that picks.

use std::sync::Arc;

use te_cache::{CacheLayout, HostKvStorage, InferenceParams};
use te_kernels::DType;

use crate::context_parallel::ContextParallel;
use crate::cuda::{CudaKvStorage, CudaModel, CudaRunner, KvStore};
use crate::layer::Workspace;
use crate::model::{Logits, Model, StepOutput};
use crate::{ModelError, Result};

/// Where a model's steps run, with that device's reused state.
pub enum Runner {
    /// The CPU forward ([`Model::forward_with`]) over one reused workspace.
    Cpu(Box<Workspace>),
    /// The CUDA forward on weights uploaded to a GPU.
    Cuda(Box<CudaRunner>),
}

impl Runner {
    /// A runner on `gpu` (weights uploaded by [`CudaModel::upload`]), or
    /// on the CPU when `None`.
    pub fn new(gpu: Option<Arc<CudaModel>>) -> Runner {
        match gpu {
            None => Runner::Cpu(Box::default()),
            Some(cm) => Runner::Cuda(Box::new(CudaRunner::new(cm))),
        }
    }

    /// A KV cache for `model` in this runner's memory (host memory on the
    /// CPU, device memory on a GPU): `max_batch_size` sequences of up to
    /// `max_seqlen` tokens, f32, with a ring for every sliding-window
    /// layer that holds steps of up to `max_step_len` tokens per sequence.
    pub fn new_cache(
        &self,
        model: &Model,
        max_batch_size: usize,
        max_seqlen: usize,
        max_step_len: usize,
        layout: CacheLayout,
    ) -> Result<InferenceParams<KvStore>> {
        let layers = model.config.num_hidden_layers;
        let storage = match self {
            Runner::Cpu(_) => KvStore::Host(HostKvStorage::new(DType::F32, layers)),
            Runner::Cuda(r) => KvStore::Cuda(CudaKvStorage::new(r.model().stream()?, layers)),
        };
        model.new_cache_in(max_batch_size, max_seqlen, max_step_len, layout, storage)
    }

    /// One step of `tokens: [t]` (thd order, planned by the last
    /// `cache.pre_step`) of `model` on this runner's device, the cache made
    /// by [`Runner::new_cache`]. `greedy`: every sequence takes the argmax
    /// of its last logits, and a GPU then returns [`StepOutput::Tokens`]
    /// (one id per sequence copied back); otherwise, and always on the
    /// CPU, the logits `[b, vocab]` of each sequence's last token.
    ///
    /// Errors: those of [`Model::forward`]; CUDA errors; a cache whose
    /// storage is not on this runner's device.
    pub fn step<'w>(
        &'w mut self,
        model: &Model,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        greedy: bool,
    ) -> Result<StepOutput<'w>> {
        match self {
            Runner::Cpu(ws) => Ok(StepOutput::Logits(model.forward_with(
                tokens,
                cache,
                Logits::Last,
                ws,
            )?)),
            Runner::Cuda(r) => r.step(model, tokens, cache, greedy),
        }
    }

    /// One step of `tokens: [t]` whose logits are those of the last
    /// `tails[b]` tokens of each sequence `b` ([`Model::forward_tails`]):
    /// f32 `[sum(tails), vocab]` (speculative verification). CPU only.
    ///
    /// Errors: those of [`Model::forward_tails`]; a GPU runner.
    pub fn step_tails<'w>(
        &'w mut self,
        model: &Model,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        tails: &[usize],
    ) -> Result<&'w [f32]> {
        match self {
            Runner::Cpu(ws) => model.forward_tails(tokens, cache, tails, ws),
            Runner::Cuda(_) => Err(ModelError::Cuda(
                "logits of several rows per sequence (speculative verification) run on the CPU only"
                    .into(),
            )),
        }
    }

    /// Whether steps run on the CPU.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Runner::Cpu(_))
    }

    /// One step of `tokens: [t]` on rank `cp.cp_rank()` of a
    /// context-parallel group ([`Model::forward_context_parallel`]: the
    /// step's rows placed by `cp`, the same model loop with collectives):
    /// the logits `[b, vocab]` of each sequence's last token, the same on
    /// every rank.
    ///
    /// Errors: a GPU runner (context parallelism runs on the CPU), and
    /// those of [`Model::forward_context_parallel`].
    pub fn step_context_parallel<'w>(
        &'w mut self,
        model: &Model,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        cp: &mut ContextParallel,
    ) -> Result<StepOutput<'w>> {
        match self {
            Runner::Cpu(ws) => Ok(StepOutput::Logits(
                model.forward_context_parallel(tokens, cache, cp, ws)?,
            )),
            Runner::Cuda(_) => Err(ModelError::Cuda(
                "context parallelism runs on the CPU only (--device cpu)".into(),
            )),
        }
    }
}
