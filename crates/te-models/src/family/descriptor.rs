//! What a model family is: the facts every architecture file in
//! [`crate::family`] states ([`Family`]), the handle a resolved config
//! carries ([`Architecture`]), and the tensor names of each file format
//! ([`TensorNames`]).

use te_formats::gguf::GgufFile;
use te_formats::hf_config::HfConfig;
use te_kernels::activation::Activation;
use te_kernels::rope::RopeConvention;

use crate::Result;

/// Every fact of one architecture that loading, validation, conversion and
/// the forward need. Each family file holds one, registered in
/// [`crate::family::FAMILIES`]; the GGUF and Hugging Face readers read the
/// fields every family shares and ask the family for the rest.
#[derive(Debug)]
pub struct Family {
    /// GGUF `general.architecture` (and its metadata key prefix), and the
    /// name `te inspect` shows.
    pub name: &'static str,
    /// Hugging Face `model_type`s read as this family.
    pub hf_model_types: &'static [&'static str],
    /// The `model_type` `te convert` writes (`gemma3_text`: the text model).
    pub hf_model_type: &'static str,
    /// The `architectures` class `te convert` writes.
    pub hf_class: &'static str,
    /// The gated MLP's activation: GGUF names none; `config.json`'s
    /// `hidden_activation` / `hidden_act` override it.
    pub activation: Activation,
    /// `tie_word_embeddings` when `config.json` does not say.
    pub default_tie_word_embeddings: bool,
    /// How GGUF files of the family store Q/K rows: permuted for
    /// interleaved RoPE (llama.cpp's llama converter), or as Hugging Face
    /// (half-split).
    pub gguf_rope_convention: RopeConvention,
    /// Added to stored norm weights: Gemma's RMSNorm multiplies by
    /// `1 + w` and Hugging Face checkpoints store `w` (GGUF files store
    /// `1 + w` already).
    pub hf_norm_offset: f32,
    /// The embedding is multiplied by sqrt(hidden_size) (Gemma).
    pub scale_embedding: bool,
    /// Per-head RMSNorm of q and k before RoPE (Gemma 3, Qwen3).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections whatever `config.json` says
    /// (Qwen2: Hugging Face's `Qwen2Attention` always has them, and no
    /// bias on o).
    pub qkv_bias: bool,
    /// Norms after attention and after the MLP too (Gemma 2/3: four per
    /// layer; Hugging Face calls the pre-MLP one
    /// `pre_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// `config.json` turns sliding windows on with `use_sliding_window`
    /// (Qwen2/3), which `te convert` writes.
    pub hf_use_sliding_window: bool,
    /// The sliding-window layers rotate with their own, unscaled table
    /// (Gemma 3's `rope_local_base_freq`, rope_type "default").
    pub local_rope_unscaled: bool,
    /// The family's config values that vary per model, from `config.json`.
    pub from_hf: fn(&HfConfig, &Shared) -> Result<Specifics>,
    /// The same from GGUF metadata.
    pub from_gguf: fn(&GgufKeys<'_>, &Shared) -> Result<Specifics>,
}

/// Config values every family reads the same way, given to a family's
/// readers.
#[derive(Clone, Copy, Debug)]
pub struct Shared {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub head_dim: usize,
}

/// A family's config values that vary per model; `None` and empty mean
/// the shared default.
#[derive(Clone, Debug, Default)]
pub struct Specifics {
    /// `softmax_scale = 1 / sqrt(base)`; default `head_dim`.
    pub softmax_scale_base: Option<f32>,
    /// Per layer, `Some(W)`: a sliding window of W keys; default: every
    /// layer global.
    pub layer_windows: Option<Vec<Option<usize>>>,
    /// RoPE base of the sliding-window layers; default `rope_theta`.
    pub rope_local_base_freq: Option<f32>,
    pub attn_logit_softcapping: Option<f32>,
    pub final_logit_softcapping: Option<f32>,
}

/// A GGUF file's metadata under its architecture's prefix
/// (`<arch>.block_count`, ...).
pub struct GgufKeys<'a> {
    pub file: &'a GgufFile,
    /// `general.architecture`.
    pub arch: &'a str,
}

impl GgufKeys<'_> {
    /// `<arch>.<k>`.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// A required integer; errors name the key.
    pub fn usize(&self, k: &str) -> Result<usize> {
        Ok(self.file.get_u64(&self.key(k)).map(|v| v as usize)?)
    }

    /// An optional integer; errors name the key when it has the wrong type.
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.file.metadata(&self.key(k)) {
            None => Ok(None),
            Some(_) => self.usize(k).map(Some),
        }
    }

    /// An optional float; errors name the key when it has the wrong type.
    pub fn opt_f32(&self, k: &str) -> Result<Option<f32>> {
        match self.file.metadata(&self.key(k)) {
            None => Ok(None),
            Some(_) => Ok(Some(self.file.get_f32(&self.key(k))?)),
        }
    }
}

/// The family of a resolved config: a handle to its [`Family`], compared
/// by name.
#[derive(Clone, Copy)]
pub struct Architecture(pub &'static Family);

impl Architecture {
    /// Name as written in GGUF `general.architecture` and by `te inspect`.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// The family's facts.
    pub fn family(self) -> &'static Family {
        self.0
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Architecture {}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Architecture({})", self.0.name)
    }
}

/// Tensor names of one file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameScheme {
    /// GGUF (`blk.N.attn_q.weight`, ...).
    Gguf,
    /// Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...).
    HuggingFace,
}

/// Tensor names of one architecture in one file format, by role: the one
/// name mapping used to read weights (`crate::weights::ModelWeights::load`) and to write
/// them (`crate::convert`).
///
/// Layer roles: `attn_norm`, `q`, `k`, `v`, `o`, `q_norm`, `k_norm`,
/// `post_attn_norm`, `ffn_norm`, `gate`, `up`, `down`, `post_ffn_norm`.
/// Global roles: `embed`, `norm`, `lm_head`. An unknown role is a
/// programming error and panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorNames {
    pub scheme: NameScheme,
    pub arch: Architecture,
}

impl TensorNames {
    /// The name of layer `i`'s weight of role `what` (`blk.3.attn_q.weight`,
    /// `model.layers.3.self_attn.q_proj.weight`).
    pub fn layer(&self, i: usize, what: &str) -> String {
        match self.scheme {
            NameScheme::Gguf => {
                let n = match what {
                    "attn_norm" => "attn_norm",
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "q_norm" => "attn_q_norm",
                    "k_norm" => "attn_k_norm",
                    "post_attn_norm" => "post_attention_norm",
                    "ffn_norm" => "ffn_norm",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "post_ffn_norm" => "post_ffw_norm",
                    _ => unreachable!("unknown weight role {what}"),
                };
                format!("blk.{i}.{n}.weight")
            }
            NameScheme::HuggingFace => {
                let sandwich = self.arch.family().sandwich_norms;
                let n = match what {
                    "attn_norm" => "input_layernorm",
                    "q" => "self_attn.q_proj",
                    "k" => "self_attn.k_proj",
                    "v" => "self_attn.v_proj",
                    "o" => "self_attn.o_proj",
                    "q_norm" => "self_attn.q_norm",
                    "k_norm" => "self_attn.k_norm",
                    "post_attn_norm" => "post_attention_layernorm",
                    // Llama and Gemma 1 call the pre-MLP norm
                    // `post_attention_layernorm`; Gemma 2/3 have both.
                    "ffn_norm" if sandwich => "pre_feedforward_layernorm",
                    "ffn_norm" => "post_attention_layernorm",
                    "gate" => "mlp.gate_proj",
                    "up" => "mlp.up_proj",
                    "down" => "mlp.down_proj",
                    "post_ffn_norm" => "post_feedforward_layernorm",
                    _ => unreachable!("unknown weight role {what}"),
                };
                format!("model.layers.{i}.{n}.weight")
            }
        }
    }

    /// The name of the bias of layer `i`'s matrix of role `what` (`q`, `k`,
    /// `v`, `o`, `gate`, `up`, `down`): `blk.3.attn_q.bias`,
    /// `model.layers.3.self_attn.q_proj.bias`.
    pub fn layer_bias(&self, i: usize, what: &str) -> String {
        let weight = self.layer(i, what);
        let stem = weight.strip_suffix(".weight").unwrap_or(&weight);
        format!("{stem}.bias")
    }

    /// The name of a weight outside the layers (`embed`, `norm`, `lm_head`).
    pub fn global(&self, what: &str) -> &'static str {
        match (self.scheme, what) {
            (NameScheme::Gguf, "embed") => "token_embd.weight",
            (NameScheme::Gguf, "norm") => "output_norm.weight",
            (NameScheme::Gguf, "lm_head") => "output.weight",
            (NameScheme::HuggingFace, "embed") => "model.embed_tokens.weight",
            (NameScheme::HuggingFace, "norm") => "model.norm.weight",
            (NameScheme::HuggingFace, "lm_head") => "lm_head.weight",
            _ => unreachable!("unknown weight role {what}"),
        }
    }
}
