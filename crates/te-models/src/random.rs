//! Random-weight models: `--model random:<preset>` or
//! `--model random:<path/to/config.json>`, for checks and benchmarks that
//! need an architecture's shapes but no weight files.
//!
//! Spec: `random:NAME[?seed=N][&dtype=f32|bf16]`. `NAME` is a preset of
//! [`PRESETS`] or, when it contains a `/` or ends in `.json`, a Hugging
//! Face `config.json` of any supported architecture. `seed` defaults to 0;
//! `dtype` (the storage of every tensor, math stays f32) to f32 for the
//! `tiny-*` presets and bf16 for everything else, so `random:gemma-7b`
//! takes its checkpoint's 17 GB rather than 34.
//!
//! Weights: the tensors a Hugging Face checkpoint of the config holds
//! ([`crate::validate::expected_tensors`], Hugging Face names), each
//! generated only when loaded. Element `i` of tensor `name` is a function
//! of `(seed, name, i)` alone (a SplitMix64-style hash of a per-tensor key
//! and `i`), so any tensor, or any part of one, comes out the same in any
//! order and on any thread. Values are near-normal (Irwin–Hall: the sum of
//! four 16-bit uniforms, centred and scaled, bounded at ±3.46 std): matrices
//! `[out, in]` with std `1/sqrt(in)` (0.018 for Gemma-7B, near Hugging
//! Face's `initializer_range` 0.02), so every projection keeps activations
//! at unit scale and the logits stay finite; norm weights stored as Hugging
//! Face stores them, an effective multiplier of 1 ± 0.1 (Llama: `1 + n`,
//! Gemma: `n` of its `(1 + w)`); biases std 0.02.
//!
//! Tokenizer: none ships with a random model, so it gets
//! [`Tokenizer::bytes`]: each UTF-8 byte of a prompt is one token, and
//! every other id decodes as `<ID>`.

use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;

use crate::config::ModelConfig;
use te_formats::hf_config::read_json;

use crate::hf::config_from_json_text;
use crate::validate::expected_tensors;
use te_formats::WeightData;
use te_formats::{StoredTensor, TensorSource};
use te_kernels::quant::GgmlType;
use te_tokenizer::Tokenizer;

use crate::family::NameScheme;
use crate::{ModelError, Result};

/// A built-in config for `random:<name>`: Hugging Face `config.json` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    /// The name after `random:`.
    pub name: &'static str,
    /// What it is, for `te inspect` and error messages.
    pub about: &'static str,
    /// The `config.json` text.
    pub config_json: &'static str,
}

/// The presets. The full-size ones carry the numbers of the published
/// `config.json` of `google/gemma-7b`, `meta-llama/Meta-Llama-3-8B`,
/// `google/gemma-3-1b-pt`, `Qwen/Qwen2.5-7B` and `Qwen/Qwen3-8B`; the tiny ones are small members of each family
/// with every feature it has (GQA, Llama 3 RoPE scaling, YaRN, sliding
/// windows, softcaps, q/k norms, q/k/v biases, a separate local RoPE base), sized so a test runs
/// them in milliseconds. Their softcaps are small enough to bite at unit-scale
/// activations (Gemma 2 itself uses 50 and 30).
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "gemma-7b",
        about: "Gemma 7B (google/gemma-7b config), 8.5B parameters",
        config_json: r#"{
  "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
  "attention_bias": false, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
  "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "intermediate_size": 24576,
  "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 28,
  "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000
}"#,
    },
    Preset {
        name: "llama-3-8b",
        about: "Llama 3 8B (meta-llama/Meta-Llama-3-8B config), 8.0B parameters",
        config_json: r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "attention_bias": false, "bos_token_id": 128000, "eos_token_id": 128001,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 128256
}"#,
    },
    Preset {
        name: "gemma-3-1b",
        about: "Gemma 3 1B (google/gemma-3-1b-pt config), 1.0B parameters",
        config_json: r#"{
  "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
  "attention_bias": false, "attn_logit_softcapping": null, "bos_token_id": 2,
  "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
  "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
  "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
  "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16", "vocab_size": 262144
}"#,
    },
    Preset {
        name: "qwen2.5-7b",
        about: "Qwen2.5 7B (Qwen/Qwen2.5-7B config), 7.6B parameters",
        config_json: r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
  "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
  "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_sliding_window": false, "vocab_size": 152064
}"#,
    },
    Preset {
        name: "qwen3-8b",
        about: "Qwen3 8B (Qwen/Qwen3-8B config), 8.2B parameters",
        config_json: r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
  "attention_bias": false, "bos_token_id": 151643, "eos_token_id": 151645,
  "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
  "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
  "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_sliding_window": false,
  "vocab_size": 151936
}"#,
    },
    Preset {
        name: "tiny-llama",
        about: "a 2-layer Llama: GQA 4/2, Llama 3 RoPE scaling, untied output",
        config_json: r#"{
  "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 160, "head_dim": 16,
  "max_position_embeddings": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
  "tie_word_embeddings": false, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-gemma",
        about: "a 2-layer Gemma: GQA 4/2, GeGLU, tied embedding",
        config_json: r#"{
  "model_type": "gemma", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
  "hidden_act": "gelu", "hidden_size": 64, "intermediate_size": 192, "head_dim": 16,
  "max_position_embeddings": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-gemma2",
        about: "a 3-layer Gemma 2: sliding window 4 on even layers, softcaps, sandwich norms",
        config_json: r#"{
  "model_type": "gemma2", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 192,
  "head_dim": 16, "max_position_embeddings": 1024, "num_attention_heads": 4,
  "num_hidden_layers": 3, "num_key_value_heads": 2, "query_pre_attn_scalar": 24,
  "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4,
  "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-gemma3",
        about: "a 4-layer Gemma 3: sliding window 4 (pattern 2), local RoPE base, linear-scaled global RoPE, q/k norms",
        config_json: r#"{
  "model_type": "gemma3_text", "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 192,
  "head_dim": 16, "max_position_embeddings": 1024, "num_attention_heads": 4,
  "num_hidden_layers": 4, "num_key_value_heads": 2, "query_pre_attn_scalar": 16,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
  "rope_scaling": {"rope_type": "linear", "factor": 2.0},
  "sliding_window": 4, "sliding_window_pattern": 2, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-llama3",
        about: "a 2-layer Llama 3.2: GQA 8/2, Llama 3 RoPE scaling (factor 32), tied output",
        config_json: r#"{
  "model_type": "llama", "bos_token_id": 1, "eos_token_id": [2, 3],
  "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 160, "head_dim": 8,
  "max_position_embeddings": 1024, "num_attention_heads": 8, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
  "tie_word_embeddings": true, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-mistral",
        about: "a 2-layer Mistral: GQA 4/2, sliding window 4 on every layer",
        config_json: r#"{
  "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 160, "head_dim": 16,
  "max_position_embeddings": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "sliding_window": 4, "tie_word_embeddings": false, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-qwen2",
        about: "a 3-layer Qwen2: q/k/v biases, YaRN (factor 4 over 16 positions), sliding window 5 from layer 2, tied",
        config_json: r#"{
  "model_type": "qwen2", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 160,
  "max_position_embeddings": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
  "use_sliding_window": true, "max_window_layers": 2, "sliding_window": 5,
  "tie_word_embeddings": true, "vocab_size": 320
}"#,
    },
    Preset {
        name: "tiny-qwen3",
        about: "a 2-layer Qwen3: q/k norms, head_dim 24 (heads x head_dim != hidden), GQA 4/2",
        config_json: r#"{
  "model_type": "qwen3", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": false,
  "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 160, "head_dim": 24,
  "max_position_embeddings": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "vocab_size": 320
}"#,
    },
];

/// Where a random model's config comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RandomConfig {
    /// A built-in preset.
    Preset(&'static Preset),
    /// A Hugging Face `config.json`.
    File(PathBuf),
}

/// Storage of a random model's tensors (the math is f32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RandomDtype {
    F32,
    Bf16,
}

impl RandomDtype {
    /// The dtype name as safetensors writes it (`F32`, `BF16`).
    pub fn name(self) -> &'static str {
        match self {
            RandomDtype::F32 => "F32",
            RandomDtype::Bf16 => "BF16",
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            RandomDtype::F32 => 4,
            RandomDtype::Bf16 => 2,
        }
    }
}

/// A parsed `random:` spec: what to build, nothing generated yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomModel {
    /// The whole `--model` argument (`random:tiny-gemma3?seed=7`), named
    /// in errors.
    pub spec: String,
    pub config: RandomConfig,
    /// Seed of every tensor.
    pub seed: u64,
    pub dtype: RandomDtype,
}

fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl RandomModel {
    /// Parses `spec` (`random:NAME[?seed=N][&dtype=f32|bf16]`, see the
    /// module doc). A config file is checked to exist here, read later.
    ///
    /// Errors: [`ModelError::Resolve`] naming the spec: not `random:`, an
    /// unknown preset (listing the presets), a missing config file, an
    /// unknown option or a bad value.
    pub fn parse(spec: &str) -> Result<RandomModel> {
        let err = |reason: String| ModelError::Resolve {
            model: spec.to_string(),
            reason,
        };
        let rest = spec
            .strip_prefix("random:")
            .ok_or_else(|| err("does not start with `random:`".into()))?;
        let (name, options) = rest.split_once('?').unwrap_or((rest, ""));
        if name.is_empty() {
            return Err(err(format!(
                "no preset or config.json after `random:` (presets: {})",
                preset_names()
            )));
        }
        let config = if name.contains('/') || name.ends_with(".json") {
            let path = PathBuf::from(name);
            if !path.is_file() {
                return Err(err(format!("no such config file {}", path.display())));
            }
            RandomConfig::File(path)
        } else {
            let preset = PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
                err(format!(
                    "unknown preset `{name}` (presets: {}; or a path to a config.json)",
                    preset_names()
                ))
            })?;
            RandomConfig::Preset(preset)
        };
        let mut seed = 0;
        let mut dtype = match config {
            RandomConfig::Preset(p) if p.name.starts_with("tiny-") => RandomDtype::F32,
            _ => RandomDtype::Bf16,
        };
        for option in options.split('&').filter(|o| !o.is_empty()) {
            match option.split_once('=') {
                Some(("seed", v)) => {
                    seed = v
                        .parse()
                        .map_err(|_| err(format!("seed `{v}` is not an unsigned integer")))?
                }
                Some(("dtype", "f32")) => dtype = RandomDtype::F32,
                Some(("dtype", "bf16")) => dtype = RandomDtype::Bf16,
                Some(("dtype", v)) => return Err(err(format!("dtype `{v}` is not f32 or bf16"))),
                _ => {
                    return Err(err(format!(
                        "unknown option `{option}` (options: seed=N, dtype=f32|bf16)"
                    )))
                }
            }
        }
        Ok(RandomModel {
            spec: spec.to_string(),
            config,
            seed,
            dtype,
        })
    }

    /// The resolved, validated config (the preset's or the file's).
    ///
    /// Errors: reading the file, and everything [`crate::hf`] reports about
    /// a `config.json`, naming the field.
    pub fn load_config(&self) -> Result<ModelConfig> {
        let cfg = match &self.config {
            RandomConfig::Preset(p) => config_from_json_text(Path::new(&self.spec), p.config_json)?,
            RandomConfig::File(path) => config_from_json_text(path, &read_json(path)?)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The byte tokenizer of the config ([`Tokenizer::bytes`]).
    ///
    /// Errors: those of [`Self::load_config`] and [`Tokenizer::bytes`].
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let cfg = self.load_config()?;
        Ok(Tokenizer::bytes(
            cfg.vocab_size,
            cfg.bos_token_id,
            &cfg.eos_token_ids,
        )?)
    }

    /// The tensors of `cfg` (the config from [`Self::load_config`]),
    /// generated on demand.
    pub fn tensors(&self, cfg: &ModelConfig) -> RandomTensors {
        let tensors = expected_tensors(cfg, NameScheme::HuggingFace)
            .into_iter()
            .filter(|t| t.required)
            .map(|t| StoredTensor {
                name: t.name,
                shape: t.shape,
                dtype: self.dtype.name().to_string(),
                unreadable: None,
            })
            .collect();
        RandomTensors {
            origin: PathBuf::from(&self.spec),
            tensors,
            seed: self.seed,
            dtype: self.dtype,
            // Effective multipliers near 1: Gemma stores w of (1 + w).
            norm_base: 1.0 - cfg.architecture.family().hf_norm_offset,
        }
    }
}

/// The tensors of a random model as a [`TensorSource`] (Hugging Face
/// names), each generated when loaded.
#[derive(Debug, Clone)]
pub struct RandomTensors {
    origin: PathBuf,
    tensors: Vec<StoredTensor>,
    seed: u64,
    dtype: RandomDtype,
    /// The stored value of a norm weight that multiplies by 1 (Llama 1,
    /// Gemma 0 of its `(1 + w)`).
    norm_base: f32,
}

/// SplitMix64's increment (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective 64-bit mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a of a tensor name.
fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Element `i` of the stream `key`: near-normal with mean 0 and std 1
/// (four 16-bit uniforms on (0, 1), each of variance ~1/12, summed and
/// centred: variance 1/3, so times sqrt(3)).
fn unit_normal(key: u64, i: u64) -> f32 {
    let u = mix64(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)));
    let lanes = (0..4).map(|j| ((u >> (16 * j)) & 0xFFFF) as f32 + 0.5);
    let sum: f32 = lanes.sum::<f32>() / 65536.0;
    (sum - 2.0) * 3f32.sqrt()
}

/// How one tensor's values are drawn: `mean + std * unit_normal`.
#[derive(Clone, Copy)]
struct Draw {
    key: u64,
    mean: f32,
    std: f32,
}

impl Draw {
    fn value(self, i: usize) -> f32 {
        self.mean + self.std * unit_normal(self.key, i as u64)
    }
}

impl RandomTensors {
    fn find(&self, name: &str) -> te_formats::Result<&StoredTensor> {
        self.tensors.iter().find(|t| t.name == name).ok_or_else(|| {
            te_formats::FormatError::Tensor {
                tensor: name.to_string(),
                reason: format!("not a tensor of {}", self.origin.display()),
            }
        })
    }

    fn draw(&self, t: &StoredTensor) -> Draw {
        let key = mix64(self.seed ^ fnv1a(&t.name));
        match t.shape.as_slice() {
            [_, cols] => Draw {
                key,
                mean: 0.0,
                std: 1.0 / (*cols as f32).sqrt(),
            },
            _ if t.name.ends_with(".bias") => Draw {
                key,
                mean: 0.0,
                std: 0.02,
            },
            _ => Draw {
                key,
                mean: self.norm_base,
                std: 0.1,
            },
        }
    }

    /// Rows of at most this many elements are generated per rayon task.
    fn chunk(t: &StoredTensor) -> usize {
        t.shape.last().copied().unwrap_or(1).max(1)
    }
}

impl TensorSource for RandomTensors {
    /// The tensor's values as stored: bf16-rounded for a bf16 model.
    fn load(&self, name: &str) -> te_formats::Result<(Vec<usize>, Vec<f32>)> {
        let t = self.find(name)?;
        let draw = self.draw(t);
        let chunk = Self::chunk(t);
        let mut data = vec![0.0f32; t.shape.iter().product()];
        let bf16_storage = self.dtype == RandomDtype::Bf16;
        data.par_chunks_mut(chunk).enumerate().for_each(|(r, row)| {
            for (c, v) in row.iter_mut().enumerate() {
                let x = draw.value(r * chunk + c);
                *v = if bf16_storage {
                    bf16::from_f32(x).to_f32()
                } else {
                    x
                };
            }
        });
        Ok((t.shape.clone(), data))
    }

    /// A bf16 model's matrices stay bf16 (GGUF type BF16 rows, converted
    /// when used); the same values [`Self::load`] gives.
    fn load_matrix(&self, name: &str) -> te_formats::Result<(Vec<usize>, WeightData)> {
        if self.dtype == RandomDtype::F32 {
            let (shape, data) = self.load(name)?;
            return Ok((shape, WeightData::F32(data)));
        }
        let t = self.find(name)?;
        let draw = self.draw(t);
        let chunk = Self::chunk(t);
        let mut data = vec![0u8; 2 * t.shape.iter().product::<usize>()];
        data.par_chunks_mut(2 * chunk)
            .enumerate()
            .for_each(|(r, row)| {
                for (c, out) in row.chunks_exact_mut(2).enumerate() {
                    out.copy_from_slice(&bf16::from_f32(draw.value(r * chunk + c)).to_le_bytes());
                }
            });
        Ok((
            t.shape.clone(),
            WeightData::Quantized {
                ty: GgmlType::BF16,
                data: data.into(),
            },
        ))
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name == name)
    }

    fn stored_tensors(&self) -> Vec<StoredTensor> {
        self.tensors.clone()
    }

    fn origin(&self) -> &Path {
        &self.origin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_errors_name_the_spec() {
        let m = RandomModel::parse("random:tiny-gemma3?seed=7").unwrap();
        assert_eq!((m.seed, m.dtype), (7, RandomDtype::F32));
        let m = RandomModel::parse("random:gemma-7b").unwrap();
        assert_eq!((m.seed, m.dtype), (0, RandomDtype::Bf16));
        let m = RandomModel::parse("random:tiny-llama?dtype=bf16&seed=3").unwrap();
        assert_eq!((m.seed, m.dtype), (3, RandomDtype::Bf16));
        for (spec, needle) in [
            ("random:nope", "unknown preset `nope`"),
            ("random:", "no preset"),
            ("random:tiny-llama?seed=x", "seed `x`"),
            ("random:tiny-llama?dtype=f16", "dtype `f16`"),
            (
                "random:tiny-llama?colour=red",
                "unknown option `colour=red`",
            ),
            ("random:/no/such/config.json", "no such config file"),
        ] {
            let e = RandomModel::parse(spec).unwrap_err().to_string();
            assert!(e.contains(spec) && e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn presets_resolve() {
        for p in PRESETS {
            let m = RandomModel::parse(&format!("random:{}", p.name)).unwrap();
            let cfg = m
                .load_config()
                .unwrap_or_else(|e| panic!("{}: {e}", p.name));
            m.tokenizer().unwrap_or_else(|e| panic!("{}: {e}", p.name));
            assert!(!m.tensors(&cfg).tensors.is_empty());
        }
    }

    #[test]
    fn published_numbers() {
        let cfg = |n: &str| {
            RandomModel::parse(&format!("random:{n}"))
                .unwrap()
                .load_config()
                .unwrap()
        };
        let g = cfg("gemma-7b");
        assert_eq!(
            (g.hidden_size, g.intermediate_size, g.num_hidden_layers),
            (3072, 24576, 28)
        );
        assert_eq!((g.num_attention_heads, g.num_key_value_heads), (16, 16));
        let l = cfg("llama-3-8b");
        assert_eq!((l.num_key_value_heads, l.vocab_size), (8, 128256));
        let q = cfg("qwen2.5-7b");
        assert_eq!(
            (q.num_key_value_heads, q.head_dim, q.vocab_size),
            (4, 128, 152064)
        );
        assert!(q.qkv_bias && !q.attention_bias && q.layer_windows.iter().all(Option::is_none));
        let q3 = cfg("qwen3-8b");
        assert_eq!((q3.head_dim, q3.num_hidden_layers), (128, 36));
        assert!(q3.qk_norm && !q3.qkv_bias);
        let g3 = cfg("gemma-3-1b");
        assert_eq!(
            g3.layer_windows.iter().filter(|w| w.is_none()).count(),
            26 / 6
        );
    }

    /// The generator: mean 0, std 1, bounded, and a function of (key, i).
    #[test]
    fn unit_normal_moments() {
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| unit_normal(12345, i) as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        assert!(xs.iter().all(|x| x.abs() <= 2.0 * 3f64.sqrt()));
        assert_eq!(unit_normal(12345, 17), xs[17] as f32);
        assert_ne!(unit_normal(12346, 17), xs[17] as f32);
    }

    #[test]
    fn bf16_matrix_matches_load() {
        let m = RandomModel::parse("random:tiny-gemma?dtype=bf16").unwrap();
        let cfg = m.load_config().unwrap();
        let src = m.tensors(&cfg);
        let name = "model.layers.1.mlp.down_proj.weight";
        let (shape, values) = src.load(name).unwrap();
        let (_, WeightData::Quantized { ty, data }) = src.load_matrix(name).unwrap() else {
            panic!("bf16 storage expected");
        };
        assert_eq!((ty, shape), (GgmlType::BF16, vec![64, 192]));
        for (v, b) in values.iter().zip(data.chunks_exact(2)) {
            assert_eq!(*v, bf16::from_le_bytes([b[0], b[1]]).to_f32());
        }
    }

    #[test]
    fn byte_ids_skip_specials() {
        let ids = te_tokenizer::byte_token_ids(300, &[1, 2]).unwrap();
        assert_eq!(&ids[..3], &[0, 3, 4]);
        assert_eq!(ids[255], 257);
        assert!(te_tokenizer::byte_token_ids(257, &[0, 1]).is_none());
    }
}
