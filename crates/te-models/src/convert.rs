//! GGUF file -> Hugging Face model directory (`te convert`).
//!
//! Writes `config.json` (Hugging Face field names and `model_type`),
//! `generation_config.json` (BOS/EOS ids), `tokenizer.json` and
//! `model.safetensors`, such that loading the directory gives the same
//! model as loading the GGUF file: same resolved config (up to the RoPE
//! convention, see below), same weights (exactly, with [`OutputDtype::F32`]),
//! same tokenizer.
//!
//! Two facts of the GGUF layout are undone (tests/refs/README.md):
//! - GGUF llama files store the rows of `attn_q` and `attn_k` permuted per
//!   head so that interleaved ("adjacent pairs") RoPE on them equals
//!   half-split ("rotate_half") RoPE on the original weights: within a head
//!   of `d` rows, GGUF row `2i` is Hugging Face row `i` and GGUF row `2i + 1`
//!   is Hugging Face row `i + d/2` (llama.cpp's converter reshapes each head
//!   to `[2, d/2]` rows and swaps the two axes). [`unpermute_qk_rows`] puts
//!   the rows back; Hugging Face models then use half-split RoPE. Gemma GGUF
//!   files are not permuted (llama.cpp runs them with NeoX RoPE).
//! - Gemma GGUF norm weights hold the effective multiplier `1 + w`; Hugging
//!   Face stores `w` (its loader adds 1), so 1 is subtracted
//!   ([`GEMMA_NORM_OFFSET`]).
//!
//! The weights are dequantized to f32 once (the GGUF quantization is not
//! kept). [`OutputDtype::F32`] reproduces them bit for bit except Gemma norm
//! weights below 0.5, whose `(x - 1) + 1` in f32 may differ from `x` by up
//! to 2^-25 (half an ulp of 1); [`OutputDtype::Bf16`] halves the file but
//! rounds every weight to 8 significant bits, so greedy tokens may differ
//! from the GGUF's.

use std::borrow::Cow;
use std::path::Path;

use serde_json::{json, Value};
use te_kernels::rope::{RopeConvention, RopeFreqs, RopeScaling};

use crate::config::{Activation, ModelConfig};
use crate::family::{NameScheme, TensorNames};
use crate::loader::{load_model, LoadedModel};
use crate::ops::Linear;
use crate::source::ModelSource;
use crate::{ModelError, Result};

/// What Gemma GGUF norm weights hold beyond Hugging Face's: `1 + w` vs `w`.
pub const GEMMA_NORM_OFFSET: f32 = 1.0;

/// The dtype of the written `model.safetensors`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputDtype {
    /// f32: the dequantized GGUF weights exactly (the default).
    F32,
    /// bf16 (round to nearest even): half the size, not exact.
    Bf16,
}

impl OutputDtype {
    /// Hugging Face `torch_dtype` name (`"float32"`, `"bfloat16"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            OutputDtype::F32 => "float32",
            OutputDtype::Bf16 => "bfloat16",
        }
    }
}

/// What [`convert_gguf_to_hf`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertSummary {
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// Parameters (elements) in `model.safetensors`.
    pub parameters: u64,
    /// Whether the Q/K rows were un-permuted (GGUF llama files).
    pub unpermuted_qk: bool,
    /// Whether 1 was subtracted from the norm weights (Gemma).
    pub shifted_norms: bool,
}

/// An f32 as JSON through its shortest decimal form (`1e-6`, not
/// `9.99999997e-7`), which reads back as the same f32.
pub(crate) fn f32_json(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map(Value::from)
        .unwrap_or(Value::Null)
}

/// `eos_token_id` as Hugging Face writes it: an id, or a list when several.
fn eos_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

/// Hugging Face `config.json` for a resolved config. Reading it back with
/// [`crate::hf::load_config`] gives `cfg` again, except `rope_convention`
/// (always half-split for Hugging Face weights).
///
/// `query_pre_attn_scalar` (Gemma 2/3) is recovered from `softmax_scale =
/// 1/sqrt(query_pre_attn_scalar)`, rounded to an integer when within 1e-3
/// of one (it is one in every released Gemma).
///
/// Errors: GGUF `rope_freqs` divisors that are not those of a Llama 3.x
/// `rope_scaling` ([`llama3_scaling_of`]): `config.json` has no field for
/// arbitrary ones.
pub fn hf_config_json(cfg: &ModelConfig, dtype: OutputDtype) -> Result<Value> {
    let fam = cfg.architecture.family();
    let mut c = json!({
        "architectures": [fam.hf_class],
        "model_type": fam.hf_model_type,
        "torch_dtype": dtype.torch_name(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": f32_json(cfg.rms_norm_eps),
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": f32_json(cfg.rope_theta),
        "rope_scaling": rope_scaling_json(cfg)?,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos_json(&cfg.eos_token_ids),
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
    });
    let act = match cfg.hidden_activation {
        Activation::Silu => "silu",
        Activation::GeluTanh => "gelu_pytorch_tanh",
    };
    let obj = c.as_object_mut().expect("a JSON object");
    // Gemma configs name the activation `hidden_activation`.
    if fam.activation == Activation::GeluTanh {
        obj.insert("hidden_activation".into(), json!(act));
    }
    obj.insert("hidden_act".into(), json!(act));
    // The families with four norms per layer (Gemma 2/3) carry
    // query_pre_attn_scalar, softcaps and sliding windows.
    if fam.sandwich_norms {
        let s = cfg.softmax_scale as f64;
        let q = 1.0 / (s * s);
        let q = if (q - q.round()).abs() <= 1e-3 * q.round() {
            json!(q.round() as u64)
        } else {
            json!(q)
        };
        obj.insert("query_pre_attn_scalar".into(), q);
        obj.insert(
            "attn_logit_softcapping".into(),
            cfg.attn_logit_softcapping
                .map(f32_json)
                .unwrap_or(Value::Null),
        );
        obj.insert(
            "final_logit_softcapping".into(),
            cfg.final_logit_softcapping
                .map(f32_json)
                .unwrap_or(Value::Null),
        );
    }
    // Sliding windows: Gemma 2/3 always state theirs; Mistral and Qwen
    // when a layer slides (Qwen also switches them on).
    let window = cfg.layer_windows.iter().flatten().next().copied();
    if fam.sandwich_norms || window.is_some() {
        obj.insert("sliding_window".into(), json!(window));
        let types: Vec<&str> = cfg
            .layer_windows
            .iter()
            .map(|w| {
                if w.is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        obj.insert("layer_types".into(), json!(types));
        if fam.hf_use_sliding_window {
            obj.insert("use_sliding_window".into(), json!(true));
        }
    }
    if fam.local_rope_unscaled {
        obj.insert(
            "rope_local_base_freq".into(),
            f32_json(cfg.rope_local_base_freq),
        );
    }
    Ok(c)
}

/// The Llama 3.x `rope_scaling` (`factor` 2 to 32, `low_freq_factor` 1,
/// `high_freq_factor` 4, `original_max_position_embeddings` 4096 to
/// 32768: every released Llama 3.1/3.2/3.3 uses one of these) whose
/// divisors `base^(-2i/d) / inv_freq'_i` equal `factors` (GGUF
/// `rope_freqs`, as llama.cpp's converter computes them in f32) to 1e-5
/// relative, if any.
pub fn llama3_scaling_of(factors: &[f32], base: f32, head_dim: usize) -> Option<RopeScaling> {
    let freqs = |scaling| RopeFreqs {
        base: base as f64,
        rotary_dim: head_dim,
        max_positions: 1,
        scaling,
    };
    let plain = freqs(RopeScaling::None).inv_freqs();
    for factor in [8.0, 32.0, 16.0, 4.0, 2.0] {
        for original_max_position_embeddings in [8192, 4096, 16384, 32768] {
            let scaling = RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings,
            };
            let scaled = freqs(scaling).inv_freqs();
            let same = factors.len() == plain.len()
                && plain.iter().zip(&scaled).zip(factors).all(|((p, s), f)| {
                    let want = p / s;
                    (want - *f as f64).abs() <= 1e-5 * want
                });
            if same {
                return Some(scaling);
            }
        }
    }
    None
}

/// `rope_scaling` of `cfg` as `config.json` writes it (GGUF `rope_freqs`
/// as the Llama 3.x scaling they equal).
fn rope_scaling_json(cfg: &ModelConfig) -> Result<Value> {
    let scaling = match &cfg.rope_freq_factors {
        None => cfg.rope_scaling,
        Some(f) => llama3_scaling_of(f, cfg.rope_theta, cfg.head_dim)
            .filter(|_| cfg.rope_scaling == RopeScaling::None)
            .ok_or_else(|| ModelError::Config {
                field: "rope_freqs".into(),
                reason: "these per-frequency RoPE divisors are not a Llama 3.x rope_scaling; \
                         config.json cannot state them"
                    .into(),
            })?,
    };
    Ok(match scaling {
        RopeScaling::None => Value::Null,
        RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": factor }),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "attention_factor": attention_factor,
            "truncate": truncate,
        }),
    })
}

/// Hugging Face `generation_config.json`: BOS and EOS ids.
pub fn generation_config_json(cfg: &ModelConfig) -> Value {
    json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos_json(&cfg.eos_token_ids),
    })
}

/// Undoes the GGUF llama Q/K row permutation.
///
/// `w: [n_heads * head_dim, cols]` row-major, in GGUF row order; returns
/// the same matrix in Hugging Face row order: within each head, Hugging Face
/// row `i` is GGUF row `2i` and row `i + head_dim/2` is GGUF row `2i + 1`,
/// for `i < head_dim/2`.
///
/// Errors: `w.len()` not `n_heads * head_dim * cols`, or `head_dim` odd
/// (named after `tensor`).
pub fn unpermute_qk_rows(
    tensor: &str,
    w: &[f32],
    n_heads: usize,
    head_dim: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    if w.len() != n_heads * head_dim * cols || !head_dim.is_multiple_of(2) {
        return Err(ModelError::Tensor {
            tensor: tensor.to_string(),
            reason: format!(
                "cannot un-permute {} elements as {n_heads} heads x {head_dim} rows (even) x {cols} columns",
                w.len()
            ),
        });
    }
    Ok(unpermute_rows(w, n_heads, head_dim, cols))
}

/// [`unpermute_qk_rows`] on a matrix of checked shape.
fn unpermute_rows(w: &[f32], n_heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0f32; w.len()];
    for h in 0..n_heads {
        let base = h * head_dim;
        for i in 0..half {
            for (hf_row, gguf_row) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                let dst = (base + hf_row) * cols;
                let src = (base + gguf_row) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// Subtracts the Gemma norm offset: GGUF `1 + w` -> Hugging Face `w`.
pub fn gemma_norm_to_hf(norm: &[f32]) -> Vec<f32> {
    norm.iter().map(|x| x - GEMMA_NORM_OFFSET).collect()
}

/// Where a written tensor's f32 values come from.
enum Values<'a> {
    /// A weight matrix, dequantized when written; `qk_heads: Some(h)` = a
    /// GGUF llama Q/K matrix of `h` heads whose rows are un-permuted.
    Matrix {
        lin: &'a Linear,
        qk_heads: Option<usize>,
        head_dim: usize,
    },
    /// A norm weight; `gemma`: GGUF `1 + w`, written as `w`.
    Norm { v: &'a [f32], gemma: bool },
    /// A projection bias; `qk_heads: Some(h)`: the bias of a GGUF llama
    /// Q/K matrix, its rows un-permuted like the matrix's.
    Bias {
        v: &'a [f32],
        qk_heads: Option<usize>,
        head_dim: usize,
    },
}

/// One tensor to write, converted to Hugging Face layout and encoded to the
/// output dtype only when the writer asks (one tensor in memory at a time).
struct OutTensor<'a> {
    shape: Vec<usize>,
    values: Values<'a>,
    dtype: OutputDtype,
}

impl OutTensor<'_> {
    fn f32_values(&self) -> Vec<f32> {
        match self.values {
            Values::Matrix {
                lin,
                qk_heads: None,
                ..
            } => lin.to_f32(),
            Values::Matrix {
                lin,
                qk_heads: Some(heads),
                head_dim,
            } => unpermute_rows(&lin.to_f32(), heads, head_dim, lin.in_features),
            Values::Norm { v, gemma: true } => gemma_norm_to_hf(v),
            Values::Norm { v, gemma: false } => v.to_vec(),
            Values::Bias {
                v,
                qk_heads: Some(heads),
                head_dim,
            } => unpermute_rows(v, heads, head_dim, 1),
            Values::Bias { v, .. } => v.to_vec(),
        }
    }

    fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}

impl safetensors::View for OutTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            OutputDtype::F32 => safetensors::Dtype::F32,
            OutputDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let values = self.f32_values();
        let bytes: Vec<u8> = match self.dtype {
            OutputDtype::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            OutputDtype::Bf16 => values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        let per = match self.dtype {
            OutputDtype::F32 => 4,
            OutputDtype::Bf16 => 2,
        };
        self.n_elements() * per
    }
}

/// Queues a weight matrix; `qk_heads: Some(h)` un-permutes its rows as
/// `h` heads of `head_dim` rows (checked here, so writing cannot fail).
fn push_matrix<'a>(
    tensors: &mut Vec<(String, OutTensor<'a>)>,
    name: String,
    lin: &'a Linear,
    qk_heads: Option<usize>,
    head_dim: usize,
    dtype: OutputDtype,
) -> Result<()> {
    if let Some(heads) = qk_heads {
        if lin.out_features != heads * head_dim || !head_dim.is_multiple_of(2) {
            return Err(ModelError::Tensor {
                tensor: name,
                reason: format!(
                    "has {} rows; cannot un-permute as {heads} heads of {head_dim} (even) rows",
                    lin.out_features
                ),
            });
        }
    }
    let shape = vec![lin.out_features, lin.in_features];
    let values = Values::Matrix {
        lin,
        qk_heads,
        head_dim,
    };
    tensors.push((
        name,
        OutTensor {
            shape,
            values,
            dtype,
        },
    ));
    Ok(())
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    })
}

/// Converts the GGUF file `gguf` into a Hugging Face directory `out_dir`
/// (created if missing; existing files of the same names are replaced).
///
/// Errors: everything loading the GGUF reports; [`ModelError::Io`] naming
/// the file that cannot be written; [`ModelError::Tokenizer`] if the
/// tokenizer cannot be serialized.
pub fn convert_gguf_to_hf(
    gguf: &Path,
    out_dir: &Path,
    dtype: OutputDtype,
) -> Result<ConvertSummary> {
    let LoadedModel { model, tokenizer } = load_model(&ModelSource::Gguf(gguf.to_path_buf()))?;
    let cfg = &model.config;
    let w = &model.weights;
    std::fs::create_dir_all(out_dir).map_err(|error| ModelError::Io {
        path: out_dir.to_path_buf(),
        error,
    })?;

    let unpermute = cfg.rope_convention == RopeConvention::Interleaved;
    let gemma = cfg.architecture.family().hf_norm_offset != 0.0;
    let names = TensorNames {
        scheme: NameScheme::HuggingFace,
        arch: cfg.architecture,
    };
    let d = cfg.head_dim;
    let mut tensors: Vec<(String, OutTensor)> = Vec::new();
    let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    for (i, l) in w.layers.iter().enumerate() {
        let n = |role: &str| names.layer(i, role);
        for (role, lin, qk_heads) in [
            ("q", &l.q_proj, unpermute.then_some(hq)),
            ("k", &l.k_proj, unpermute.then_some(hkv)),
            ("v", &l.v_proj, None),
            ("o", &l.o_proj, None),
            ("gate", &l.gate_proj, None),
            ("up", &l.up_proj, None),
            ("down", &l.down_proj, None),
        ] {
            push_matrix(&mut tensors, n(role), lin, qk_heads, d, dtype)?;
            if let Some(v) = &lin.bias {
                let values = Values::Bias {
                    v,
                    qk_heads,
                    head_dim: d,
                };
                let shape = vec![v.len()];
                let name = names.layer_bias(i, role);
                tensors.push((
                    name,
                    OutTensor {
                        shape,
                        values,
                        dtype,
                    },
                ));
            }
        }
    }
    push_matrix(
        &mut tensors,
        names.global("embed").into(),
        &w.embed_tokens,
        None,
        d,
        dtype,
    )?;
    if let Some(head) = &w.lm_head {
        push_matrix(
            &mut tensors,
            names.global("lm_head").into(),
            head,
            None,
            d,
            dtype,
        )?;
    }
    // Norm weights `[len]`, in the same order for every layer.
    let mut norms: Vec<(String, &[f32])> = Vec::new();
    for (i, l) in w.layers.iter().enumerate() {
        let n = |role: &str| names.layer(i, role);
        for (role, v) in [
            ("attn_norm", Some(&l.attn_norm)),
            ("ffn_norm", Some(&l.ffn_norm)),
            ("q_norm", l.q_norm.as_ref()),
            ("k_norm", l.k_norm.as_ref()),
            ("post_attn_norm", l.post_attn_norm.as_ref()),
            ("post_ffn_norm", l.post_ffn_norm.as_ref()),
        ] {
            if let Some(v) = v {
                norms.push((n(role), v));
            }
        }
    }
    norms.push((names.global("norm").to_string(), &w.final_norm));
    for (name, v) in norms {
        let values = Values::Norm { v, gemma };
        tensors.push((
            name,
            OutTensor {
                shape: vec![v.len()],
                values,
                dtype,
            },
        ));
    }
    let summary = ConvertSummary {
        tensors: tensors.len(),
        parameters: tensors.iter().map(|(_, t)| t.n_elements() as u64).sum(),
        unpermuted_qk: unpermute,
        shifted_norms: gemma,
    };

    let st_path = out_dir.join("model.safetensors");
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(metadata), &st_path).map_err(|e| {
        ModelError::Io {
            path: st_path.clone(),
            error: std::io::Error::other(e.to_string()),
        }
    })?;
    // The writer creates the file private (a temporary file renamed into
    // place); make it readable like the JSON files.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&st_path, std::fs::Permissions::from_mode(0o644)).map_err(
            |error| ModelError::Io {
                path: st_path.clone(),
                error,
            },
        )?;
    }
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values serialize");
    write_file(
        &out_dir.join("config.json"),
        &pretty(&hf_config_json(cfg, dtype)?),
    )?;
    write_file(
        &out_dir.join("generation_config.json"),
        &pretty(&generation_config_json(cfg)),
    )?;
    write_file(&out_dir.join("tokenizer.json"), &tokenizer.to_json()?)?;
    if let Some(template) = tokenizer.chat_template() {
        let config = serde_json::json!({ "chat_template": template });
        write_file(&out_dir.join("tokenizer_config.json"), &pretty(&config))?;
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama.cpp's permutation written independently: each head's rows
    /// viewed as `[2, d/2]` (half, index) and transposed to `[d/2, 2]`.
    fn permute_like_gguf(hf: &[f32], n_heads: usize, d: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; hf.len()];
        for h in 0..n_heads {
            for half in 0..2 {
                for i in 0..d / 2 {
                    let hf_row = h * d + half * (d / 2) + i;
                    let gguf_row = h * d + i * 2 + half;
                    out[gguf_row * cols..(gguf_row + 1) * cols]
                        .copy_from_slice(&hf[hf_row * cols..(hf_row + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_hand_built_example() {
        // One head, d = 4, one column: HF rows [a0, a1, b0, b1] (first half
        // a, second half b) are stored in GGUF as [a0, b0, a1, b1].
        let gguf = [10.0, 20.0, 11.0, 21.0];
        let hf = unpermute_qk_rows("q", &gguf, 1, 4, 1).unwrap();
        assert_eq!(hf, vec![10.0, 11.0, 20.0, 21.0]);
    }

    #[test]
    fn unpermute_inverts_gguf_permutation_over_heads_and_columns() {
        let (n_heads, d, cols) = (3, 8, 5);
        let hf: Vec<f32> = (0..n_heads * d * cols).map(|x| x as f32).collect();
        let gguf = permute_like_gguf(&hf, n_heads, d, cols);
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_qk_rows("k", &gguf, n_heads, d, cols).unwrap(), hf);
    }

    #[test]
    fn unpermute_rejects_bad_shapes() {
        let e = unpermute_qk_rows("blk.0.attn_q.weight", &[0.0; 6], 1, 3, 2).unwrap_err();
        assert!(e.to_string().contains("blk.0.attn_q.weight"), "{e}");
        assert!(unpermute_qk_rows("q", &[0.0; 7], 1, 4, 2).is_err());
    }

    #[test]
    fn gemma_norm_offset_round_trips_through_hf_loader_offset() {
        // GGUF holds 1 + w; HF stores w and its loader adds 1 back.
        let gguf = [1.0f32, 2.5, 0.75, 31.125, 1.0e-3];
        let hf = gemma_norm_to_hf(&gguf);
        assert_eq!(hf, vec![0.0, 1.5, -0.25, 30.125, 1.0e-3 - 1.0]);
        for (x, y) in gguf.iter().zip(&hf) {
            // Exact for x >= 0.5 (x - 1 is exact there); within half an
            // ulp of 1 below.
            let back = y + 1.0;
            if *x >= 0.5 {
                assert_eq!(back, *x);
            } else {
                assert!((back - x).abs() <= f32::EPSILON / 2.0, "{x} -> {back}");
            }
        }
    }

    fn round_trip_config(cfg: &ModelConfig, name: &str) -> ModelConfig {
        let dir = std::env::temp_dir().join(format!("te-convert-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config =
            serde_json::to_string(&hf_config_json(cfg, OutputDtype::Bf16).unwrap()).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        let gen = serde_json::to_string(&generation_config_json(cfg)).unwrap();
        std::fs::write(dir.join("generation_config.json"), gen).unwrap();
        let back = crate::hf::load_config(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        back.unwrap()
    }

    fn gemma2_like() -> ModelConfig {
        ModelConfig {
            architecture: crate::family::by_gguf_name("gemma2").expect("a family"),
            vocab_size: 256,
            hidden_size: 96,
            intermediate_size: 160,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 24,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
            rope_theta: 10000.0,
            rope_local_base_freq: 10000.0,
            rope_scaling: RopeScaling::None,
            rope_convention: RopeConvention::HalfSplit,
            hidden_activation: Activation::GeluTanh,
            // query_pre_attn_scalar 96 = hidden / heads (not head_dim).
            softmax_scale: 1.0 / 96f32.sqrt(),
            attn_logit_softcapping: Some(50.0),
            final_logit_softcapping: Some(30.0),
            layer_windows: vec![Some(4096), None, Some(4096), None],
            scale_embedding: true,
            qk_norm: false,
            sandwich_norms: true,
            tie_word_embeddings: true,
            attention_bias: false,
            qkv_bias: false,
            mlp_bias: false,
            rope_freq_factors: None,
            bos_token_id: Some(2),
            eos_token_ids: vec![1, 107],
        }
    }

    #[test]
    fn hf_config_reads_back_as_the_same_config() {
        let g2 = gemma2_like();
        assert_eq!(round_trip_config(&g2, "gemma2"), g2);

        let g3 = ModelConfig {
            architecture: crate::family::by_gguf_name("gemma3").expect("a family"),
            rope_theta: 1e6,
            rope_scaling: RopeScaling::Linear { factor: 8.0 },
            softmax_scale: 1.0 / 24f32.sqrt(),
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            qk_norm: true,
            layer_windows: vec![Some(512), Some(512), Some(512), None],
            eos_token_ids: vec![1],
            ..gemma2_like()
        };
        assert_eq!(round_trip_config(&g3, "gemma3"), g3);

        let llama = ModelConfig {
            architecture: crate::family::by_gguf_name("llama").expect("a family"),
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_local_base_freq: 500000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            hidden_activation: Activation::Silu,
            softmax_scale: 1.0 / 24f32.sqrt(),
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            layer_windows: vec![None; 4],
            scale_embedding: false,
            sandwich_norms: false,
            tie_word_embeddings: false,
            attention_bias: true,
            mlp_bias: true,
            bos_token_id: Some(200),
            eos_token_ids: vec![201, 209],
            ..gemma2_like()
        };
        let back = round_trip_config(&llama, "llama");
        assert_eq!(back, llama);
        let json = hf_config_json(&llama, OutputDtype::F32).unwrap();
        assert_eq!(json["model_type"], "llama");
        assert_eq!(json["torch_dtype"], "float32");
        assert_eq!(json["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(
            hf_config_json(&g3, OutputDtype::F32).unwrap()["model_type"],
            "gemma3_text"
        );
        assert_eq!(
            hf_config_json(&g2, OutputDtype::F32).unwrap()["query_pre_attn_scalar"],
            96
        );

        // Qwen2: q/k/v biases from the family, YaRN, windows on the last
        // layers only; Qwen3: q/k norms; Mistral: a window on every layer.
        let plain = ModelConfig {
            rope_local_base_freq: 1e6,
            rope_theta: 1e6,
            softmax_scale: 1.0 / 24f32.sqrt(),
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            scale_embedding: false,
            sandwich_norms: false,
            hidden_activation: Activation::Silu,
            tie_word_embeddings: false,
            ..gemma2_like()
        };
        let qwen2 = ModelConfig {
            architecture: crate::family::by_gguf_name("qwen2").expect("a family"),
            qkv_bias: true,
            max_position_embeddings: 131072,
            rope_scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32768,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: RopeScaling::yarn_mscale(4.0, 1.0),
                truncate: true,
            },
            layer_windows: vec![None, None, Some(64), Some(64)],
            ..plain.clone()
        };
        assert_eq!(round_trip_config(&qwen2, "qwen2"), qwen2);
        let qwen3 = ModelConfig {
            architecture: crate::family::by_gguf_name("qwen3").expect("a family"),
            qk_norm: true,
            layer_windows: vec![None; 4],
            ..plain.clone()
        };
        assert_eq!(round_trip_config(&qwen3, "qwen3"), qwen3);
        let mistral = ModelConfig {
            architecture: crate::family::by_gguf_name("mistral").expect("a family"),
            layer_windows: vec![Some(4096); 4],
            ..plain.clone()
        };
        assert_eq!(round_trip_config(&mistral, "mistral"), mistral);
        let json = hf_config_json(&mistral, OutputDtype::F32).unwrap();
        assert_eq!(json["architectures"][0], "MistralForCausalLM");
        assert_eq!(json["sliding_window"], 4096);
    }

    /// GGUF `rope_freqs` as llama.cpp's converter computes them (in f32,
    /// from Llama 3.1's parameters) are written back as those parameters;
    /// other divisors are refused, naming `rope_freqs`.
    #[test]
    fn rope_freqs_convert_to_the_llama3_scaling_they_equal() {
        let (base, d) = (500000.0f32, 128usize);
        let (factor, low, high, old) = (8.0f32, 1.0f32, 4.0f32, 8192.0f32);
        // llama.cpp's convert_hf_to_gguf formula, in f32.
        let factors: Vec<f32> = (0..d / 2)
            .map(|i| {
                let freq = 1.0 / base.powf((2 * i) as f32 / d as f32);
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect();
        assert!(
            factors.iter().any(|f| *f > 1.0 && *f < factor),
            "a blended frequency"
        );
        let got = llama3_scaling_of(&factors, base, d).expect("recognised");
        assert_eq!(
            got,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }
        );
        let cfg = ModelConfig {
            architecture: crate::family::by_gguf_name("llama").expect("a family"),
            head_dim: d,
            rope_theta: base,
            rope_freq_factors: Some(factors.clone()),
            ..gemma2_like()
        };
        let json = hf_config_json(&cfg, OutputDtype::F32).unwrap();
        assert_eq!(json["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(json["rope_scaling"]["factor"], 8.0);
        let mut odd = factors;
        odd[3] *= 1.5;
        let err = hf_config_json(
            &ModelConfig {
                rope_freq_factors: Some(odd),
                ..cfg
            },
            OutputDtype::F32,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("rope_freqs"), "{err}");
    }

    #[test]
    fn f32_json_reads_back_as_the_same_f32() {
        for x in [1e-6f32, 1e-5, 100000.0, 1e6, 30.0, 0.0625] {
            let v = f32_json(x);
            assert_eq!(v.as_f64().unwrap() as f32, x);
        }
    }
}
