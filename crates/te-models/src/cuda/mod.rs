//! The model on a GPU (`te generate --device cuda[:N]`): the same layer and
//! model code as the CPU ([`crate::device`]), run by [`ops::Cuda`], with
//! the weights uploaded once as bf16 ([`CudaModel`], `model.rs`), the KV cache in
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
//! read it there. With `--cuda-graphs` ([`CudaModel::set_graphs`]), decode
//! steps are padded to a batch bucket and replay a CUDA graph captured once
//! per bucket (`graph.rs`); [`CudaRunner`] (`runner.rs`) picks one or the
//! other for each step. This file only declares the modules.
//!
//! Status: compile-checked (Rust and NVRTC + ptxas); not yet run on a GPU.
//! The parity tests (`tests/cuda_model.rs`) and the GPU bundle are ready for
//! the first GPU machine.

mod device;
mod graph;
mod libs;
mod model;
pub mod ops;
mod plan;
mod runner;
pub mod storage;

pub use device::Device;
pub use libs::check_libraries;
pub use model::CudaModel;
pub use ops::{Cuda, CudaLinear, GemmBackend, LAUNCHES};
pub use runner::CudaRunner;
pub use storage::{CudaKvStorage, KvStore};
