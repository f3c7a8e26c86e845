//! The model on a GPU (`te generate --device cuda[:N]`): the same layer and
//! model code as the CPU ([`crate::device`]), run by [`ops::Cuda`], with
//! the weights uploaded once as bf16 ([`CudaModel`]), the KV cache in
//! device memory ([`CudaKvStorage`] behind te-cache's `KvStorage`), f32
//! activations and accumulation, and greedy argmax on the device (a decode
//! step copies back one id per sequence).
//!
//! Libraries, all loaded at run time (cudarc's dynamic loading): the
//! driver (`libcuda`) and NVRTC (`libnvrtc`) are required (an error naming
//! the missing one); cuBLAS (`libcublas`) is optional: without it the
//! products run on te-rs' own GEMM kernel, with a note on stderr. They are
//! found on `LD_LIBRARY_PATH` under their unversioned or CUDA 12 names
//! (`libcublas.so`, `libcublas.so.12`); for CUDA 13 wheels (`.so.13` only),
//! `xtask/gpu/run.sh` links the unversioned names into a directory first.
//!
//! A step's metadata (tokens, RoPE runs, KV-save rows, attention's
//! per-sequence fields and page tables, logit rows) is built on the host
//! once and uploaded once per step (`DevicePlan`, `plan.rs`); every layer's launches
//! read it there. With `--cuda-graphs` ([`Model::set_cuda_graphs`]), decode
//! steps are padded to a batch bucket and replay a CUDA graph captured once
//! per bucket (`graph.rs`).
//!
//! Status: compile-checked (Rust and NVRTC + ptxas); not yet run on a GPU.
//! The parity tests (`tests/cuda_model.rs`) and the GPU bundle are ready for
//! the first GPU machine.

mod graph;
pub mod ops;
mod plan;
pub mod storage;

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use te_cache::InferenceParams;
use te_kernels::cuda::{save_kv_cuda_planned, CudaRopeTable};

pub use ops::{Cuda, CudaLinear, GemmBackend, LAUNCHES};
use plan::DevicePlan;
pub use storage::{CudaKvStorage, KvStore};

use crate::layer::{Layer, Qkv, Rows};
use crate::model::{Logits, Model, ModelBufs, RopeTables};
use te_formats::WeightData;

use crate::ops::Linear;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};
use ops::cuda_err;

/// Where a model runs (`te generate --device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host (rayon), the default.
    Cpu,
    /// GPU `N` (`cuda` = `cuda:0`).
    Cuda(usize),
    /// GPU 0 when the driver and NVRTC load and a device exists, else the
    /// CPU.
    Auto,
}

impl Device {
    /// Parses `cpu`, `cuda`, `cuda:N` or `auto`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            "auto" => Ok(Device::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    ModelError::Request(format!(
                        "--device `{s}`: expected cpu, cuda, cuda:N or auto"
                    ))
                }),
        }
    }

    /// Opens the GPU this names, before any weights are read (so a
    /// missing GPU fails in a moment, not after loading): `Cpu` gives
    /// `None`; `Cuda(n)` opens GPU `n` (driver, NVRTC, the device, and
    /// cuBLAS unless `TE_NO_CUBLAS` is set, else a note that our GEMM
    /// kernel runs); `Auto` opens GPU 0 when it can, else gives `None`
    /// with a note on stderr saying why.
    ///
    /// Errors (`Cuda(n)` only): the missing library, or the device that
    /// failed to open, named.
    pub fn open(self) -> Result<Option<Cuda>> {
        let use_cublas = std::env::var_os("TE_NO_CUBLAS").is_none();
        match self {
            Device::Cpu => Ok(None),
            Device::Cuda(n) => Cuda::new(n, use_cublas).map(Some),
            Device::Auto => match Cuda::new(0, use_cublas) {
                Ok(cuda) => Ok(Some(cuda)),
                Err(e) => {
                    eprintln!("note: --device auto: no usable GPU ({e}): running on the CPU");
                    Ok(None)
                }
            },
        }
    }
}

/// Checks the libraries the CUDA path needs: the driver with a device,
/// and NVRTC. The error names the missing one; never panics.
pub fn check_libraries() -> Result<()> {
    te_kernels::cuda::gpu_available().map_err(ModelError::Cuda)
}

/// cuBLAS on `stream` when `libcublas` loads; `None` (with a note on
/// stderr naming the library) otherwise.
pub(crate) fn load_cublas(stream: &Arc<CudaStream>) -> Option<CudaBlas> {
    // SAFETY: only tries to open the library.
    let present = std::panic::catch_unwind(|| unsafe { cudarc::cublas::sys::is_culib_present() });
    if !matches!(present, Ok(true)) {
        eprintln!(
            "note: libcublas not found on LD_LIBRARY_PATH: the products run on te-rs' GEMM kernel (kernels/gemm.cu)"
        );
        return None;
    }
    match std::panic::catch_unwind(|| CudaBlas::new(stream.clone())) {
        Ok(Ok(blas)) => Some(blas),
        Ok(Err(e)) => {
            eprintln!(
                "note: cuBLAS failed to start ({e:?}): the products run on te-rs' GEMM kernel"
            );
            None
        }
        Err(_) => {
            eprintln!(
                "note: cuBLAS panicked while loading: the products run on te-rs' GEMM kernel"
            );
            None
        }
    }
}

/// A model's weights and RoPE tables on one GPU, uploaded once: matrices
/// bf16 `[out_features, in_features]` (GGUF blocks dequantized on the host
/// first; f32 and bf16 sources rounded to nearest even, so bf16 files keep
/// their values), vectors and biases f32.
pub struct CudaModel {
    pub(crate) cuda: std::sync::Mutex<Cuda>,
    pub(crate) weights: ModelWeights<CudaLinear, CudaSlice<f32>>,
    /// The global and local layers' tables (the same upload twice when equal).
    rope_global: CudaRopeTable,
    rope_local: Option<CudaRopeTable>,
    /// Decode steps replay CUDA graphs ([`Model::set_cuda_graphs`]).
    graphs: bool,
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
    /// Uploads `model`'s weights and RoPE tables to `cuda`'s GPU.
    ///
    /// Errors: out of device memory, a driver error.
    pub fn upload(model: &Model, cuda: Cuda) -> Result<Self> {
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
        // Every position up front: device memory is not what limits a GPU
        // run, and graphs capture the tables' addresses.
        let rope = RopeTables::new(&model.config, model.config.max_position_embeddings)?;
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

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Cuda>> {
        self.cuda
            .lock()
            .map_err(|_| ModelError::Cuda("the device lock is poisoned (an earlier panic)".into()))
    }
}

/// The CUDA path's buffers, reused from step to step: those of plain
/// steps, and one set per CUDA-graph batch bucket (each graph replays
/// launches on the buffers it was captured with).
#[derive(Default)]
pub struct CudaWorkspace {
    plain: StepBufs,
    graphs: Vec<graph::GraphStep>,
}

/// The device buffers one step's launches use: the step plan (and the
/// scratch it carries), the layers' eight intermediates, the hidden state,
/// the gathered rows, the logits and the greedy ids (exact lengths:
/// reallocated only when a step's size changes), and the host copies of
/// the plan's tokens, RoPE runs and logit rows the model code reads.
#[derive(Default)]
pub(crate) struct StepBufs {
    plan: Option<Box<DevicePlan>>,
    layer: [Option<CudaSlice<f32>>; 8],
    x: Option<CudaSlice<f32>>,
    h: Option<CudaSlice<f32>>,
    logits: Option<CudaSlice<f32>>,
    ids: Option<CudaSlice<u32>>,
    tokens: Vec<u32>,
    cu: Vec<i32>,
    starts: Vec<i32>,
    rows: Vec<usize>,
}

/// What a step hands back.
#[derive(Debug)]
pub enum StepOutput<'w> {
    /// f32 logits `[b, vocab]` of each sequence's last token.
    Logits(&'w [f32]),
    /// Greedy tokens `[b]`, chosen on the device.
    Tokens(&'w [u32]),
}

impl Model {
    /// One step of `tokens: [t]` (thd order, planned by `cache.pre_step`)
    /// on the model's device: the CPU forward ([`Model::forward_with`]) or,
    /// after [`Model::to_device`], the CUDA one over a device cache (made
    /// by [`Model::new_step_cache`]). `greedy`: every sequence takes the
    /// argmax of its last logits; the CUDA path then returns
    /// [`StepOutput::Tokens`] (one id per sequence copied back), else the
    /// logits `[b, vocab]` of each sequence's last token. With
    /// [`Model::set_cuda_graphs`], a decode step (one token per sequence)
    /// of at most 128 sequences replays a CUDA graph of its batch bucket.
    ///
    /// Errors: those of [`Model::forward`]; CUDA errors; a cache whose
    /// storage is not on the model's device.
    pub fn forward_step<'w>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        greedy: bool,
        ws: &'w mut crate::layer::Workspace,
    ) -> Result<StepOutput<'w>> {
        match &self.cuda {
            None => Ok(StepOutput::Logits(self.forward_with(
                tokens,
                cache,
                Logits::Last,
                ws,
            )?)),
            Some(cm) => self.forward_cuda(cm, tokens, cache, greedy, ws),
        }
    }

    fn forward_cuda<'w>(
        &self,
        cm: &CudaModel,
        tokens: &[u32],
        cache: &mut InferenceParams<KvStore>,
        greedy: bool,
        ws: &'w mut crate::layer::Workspace,
    ) -> Result<StepOutput<'w>> {
        let plan = cache.plan().ok_or_else(|| {
            ModelError::Request("forward: no step planned (call pre_step first)".into())
        })?;
        let t = tokens.len();
        if plan.num_tokens() != t {
            return Err(ModelError::Request(format!(
                "forward: {t} tokens given, the planned step has {}",
                plan.num_tokens()
            )));
        }
        let b = plan.batch_size();
        let mut cuda = cm.lock()?;
        let cw = ws.cuda.get_or_insert_with(Default::default);
        let bucket = graph::bucket(b).filter(|_| cm.graphs && t == b);
        let bufs = match bucket {
            Some(bucket) => graph::step(
                self,
                cm,
                &mut cuda,
                &mut cw.graphs,
                bucket,
                tokens,
                cache,
                &plan,
                greedy,
            )?,
            None => {
                let bufs = &mut cw.plain;
                let dp = bufs.plan.get_or_insert_with(Default::default);
                dp.build(self, &cuda.dev, cache, &plan, tokens, None)?;
                dp.upload(cuda.stream())?;
                self.launch_step(cm, &mut cuda, bufs, cache, greedy)?;
                bufs
            }
        };
        // Rows b.. are a graph bucket's padding: dropped.
        let vocab = self.config.vocab_size;
        if greedy {
            let ids = bufs.ids.as_ref().ok_or_else(|| no_output("ids"))?;
            cuda.download(ids, &mut ws.tokens)?;
            ws.tokens.truncate(b);
            Ok(StepOutput::Tokens(&ws.tokens))
        } else {
            let logits = bufs.logits.as_ref().ok_or_else(|| no_output("logits"))?;
            cuda.download(logits, &mut ws.logits)?;
            ws.logits.truncate(b * vocab);
            Ok(StepOutput::Logits(&ws.logits))
        }
    }

    /// Issues one step's launches on `bufs` (whose plan was built and
    /// uploaded): the forward, then the argmax when `greedy`. Nothing is
    /// allocated when `bufs` already hold this step's sizes, nothing is
    /// copied and nothing waits for the device: the body a CUDA graph
    /// captures.
    pub(crate) fn launch_step(
        &self,
        cm: &CudaModel,
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
            self.forward_on(
                &mut *cuda,
                &cm.weights,
                [
                    &cm.rope_global,
                    cm.rope_local.as_ref().unwrap_or(&cm.rope_global),
                ],
                &bufs.tokens,
                rows,
                &bufs.rows,
                ModelBufs {
                    layer: &mut layer,
                    x: &mut x,
                    h: &mut h,
                    logits: &mut logits,
                },
                &mut attend,
            )
        };
        let vocab = self.config.vocab_size;
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

    /// Whether decode steps replay CUDA graphs ([`Model::set_cuda_graphs`]).
    pub fn cuda_graphs(&self) -> bool {
        self.cuda.as_ref().is_some_and(|cm| cm.graphs)
    }

    /// Turns CUDA graphs for decode steps on or off (`te generate
    /// --cuda-graphs`): a step of `b <= 128` sequences of one token each
    /// runs padded to its bucket (1, 2, 4, ..., 128), captured once per
    /// bucket (and again when a page table outgrows its captured width)
    /// and replayed with the plan rewritten in place; every other step
    /// runs launch by launch. Call before [`Model::new_step_cache`].
    ///
    /// Errors: the model is not on a GPU.
    pub fn set_cuda_graphs(&mut self, on: bool) -> Result<()> {
        match &mut self.cuda {
            Some(cm) => {
                cm.graphs = on;
                Ok(())
            }
            None if !on => Ok(()),
            None => Err(ModelError::Request(
                "--cuda-graphs needs a GPU: use --device cuda[:N] (or auto with a GPU present)"
                    .into(),
            )),
        }
    }

    /// Moves the model's compute to `device`: [`Device::open`], then
    /// [`Model::place`].
    ///
    /// Errors: a missing library (named) or device, out of device memory.
    pub fn to_device(&mut self, device: Device) -> Result<Device> {
        let gpu = device.open()?;
        self.place(gpu)
    }

    /// Moves the model's compute to `gpu` (from [`Device::open`]; `None`:
    /// the CPU): uploads the weights (bf16). The host weights stay (the
    /// CPU reference). Returns where the model now computes.
    ///
    /// Errors: out of device memory, a failed upload.
    pub fn place(&mut self, gpu: Option<Cuda>) -> Result<Device> {
        match gpu {
            None => {
                self.cuda = None;
                Ok(Device::Cpu)
            }
            Some(cuda) => {
                let n = cuda.dev.context().ordinal();
                self.cuda = Some(CudaModel::upload(self, cuda)?);
                Ok(Device::Cuda(n))
            }
        }
    }

    /// Where the model computes.
    pub fn device(&self) -> Device {
        match &self.cuda {
            None => Device::Cpu,
            Some(cm) => Device::Cuda(cm.lock().map_or(0, |c| c.dev.context().ordinal())),
        }
    }

    /// The model on the GPU, when it was moved there.
    pub fn cuda(&self) -> Option<&CudaModel> {
        self.cuda.as_ref()
    }
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
            "the KV cache is in host memory; a CUDA model needs Model::new_step_cache".into(),
        ));
    };
    let (k_cache, v_cache) = storage.layer_mut(layer.index)?;
    // The scratch leaves the plan while the plan's views are borrowed.
    let mut scratch = std::mem::take(&mut plan.attn_scratch);
    let result = (|| -> Result<()> {
        let (save, pairs, attn) = plan.layer(layer.index)?;
        save_kv_cuda_planned(d, save, &pairs, qkv.k, qkv.v, k_cache, v_cache)?;
        if let Some((launch, meta)) = attn {
            let (q, k, v) = (qkv.q.slice(..), k_cache.slice(..), v_cache.slice(..));
            let mut o = out.slice_mut(..);
            layer.attention.launch_cuda(
                d,
                launch,
                &meta,
                &q,
                [&k, &v],
                &mut o,
                None,
                &mut scratch,
            )?;
        }
        Ok(())
    })();
    plan.attn_scratch = scratch;
    result
}

/// A buffer a step should have made is missing (an earlier failed step).
fn no_output(what: &str) -> ModelError {
    ModelError::Cuda(format!(
        "the step's {what} buffer is missing (an earlier step failed)"
    ))
}
