//! Running steps on a GPU: [`CudaRunner`] holds the uploaded model and
//! the buffers its steps reuse, and picks for each step a plain launch
//! sequence or the replay of a CUDA graph.

use std::sync::Arc;

use te_cache::InferenceParams;

use super::graph::{self, DecodeStep, GraphStep};
use super::model::{no_output, CudaModel, StepBufs};
use super::storage::KvStore;
use crate::model::{planned_step, Model, StepOutput};
use crate::Result;

/// The CUDA path's buffers, reused from step to step: those of plain
/// steps, and one set per CUDA-graph batch bucket (each graph replays
/// launches on the buffers it was captured with).
#[derive(Default)]
pub(crate) struct CudaWorkspace {
    plain: StepBufs,
    graphs: Vec<GraphStep>,
}

/// A model's steps on its GPU: the uploaded weights and the device and
/// host buffers reused from step to step.
pub struct CudaRunner {
    model: Arc<CudaModel>,
    ws: CudaWorkspace,
    /// Greedy tokens `[b]` copied back from the device.
    tokens: Vec<u32>,
    /// Logits `[b, vocab]` copied back from the device.
    logits: Vec<f32>,
}

impl CudaRunner {
    /// A runner of `model`'s steps, its buffers made on the first step.
    pub fn new(model: Arc<CudaModel>) -> Self {
        CudaRunner {
            model,
            ws: CudaWorkspace::default(),
            tokens: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// The uploaded model.
    pub fn model(&self) -> &Arc<CudaModel> {
        &self.model
    }

    /// One step of `tokens: [t]` (thd order, planned by `cache.pre_step`
    /// on a device cache): `greedy` takes each sequence's argmax on the
    /// device and returns [`StepOutput::Tokens`] (one id per sequence
    /// copied back), else the logits `[b, vocab]` of each sequence's last
    /// token. With [`CudaModel::set_graphs`], a decode step (one token per
    /// sequence) of at most 128 sequences replays a CUDA graph of its
    /// batch bucket.
    ///
    /// Errors: a step not planned or not matching `tokens`, a cache in
    /// host memory, CUDA errors.
    pub fn step<'w>(
        &'w mut self,
        model: &Model,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        greedy: bool,
    ) -> Result<StepOutput<'w>> {
        let cm = &*self.model;
        let plan = planned_step(cache, tokens)?;
        let t = tokens.len();
        let b = plan.batch_size();
        let mut cuda = cm.lock()?;
        let cw = &mut self.ws;
        let bucket = graph::bucket(b).filter(|_| cm.graphs && t == b);
        let bufs = match bucket {
            Some(bucket) => {
                let step = DecodeStep {
                    tokens,
                    cache,
                    plan: &plan,
                    greedy,
                };
                graph::step(model, cm, &mut cuda, &mut cw.graphs, bucket, step)?
            }
            None => {
                let bufs = &mut cw.plain;
                let dp = bufs.plan.get_or_insert_with(Default::default);
                dp.build(model, &cuda.dev, cache, &plan, tokens, None)?;
                dp.upload(cuda.stream())?;
                cm.launch_step(model, &mut cuda, bufs, cache, greedy)?;
                bufs
            }
        };
        // Rows b.. are a graph bucket's padding: dropped.
        let vocab = model.config.vocab_size;
        if greedy {
            let ids = bufs.ids.as_ref().ok_or_else(|| no_output("ids"))?;
            cuda.download(ids, &mut self.tokens)?;
            self.tokens.truncate(b);
            Ok(StepOutput::Tokens(&self.tokens))
        } else {
            let logits = bufs.logits.as_ref().ok_or_else(|| no_output("logits"))?;
            cuda.download(logits, &mut self.logits)?;
            self.logits.truncate(b * vocab);
            Ok(StepOutput::Logits(&self.logits))
        }
    }
}
