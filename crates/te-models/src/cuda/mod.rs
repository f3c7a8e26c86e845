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
//! Status: compile-checked (Rust and NVRTC + ptxas); not yet run on a GPU.
//! The parity tests (`tests/cuda_model.rs`) and the GPU bundle are ready for
//! the first GPU machine. Not built yet: CUDA graphs for decode steps
//! (`--cuda-graphs`), and the per-layer uploads of the page table by
//! te-kernels' KV save and te-attention's launch (a few hundred bytes per
//! layer; the plan's `cu_seqlens`/positions for RoPE likewise).

pub mod ops;
pub mod storage;

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use te_attention::cuda::CudaKvInput;
use te_attention::AttnMetadata;
use te_cache::InferenceParams;
use te_kernels::cuda::{save_kv_cuda, CudaRopeTable};
use te_kernels::{KvStep, QkvFormat};

pub use ops::{Cuda, CudaLinear, GemmBackend, LAUNCHES};
pub use storage::{CudaKvStorage, KvStore};

use crate::layer::{Layer, Qkv, Rows};
use crate::model::{logit_rows, Logits, Model, ModelBufs};
use crate::ops::{Linear, WeightData};
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

    /// [`Device::Auto`] resolved: `Cuda(0)` when a GPU is usable, else `Cpu`.
    pub fn resolve(self) -> Self {
        match self {
            Device::Auto if check_libraries().is_ok() => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
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
        let (global, local) = model.rope_tables();
        let rope_global = CudaRopeTable::new(&cuda.dev, global)?;
        let rope_local = local
            .map(|t| CudaRopeTable::new(&cuda.dev, t))
            .transpose()?;
        Ok(CudaModel {
            cuda: std::sync::Mutex::new(cuda),
            weights,
            rope_global,
            rope_local,
        })
    }

    /// The GEMM in use.
    pub fn gemm_backend(&self) -> GemmBackend {
        self.cuda
            .lock()
            .map_or(GemmBackend::Kernel, |c| c.gemm_backend())
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

/// The CUDA path's device buffers, reused from step to step (exact
/// lengths: reallocated only when a step's size changes).
#[derive(Default)]
pub struct CudaWorkspace {
    layer: [Option<CudaSlice<f32>>; 8],
    x: Option<CudaSlice<f32>>,
    h: Option<CudaSlice<f32>>,
    logits: Option<CudaSlice<f32>>,
    ids: Option<CudaSlice<u32>>,
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
    /// logits `[b, vocab]` of each sequence's last token.
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
        logit_rows(Logits::Last, t, plan.cu_seqlens_q(), &mut ws.rows);
        let mut cuda = cm.lock()?;
        let cw = ws.cuda.get_or_insert_with(Default::default);
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
        for (dst, src) in layer_bufs.iter_mut().zip(cw.layer.iter_mut()) {
            *dst = Some(take(src)?);
        }
        let mut layer: [CudaSlice<f32>; 8] = layer_bufs.map(|b| b.expect("filled above"));
        let (mut x, mut h, mut logits) =
            (take(&mut cw.x)?, take(&mut cw.h)?, take(&mut cw.logits)?);
        let rows = Rows {
            t,
            rope_cu: plan.cu_seqlens_q(),
            rope_start: plan.start_positions(),
        };
        let result = {
            let mut attend = |l: &Layer,
                              dev: &mut Cuda,
                              qkv: Qkv<'_, CudaSlice<f32>>,
                              out: &mut CudaSlice<f32>| {
                attend_cuda(l, dev, cache, &plan, qkv, out)
            };
            self.forward_on(
                &mut *cuda,
                &cm.weights,
                [
                    &cm.rope_global,
                    cm.rope_local.as_ref().unwrap_or(&cm.rope_global),
                ],
                tokens,
                rows,
                &ws.rows,
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
        let out = result.and_then(|()| {
            if greedy {
                let b = ws.rows.len();
                let mut ids = match cw.ids.take() {
                    Some(ids) if ids.len() == b => ids,
                    _ => cuda
                        .stream()
                        .alloc_zeros::<u32>(b)
                        .map_err(|e| cuda_err("alloc", e))?,
                };
                let r = cuda
                    .argmax(&logits, vocab, &mut ids)
                    .and_then(|()| cuda.download(&ids, &mut ws.tokens));
                cw.ids = Some(ids);
                r.map(|()| true)
            } else {
                cuda.download(&logits, &mut ws.logits).map(|()| false)
            }
        });
        for (dst, src) in cw.layer.iter_mut().zip(layer) {
            *dst = Some(src);
        }
        (cw.x, cw.h, cw.logits) = (Some(x), Some(h), Some(logits));
        Ok(if out? {
            StepOutput::Tokens(&ws.tokens)
        } else {
            StepOutput::Logits(&ws.logits)
        })
    }

    /// Moves the model's compute to `device` (resolving `auto`): for CUDA,
    /// uploads the weights (bf16) and opens cuBLAS (or notes that the GEMM
    /// kernel is used). The host weights stay (the CPU reference).
    ///
    /// Errors: a missing library (named) or device, out of device memory.
    pub fn to_device(&mut self, device: Device) -> Result<Device> {
        match device.resolve() {
            Device::Cpu | Device::Auto => {
                self.cuda = None;
                Ok(Device::Cpu)
            }
            Device::Cuda(n) => {
                let use_cublas = std::env::var_os("TE_NO_CUBLAS").is_none();
                let cuda = Cuda::new(n, use_cublas)?;
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
/// (te-kernels' `save_kv_cuda`) and attends (te-attention's
/// `forward_cuda`, causal bottom-right, the layer's window and softcap).
fn attend_cuda(
    layer: &Layer,
    dev: &mut Cuda,
    cache: &mut InferenceParams<KvStore>,
    plan: &te_cache::StepPlan,
    qkv: Qkv<'_, CudaSlice<f32>>,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let (lay, storage) = cache.step_storage(layer.index)?;
    let storage = match storage {
        KvStore::Cuda(s) => s,
        KvStore::Host(_) => {
            return Err(ModelError::Cuda(
                "the KV cache is in host memory; a CUDA model needs Model::new_step_cache".into(),
            ))
        }
    };
    storage.take_error()?;
    let (k_cache, v_cache) = storage.layer_mut(layer.index)?;
    let kv_step = KvStep {
        format: QkvFormat::Thd,
        cu_seqlens: plan.cu_seqlens_q(),
        max_seqlen: plan.max_seqlen_q(),
    };
    save_kv_cuda(&dev.dev, qkv.k, qkv.v, k_cache, v_cache, &lay, &kv_step)?;
    let meta = AttnMetadata {
        batch: plan.batch_size(),
        max_seqlen_q: 0,
        max_seqlen_kv: 0,
        cu_seqlens_q: Some(plan.cu_seqlens_q()),
        cu_seqlens_kv: None,
    };
    let kv = CudaKvInput::Cache {
        k_cache: k_cache.slice(..),
        v_cache: v_cache.slice(..),
        layout: lay,
    };
    let q = qkv.q.slice(..);
    let mut o = out.slice_mut(..);
    layer
        .attention
        .forward_cuda(&dev.dev, &q, &kv, &meta, &mut o, None)?;
    Ok(())
}
