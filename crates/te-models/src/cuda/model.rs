//! A model's weights on one GPU ([`CudaModel`], uploaded once as bf16)
//! and one step's launches over them: the same model and layer code as
//! the CPU (`crate::model::Model::forward_on`) on [`Cuda`]'s device ops,
//! with the KV cache in device memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use te_attention::cuda::CudaAttnBuffers;
use te_cache::InferenceParams;
use te_formats::WeightData;
use te_kernels::cuda::{save_kv_cuda_planned, CudaRopeTable};

use super::libs::cuda_err;
use super::ops::{Cuda, CudaLinear, GemmBackend};
use super::plan::DevicePlan;
use super::storage::KvStore;
use crate::layer::{Layer, Qkv, Rows};
use crate::model::{Model, ModelBufs, RopeTables, StepInput};
use crate::ops::Linear;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// A model's weights and RoPE tables on one GPU, uploaded once: matrices
/// bf16 `[out_features, in_features]` (GGUF blocks dequantized on the host
/// first; f32 and bf16 sources rounded to nearest even, so bf16 files keep
/// their values), vectors and biases f32.
pub struct CudaModel {
    pub(crate) cuda: std::sync::Mutex<Cuda>,
    pub(crate) weights: ModelWeights<CudaLinear, CudaSlice<f32>>,
    /// The global and local layers' tables (the same upload twice when equal).
    pub(crate) rope_global: CudaRopeTable,
    pub(crate) rope_local: Option<CudaRopeTable>,
    /// Decode steps replay CUDA graphs ([`CudaModel::set_graphs`]).
    pub(crate) graphs: bool,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel").finish_non_exhaustive()
    }
}

/// A host matrix as bf16 rows (dequantized first when quantized).
fn to_bf16(w: &Linear) -> Vec<bf16> {
    match &w.weight {
        WeightData::F32(v) => v.iter().map(|&x| bf16::from_f32(x)).collect(),
        WeightData::Quantized { .. } => w.to_f32().into_iter().map(bf16::from_f32).collect(),
    }
}

impl CudaModel {
    /// Uploads `model`'s weights and RoPE tables to `cuda`'s GPU, the
    /// tables for the run's context: positions `0..positions` (capped at
    /// `max_position_embeddings`), not the config's whole maximum. A step
    /// that reaches past them is the RoPE kernel's error naming the
    /// position.
    ///
    /// Errors: out of device memory, a driver error.
    pub fn upload(model: &Model, cuda: Cuda, positions: usize) -> Result<Self> {
        let stream = cuda.stream().clone();
        let weights = model.weights.try_map(
            |l: &Linear| -> Result<CudaLinear> {
                Ok(CudaLinear {
                    weight: stream
                        .clone_htod(&to_bf16(l))
                        .map_err(|e| cuda_err("upload", e))?,
                    bias: match &l.bias {
                        Some(b) => Some(stream.clone_htod(b).map_err(|e| cuda_err("upload", e))?),
                        None => None,
                    },
                    out_features: l.out_features,
                    in_features: l.in_features,
                })
            },
            |v: &Vec<f32>| stream.clone_htod(v).map_err(|e| cuda_err("upload", e)),
        )?;
        // Every position of the run up front: graphs capture the tables'
        // addresses.
        let positions = positions.clamp(1, model.config.max_position_embeddings);
        let rope = RopeTables::new(&model.config, positions)?;
        let rope_global = CudaRopeTable::new(&cuda.dev, &rope.global)?;
        let rope_local = rope
            .local
            .as_ref()
            .map(|t| CudaRopeTable::new(&cuda.dev, t))
            .transpose()?;
        Ok(CudaModel {
            cuda: std::sync::Mutex::new(cuda),
            weights,
            rope_global,
            rope_local,
            graphs: false,
        })
    }

    /// Whether decode steps replay CUDA graphs ([`CudaModel::set_graphs`]).
    pub fn graphs(&self) -> bool {
        self.graphs
    }

    /// Turns CUDA graphs for decode steps on or off (`te generate
    /// --cuda-graphs`): a step of `b <= 128` sequences of one token each
    /// runs padded to its bucket (1, 2, 4, ..., 128), captured once per
    /// bucket (and again when a page table outgrows its captured width)
    /// and replayed with the plan rewritten in place; every other step
    /// runs launch by launch.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.cuda.lock().map_or(0, |c| c.dev.context().ordinal())
    }

    /// The GEMM in use.
    pub fn gemm_backend(&self) -> GemmBackend {
        self.cuda
            .lock()
            .map_or(GemmBackend::Kernel, |c| c.gemm_backend())
    }

    /// Makes the products run on `backend` (the GEMM kernel's rows do not
    /// depend on the batch, cuBLAS' algorithm may: for exact comparisons).
    ///
    /// Errors: [`GemmBackend::Cublas`] when cuBLAS did not load.
    pub fn set_gemm_backend(&self, backend: GemmBackend) -> Result<()> {
        self.lock()?.set_gemm_backend(backend)
    }

    /// The stream everything runs on.
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        Ok(self.lock()?.stream().clone())
    }

    pub(crate) fn lock(&self) -> Result<std::sync::MutexGuard<'_, Cuda>> {
        self.cuda
            .lock()
            .map_err(|_| ModelError::Cuda("the device lock is poisoned (an earlier panic)".into()))
    }

    /// Issues one step's launches on `bufs` (whose plan was built and
    /// uploaded): the forward, then the argmax when `greedy`. Nothing is
    /// allocated when `bufs` already hold this step's sizes, nothing is
    /// copied and nothing waits for the device: the body a CUDA graph
    /// captures.
    pub(crate) fn launch_step(
        &self,
        model: &Model,
        cuda: &mut Cuda,
        bufs: &mut StepBufs,
        cache: &mut InferenceParams<KvStore>,
        greedy: bool,
    ) -> Result<()> {
        let dp = bufs.plan.take().ok_or_else(|| no_output("plan"))?;
        bufs.tokens.clone_from(&dp.tokens);
        bufs.rows.clone_from(&dp.rows);
        let (cu, starts) = dp.host_rope();
        bufs.cu.clear();
        bufs.cu.extend_from_slice(cu);
        bufs.starts.clear();
        bufs.starts.extend_from_slice(starts);
        let batch = bufs.rows.len();
        let stream = cuda.stream().clone();
        let take = |b: &mut Option<CudaSlice<f32>>| -> Result<CudaSlice<f32>> {
            match b.take() {
                Some(b) => Ok(b),
                None => stream
                    .alloc_zeros::<f32>(0)
                    .map_err(|e| cuda_err("alloc", e)),
            }
        };
        let mut layer_bufs = [(); 8].map(|_| None);
        for (dst, src) in layer_bufs.iter_mut().zip(bufs.layer.iter_mut()) {
            *dst = Some(take(src)?);
        }
        let mut layer: [CudaSlice<f32>; 8] = layer_bufs.map(|b| b.expect("filled above"));
        let (mut x, mut h, mut logits) = (
            take(&mut bufs.x)?,
            take(&mut bufs.h)?,
            take(&mut bufs.logits)?,
        );
        // The plan (and its scratch) belong to the device for the step.
        let mut dp = dp;
        std::mem::swap(&mut cuda.x_bf16, &mut dp.x_bf16);
        cuda.plan = Some(dp);
        let rows = Rows {
            t: bufs.tokens.len(),
            rope_cu: &bufs.cu,
            rope_start: &bufs.starts,
        };
        let result = {
            let mut attend =
                |l: &Layer,
                 dev: &mut Cuda,
                 qkv: Qkv<'_, CudaSlice<f32>>,
                 out: &mut CudaSlice<f32>| { attend_cuda(l, dev, cache, qkv, out) };
            let input = StepInput {
                tokens: &bufs.tokens,
                rows,
                logit_rows: &bufs.rows,
            };
            model.forward_on(
                &mut *cuda,
                &self.weights,
                [
                    &self.rope_global,
                    self.rope_local.as_ref().unwrap_or(&self.rope_global),
                ],
                input,
                ModelBufs {
                    layer: &mut layer,
                    x: &mut x,
                    h: &mut h,
                    logits: &mut logits,
                },
                &mut attend,
            )
        };
        let vocab = model.config.vocab_size;
        let result = result.and_then(|()| {
            if !greedy {
                return Ok(());
            }
            let mut ids = match bufs.ids.take() {
                Some(ids) if ids.len() == batch => ids,
                _ => cuda
                    .stream()
                    .alloc_zeros::<u32>(batch)
                    .map_err(|e| cuda_err("alloc", e))?,
            };
            let r = cuda.argmax(&logits, vocab, &mut ids);
            bufs.ids = Some(ids);
            r
        });
        let mut dp = cuda.plan.take().expect("set above");
        std::mem::swap(&mut cuda.x_bf16, &mut dp.x_bf16);
        bufs.plan = Some(dp);
        for (dst, src) in bufs.layer.iter_mut().zip(layer) {
            *dst = Some(src);
        }
        (bufs.x, bufs.h, bufs.logits) = (Some(x), Some(h), Some(logits));
        result
    }
}

/// The device buffers one step's launches use: the step plan (and the
/// scratch it carries), the layers' eight intermediates, the hidden state,
/// the gathered rows, the logits and the greedy ids (exact lengths:
/// reallocated only when a step's size changes), and the host copies of
/// the plan's tokens, RoPE runs and logit rows the model code reads.
#[derive(Default)]
pub(crate) struct StepBufs {
    pub(crate) plan: Option<Box<DevicePlan>>,
    pub(crate) layer: [Option<CudaSlice<f32>>; 8],
    pub(crate) x: Option<CudaSlice<f32>>,
    pub(crate) h: Option<CudaSlice<f32>>,
    pub(crate) logits: Option<CudaSlice<f32>>,
    pub(crate) ids: Option<CudaSlice<u32>>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) cu: Vec<i32>,
    pub(crate) starts: Vec<i32>,
    pub(crate) rows: Vec<usize>,
}

/// The CUDA `attend` of a layer: saves its K/V in the device cache
/// (te-kernels' `save_kv_cuda_planned`) and attends (te-attention's
/// `launch_cuda`, causal bottom-right, the layer's window and softcap),
/// both reading the step plan on the device.
fn attend_cuda(
    layer: &Layer,
    dev: &mut Cuda,
    cache: &mut InferenceParams<KvStore>,
    qkv: Qkv<'_, CudaSlice<f32>>,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let Cuda { dev: d, plan, .. } = dev;
    let plan = plan.as_deref_mut().ok_or_else(|| no_output("plan"))?;
    let (_, storage) = cache.step_storage(layer.index)?;
    let KvStore::Cuda(storage) = storage else {
        return Err(ModelError::Cuda(
            "the KV cache is in host memory; a CUDA model needs Runner::new_cache".into(),
        ));
    };
    let (k_cache, v_cache) = storage.layer_mut(layer.index)?;
    // The scratch leaves the plan while the plan's views are borrowed.
    let mut scratch = std::mem::take(&mut plan.attn_scratch);
    let result = (|| -> Result<()> {
        let (save, pairs, attn) = plan.layer(layer.index)?;
        save_kv_cuda_planned(d, save, &pairs, qkv.k, qkv.v, k_cache, v_cache)?;
        if let Some((launch, meta)) = attn {
            let bufs = CudaAttnBuffers {
                meta,
                q: qkv.q.slice(..),
                k: k_cache.slice(..),
                v: v_cache.slice(..),
                out: out.slice_mut(..),
                lse: None,
            };
            layer.attention.launch_cuda(d, launch, bufs, &mut scratch)?;
        }
        Ok(())
    })();
    plan.attn_scratch = scratch;
    result
}

/// A buffer a step should have made is missing (an earlier failed step).
pub(crate) fn no_output(what: &str) -> ModelError {
    ModelError::Cuda(format!(
        "the step's {what} buffer is missing (an earlier step failed)"
    ))
}
