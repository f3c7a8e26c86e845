//! Model validation in one place: a resolved config against the tensors
//! of its file(s), the metadata that repeats what the tensors say, and the
//! tokenizer's ids, before any weight is read (a GGUF file's tokenizer, built
//! beside its weights, is checked once both are there).
//!
//! What is checked ([`problems`]):
//! - every tensor the architecture needs is present, with the shape the
//!   config implies ([`expected_tensors`] is the one list of names and
//!   shapes; [`crate::weights::ModelWeights::load`] reads by it);
//! - no stored tensor is left unused, except those the architecture says
//!   may be there: Hugging Face `*.self_attn.rotary_emb.inv_freq` (RoPE
//!   frequencies older checkpoints store, recomputed from the config);
//!   an `lm_head.weight` / `output.weight` next to tied embeddings is used,
//!   not skipped;
//! - every tensor's stored type is one te-rs reads;
//! - GGUF metadata that repeats the tensors agrees with them
//!   (`<arch>.vocab_size` and `tokenizer.ggml.tokens` with the rows of
//!   `token_embd.weight`, `<arch>.rope.dimension_count` and
//!   `<arch>.attention.value_length` with the head size, no experts);
//! - the config's layer count agrees with the layers the file holds;
//! - every token id the tokenizer can produce is inside the vocabulary.
//!
//! Byte ranges are checked where the files are opened: GGUF tensor data
//! must be in bounds, aligned and each tensor must start at the aligned end
//! of the previous one (so ranges are disjoint; [`te_formats::gguf`]);
//! safetensors headers are checked the same way by the `safetensors`
//! crate (contiguous, in bounds, sizes matching dtype and shape).
//!
//! Errors name the tensors and the config fields (Hugging Face names for
//! `config.json`, GGUF keys for GGUF files) involved.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use crate::config::{Architecture, ModelConfig};
use te_formats::gguf::GgufFile;
use te_formats::TensorSource;
use te_tokenizer::Tokenizer;

use crate::family::{NameScheme, TensorNames};
use crate::{ModelError, Result};

/// One tensor a model of a given config reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// The tensor name in the file's scheme.
    pub name: String,
    /// Row-major shape, outermost first.
    pub shape: Vec<usize>,
    /// Whether the model cannot run without it (else it is used when present).
    pub required: bool,
    /// The shape in terms of config fields, for errors
    /// (`"[num_attention_heads × head_dim, hidden_size]"`).
    pub formula: String,
}

/// Names of the config fields that size tensors, in one file format.
struct Fields {
    vocab: String,
    hidden: String,
    ffn: String,
    layers: String,
    heads: String,
    kv_heads: String,
    head_dim: String,
}

fn fields(scheme: NameScheme, arch: Architecture) -> Fields {
    match scheme {
        NameScheme::HuggingFace => Fields {
            vocab: "vocab_size".into(),
            hidden: "hidden_size".into(),
            ffn: "intermediate_size".into(),
            layers: "num_hidden_layers".into(),
            heads: "num_attention_heads".into(),
            kv_heads: "num_key_value_heads".into(),
            head_dim: "head_dim".into(),
        },
        NameScheme::Gguf => {
            let a = arch.name();
            Fields {
                vocab: "rows of token_embd.weight".into(),
                hidden: format!("{a}.embedding_length"),
                ffn: format!("{a}.feed_forward_length"),
                layers: format!("{a}.block_count"),
                heads: format!("{a}.attention.head_count"),
                kv_heads: format!("{a}.attention.head_count_kv"),
                head_dim: format!("{a}.attention.key_length"),
            }
        }
    }
}

/// Every tensor a model of `cfg` reads from a file of `scheme`, in load
/// order: per layer (norms, projections, their biases, Gemma norms), then
/// the embedding, the output projection and the final norm.
pub fn expected_tensors(cfg: &ModelConfig, scheme: NameScheme) -> Vec<ExpectedTensor> {
    expected_tensors_of_layers(cfg, scheme, cfg.num_hidden_layers)
}

/// [`expected_tensors`] for the first `layers` layers only.
fn expected_tensors_of_layers(
    cfg: &ModelConfig,
    scheme: NameScheme,
    layers: usize,
) -> Vec<ExpectedTensor> {
    let names = TensorNames {
        scheme,
        arch: cfg.architecture,
    };
    let f = fields(scheme, cfg.architecture);
    let (hidden, d, ffn) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let q_rows = format!("{} × {}", f.heads, f.head_dim);
    let kv_rows = format!("{} × {}", f.kv_heads, f.head_dim);
    // (role, shape, formula) of each layer matrix.
    let matrices: [(&str, [usize; 2], [&str; 2]); 7] = [
        ("q", [hq * d, hidden], [&q_rows, &f.hidden]),
        ("k", [hkv * d, hidden], [&kv_rows, &f.hidden]),
        ("v", [hkv * d, hidden], [&kv_rows, &f.hidden]),
        ("o", [hidden, hq * d], [&f.hidden, &q_rows]),
        ("gate", [ffn, hidden], [&f.ffn, &f.hidden]),
        ("up", [ffn, hidden], [&f.ffn, &f.hidden]),
        ("down", [hidden, ffn], [&f.hidden, &f.ffn]),
    ];
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, required: bool, formula: String| {
        out.push(ExpectedTensor {
            name,
            shape,
            required,
            formula,
        })
    };
    for i in 0..layers.min(cfg.num_hidden_layers) {
        let vector = |len: usize, field: &str| (vec![len], format!("[{field}]"));
        let (s, fm) = vector(hidden, &f.hidden);
        push(names.layer(i, "attn_norm"), s, true, fm);
        for (role, shape, formula) in &matrices {
            push(
                names.layer(i, role),
                shape.to_vec(),
                true,
                format!("[{}, {}]", formula[0], formula[1]),
            );
            if cfg.has_bias(role) {
                push(
                    names.layer_bias(i, role),
                    vec![shape[0]],
                    true,
                    format!("[{}]", formula[0]),
                );
            }
        }
        if cfg.qk_norm {
            for role in ["q_norm", "k_norm"] {
                let (s, fm) = vector(d, &f.head_dim);
                push(names.layer(i, role), s, true, fm);
            }
        }
        if cfg.sandwich_norms {
            for role in ["post_attn_norm", "post_ffn_norm"] {
                let (s, fm) = vector(hidden, &f.hidden);
                push(names.layer(i, role), s, true, fm);
            }
        }
        let (s, fm) = vector(hidden, &f.hidden);
        push(names.layer(i, "ffn_norm"), s, true, fm);
    }
    if scheme == NameScheme::Gguf && cfg.rope_freq_factors.is_some() {
        push(
            "rope_freqs.weight".into(),
            vec![d / 2],
            true,
            format!("[{} / 2]", f.head_dim),
        );
    }
    let table = format!("[{}, {}]", f.vocab, f.hidden);
    push(
        names.global("embed").into(),
        vec![cfg.vocab_size, hidden],
        true,
        table.clone(),
    );
    push(
        names.global("lm_head").into(),
        vec![cfg.vocab_size, hidden],
        !cfg.tie_word_embeddings,
        table,
    );
    push(
        names.global("norm").into(),
        vec![hidden],
        true,
        format!("[{}]", f.hidden),
    );
    out
}

/// Whether `name` may be stored without being used: buffers the
/// architecture recomputes from the config.
fn may_be_unused(name: &str, scheme: NameScheme) -> bool {
    scheme == NameScheme::HuggingFace && name.ends_with(".self_attn.rotary_emb.inv_freq")
}

/// The layer index of a layer tensor name (`blk.3.…`, `model.layers.3.…`).
fn layer_of(name: &str) -> Option<usize> {
    let rest = name
        .strip_prefix("blk.")
        .or_else(|| name.strip_prefix("model.layers."))?;
    rest.split('.').next()?.parse().ok()
}

/// A layer tensor's name with its layer index replaced by `N`.
fn layer_pattern(name: &str) -> String {
    match layer_of(name) {
        Some(l) => name.replacen(&format!(".{l}."), ".N.", 1),
        None => name.to_string(),
    }
}

/// `a`, `b`, `c` and 4 more.
fn name_list(names: &[&str], max: usize) -> String {
    let mut s = names
        .iter()
        .take(max)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > max {
        s.push_str(&format!(" and {} more", names.len() - max));
    }
    s
}

/// Names listed per problem at most.
const MAX_NAMES: usize = 4;

/// Problems of `src`'s tensors for a model of `cfg` (empty: all good).
pub fn tensor_problems(
    cfg: &ModelConfig,
    scheme: NameScheme,
    src: &dyn TensorSource,
) -> Vec<String> {
    let f = fields(scheme, cfg.architecture);
    let stored = src.stored_tensors();
    let by_name: HashMap<&str, usize> = stored
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut problems = Vec::new();

    // The layer count against the layers the file holds.
    let stored_layers: BTreeSet<usize> = stored.iter().filter_map(|t| layer_of(&t.name)).collect();
    let file_layers = stored_layers.last().map_or(0, |l| l + 1);
    if file_layers != cfg.num_hidden_layers {
        problems.push(format!(
            "`{}` = {}, but the file holds tensors of {file_layers} layers",
            f.layers, cfg.num_hidden_layers
        ));
    }
    // Layers past the file's first missing one are not listed one by one
    // (and a huge layer count costs nothing).
    let expected = expected_tensors_of_layers(cfg, scheme, file_layers + 1);

    let mut missing: Vec<&str> = Vec::new();
    // Shape mismatches grouped over layers: (name pattern, got, want) ->
    // (problem index, tensors).
    let mut mismatches: Vec<(String, Vec<usize>, &ExpectedTensor, Vec<&str>)> = Vec::new();
    for e in &expected {
        let Some(&i) = by_name.get(e.name.as_str()) else {
            if e.required {
                missing.push(&e.name);
            }
            continue;
        };
        let t = &stored[i];
        if t.shape != e.shape {
            let pattern = layer_pattern(&e.name);
            match mismatches
                .iter_mut()
                .find(|m| m.0 == pattern && m.1 == t.shape && m.2.shape == e.shape)
            {
                Some(m) => m.3.push(&e.name),
                None => mismatches.push((pattern, t.shape.clone(), e, vec![&e.name])),
            }
        }
    }
    for (_, got, e, names) in &mismatches {
        let more = match names.len() {
            1 => String::new(),
            n => format!(
                " (and {} more like it: {})",
                n - 1,
                name_list(&names[1..], 2)
            ),
        };
        problems.push(format!(
            "tensor `{}` has shape {got:?}, but the config implies {:?} = {}{more}",
            e.name, e.shape, e.formula
        ));
    }
    if !missing.is_empty() {
        let hint = if missing.iter().any(|n| n.ends_with(".bias")) {
            match scheme {
                NameScheme::HuggingFace => {
                    let flags: Vec<&str> = [
                        (cfg.attention_bias, "attention_bias"),
                        (cfg.mlp_bias, "mlp_bias"),
                    ]
                    .iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, f)| *f)
                    .collect();
                    format!(" (config.json sets {} to true)", flags.join(" and "))
                }
                NameScheme::Gguf => " (the file has some projection biases of this kind; \
                                     every layer needs them all)"
                    .to_string(),
            }
        } else {
            String::new()
        };
        problems.push(format!(
            "missing {} {}{hint}",
            if missing.len() == 1 {
                "tensor"
            } else {
                "tensors"
            },
            name_list(&missing, MAX_NAMES)
        ));
    }

    let wanted: std::collections::HashSet<&str> =
        expected.iter().map(|e| e.name.as_str()).collect();
    let unused: Vec<&str> = stored
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !wanted.contains(n) && !may_be_unused(n, scheme))
        .collect();
    if !unused.is_empty() {
        let biases = unused.iter().any(|n| n.ends_with(".bias"));
        let hint = if biases && scheme == NameScheme::HuggingFace {
            " (bias tensors need `attention_bias` / `mlp_bias` = true in config.json)".to_string()
        } else {
            String::new()
        };
        problems.push(format!(
            "{} {} not used by a {} model with this config{hint}: {}",
            unused.len(),
            if unused.len() == 1 {
                "tensor"
            } else {
                "tensors"
            },
            cfg.architecture.name(),
            name_list(&unused, MAX_NAMES)
        ));
    }

    for t in &stored {
        if let Some(why) = &t.unreadable {
            problems.push(format!("tensor `{}`: {why}", t.name));
        }
    }
    problems
}

/// Problems of GGUF metadata that repeats what the tensors say.
pub fn gguf_metadata_problems(file: &GgufFile, cfg: &ModelConfig) -> Vec<String> {
    let a = cfg.architecture.name();
    let mut problems = Vec::new();
    let rows = file.tensor_info("token_embd.weight").map(|t| t.shape()[0]);
    let mut check = |key: String, want: usize, what: &str, note: &str| {
        if file.metadata(&key).is_none() {
            return;
        }
        match file.get_u64(&key) {
            Ok(v) if v == want as u64 => {}
            Ok(v) => problems.push(format!("`{key}` = {v}, but {what} is {want}{note}")),
            Err(e) => problems.push(e.to_string()),
        }
    };
    if let Some(rows) = rows {
        check(
            format!("{a}.vocab_size"),
            rows,
            "the row count of `token_embd.weight`",
            "",
        );
    }
    check(
        format!("{a}.rope.dimension_count"),
        cfg.head_dim,
        "the head size",
        " (te-rs rotates every dimension of a head; partial rotary embeddings are not supported)",
    );
    check(
        format!("{a}.attention.value_length"),
        cfg.head_dim,
        "the key head size",
        " (te-rs needs equal key and value head sizes)",
    );
    for key in [
        format!("{a}.expert_count"),
        format!("{a}.expert_used_count"),
    ] {
        if let Some(v) = file.metadata(&key).and_then(|v| v.as_u64()) {
            if v > 0 {
                problems.push(format!(
                    "`{key}` = {v}: mixture-of-experts models are not supported"
                ));
            }
        }
    }
    if let (Some(rows), Some(te_formats::gguf::GgufValue::Array(tokens))) =
        (rows, file.metadata("tokenizer.ggml.tokens"))
    {
        if tokens.len() != rows {
            problems.push(format!(
                "`tokenizer.ggml.tokens` has {} tokens, but `token_embd.weight` has {rows} rows",
                tokens.len()
            ));
        }
    }
    problems
}

/// Problems of a tokenizer whose ids do not fit the model's vocabulary.
pub fn tokenizer_problems(tokenizer: &Tokenizer, cfg: &ModelConfig) -> Vec<String> {
    match tokenizer.max_token_id() {
        Some(id) if id as usize >= cfg.vocab_size => vec![format!(
            "the tokenizer has token id {id} ({}), outside the model's vocabulary of {} (embedding rows)",
            tokenizer
                .token_text(id)
                .map_or("?".into(), |t| format!("`{t}`")),
            cfg.vocab_size
        )],
        _ => vec![],
    }
}

/// Everything [`crate::loader::load_model`] refuses about a model whose
/// config loaded: tensor problems, GGUF metadata problems (when `gguf`),
/// tokenizer problems (when `tokenizer`). Empty when the model is good.
pub fn problems(
    cfg: &ModelConfig,
    scheme: NameScheme,
    src: &dyn TensorSource,
    gguf: Option<&GgufFile>,
    tokenizer: Option<&Tokenizer>,
) -> Vec<String> {
    let mut p = Vec::new();
    if let Some(file) = gguf {
        p.extend(gguf_metadata_problems(file, cfg));
    }
    p.extend(tensor_problems(cfg, scheme, src));
    if let Some(t) = tokenizer {
        p.extend(tokenizer_problems(t, cfg));
    }
    p
}

/// `Err(ModelError::Invalid)` naming `path` when `problems` is not empty.
pub fn to_result(path: &Path, problems: Vec<String>) -> Result<()> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ModelError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

/// [`tensor_problems`] as a result (what loading weights checks first).
pub fn check_tensors(cfg: &ModelConfig, scheme: NameScheme, src: &dyn TensorSource) -> Result<()> {
    to_result(src.origin(), tensor_problems(cfg, scheme, src))
}
