//! Hugging Face model directories: `config.json` (+ `generation_config.json`
//! for EOS ids) into a [`ModelConfig`], and safetensors weights (single file
//! or sharded through `model.safetensors.index.json`, memory-mapped) as a
//! [`TensorSource`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use te_kernels::rope::{RopeConvention, RopeScaling};

use crate::config::{plausible_layers, Activation, Architecture, ModelConfig};
use crate::weights::{StoredTensor, TensorSource};
use crate::{ModelError, Result};

/// `config.json` as Hugging Face writes it (the fields te-rs reads).
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    text_config: Option<Box<HfConfig>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

fn field<T>(v: Option<T>, name: &str) -> Result<T> {
    v.ok_or_else(|| ModelError::Config {
        field: name.to_string(),
        reason: "missing from config.json".into(),
    })
}

fn token_ids(v: &Option<serde_json::Value>, name: &str) -> Result<Vec<u32>> {
    let bad = || ModelError::Config {
        field: name.to_string(),
        reason: "expected a token id or a list of token ids".into(),
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(vec![]),
        Some(serde_json::Value::Number(n)) => Ok(vec![n.as_u64().ok_or_else(bad)? as u32]),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().map(|x| x as u32).ok_or_else(bad))
            .collect(),
        Some(_) => Err(bad()),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| ModelError::Format {
        path: path.to_path_buf(),
        reason: format!("invalid JSON: {e}"),
    })
}

/// Reads `dir/config.json` (and `generation_config.json` if present).
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let mut cfg = config_from_json_text(&path, &read_json(&path)?)?;
    let gen_path = dir.join("generation_config.json");
    if gen_path.exists() {
        #[derive(Deserialize)]
        struct Gen {
            eos_token_id: Option<serde_json::Value>,
        }
        let gen: Gen = parse_json(&gen_path, &read_json(&gen_path)?)?;
        let eos = token_ids(&gen.eos_token_id, "generation_config.eos_token_id")?;
        if !eos.is_empty() {
            cfg.eos_token_ids = eos;
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Resolves the text of a Hugging Face `config.json` (`path` is named in
/// JSON errors) into a [`ModelConfig`], not yet validated.
pub fn config_from_json_text(path: &Path, text: &str) -> Result<ModelConfig> {
    let mut raw: HfConfig = parse_json(path, text)?;
    let model_type = field(raw.model_type.clone(), "model_type")?;
    if let Some(text) = raw.text_config.take() {
        // Multimodal Gemma 3 wraps the text model's config.
        raw = HfConfig {
            model_type: Some(model_type.clone()),
            ..*text
        };
    }
    let architecture = Architecture::parse(&model_type).ok_or_else(|| ModelError::Config {
        field: "model_type".into(),
        reason: format!("unknown model_type `{model_type}` (supported: llama, mistral, gemma, gemma2, gemma3, gemma3_text)"),
    })?;
    config_from_hf(architecture, &raw)
}

fn config_from_hf(architecture: Architecture, raw: &HfConfig) -> Result<ModelConfig> {
    let gemma = architecture.is_gemma();
    let hidden_size = field(raw.hidden_size, "hidden_size")?;
    let num_attention_heads = field(raw.num_attention_heads, "num_attention_heads")?;
    let num_hidden_layers = plausible_layers(
        "num_hidden_layers",
        field(raw.num_hidden_layers, "num_hidden_layers")?,
    )?;
    let head_dim = raw
        .head_dim
        .unwrap_or(hidden_size / num_attention_heads.max(1));
    let rope_theta = raw.rope_theta.unwrap_or(10000.0) as f32;
    let rope_scaling = match &raw.rope_scaling {
        None => RopeScaling::None,
        Some(s) => {
            let kind = s
                .rope_type
                .as_deref()
                .or(s.kind.as_deref())
                .unwrap_or("default");
            let factor = || field(s.factor, "rope_scaling.factor");
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: factor()? },
                "llama3" => RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: field(s.low_freq_factor, "rope_scaling.low_freq_factor")?,
                    high_freq_factor: field(s.high_freq_factor, "rope_scaling.high_freq_factor")?,
                    original_max_position_embeddings: field(
                        s.original_max_position_embeddings,
                        "rope_scaling.original_max_position_embeddings",
                    )?,
                },
                other => {
                    return Err(ModelError::Config {
                        field: "rope_scaling.rope_type".into(),
                        reason: format!(
                            "unsupported `{other}` (supported: default, linear, llama3)"
                        ),
                    })
                }
            }
        }
    };
    let act = raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
        .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
    let hidden_activation = match act {
        "silu" | "swish" => Activation::Silu,
        // Gemma 1 configs say `gelu` but the reference implementation uses
        // the tanh approximation (Gemma model card / HF `hidden_activation`).
        "gelu_pytorch_tanh" | "gelu_tanh" | "gelu" => Activation::GeluTanh,
        other => {
            return Err(ModelError::Config {
                field: "hidden_act".into(),
                reason: format!("unsupported activation `{other}`"),
            })
        }
    };
    let scale_base = match architecture {
        Architecture::Gemma2 | Architecture::Gemma3 => {
            field(raw.query_pre_attn_scalar, "query_pre_attn_scalar")? as f32
        }
        _ => head_dim as f32,
    };
    let layer_windows = match architecture {
        Architecture::Llama | Architecture::Gemma => vec![None; num_hidden_layers],
        Architecture::Gemma2 | Architecture::Gemma3 => {
            let w = field(raw.sliding_window, "sliding_window")?;
            match &raw.layer_types {
                Some(types) => types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(Some(w)),
                        "full_attention" => Ok(None),
                        other => Err(ModelError::Config {
                            field: "layer_types".into(),
                            reason: format!("unknown layer type `{other}`"),
                        }),
                    })
                    .collect::<Result<Vec<_>>>()?,
                None if architecture == Architecture::Gemma2 => (0..num_hidden_layers)
                    .map(|i| (i % 2 == 0).then_some(w))
                    .collect(),
                None => {
                    let pattern = raw.sliding_window_pattern.unwrap_or(6).max(1);
                    (0..num_hidden_layers)
                        .map(|i| ((i + 1) % pattern != 0).then_some(w))
                        .collect()
                }
            }
        }
    };
    let eos_token_ids = token_ids(&raw.eos_token_id, "eos_token_id")?;
    let bos_token_id = token_ids(&raw.bos_token_id, "bos_token_id")?
        .first()
        .copied();
    Ok(ModelConfig {
        architecture,
        vocab_size: field(raw.vocab_size, "vocab_size")?,
        hidden_size,
        intermediate_size: field(raw.intermediate_size, "intermediate_size")?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
        head_dim,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
        max_position_embeddings: raw.max_position_embeddings.unwrap_or(8192),
        rope_theta,
        rope_local_base_freq: match architecture {
            Architecture::Gemma3 => raw.rope_local_base_freq.unwrap_or(10000.0) as f32,
            _ => rope_theta,
        },
        rope_scaling,
        rope_convention: RopeConvention::HalfSplit,
        hidden_activation,
        softmax_scale: 1.0 / scale_base.sqrt(),
        attn_logit_softcapping: match architecture {
            Architecture::Gemma2 => raw.attn_logit_softcapping.map(|c| c as f32),
            _ => None,
        },
        final_logit_softcapping: match architecture {
            Architecture::Gemma2 => raw.final_logit_softcapping.map(|c| c as f32),
            _ => None,
        },
        layer_windows,
        scale_embedding: gemma,
        qk_norm: architecture == Architecture::Gemma3,
        sandwich_norms: matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
        attention_bias: raw.attention_bias.unwrap_or(false),
        mlp_bias: raw.mlp_bias.unwrap_or(false),
        bos_token_id,
        eos_token_ids,
    })
}

/// Safetensors weights of a Hugging Face directory, memory-mapped.
pub struct SafetensorsSource {
    /// The model directory.
    dir: PathBuf,
    /// The mapped files, kept alive for `index`.
    files: Vec<(PathBuf, memmap2::Mmap)>,
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
        return Err(ModelError::Format {
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
            return Err(ModelError::Resolve {
                model: dir.display().to_string(),
                reason: "no model.safetensors or model.safetensors.index.json".into(),
            });
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut stored = Vec::new();
        for (path, listed) in shards {
            let io = |error| ModelError::Io {
                path: path.clone(),
                error,
            };
            let file = std::fs::File::open(&path).map_err(io)?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            let bad = |e: safetensors::SafeTensorError| ModelError::Format {
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
                    let (other_path, _): &(PathBuf, memmap2::Mmap) = &files[other];
                    return Err(ModelError::Format {
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
                return Err(ModelError::Format {
                    path: index_path.clone(),
                    reason: format!(
                        "weight_map places tensor `{t}` in {}, which does not hold it",
                        path.display()
                    ),
                });
            }
            files.push((path, mmap));
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
                safetensors::SafeTensors::read_metadata(mmap).map_err(|e| ModelError::Format {
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
        let missing = || ModelError::Tensor {
            tensor: name.to_string(),
            reason: "missing from the safetensors files".into(),
        };
        let &file = self.index.get(name).ok_or_else(missing)?;
        let (path, mmap) = &self.files[file];
        let st = safetensors::SafeTensors::deserialize(mmap).map_err(|e| ModelError::Format {
            path: path.clone(),
            reason: format!("invalid safetensors: {e}"),
        })?;
        let view = st.tensor(name).map_err(|_| missing())?;
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
                return Err(ModelError::Tensor {
                    tensor: name.to_string(),
                    reason: format!("unsupported dtype {other:?} (expected F32, F16 or BF16)"),
                })
            }
        };
        Ok((view.shape().to_vec(), data))
    }
}
