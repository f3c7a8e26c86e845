//! Hugging Face `config.json` and `generation_config.json` as stored: the
//! fields te-rs reads, typed but not interpreted ([`HfConfig`]; a model
//! family turns them into a resolved config), and the JSON helpers every
//! reader here shares (errors name the file and the field).

use std::path::Path;

use serde::Deserialize;

use crate::{FormatError, Result};

/// `config.json` as Hugging Face writes it (the fields te-rs reads).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub text_config: Option<Box<HfConfig>>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_local_base_freq: Option<f64>,
    pub rope_scaling: Option<HfRopeScaling>,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub hidden_activation: Option<String>,
    pub query_pre_attn_scalar: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub sliding_window: Option<usize>,
    pub sliding_window_pattern: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    /// Qwen2/3: the window applies only when this is true, and only to
    /// layers `>= max_window_layers`.
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    /// Fraction of `head_dim` that RoPE rotates (te-rs runs 1.0 only).
    pub partial_rotary_factor: Option<f64>,
    /// Mixture-of-experts counts (te-rs runs dense models only).
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    pub bos_token_id: Option<serde_json::Value>,
    pub eos_token_id: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct HfRopeScaling {
    pub rope_type: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN (`rope_type = "yarn"`).
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub truncate: Option<bool>,
}

pub fn field<T>(v: Option<T>, name: &str) -> Result<T> {
    v.ok_or_else(|| FormatError::Config {
        field: name.to_string(),
        reason: "missing from config.json".into(),
    })
}

pub fn token_ids(v: &Option<serde_json::Value>, name: &str) -> Result<Vec<u32>> {
    let bad = || FormatError::Config {
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

pub fn read_json(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|error| FormatError::Io {
        path: path.to_path_buf(),
        error,
    })
}

pub fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| FormatError::Format {
        path: path.to_path_buf(),
        reason: format!("invalid JSON: {e}"),
    })
}

/// Reads and parses `dir/config.json`, the text config of a multimodal
/// wrapper taking the outer `model_type`; `generation_config.json`'s
/// `eos_token_id`, when that file exists and names any, replaces the
/// config's.
///
/// Errors: a missing or unreadable file, invalid JSON (the file named),
/// a missing `model_type`, an `eos_token_id` that is not ids.
pub fn load_hf_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join("config.json");
    let mut raw = hf_config_from_text(&path, &read_json(&path)?)?;
    let gen_path = dir.join("generation_config.json");
    if gen_path.exists() {
        #[derive(Deserialize)]
        struct Gen {
            eos_token_id: Option<serde_json::Value>,
        }
        let gen: Gen = parse_json(&gen_path, &read_json(&gen_path)?)?;
        let eos = token_ids(&gen.eos_token_id, "generation_config.eos_token_id")?;
        if !eos.is_empty() {
            raw.eos_token_id = Some(serde_json::json!(eos));
        }
    }
    Ok(raw)
}

/// Parses the text of a `config.json` (`path` is named in errors); a
/// multimodal wrapper's `text_config` replaces it, keeping the outer
/// `model_type`.
///
/// Errors: invalid JSON, a missing `model_type`.
pub fn hf_config_from_text(path: &Path, text: &str) -> Result<HfConfig> {
    let mut raw: HfConfig = parse_json(path, text)?;
    let model_type = field(raw.model_type.clone(), "model_type")?;
    if let Some(text) = raw.text_config.take() {
        // Multimodal Gemma 3 wraps the text model's config.
        raw = HfConfig {
            model_type: Some(model_type),
            ..*text
        };
    }
    Ok(raw)
}
