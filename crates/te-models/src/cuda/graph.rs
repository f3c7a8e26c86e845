//! CUDA graphs for decode steps (`--cuda-graphs`).
//!
//! A decode step of `b` sequences runs padded to the smallest bucket `B >=
//! b` of [`BUCKETS`] (padding rows: see [`super::plan`]). The first step of
//! a bucket runs its launches plainly (its result is the step's) and then
//! captures the same launches on the stream; later steps of the bucket
//! rewrite the plan's device buffers in place and replay the graph. A graph
//! is captured again when the plan's shape changes (a page table outgrew
//! its power-of-two width); a bucket whose capture fails runs plainly from
//! then on, with a note on stderr.
//!
//! Capture rules the step keeps: everything on one non-default stream
//! with cudarc's event tracking off ([`te_kernels::cuda::CudaDevice::new_capturable`]);
//! no allocation (the bucket's buffers were sized by its plain run), no
//! copy and no host wait inside the captured region (the plan is uploaded
//! before the replay, the ids copied back after).

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use te_cache::{InferenceParams, StepPlan};

use super::libs::cuda_err;
use super::model::{CudaModel, StepBufs};
use super::ops::Cuda;
use super::plan::PlanShape;
use super::storage::KvStore;
use crate::model::Model;
use crate::Result;

/// Batch buckets of graph decode steps; larger batches run plainly.
pub(crate) const BUCKETS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// The bucket of a decode step of `b` sequences, `None` for an empty step
/// or beyond the last bucket.
pub(crate) fn bucket(b: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&s| s >= b).filter(|_| b > 0)
}

/// A captured graph that may move to another thread with its workspace.
pub(crate) struct SendGraph(CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as no two use
// it at once (CUDA's graph thread-safety rules); it is reached only
// through `&mut` of the workspace that owns it, and `CudaGraph::launch`
// binds the context to the calling thread first.
unsafe impl Send for SendGraph {}

/// One bucket: its buffers, its graph and the plan shape it was captured
/// for.
#[derive(Default)]
pub(crate) struct GraphStep {
    bucket: usize,
    bufs: StepBufs,
    graph: Option<SendGraph>,
    shape: PlanShape,
    /// The graph ends with the argmax (greedy steps) or at the logits.
    greedy: bool,
    /// The capture failed once: run plainly.
    failed: bool,
}

/// One decode step as [`step`] runs it.
pub(crate) struct DecodeStep<'a> {
    /// `[b]` token ids, one per sequence, in the plan's batch order.
    pub tokens: &'a [u32],
    /// The device cache the step was planned in.
    pub cache: &'a mut InferenceParams<KvStore>,
    /// The step `cache.pre_step` planned.
    pub plan: &'a StepPlan,
    /// End with each sequence's argmax (ids) instead of at the logits.
    pub greedy: bool,
}

/// Runs the decode `step` padded to `bucket` on that bucket's buffers in
/// `graphs`: replays its graph, or runs plainly and captures. Returns the
/// buffers holding the outputs (rows past the real batch are padding).
///
/// Errors: CUDA errors of the plan upload, the launches or the replay (a
/// failed capture is not an error).
pub(crate) fn step<'g>(
    model: &Model,
    cm: &CudaModel,
    cuda: &mut Cuda,
    graphs: &'g mut Vec<GraphStep>,
    bucket: usize,
    step: DecodeStep<'_>,
) -> Result<&'g mut StepBufs> {
    let DecodeStep {
        tokens,
        cache,
        plan,
        greedy,
    } = step;
    let i = match graphs.iter().position(|g| g.bucket == bucket) {
        Some(i) => i,
        None => {
            graphs.push(GraphStep {
                bucket,
                ..Default::default()
            });
            graphs.len() - 1
        }
    };
    let g = &mut graphs[i];
    let dp = g.bufs.plan.get_or_insert_with(Default::default);
    dp.build(model, &cuda.dev, cache, plan, tokens, Some(bucket))?;
    let shape = dp.shape();
    if g.shape != shape || g.greedy != greedy {
        // Launch sizes change (or the argmax comes or goes): the old graph
        // no longer fits (and the upload below may reallocate buffers it
        // points at).
        g.graph = None;
    }
    dp.upload(cuda.stream())?;
    if let Some(SendGraph(graph)) = &g.graph {
        graph.launch().map_err(|e| cuda_err("graph launch", e))?;
        return Ok(&mut g.bufs);
    }
    // The step itself, launch by launch; it also sizes every buffer.
    cm.launch_step(model, cuda, &mut g.bufs, cache, greedy)?;
    if !g.failed {
        match capture(model, cm, cuda, &mut g.bufs, cache, greedy) {
            Ok(graph) => {
                g.graph = Some(SendGraph(graph));
                g.shape = shape;
                g.greedy = greedy;
            }
            Err(e) => {
                eprintln!(
                    "note: CUDA graph capture of batch bucket {bucket} failed ({e}); \
                     its decode steps run without a graph"
                );
                g.failed = true;
            }
        }
    }
    Ok(&mut g.bufs)
}

/// Captures the launches of one step on `bufs` (whose plan is uploaded).
/// The capture runs nothing; the stream leaves capture mode on every path.
fn capture(
    model: &Model,
    cm: &CudaModel,
    cuda: &mut Cuda,
    bufs: &mut StepBufs,
    cache: &mut InferenceParams<KvStore>,
    greedy: bool,
) -> Result<CudaGraph> {
    let stream = cuda.stream().clone();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| cuda_err("begin capture", e))?;
    let launched = cm.launch_step(model, cuda, bufs, cache, greedy);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    launched?;
    let graph = graph.map_err(|e| cuda_err("end capture", e))?;
    let graph = graph.ok_or_else(|| cuda_err("end capture", "no launches captured"))?;
    graph.upload().map_err(|e| cuda_err("graph upload", e))?;
    Ok(graph)
}
