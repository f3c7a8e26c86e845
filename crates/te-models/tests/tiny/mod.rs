//! Tiny random-weight Hugging Face checkpoints written by the tests, an
//! independent float64 forward pass over the weights they wrote, and a
//! runner that feeds te-models any schedule of ragged steps.
//!
//! Layout of this module: [`Spec`] (the config, Hugging Face field names),
//! [`Checkpoint`] (writes `config.json` and safetensors to a temp dir),
//! [`reference_logits`] (the f64 forward), [`run_schedule`] and the
//! schedule builders, [`assert_rows_match`].
//!
//! The reference follows the Hugging Face modeling code's math (Llama,
//! Gemma, Gemma 2, Gemma 3 text) written from scratch as plain loops; it
//! reads the weights the test wrote (rounded to the stored dtype), never
//! anything computed by te-models.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use te_cache::CacheLayout;
use te_models::family::NameScheme;
use te_models::model::{Logits, Model};
use te_models::weights::ModelWeights;

// ---------------------------------------------------------------- spec

/// Model family, as Hugging Face `model_type` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma,
    Gemma2,
    Gemma3,
}

impl Family {
    fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma => "gemma",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3_text",
        }
    }

    fn is_gemma(self) -> bool {
        matches!(self, Family::Gemma | Family::Gemma2 | Family::Gemma3)
    }

    /// Per-head RMSNorm of q and k before RoPE (Gemma 3, Qwen3).
    fn qk_norm(self) -> bool {
        matches!(self, Family::Gemma3 | Family::Qwen3)
    }

    /// Gemma 2/3: post-attention and post-feedforward norms.
    fn sandwich(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3)
    }
}

/// Hugging Face `rope_scaling`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// `rope_type: "yarn"` with Hugging Face's defaults for the rest
    /// (beta_fast 32, beta_slow 1, attention factor `0.1 ln(factor) + 1`,
    /// truncated correction range).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// Dtype the safetensors file stores the weights in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    F16,
    BF16,
}

/// How `config.json` says which layers slide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowEncoding {
    /// `layer_types: ["sliding_attention", "full_attention", ...]`.
    LayerTypes,
    /// Gemma 3 `sliding_window_pattern: N` (layer i slides unless
    /// `(i + 1) % N == 0`).
    Pattern(usize),
    /// Nothing written: Gemma 2's default (even layers slide); Mistral:
    /// every layer slides when `sliding_window` is written.
    Implicit,
    /// Qwen2/3: `use_sliding_window: true` and `max_window_layers: N`
    /// (layers `i >= N` slide).
    UseSlidingWindow(usize),
}

/// A tiny model: config fields (Hugging Face names) plus how to write it.
#[derive(Clone, Debug)]
pub struct Spec {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Gemma 3: RoPE base of the sliding layers.
    pub rope_local_base_freq: Option<f64>,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub query_pre_attn_scalar: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// Keys a sliding layer's query sees, itself included.
    pub sliding_window: Option<usize>,
    /// `[num_hidden_layers]`: whether layer i is a sliding-window layer
    /// (what the reference uses; `window_encoding` says how it is written).
    pub sliding_layers: Vec<bool>,
    pub window_encoding: WindowEncoding,
    pub storage: Storage,
    /// 1: `model.safetensors`; more: shards with an index.
    pub shards: usize,
    /// Gain of the q/k projections (larger makes attention logits larger,
    /// so softcaps bite).
    pub qk_gain: f64,
    /// Hugging Face `attention_bias`: q/k/v/o biases written and used.
    pub attention_bias: bool,
    /// Hugging Face `mlp_bias`: gate/up/down biases written and used.
    pub mlp_bias: bool,
    pub seed: u64,
}

impl Spec {
    /// Llama: GQA (4 query heads, 2 KV heads), head_dim 16 with
    /// `h_q * d != hidden`, untied lm_head, SiLU.
    pub fn llama() -> Self {
        Spec {
            family: Family::Llama,
            vocab_size: 53,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_local_base_freq: None,
            rope_scaling: None,
            max_position_embeddings: 128,
            tie_word_embeddings: false,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window: None,
            sliding_layers: vec![false; 2],
            window_encoding: WindowEncoding::Implicit,
            storage: Storage::F32,
            shards: 1,
            qk_gain: 1.0,
            attention_bias: false,
            mlp_bias: false,
            seed: 1,
        }
    }

    /// Gemma (1): multi-query (1 KV head), tied, GELU-tanh, (1 + w) norms,
    /// embedding times sqrt(hidden).
    pub fn gemma() -> Self {
        Spec {
            family: Family::Gemma,
            num_key_value_heads: 1,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            seed: 2,
            ..Spec::llama()
        }
    }

    /// Gemma 2: softcaps small enough to bite, sliding window 4 on even
    /// layers (Gemma 2's default), `query_pre_attn_scalar != head_dim`.
    pub fn gemma2() -> Self {
        Spec {
            family: Family::Gemma2,
            num_key_value_heads: 2,
            head_dim: 16,
            query_pre_attn_scalar: Some(24.0),
            attn_logit_softcapping: Some(5.0),
            final_logit_softcapping: Some(3.0),
            sliding_window: Some(4),
            sliding_layers: vec![true, false],
            window_encoding: WindowEncoding::Implicit,
            qk_gain: 3.0,
            seed: 3,
            ..Spec::gemma()
        }
    }

    /// Gemma 3 text: q/k norms, sandwich norms, window 8 on layer 0 (layer
    /// types `[sliding, full]`), local RoPE base 10000 vs global 1e6.
    pub fn gemma3() -> Self {
        Spec {
            family: Family::Gemma3,
            num_key_value_heads: 1,
            head_dim: 8,
            rope_theta: 1e6,
            rope_local_base_freq: Some(10000.0),
            query_pre_attn_scalar: Some(8.0),
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window: Some(8),
            sliding_layers: vec![true, false],
            window_encoding: WindowEncoding::LayerTypes,
            qk_gain: 2.0,
            seed: 4,
            ..Spec::gemma2()
        }
    }

    /// Qwen2: biases on q/k/v (not o), SwiGLU, tied, GQA 4:2, base 1e6.
    pub fn qwen2() -> Self {
        Spec {
            family: Family::Qwen2,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            seed: 21,
            ..Spec::llama()
        }
    }

    /// Qwen3: q/k norms, `head_dim` 24 with `heads * head_dim != hidden`,
    /// untied.
    pub fn qwen3() -> Self {
        Spec {
            family: Family::Qwen3,
            head_dim: 24,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            qk_gain: 2.0,
            seed: 22,
            ..Spec::llama()
        }
    }

    /// Mistral: a sliding window of 5 keys on every layer.
    pub fn mistral() -> Self {
        Spec {
            family: Family::Mistral,
            sliding_window: Some(5),
            sliding_layers: vec![true; 2],
            seed: 23,
            ..Spec::llama()
        }
    }

    /// `config.json` as Hugging Face writes it.
    fn config_json(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        });
        let o = c.as_object_mut().expect("object");
        match self.family {
            Family::Llama | Family::Mistral | Family::Qwen2 | Family::Qwen3 => {
                o.insert("hidden_act".into(), "silu".into());
            }
            // Gemma 1 configs say `gelu` and mean the tanh approximation.
            Family::Gemma => {
                o.insert("hidden_act".into(), "gelu".into());
            }
            Family::Gemma2 | Family::Gemma3 => {
                o.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
            }
        }
        let mut put = |k: &str, v: Option<f64>| {
            if let Some(v) = v {
                o.insert(k.into(), v.into());
            }
        };
        put("rope_local_base_freq", self.rope_local_base_freq);
        put("query_pre_attn_scalar", self.query_pre_attn_scalar);
        put("attn_logit_softcapping", self.attn_logit_softcapping);
        put("final_logit_softcapping", self.final_logit_softcapping);
        if let Some(w) = self.sliding_window {
            o.insert("sliding_window".into(), w.into());
        }
        match self.window_encoding {
            WindowEncoding::LayerTypes => {
                let types: Vec<&str> = self
                    .sliding_layers
                    .iter()
                    .map(|&s| {
                        if s {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                o.insert("layer_types".into(), types.into());
            }
            WindowEncoding::Pattern(n) => {
                o.insert("sliding_window_pattern".into(), n.into());
            }
            WindowEncoding::UseSlidingWindow(n) => {
                o.insert("use_sliding_window".into(), true.into());
                o.insert("max_window_layers".into(), n.into());
            }
            WindowEncoding::Implicit => {}
        }
        match self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                o.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"rope_type": "linear", "factor": factor}),
                );
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                o.insert(
                    "rope_scaling".into(),
                    serde_json::json!({
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low_freq_factor,
                        "high_freq_factor": high_freq_factor,
                        "original_max_position_embeddings": original_max_position_embeddings,
                    }),
                );
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
            }) => {
                o.insert(
                    "rope_scaling".into(),
                    serde_json::json!({
                        "type": "yarn",
                        "factor": factor,
                        "original_max_position_embeddings": original_max_position_embeddings,
                    }),
                );
            }
        }
        c
    }
}

// ---------------------------------------------------------- checkpoint

/// splitmix64: a deterministic generator for weights and prompts.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn symmetric(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// `n` token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % vocab as u64) as u32)
            .collect()
    }
}

/// One tensor to write: Hugging Face name, shape, values (already rounded
/// to the stored dtype once [`Checkpoint::write_with`] has run).
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

/// Every tensor a Hugging Face checkpoint of `spec` holds, random.
///
/// Matrices are uniform with std `gain / sqrt(in_features)` (unit-size
/// outputs for unit-size inputs); the embedding uniform in [-1, 1); norm
/// weights `w` uniform in [-0.2, 0.2] for Gemma (used as `1 + w`) and
/// `1 + that` for Llama (used as stored).
fn random_tensors(spec: &Spec) -> Vec<Tensor> {
    let mut rng = Rng::new(spec.seed);
    let (hid, d, ffn) = (spec.hidden_size, spec.head_dim, spec.intermediate_size);
    let (hq, hkv) = (spec.num_attention_heads, spec.num_key_value_heads);
    let mut out = Vec::new();
    let mut matrix = |name: String, rows: usize, cols: usize, gain: f64| Tensor {
        values: (0..rows * cols)
            .map(|_| rng.symmetric() * gain * (3.0 / cols as f64).sqrt())
            .collect(),
        name,
        shape: vec![rows, cols],
    };
    let mut mats = vec![matrix(
        "model.embed_tokens.weight".into(),
        spec.vocab_size,
        hid,
        (hid as f64 / 3.0).sqrt(),
    )];
    for l in 0..spec.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        mats.push(matrix(p("self_attn.q_proj"), hq * d, hid, spec.qk_gain));
        mats.push(matrix(p("self_attn.k_proj"), hkv * d, hid, spec.qk_gain));
        mats.push(matrix(p("self_attn.v_proj"), hkv * d, hid, 1.0));
        mats.push(matrix(p("self_attn.o_proj"), hid, hq * d, 1.0));
        mats.push(matrix(p("mlp.gate_proj"), ffn, hid, 1.0));
        mats.push(matrix(p("mlp.up_proj"), ffn, hid, 1.0));
        mats.push(matrix(p("mlp.down_proj"), hid, ffn, 1.0));
    }
    if !spec.tie_word_embeddings {
        mats.push(matrix("lm_head.weight".into(), spec.vocab_size, hid, 1.0));
    }
    out.extend(mats);
    // Biases uniform in [-0.5, 0.5): large enough to move the logits.
    let mut bias = |name: String, len: usize| Tensor {
        values: (0..len).map(|_| 0.5 * rng.symmetric()).collect(),
        name,
        shape: vec![len],
    };
    for l in 0..spec.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.bias");
        if spec.attention_bias || spec.family == Family::Qwen2 {
            out.push(bias(p("self_attn.q_proj"), hq * d));
            out.push(bias(p("self_attn.k_proj"), hkv * d));
            out.push(bias(p("self_attn.v_proj"), hkv * d));
        }
        if spec.attention_bias {
            out.push(bias(p("self_attn.o_proj"), hid));
        }
        if spec.mlp_bias {
            out.push(bias(p("mlp.gate_proj"), ffn));
            out.push(bias(p("mlp.up_proj"), ffn));
            out.push(bias(p("mlp.down_proj"), hid));
        }
    }
    let offset = if spec.family.is_gemma() { 0.0 } else { 1.0 };
    let mut norm = |name: String, len: usize| Tensor {
        values: (0..len).map(|_| offset + 0.2 * rng.symmetric()).collect(),
        name,
        shape: vec![len],
    };
    for l in 0..spec.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        out.push(norm(p("input_layernorm"), hid));
        out.push(norm(p("post_attention_layernorm"), hid));
        if spec.family.sandwich() {
            out.push(norm(p("pre_feedforward_layernorm"), hid));
            out.push(norm(p("post_feedforward_layernorm"), hid));
        }
        if spec.family.qk_norm() {
            out.push(norm(p("self_attn.q_norm"), d));
            out.push(norm(p("self_attn.k_norm"), d));
        }
    }
    out.push(norm("model.norm.weight".into(), hid));
    out
}

/// Rounds `v` to the stored dtype and returns its little-endian bytes.
fn encode(storage: Storage, v: &mut [f64]) -> (safetensors::Dtype, Vec<u8>) {
    let mut bytes = Vec::new();
    let dtype = match storage {
        Storage::F32 => {
            for x in v.iter_mut() {
                let y = *x as f32;
                *x = y as f64;
                bytes.extend_from_slice(&y.to_le_bytes());
            }
            safetensors::Dtype::F32
        }
        Storage::F16 => {
            for x in v.iter_mut() {
                let y = half::f16::from_f64(*x);
                *x = y.to_f64();
                bytes.extend_from_slice(&y.to_le_bytes());
            }
            safetensors::Dtype::F16
        }
        Storage::BF16 => {
            for x in v.iter_mut() {
                let y = half::bf16::from_f64(*x);
                *x = y.to_f64();
                bytes.extend_from_slice(&y.to_le_bytes());
            }
            safetensors::Dtype::BF16
        }
    };
    (dtype, bytes)
}

/// `tensors` as one safetensors file (values rounded in place).
fn safetensors_bytes(storage: Storage, tensors: &mut [Tensor]) -> Vec<u8> {
    let encoded: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = tensors
        .iter_mut()
        .map(|t| {
            let (dtype, bytes) = encode(storage, &mut t.values);
            (t.name.clone(), t.shape.clone(), dtype, bytes)
        })
        .collect();
    let views = encoded.iter().map(|(name, shape, dtype, bytes)| {
        let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
            .expect("tensor view of the right size");
        (name.as_str(), view)
    });
    safetensors::serialize(views, None).expect("serialize safetensors")
}

/// A tiny checkpoint on disk; the directory is removed on drop.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub spec: Spec,
    /// Name -> values as stored (after dtype rounding).
    pub weights: BTreeMap<String, Vec<f64>>,
}

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("te-models-tiny-{}-{n}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

impl Checkpoint {
    /// Writes `spec` with random weights.
    pub fn write(spec: Spec) -> Self {
        Self::write_with(spec, |_| {})
    }

    /// Writes `spec`, letting `edit` change the tensor list first (drop a
    /// tensor, give one a wrong shape, ...).
    pub fn write_with(spec: Spec, edit: impl FnOnce(&mut Vec<Tensor>)) -> Self {
        let dir = temp_dir(spec.family.model_type());
        let config = serde_json::to_string_pretty(&spec.config_json()).expect("config json");
        std::fs::write(dir.join("config.json"), config).expect("write config.json");
        let mut tensors = random_tensors(&spec);
        edit(&mut tensors);
        if spec.shards <= 1 {
            let bytes = safetensors_bytes(spec.storage, &mut tensors);
            std::fs::write(dir.join("model.safetensors"), bytes).expect("write safetensors");
        } else {
            let per_shard = tensors.len().div_ceil(spec.shards);
            let mut weight_map = serde_json::Map::new();
            for (i, chunk) in tensors.chunks_mut(per_shard).enumerate() {
                let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, spec.shards);
                for t in chunk.iter() {
                    weight_map.insert(t.name.clone(), file.clone().into());
                }
                let bytes = safetensors_bytes(spec.storage, chunk);
                std::fs::write(dir.join(&file), bytes).expect("write shard");
            }
            let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(
                dir.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index).expect("index json"),
            )
            .expect("write index");
        }
        let weights = tensors.into_iter().map(|t| (t.name, t.values)).collect();
        Checkpoint { dir, spec, weights }
    }

    /// Loads the checkpoint through te-models' Hugging Face path.
    pub fn load(&self) -> te_models::Result<Model> {
        load_dir(&self.dir)
    }

    /// f64 reference logits `[n, vocab]` for every position of `tokens`.
    pub fn reference(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        reference_logits(&self.spec, &self.weights, tokens)
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `load_config` + `SafetensorsSource::open` + `ModelWeights::load` +
/// `Model::new`, as a Hugging Face directory is loaded.
pub fn load_dir(dir: &Path) -> te_models::Result<Model> {
    let cfg = te_models::hf::load_config(dir)?;
    let src = te_formats::safetensors::SafetensorsSource::open(dir)?;
    let norm_offset = cfg.architecture.family().hf_norm_offset;
    let weights = ModelWeights::load(&src, NameScheme::HuggingFace, &cfg, norm_offset)?;
    Model::new(cfg, weights)
}

// ----------------------------------------------------- f64 reference

/// `x: [rows, in]` times `w: [out, in]` transposed -> `[rows, out]`.
fn linear(x: &[f64], w: &[f64], out: usize) -> Vec<f64> {
    linear_bias(x, w, None, out)
}

/// [`linear`] plus `b: [out]` on every row when given.
fn linear_bias(x: &[f64], w: &[f64], b: Option<&[f64]>, out: usize) -> Vec<f64> {
    let inp = w.len() / out;
    x.chunks(inp)
        .flat_map(|row| {
            (0..out).map(move |o| {
                let wr = &w[o * inp..(o + 1) * inp];
                row.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>() + b.map_or(0.0, |b| b[o])
            })
        })
        .collect()
}

/// RMSNorm over rows of length `w.len()`: `x / sqrt(mean(x²) + eps) * g`
/// with `g = 1 + w` for Gemma, `w` for Llama.
fn rms_norm(x: &[f64], w: &[f64], eps: f64, gemma: bool) -> Vec<f64> {
    let dim = w.len();
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, g)| v * inv * if gemma { 1.0 + g } else { *g })
        })
        .collect()
}

/// Hugging Face inverse frequencies `base^(-2i/d)`, i < d/2, with
/// `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`.
fn inv_freqs(base: f64, d: usize, scaling: Option<RopeScaling>) -> Vec<f64> {
    let plain = (0..d / 2).map(|i| base.powf(-((2 * i) as f64) / d as f64));
    match scaling {
        None => plain.collect(),
        Some(RopeScaling::Linear { factor }) => plain.map(|f| f / factor).collect(),
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
        }) => {
            // `_compute_yarn_parameters`: the correction range of beta_fast
            // 32 and beta_slow 1 rotations, floored and ceiled, then a
            // linear ramp between interpolation and extrapolation.
            let dim = d as f64;
            let corr = |rotations: f64| {
                dim * (original_max_position_embeddings as f64
                    / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                    / (2.0 * base.ln())
            };
            let low = corr(32.0).floor().max(0.0);
            let high = corr(1.0).ceil().min(dim - 1.0);
            let high = if low == high { high + 0.001 } else { high };
            plain
                .enumerate()
                .map(|(i, f)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    f / factor * (1.0 - extrapolation) + f * extrapolation
                })
                .collect()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = original_max_position_embeddings as f64;
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            plain
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    // torch.where(wavelen > low_freq_wavelen, f / factor, f)
                    let scaled = if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        f
                    };
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}

/// YaRN's `attention_scaling` (`0.1 ln(factor) + 1`), which multiplies
/// `cos` and `sin`; 1 for the other scalings.
fn attention_scaling(scaling: Option<RopeScaling>) -> f64 {
    match scaling {
        Some(RopeScaling::Yarn { factor, .. }) if factor > 1.0 => 0.1 * factor.ln() + 1.0,
        _ => 1.0,
    }
}

/// Half-split RoPE (`rotate_half`) of `x: [n, heads, d]` at positions 0..n,
/// with `cos` and `sin` times `m`.
fn rope(x: &mut [f64], heads: usize, d: usize, inv_freq: &[f64], m: f64) {
    let half = d / 2;
    for (pos, token) in x.chunks_mut(heads * d).enumerate() {
        for head in token.chunks_mut(d) {
            for i in 0..half {
                let (sin, cos) = (pos as f64 * inv_freq[i]).sin_cos();
                let (sin, cos) = (sin * m, cos * m);
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = b * cos + a * sin;
            }
        }
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The Hugging Face forward of `spec` over one sequence `tokens`, in f64:
/// logits `[n, vocab]` for every position (causal, so position i depends
/// on tokens 0..=i only and every step schedule must reproduce row i).
pub fn reference_logits(
    spec: &Spec,
    weights: &BTreeMap<String, Vec<f64>>,
    tokens: &[u32],
) -> Vec<Vec<f64>> {
    let w = |name: &str| -> &[f64] {
        weights
            .get(name)
            .unwrap_or_else(|| panic!("reference: no tensor {name}"))
    };
    let n = tokens.len();
    let (hid, d, ffn) = (spec.hidden_size, spec.head_dim, spec.intermediate_size);
    let (hq, hkv) = (spec.num_attention_heads, spec.num_key_value_heads);
    let kv_group = hq / hkv;
    let gemma = spec.family.is_gemma();
    let eps = spec.rms_norm_eps;
    let norm = |x: &[f64], name: &str| rms_norm(x, w(name), eps, gemma);

    // Embedding (Gemma: times sqrt(hidden_size)). x: [n, hid]
    let embed = w("model.embed_tokens.weight");
    let scale = if gemma { (hid as f64).sqrt() } else { 1.0 };
    let mut x: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| {
            embed[t as usize * hid..(t as usize + 1) * hid]
                .iter()
                .map(|v| v * scale)
        })
        .collect();

    for l in 0..spec.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        // A projection with its bias when the spec has one.
        let proj = |x: &[f64], s: &str, out: usize, biased: bool| {
            let b = format!("model.layers.{l}.{s}.bias");
            linear_bias(x, w(&p(s)), biased.then(|| w(&b)), out)
        };
        let (ab, mb) = (spec.attention_bias, spec.mlp_bias);
        let qkv_b = ab || spec.family == Family::Qwen2;
        let sliding = spec.sliding_layers[l];
        // Attention block.
        let xn = norm(&x, &p("input_layernorm"));
        let mut q = proj(&xn, "self_attn.q_proj", hq * d, qkv_b); // [n, hq, d]
        let mut k = proj(&xn, "self_attn.k_proj", hkv * d, qkv_b); // [n, hkv, d]
        let v = proj(&xn, "self_attn.v_proj", hkv * d, qkv_b); // [n, hkv, d]
        if spec.family.qk_norm() {
            q = norm(&q, &p("self_attn.q_norm"));
            k = norm(&k, &p("self_attn.k_norm"));
        }
        // Gemma 3 sliding layers: their own base, no scaling.
        let (inv_freq, m) = match (spec.rope_local_base_freq, sliding) {
            (Some(local), true) => (inv_freqs(local, d, None), 1.0),
            _ => (
                inv_freqs(spec.rope_theta, d, spec.rope_scaling),
                attention_scaling(spec.rope_scaling),
            ),
        };
        rope(&mut q, hq, d, &inv_freq, m);
        rope(&mut k, hkv, d, &inv_freq, m);
        let softmax_scale = 1.0 / spec.query_pre_attn_scalar.unwrap_or(d as f64).sqrt();
        let mut attn = vec![0.0; n * hq * d]; // [n, hq, d]
        for i in 0..n {
            for h in 0..hq {
                let kvh = h / kv_group;
                let qi = &q[(i * hq + h) * d..][..d];
                // Keys j <= i, and i - j < W on a sliding layer.
                let visible: Vec<usize> = (0..=i)
                    .filter(|&j| !sliding || i - j < spec.sliding_window.expect("window"))
                    .collect();
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        let kj = &k[(j * hkv + kvh) * d..][..d];
                        let s = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * softmax_scale;
                        match spec.attn_logit_softcapping {
                            Some(cap) => cap * (s / cap).tanh(),
                            None => s,
                        }
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                let out = &mut attn[(i * hq + h) * d..][..d];
                for (&j, e) in visible.iter().zip(&exps) {
                    let vj = &v[(j * hkv + kvh) * d..][..d];
                    for (o, vv) in out.iter_mut().zip(vj) {
                        *o += e / sum * vv;
                    }
                }
            }
        }
        let mut o = proj(&attn, "self_attn.o_proj", hid, ab);
        if spec.family.sandwich() {
            o = norm(&o, &p("post_attention_layernorm"));
        }
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

        // MLP block: down(act(gate(n)) * up(n)).
        let pre_ffn = if spec.family.sandwich() {
            "pre_feedforward_layernorm"
        } else {
            "post_attention_layernorm"
        };
        let xn = norm(&x, &p(pre_ffn));
        let g = proj(&xn, "mlp.gate_proj", ffn, mb);
        let u = proj(&xn, "mlp.up_proj", ffn, mb);
        let act = if gemma { gelu_tanh } else { silu };
        let gu: Vec<f64> = g.iter().zip(&u).map(|(g, u)| act(*g) * u).collect();
        let mut m = proj(&gu, "mlp.down_proj", hid, mb);
        if spec.family.sandwich() {
            m = norm(&m, &p("post_feedforward_layernorm"));
        }
        x.iter_mut().zip(&m).for_each(|(a, b)| *a += b);
    }

    let xn = norm(&x, "model.norm.weight");
    let head = if spec.tie_word_embeddings {
        w("model.embed_tokens.weight")
    } else {
        w("lm_head.weight")
    };
    let mut logits = linear(&xn, head, spec.vocab_size);
    if let Some(cap) = spec.final_logit_softcapping {
        logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
    }
    logits
        .chunks(spec.vocab_size)
        .map(<[f64]>::to_vec)
        .collect()
}

// -------------------------------------------------------------- runner

/// One step: `(sequence index, tokens fed)` per sequence, in batch order.
pub type Step = Vec<(usize, usize)>;

/// Logits te-models returned for one sequence: `(position, row)`.
pub type Rows = Vec<(usize, Vec<f32>)>;

/// Feeds `prompts` to `model` step by step as `steps` says (each sequence's
/// tokens in order), in one cache of `layout`, and collects every logits
/// row per sequence with its position.
pub fn run_schedule(
    model: &Model,
    layout: CacheLayout,
    prompts: &[Vec<u32>],
    steps: &[Step],
    logits: Logits,
) -> te_models::Result<Vec<Rows>> {
    let vocab = model.config.vocab_size;
    let max_seqlen = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let max_step_len = steps.iter().flatten().map(|s| s.1).max().unwrap_or(1);
    let mut cache = model.new_cache(prompts.len(), max_seqlen, max_step_len, layout)?;
    let mut fed = vec![0usize; prompts.len()];
    let mut rows: Vec<Rows> = vec![Vec::new(); prompts.len()];
    for step in steps {
        let plan: Vec<(u64, usize)> = step.iter().map(|&(s, len)| (s as u64, len)).collect();
        cache.pre_step(&plan)?;
        let tokens: Vec<u32> = step
            .iter()
            .flat_map(|&(s, len)| prompts[s][fed[s]..fed[s] + len].iter().copied())
            .collect();
        let out = model.forward(&tokens, &mut cache, logits)?;
        let mut out_rows = out.chunks(vocab);
        for &(s, len) in step {
            let positions = match logits {
                Logits::All => fed[s]..fed[s] + len,
                Logits::Last => fed[s] + len - 1..fed[s] + len,
            };
            for pos in positions {
                let row = out_rows.next().expect("a logits row per position");
                rows[s].push((pos, row.to_vec()));
            }
            fed[s] += len;
        }
        assert!(out_rows.next().is_none(), "more logits rows than expected");
    }
    Ok(rows)
}

/// One sequence of `len` tokens fed in chunks `sizes[0], sizes[1], ...`,
/// the last size repeating (`[5, 1]`: a 5-token prefill, then decode).
pub fn chunked(len: usize, sizes: &[usize]) -> Vec<Step> {
    ragged(&[len], &[sizes], &[0])
}

/// Several sequences fed together: sequence s joins at step `joins[s]`
/// and is fed chunks `sizes[s][0], sizes[s][1], ...` (the last repeating)
/// until its `lens[s]` tokens are in; sequences that are done or not yet
/// joined sit out.
pub fn ragged(lens: &[usize], sizes: &[&[usize]], joins: &[usize]) -> Vec<Step> {
    let mut fed = vec![0usize; lens.len()];
    let mut chunk = vec![0usize; lens.len()];
    let mut steps = Vec::new();
    for step_index in 0.. {
        if fed.iter().zip(lens).all(|(f, l)| f == l) {
            break;
        }
        let mut step = Vec::new();
        for s in 0..lens.len() {
            if step_index < joins[s] || fed[s] == lens[s] {
                continue;
            }
            let want = sizes[s][chunk[s].min(sizes[s].len() - 1)];
            let len = want.min(lens[s] - fed[s]);
            chunk[s] += 1;
            fed[s] += len;
            step.push((s, len));
        }
        steps.push(step);
    }
    steps
}

/// `|got - want| <= 1e-4 + 1e-4 |want|` for every logit of every row, and
/// every position of every sequence covered when `all_positions`.
pub fn assert_rows_match(
    rows: &[Rows],
    reference: &[Vec<Vec<f64>>],
    all_positions: bool,
    what: &str,
) {
    for (s, (got, want)) in rows.iter().zip(reference).enumerate() {
        if all_positions {
            let positions: Vec<usize> = got.iter().map(|r| r.0).collect();
            let expected: Vec<usize> = (0..want.len()).collect();
            assert_eq!(positions, expected, "{what}: sequence {s} positions");
        }
        assert!(!got.is_empty(), "{what}: sequence {s} got no logits");
        for (pos, row) in got {
            let want_row = &want[*pos];
            assert_eq!(row.len(), want_row.len(), "{what}: vocab");
            for (v, (g, r)) in row.iter().zip(want_row).enumerate() {
                let g = *g as f64;
                let tol = 1e-4 + 1e-4 * r.abs();
                assert!(
                    (g - r).abs() <= tol,
                    "{what}: sequence {s} position {pos} token {v}: got {g}, reference {r} (|diff| {} > {tol})",
                    (g - r).abs()
                );
            }
        }
    }
}

// ------------------------------------------------------ feeding modes

pub fn paged(page_size: usize) -> CacheLayout {
    CacheLayout::Paged {
        page_size,
        total_num_pages: 64,
    }
}

/// Two random prompts for `ck`: `len` tokens and about two thirds of that.
pub fn prompts(ck: &Checkpoint, len: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(ck.spec.seed + 1000);
    let vocab = ck.spec.vocab_size;
    vec![rng.tokens(len, vocab), rng.tokens(len * 2 / 3 + 1, vocab)]
}

/// Runs every feeding mode on `ck` with a prompt of `len` tokens (and a
/// second, shorter one for the batched runs) and checks each logits row
/// against the f64 reference.
pub fn check_all_modes(ck: &Checkpoint, len: usize) {
    check_model_all_modes(ck, &ck.load().expect("load tiny checkpoint"), len, "");
}

/// [`check_all_modes`] on `model`, a model of `ck`'s weights loaded some
/// other way (`how` names it in failures: "GGUF").
pub fn check_model_all_modes(ck: &Checkpoint, model: &Model, len: usize, how: &str) {
    let prompts = prompts(ck, len);
    let reference: Vec<_> = prompts.iter().map(|p| ck.reference(p)).collect();
    let (a, b) = (prompts[0].len(), prompts[1].len());
    let one = |sizes: &[usize]| chunked(a, sizes);
    let two = |sizes: [&[usize]; 2], joins| ragged(&[a, b], &sizes, joins);
    let contiguous = CacheLayout::Contiguous;
    let cases = [
        Case("one prefill", contiguous, one(&[a]), 1, Logits::All),
        Case(
            "chunked prefill",
            contiguous,
            one(&[3, 1, 5, 2, 7, 4, 6]),
            1,
            Logits::All,
        ),
        Case(
            "chunked prefill, paged",
            paged(4),
            one(&[5, 3, 6]),
            1,
            Logits::All,
        ),
        Case(
            "prefill 5 then decode",
            contiguous,
            one(&[5, 1]),
            1,
            Logits::Last,
        ),
        Case(
            "token by token, paged",
            paged(4),
            one(&[1]),
            1,
            Logits::Last,
        ),
        Case(
            "ragged batch, paged",
            paged(3),
            two([&[6, 1, 3, 2], &[4, 2, 1]], &[0, 1]),
            2,
            Logits::All,
        ),
        Case(
            "ragged batch decode",
            contiguous,
            two([&[2, 1], &[3, 1]], &[0, 2]),
            2,
            Logits::Last,
        ),
    ];
    for Case(what, layout, steps, n, logits) in cases {
        let what = format!("{:?} {how} {what}", ck.spec.family);
        let rows = run_schedule(model, layout, &prompts[..n], &steps, logits)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_rows_match(&rows, &reference[..n], logits == Logits::All, &what);
    }
}

/// One feeding mode of [`check_all_modes`]: name, cache layout, steps,
/// how many of the prompts they feed, which logits.
pub struct Case(&'static str, CacheLayout, Vec<Step>, usize, Logits);

/// Reference logits of `spec`'s weights under a modified spec (a feature
/// switched off), to show that the feature changes the result.
pub fn reference_with(
    ck: &Checkpoint,
    tokens: &[u32],
    change: impl FnOnce(&mut Spec),
) -> Vec<Vec<f64>> {
    let mut spec = ck.spec.clone();
    change(&mut spec);
    reference_logits(&spec, &ck.weights, tokens)
}

/// Asserts that switching `feature` off moves the reference logits of a
/// `len`-token prompt by more than 0.05 (the test would be vacuous
/// otherwise).
pub fn assert_feature_bites(
    ck: &Checkpoint,
    len: usize,
    feature: &str,
    off: impl FnOnce(&mut Spec),
) {
    let tokens = &prompts(ck, len)[0];
    let diff = max_abs_diff(&ck.reference(tokens), &reference_with(ck, tokens, off));
    assert!(diff > 0.05, "{feature} changes the logits by only {diff}");
}

/// Largest |a - b| over two sets of reference logits (to show that a
/// feature under test changes the result).
pub fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}
