//! Safetensors weights of a Hugging Face directory (a single
//! `model.safetensors` or shards listed in `model.safetensors.index.json`),
//! memory-mapped, as a [`TensorSource`]. Matrices stored as bf16 or f16
//! stay so, read in place from the file map (resident once, in the page
//! cache, as stored); te-kernels' matrix products decode them with f32
//! accumulation, as they do GGUF bf16/f16 weights.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::hf_config::{parse_json, read_json};
use te_kernels::quant::GgmlType;

use crate::tensor::{StoredTensor, TensorSource, WeightBytes, WeightData};
use crate::{FormatError, Result};

/// Safetensors weights of a Hugging Face directory, memory-mapped.
pub struct SafetensorsSource {
    /// The model directory.
    dir: PathBuf,
    /// The mapped files, kept alive for `index`.
    files: Vec<(PathBuf, std::sync::Arc<memmap2::Mmap>)>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
    /// Every tensor's header entry, file by file in header order.
    stored: Vec<StoredTensor>,
}

/// `name` as a path inside the model directory: relative, made of plain
/// components only (no `..`, no root, no drive prefix), so a
/// `model.safetensors.index.json` cannot point outside the directory.
fn shard_path(dir: &Path, index_path: &Path, name: &str) -> Result<PathBuf> {
    let rel = Path::new(name);
    let plain = !name.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !plain {
        return Err(FormatError::Format {
            path: index_path.to_path_buf(),
            reason: format!(
                "weight_map names shard `{name}`, which is not a relative path inside the model directory"
            ),
        });
    }
    Ok(dir.join(rel))
}

fn dtype_readable(dtype: safetensors::Dtype) -> Option<String> {
    match dtype {
        safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16 => None,
        other => Some(format!(
            "unsupported safetensors dtype {other:?} (te-rs reads F32, F16 and BF16)"
        )),
    }
}

impl SafetensorsSource {
    /// Opens `dir/model.safetensors`, or every shard listed in
    /// `dir/model.safetensors.index.json`.
    ///
    /// Errors: a missing or invalid file (named); a shard path in the
    /// index that is absolute or climbs out of `dir`; a tensor stored in
    /// two files; a `weight_map` entry naming a tensor its shard lacks.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        // (shard path, tensors the index places in it).
        let mut shards: Vec<(PathBuf, Vec<String>)> = Vec::new();
        if single.exists() {
            shards.push((single, vec![]));
        } else if index_path.exists() {
            #[derive(Deserialize)]
            struct Index {
                weight_map: HashMap<String, String>,
            }
            let idx: Index = parse_json(&index_path, &read_json(&index_path)?)?;
            let mut by_shard: std::collections::BTreeMap<String, Vec<String>> = Default::default();
            for (tensor, shard) in idx.weight_map {
                by_shard.entry(shard).or_default().push(tensor);
            }
            for (shard, tensors) in by_shard {
                shards.push((shard_path(dir, &index_path, &shard)?, tensors));
            }
        } else {
            return Err(FormatError::Resolve {
                model: dir.display().to_string(),
                reason: "no model.safetensors or model.safetensors.index.json".into(),
            });
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut stored = Vec::new();
        for (path, listed) in shards {
            let io = |error| FormatError::Io {
                path: path.clone(),
                error,
            };
            let file = std::fs::File::open(&path).map_err(io)?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            let bad = |e: safetensors::SafeTensorError| FormatError::Format {
                path: path.clone(),
                reason: format!("invalid safetensors: {e}"),
            };
            // Validates the header: data offsets contiguous from 0 up to
            // the end of the file, sizes matching dtype and shape.
            let (_, metadata) = safetensors::SafeTensors::read_metadata(&mmap).map_err(bad)?;
            let mut entries: Vec<(String, &safetensors::tensor::TensorInfo)> =
                metadata.tensors().into_iter().collect();
            entries.sort_by_key(|(_, info)| info.data_offsets.0);
            for (name, info) in entries {
                if let Some(&other) = index.get(&name) {
                    let (other_path, _): &(PathBuf, std::sync::Arc<memmap2::Mmap>) = &files[other];
                    return Err(FormatError::Format {
                        path: path.clone(),
                        reason: format!(
                            "tensor `{name}` is also stored in {}",
                            other_path.display()
                        ),
                    });
                }
                stored.push(StoredTensor {
                    name: name.clone(),
                    shape: info.shape.clone(),
                    dtype: format!("{:?}", info.dtype),
                    unreadable: dtype_readable(info.dtype),
                });
                index.insert(name, files.len());
            }
            if let Some(t) = listed.iter().find(|t| index.get(*t) != Some(&files.len())) {
                return Err(FormatError::Format {
                    path: index_path.clone(),
                    reason: format!(
                        "weight_map places tensor `{t}` in {}, which does not hold it",
                        path.display()
                    ),
                });
            }
            files.push((path, std::sync::Arc::new(mmap)));
        }
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            files,
            index,
            stored,
        })
    }

    /// Every tensor's `(name, dtype, shape)` as the headers declare it,
    /// sorted by name (for `te inspect`).
    pub fn tensor_infos(&self) -> Result<Vec<(String, safetensors::Dtype, Vec<usize>)>> {
        let mut out = Vec::with_capacity(self.index.len());
        for (path, mmap) in &self.files {
            let (_, metadata) =
                safetensors::SafeTensors::read_metadata(mmap).map_err(|e| FormatError::Format {
                    path: path.clone(),
                    reason: format!("invalid safetensors: {e}"),
                })?;
            for (name, info) in metadata.tensors() {
                out.push((name, info.dtype, info.shape.clone()));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

impl TensorSource for SafetensorsSource {
    fn stored_tensors(&self) -> Vec<StoredTensor> {
        self.stored.clone()
    }

    fn origin(&self) -> &Path {
        &self.dir
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn load(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.with_view(name, |view, _| Self::to_f32(name, view))
    }

    /// bf16 and f16 matrices as stored ([`WeightData::Quantized`] of
    /// [`GgmlType::BF16`] / [`GgmlType::F16`], mapped from the file); f32
    /// ones as f32.
    fn load_matrix(&self, name: &str) -> Result<(Vec<usize>, WeightData)> {
        self.with_view(name, |view, mmap| {
            let ty = match view.dtype() {
                safetensors::Dtype::BF16 => GgmlType::BF16,
                safetensors::Dtype::F16 => GgmlType::F16,
                _ => {
                    return Ok((
                        view.shape().to_vec(),
                        WeightData::F32(Self::to_f32(name, view)?.1),
                    ))
                }
            };
            let bytes = view.data();
            let start = bytes.as_ptr() as usize - mmap.as_ptr() as usize;
            let data = WeightBytes::mapped(mmap.clone(), start..start + bytes.len());
            Ok((view.shape().to_vec(), WeightData::Quantized { ty, data }))
        })
    }
}

impl SafetensorsSource {
    /// Calls `f` with tensor `name`'s view and the map of its file.
    fn with_view<T>(
        &self,
        name: &str,
        f: impl FnOnce(
            &safetensors::tensor::TensorView<'_>,
            &std::sync::Arc<memmap2::Mmap>,
        ) -> Result<T>,
    ) -> Result<T> {
        let missing = || FormatError::Tensor {
            tensor: name.to_string(),
            reason: "missing from the safetensors files".into(),
        };
        let &file = self.index.get(name).ok_or_else(missing)?;
        let (path, mmap) = &self.files[file];
        let st = safetensors::SafeTensors::deserialize(mmap).map_err(|e| FormatError::Format {
            path: path.clone(),
            reason: format!("invalid safetensors: {e}"),
        })?;
        let view = st.tensor(name).map_err(|_| missing())?;
        f(&view, mmap)
    }

    /// A tensor's values as f32.
    fn to_f32(
        name: &str,
        view: &safetensors::tensor::TensorView<'_>,
    ) -> Result<(Vec<usize>, Vec<f32>)> {
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(FormatError::Tensor {
                    tensor: name.to_string(),
                    reason: format!("unsupported dtype {other:?} (expected F32, F16 or BF16)"),
                })
            }
        };
        Ok((view.shape().to_vec(), data))
    }
}
