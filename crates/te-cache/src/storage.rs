//! Where the keys and values live: the [`KvStorage`] trait the bookkeeping
//! drives, and [`HostKvStorage`], its host-memory implementation.

use half::{bf16, f16};
use std::any::Any;
use te_kernels::{DType, Element};

use crate::error::CacheError;

/// Storage of every layer's K and V tensors, `[rows, h_kv, d_k]` and
/// `[rows, h_kv, d_v]` per layer with `rows = num_pages * page_size` of the
/// layer's pool.
///
/// The bookkeeping ([`crate::InferenceParams`]) decides which rows hold
/// what; storage only allocates and copies rows on request, so a device
/// cache implements these two methods and reuses all of the bookkeeping.
pub trait KvStorage {
    /// Allocates zeroed storage for `layer`: `rows` rows of `row_k` (K) and
    /// `row_v` (V) elements, replacing what the layer had.
    ///
    /// Errors: the size overflows or cannot be allocated.
    fn allocate(
        &mut self,
        layer: usize,
        rows: usize,
        row_k: usize,
        row_v: usize,
    ) -> Result<(), CacheError>;

    /// Copies rows `src .. src + rows` of `layer`'s K and V to `dst .. dst +
    /// rows` (the ranges never overlap: copy-on-write of a whole page).
    fn copy_rows(&mut self, layer: usize, src: usize, dst: usize, rows: usize);

    /// The storage as host memory, when it is ([`HostKvStorage`]): what
    /// [`crate::InferenceParams::step`] and `view` (the CPU KV save and
    /// attention) read and write. `None` (the default) for device storage.
    fn as_host(&self) -> Option<&HostKvStorage> {
        None
    }

    /// [`as_host`](Self::as_host), mutable.
    fn as_host_mut(&mut self) -> Option<&mut HostKvStorage> {
        None
    }
}

/// One cache tensor in its storage dtype.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tensor {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Tensor {
    fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Tensor::F32(vec![0.0; len]),
            DType::F16 => Tensor::F16(vec![f16::ZERO; len]),
            DType::BF16 => Tensor::BF16(vec![bf16::ZERO; len]),
        }
    }

    fn len(&self) -> usize {
        match self {
            Tensor::F32(v) => v.len(),
            Tensor::F16(v) => v.len(),
            Tensor::BF16(v) => v.len(),
        }
    }

    fn as_slice<T: Element>(&self) -> Option<&[T]> {
        let any: &dyn Any = match self {
            Tensor::F32(v) => v,
            Tensor::F16(v) => v,
            Tensor::BF16(v) => v,
        };
        any.downcast_ref::<Vec<T>>().map(Vec::as_slice)
    }

    fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        let any: &mut dyn Any = match self {
            Tensor::F32(v) => v,
            Tensor::F16(v) => v,
            Tensor::BF16(v) => v,
        };
        any.downcast_mut::<Vec<T>>().map(Vec::as_mut_slice)
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            Tensor::F32(v) => v.copy_within(src..src + len, dst),
            Tensor::F16(v) => v.copy_within(src..src + len, dst),
            Tensor::BF16(v) => v.copy_within(src..src + len, dst),
        }
    }
}

/// Host-memory K/V storage of one dtype (f32, f16 or bf16), chosen at run
/// time.
#[derive(Clone, Debug, PartialEq)]
pub struct HostKvStorage {
    dtype: DType,
    /// `[num_layers]` of (K, V, row_k, row_v).
    layers: Vec<(Tensor, Tensor, usize, usize)>,
}

impl HostKvStorage {
    /// Empty storage of `num_layers` layers in `dtype`.
    pub fn new(dtype: DType, num_layers: usize) -> Self {
        Self {
            dtype,
            layers: (0..num_layers)
                .map(|_| (Tensor::zeros(dtype, 0), Tensor::zeros(dtype, 0), 0, 0))
                .collect(),
        }
    }

    /// Storage dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements allocated over all layers, K and V.
    pub fn elements(&self) -> usize {
        self.layers.iter().map(|(k, v, ..)| k.len() + v.len()).sum()
    }

    /// `layer`'s K and V as `&[T]`, or `None` when `T` is not the dtype.
    pub fn layer<T: Element>(&self, layer: usize) -> Option<(&[T], &[T])> {
        let (k, v, ..) = &self.layers[layer];
        Some((k.as_slice()?, v.as_slice()?))
    }

    /// `layer`'s K and V as `&mut [T]`, or `None` when `T` is not the dtype.
    pub fn layer_mut<T: Element>(&mut self, layer: usize) -> Option<(&mut [T], &mut [T])> {
        let (k, v, ..) = &mut self.layers[layer];
        Some((k.as_mut_slice()?, v.as_mut_slice()?))
    }
}

impl KvStorage for HostKvStorage {
    fn allocate(
        &mut self,
        layer: usize,
        rows: usize,
        row_k: usize,
        row_v: usize,
    ) -> Result<(), CacheError> {
        let len = |row: usize| {
            rows.checked_mul(row)
                .ok_or_else(|| CacheError::InvalidArgument {
                    arg: "total_num_pages",
                    reason: "cache size overflows usize".into(),
                })
        };
        let (k, v) = (len(row_k)?, len(row_v)?);
        self.layers[layer] = (
            Tensor::zeros(self.dtype, k),
            Tensor::zeros(self.dtype, v),
            row_k,
            row_v,
        );
        Ok(())
    }

    fn copy_rows(&mut self, layer: usize, src: usize, dst: usize, rows: usize) {
        let (k, v, row_k, row_v) = &mut self.layers[layer];
        k.copy_within(src * *row_k, dst * *row_k, rows * *row_k);
        v.copy_within(src * *row_v, dst * *row_v, rows * *row_v);
    }

    fn as_host(&self) -> Option<&HostKvStorage> {
        Some(self)
    }

    fn as_host_mut(&mut self) -> Option<&mut HostKvStorage> {
        Some(self)
    }
}
