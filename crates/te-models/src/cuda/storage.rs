//! KV storage in device memory ([`CudaKvStorage`]) behind te-cache's
//! [`KvStorage`], and [`KvStore`], the engine's storage on either device.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use te_cache::{CacheError, HostKvStorage, KvStorage};

use crate::{ModelError, Result};

/// Every layer's K and V on one GPU, f32: `[rows, row_k]` and `[rows,
/// row_v]` per layer (`row = h_kv * d`), rows as te-cache's bookkeeping
/// assigns them (pages, rings).
///
/// [`KvStorage::copy_rows`] cannot return an error; a failed device copy
/// is kept and returned by the next step ([`take_error`](Self::take_error)).
pub struct CudaKvStorage {
    stream: Arc<CudaStream>,
    /// `[num_layers]`, `None` until allocated.
    layers: Vec<Option<LayerKv>>,
    error: Option<String>,
}

/// One layer's (K, V, row_k, row_v).
type LayerKv = (CudaSlice<f32>, CudaSlice<f32>, usize, usize);

impl std::fmt::Debug for CudaKvStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKvStorage")
            .field("layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

impl CudaKvStorage {
    /// Empty storage of `num_layers` layers on `stream`'s device.
    pub fn new(stream: Arc<CudaStream>, num_layers: usize) -> Self {
        CudaKvStorage {
            stream,
            layers: (0..num_layers).map(|_| None).collect(),
            error: None,
        }
    }

    /// The first error of a row copy since the last call, if any.
    pub fn take_error(&mut self) -> Result<()> {
        match self.error.take() {
            Some(e) => Err(ModelError::Cuda(format!("KV cache copy-on-write: {e}"))),
            None => Ok(()),
        }
    }

    /// `layer`'s K and V tensors.
    ///
    /// Errors: the layer was never allocated.
    pub fn layer_mut(
        &mut self,
        layer: usize,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)> {
        match self.layers.get_mut(layer) {
            Some(Some((k, v, ..))) => Ok((k, v)),
            _ => Err(ModelError::Cuda(format!(
                "KV cache layer {layer} is not allocated"
            ))),
        }
    }

    /// Bytes allocated over all layers.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v, ..)| (k.len() + v.len()) * 4)
            .sum()
    }
}

impl KvStorage for CudaKvStorage {
    fn allocate(
        &mut self,
        layer: usize,
        rows: usize,
        row_k: usize,
        row_v: usize,
    ) -> std::result::Result<(), CacheError> {
        let len = |row: usize| {
            rows.checked_mul(row)
                .ok_or_else(|| CacheError::InvalidArgument {
                    arg: "total_num_pages",
                    reason: "cache size overflows usize".into(),
                })
        };
        let (nk, nv) = (len(row_k)?, len(row_v)?);
        let alloc = |n: usize| {
            self.stream
                .alloc_zeros::<f32>(n)
                .map_err(|e| CacheError::InvalidArgument {
                    arg: "total_num_pages",
                    reason: format!("device allocation of {n} f32 failed: {e:?}"),
                })
        };
        let (k, v) = (alloc(nk)?, alloc(nv)?);
        self.layers[layer] = Some((k, v, row_k, row_v));
        Ok(())
    }

    fn copy_rows(&mut self, layer: usize, src: usize, dst: usize, rows: usize) {
        let Some(Some((k, v, row_k, row_v))) = self.layers.get_mut(layer) else {
            self.error
                .get_or_insert_with(|| format!("layer {layer} is not allocated"));
            return;
        };
        for (t, row) in [(k, *row_k), (v, *row_v)] {
            // Whole pages, never overlapping: a staging copy keeps the
            // borrow checker (one slice read and written) simple.
            let from = t.slice(src * row..(src + rows) * row);
            let staged = match self.stream.clone_dtod(&from) {
                Ok(s) => s,
                Err(e) => {
                    self.error.get_or_insert_with(|| format!("{e:?}"));
                    return;
                }
            };
            let mut to = t.slice_mut(dst * row..(dst + rows) * row);
            if let Err(e) = self.stream.memcpy_dtod(&staged, &mut to) {
                self.error.get_or_insert_with(|| format!("{e:?}"));
                return;
            }
        }
    }
}

/// The engine's KV storage: host memory for a CPU model, device memory for
/// a CUDA one (`crate::runner::Runner::new_cache` picks).
#[derive(Debug)]
pub enum KvStore {
    /// Host memory, what the CPU forward reads and writes.
    Host(HostKvStorage),
    /// Device memory of the model's GPU.
    Cuda(CudaKvStorage),
}

impl KvStorage for KvStore {
    fn allocate(
        &mut self,
        layer: usize,
        rows: usize,
        row_k: usize,
        row_v: usize,
    ) -> std::result::Result<(), CacheError> {
        match self {
            KvStore::Host(s) => s.allocate(layer, rows, row_k, row_v),
            KvStore::Cuda(s) => s.allocate(layer, rows, row_k, row_v),
        }
    }

    fn copy_rows(&mut self, layer: usize, src: usize, dst: usize, rows: usize) {
        match self {
            KvStore::Host(s) => s.copy_rows(layer, src, dst, rows),
            KvStore::Cuda(s) => s.copy_rows(layer, src, dst, rows),
        }
    }

    fn as_host(&self) -> Option<&HostKvStorage> {
        match self {
            KvStore::Host(s) => Some(s),
            KvStore::Cuda(_) => None,
        }
    }

    fn as_host_mut(&mut self) -> Option<&mut HostKvStorage> {
        match self {
            KvStore::Host(s) => Some(s),
            KvStore::Cuda(_) => None,
        }
    }
}
