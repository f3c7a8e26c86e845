//! What a model is, without loading its weights (`te inspect`): the
//! resolved config, parameter count, stored tensor dtypes, tokenizer and
//! the memory te-rs needs to run it.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::convert::f32_json;
use crate::loader::{load_config_only, load_tokenizer, merge_eos};
use crate::source::ModelSource;
use crate::validate;
use te_formats::gguf::GgufFile;
use te_formats::safetensors::SafetensorsSource;
use te_formats::TensorSource;

use crate::family::NameScheme;
use crate::Result;

/// Bytes of one f32: te-rs holds weights and the KV cache in f32.
const F32_BYTES: u64 = 4;

/// A model's description.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    /// `"gguf"`, `"safetensors"` or `"random"` (weights generated when
    /// loaded, [`crate::random`]).
    pub format: &'static str,
    pub config: ModelConfig,
    /// Elements of every stored tensor.
    pub parameters: u64,
    /// Stored tensors per type: GGUF type names (`"Q4_K"`, `"F32"`) or
    /// safetensors dtypes (`"BF16"`).
    pub tensor_dtypes: BTreeMap<String, usize>,
    /// [`te_tokenizer::Tokenizer::kind`].
    pub tokenizer_kind: String,
    /// Tokenizer vocabulary including added tokens.
    pub tokenizer_vocab_size: usize,
    /// Whether the model ships a chat template (`te generate --chat`).
    pub chat_template: bool,
    /// Weights fully dequantized to f32: `parameters * 4` bytes (the most
    /// te-rs holds; GGUF block-quantized and bf16/f16 matrices stay as
    /// stored).
    pub weights_f32_bytes: u64,
    /// Bytes of tensor data in the file(s), as stored.
    pub weights_stored_bytes: u64,
    /// What `te generate` would refuse about this model
    /// ([`crate::validate::problems`]); empty when it loads.
    pub problems: Vec<String>,
    /// f32 KV cache per cached token, all layers:
    /// `2 (K and V) * num_hidden_layers * num_key_value_heads * head_dim * 4`
    /// bytes. Sliding-window layers stop growing at their window.
    pub kv_cache_bytes_per_token: u64,
}

/// Describes the model at `source`: reads the config, the tensor table
/// (GGUF) or safetensors headers, and the tokenizer; no weights. The
/// checks loading makes ([`crate::validate`]) are run too and their
/// findings listed in [`ModelInfo::problems`].
///
/// Errors: whatever reading the config, tensor headers or tokenizer reports.
pub fn inspect(source: &ModelSource) -> Result<ModelInfo> {
    let mut config = load_config_only(source)?;
    let tokenizer = load_tokenizer(source)?;
    merge_eos(&mut config, &tokenizer);
    let mut tensor_dtypes = BTreeMap::new();
    let mut parameters = 0u64;
    let mut weights_stored_bytes = 0u64;
    let problems;
    let format = match source {
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(path)?;
            problems = validate::problems(
                &config,
                NameScheme::Gguf,
                &file,
                Some(&file),
                Some(&tokenizer),
            );
            for t in file.tensors() {
                parameters += t.n_elements();
                weights_stored_bytes += t.n_bytes.unwrap_or(0);
                *tensor_dtypes.entry(t.ggml_type.name()).or_insert(0) += 1;
            }
            "gguf"
        }
        ModelSource::HfDir(dir) => {
            let st = SafetensorsSource::open(dir)?;
            problems = validate::problems(
                &config,
                NameScheme::HuggingFace,
                &st,
                None,
                Some(&tokenizer),
            );
            for (_, dtype, shape) in st.tensor_infos()? {
                let n = shape.iter().product::<usize>() as u64;
                parameters += n;
                weights_stored_bytes += n * dtype.bitsize() as u64 / 8;
                *tensor_dtypes.entry(format!("{dtype:?}")).or_insert(0) += 1;
            }
            "safetensors"
        }
        ModelSource::Random(random) => {
            let tensors = random.tensors(&config);
            problems = validate::problems(
                &config,
                NameScheme::HuggingFace,
                &tensors,
                None,
                Some(&tokenizer),
            );
            for t in tensors.stored_tensors() {
                let n = t.shape.iter().product::<usize>() as u64;
                parameters += n;
                weights_stored_bytes += n * random.dtype.bytes();
                *tensor_dtypes.entry(t.dtype).or_insert(0) += 1;
            }
            "random"
        }
    };
    let c = &config;
    let kv_cache_bytes_per_token =
        2 * (c.num_hidden_layers * c.num_key_value_heads * c.head_dim) as u64 * F32_BYTES;
    Ok(ModelInfo {
        format,
        parameters,
        tensor_dtypes,
        tokenizer_kind: tokenizer.kind().to_string(),
        tokenizer_vocab_size: tokenizer.vocab_size(),
        chat_template: tokenizer.chat_template().is_some(),
        weights_f32_bytes: parameters * F32_BYTES,
        weights_stored_bytes,
        problems,
        kv_cache_bytes_per_token,
        config,
    })
}

/// Every field of a resolved config as JSON, under its field name.
pub fn config_json(cfg: &ModelConfig) -> Value {
    // Destructured so that a new field fails to compile until listed here.
    let ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        max_position_embeddings,
        rope_theta,
        rope_local_base_freq,
        rope_scaling,
        rope_freq_factors,
        rope_convention,
        hidden_activation,
        softmax_scale,
        attn_logit_softcapping,
        final_logit_softcapping,
        layer_windows,
        scale_embedding,
        qk_norm,
        sandwich_norms,
        tie_word_embeddings,
        attention_bias,
        qkv_bias,
        mlp_bias,
        bos_token_id,
        eos_token_ids,
    } = cfg;
    json!({
        "architecture": architecture.name(),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "rms_norm_eps": f32_json(*rms_norm_eps),
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": f32_json(*rope_theta),
        "rope_local_base_freq": f32_json(*rope_local_base_freq),
        "rope_scaling": format!("{rope_scaling:?}"),
        "rope_freq_factors": rope_freq_factors,
        "rope_convention": format!("{rope_convention:?}"),
        "hidden_activation": format!("{hidden_activation:?}"),
        "softmax_scale": f32_json(*softmax_scale),
        "attn_logit_softcapping": attn_logit_softcapping.map(f32_json),
        "final_logit_softcapping": final_logit_softcapping.map(f32_json),
        "layer_windows": layer_windows,
        "scale_embedding": scale_embedding,
        "qk_norm": qk_norm,
        "sandwich_norms": sandwich_norms,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": attention_bias,
        "qkv_bias": qkv_bias,
        "mlp_bias": mlp_bias,
        "bos_token_id": bos_token_id,
        "eos_token_ids": eos_token_ids,
    })
}

impl ModelInfo {
    /// The description as one JSON object (`te inspect --json`); the config
    /// under `"config"` as [`config_json`] writes it.
    pub fn to_json(&self) -> Value {
        json!({
            "architecture": self.config.architecture.name(),
            "format": self.format,
            "parameters": self.parameters,
            "tensor_dtypes": self.tensor_dtypes,
            "tokenizer": {
                "kind": self.tokenizer_kind,
                "vocab_size": self.tokenizer_vocab_size,
                "chat_template": self.chat_template,
            },
            "memory": {
                "weights_f32_bytes": self.weights_f32_bytes,
                "weights_stored_bytes": self.weights_stored_bytes,
                "kv_cache_bytes_per_token": self.kv_cache_bytes_per_token,
            },
            "config": config_json(&self.config),
            "problems": self.problems,
        })
    }
}
