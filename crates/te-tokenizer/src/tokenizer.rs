//! Tokenizers, built on the `tokenizers` crate, from GGUF metadata or a
//! Hugging Face `tokenizer.json`.
//!
//! From GGUF (`tokenizer.ggml.*` keys, llama.cpp conventions):
//! - `model = "gpt2"`: byte-level BPE from `tokens` and `merges`. The text
//!   is split before BPE as llama.cpp (`llama-vocab.cpp`) splits for `pre`
//!   ([`supported_gpt2_pres`] lists the names): `qwen2` (Qwen2/2.5,
//!   `deepseek-r1-qwen`: one digit per piece), `llama-bpe` (Llama 3,
//!   also `llama3`, `llama-v3`: up to 3 digits per piece, whole-vocabulary
//!   pieces taken without merging, BOS added by default), `smollm` (and
//!   starcoder-like names: every digit, then GPT-2's split), `gpt-2`,
//!   `default` (also when `pre` is absent). An unknown `pre` is an error.
//! - `model = "llama"`: SentencePiece-style BPE from `tokens` and `scores`,
//!   with byte fallback (`<0xXX>` pieces). GGUF stores no merges, so they are
//!   derived: every split of a vocabulary piece into two vocabulary pieces is
//!   a merge, ranked by the merged piece's score (higher first, ties by lower
//!   id). SentencePiece BPE repeatedly merges the adjacent pair whose
//!   concatenation has the highest score (leftmost on ties); with these ranks
//!   Hugging Face BPE makes the same choices. Spaces become `▁`; a `▁` prefix
//!   is added only when `add_space_prefix` is true.
//!
//! In both, `token_type` 3 (control) and 2 (unknown) pieces, and the texts
//! llama.cpp takes for control tokens whatever their type (end of turn,
//! fill-in-the-middle markers: `CONTROL_LOOKING`), become *special* added
//! tokens, matched in the text only when `parse_special` is true; other
//! type 4 (user-defined) pieces become plain added tokens, always matched
//! literally before the model runs (Gemma's runs of spaces, `\n`, tab;
//! Qwen's `<tool_call>`). BOS is prepended when `add_bos_token` says so;
//! when the key is absent, llama.cpp's default: true for `llama`, false
//! for `gpt2` except the Llama 3 names.

use std::path::Path;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use te_formats::gguf::GgufFile;

use crate::{Result, TokenizerError};

/// llama.cpp `token_type` values.
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// Texts that end a turn or a document, taken as EOS for a
/// `tokenizer.json` whose configs name no `eos_token_id`.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|end|>",
    "</s>",
    "<eos>",
];

/// Token texts llama.cpp makes control tokens whatever their `token_type`
/// (`llama-vocab.cpp`, "control-looking" tokens): per GGUF key, the texts
/// it looks for when that key is absent (the end-of-turn, end-of-message
/// and fill-in-the-middle tokens), and with no key the end-of-generation
/// texts, always. Qwen2.5 stores `<|fim_prefix|>` ... `<|file_sep|>` as
/// user-defined, so they are control in llama.cpp: matched only when
/// special text is parsed. (llama.cpp marks only the first of several
/// texts of one keyed list it meets; vocabularies hold one each.) An
/// empty key list: always. Those marked `end_of_generation` end
/// generation too (llama.cpp's end-of-generation set: end of turn, FIM
/// pad/repo/file separator, `<|endoftext|>`, ...).
const CONTROL_LOOKING: &[ControlLooking] = &[
    ControlLooking {
        keys: &["tokenizer.ggml.eot_token_id"],
        texts: &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ],
        end_of_generation: true,
    },
    ControlLooking {
        keys: &["tokenizer.ggml.eom_token_id"],
        texts: &["<|eom_id|>"],
        end_of_generation: true,
    },
    ControlLooking {
        keys: &[
            "tokenizer.ggml.fim_pre_token_id",
            "tokenizer.ggml.prefix_token_id",
        ],
        texts: &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        end_of_generation: false,
    },
    ControlLooking {
        keys: &[
            "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.suffix_token_id",
        ],
        texts: &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        end_of_generation: false,
    },
    ControlLooking {
        keys: &[
            "tokenizer.ggml.fim_mid_token_id",
            "tokenizer.ggml.middle_token_id",
        ],
        texts: &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        end_of_generation: false,
    },
    ControlLooking {
        keys: &["tokenizer.ggml.fim_pad_token_id"],
        texts: &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        end_of_generation: true,
    },
    ControlLooking {
        keys: &["tokenizer.ggml.fim_rep_token_id"],
        texts: &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        end_of_generation: true,
    },
    ControlLooking {
        keys: &["tokenizer.ggml.fim_sep_token_id"],
        texts: &["<|file_sep|>"],
        end_of_generation: true,
    },
    ControlLooking {
        keys: &[],
        texts: &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|flush|>",
            "<|calls|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "</s>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "[EOS]",
            "<|end_of_text|>",
            "<end_of_utterance>",
            "<eos>",
            "<turn|>",
            "<|tool_response>",
            "<｜end▁of▁sentence｜>",
            "[e~[",
        ],
        end_of_generation: true,
    },
];

/// One list of [`CONTROL_LOOKING`].
struct ControlLooking {
    /// GGUF keys whose presence turns the list off (its id is the key's).
    keys: &'static [&'static str],
    /// Texts that become control tokens.
    texts: &'static [&'static str],
    /// Whether they also end generation.
    end_of_generation: bool,
}

/// Texts llama.cpp makes user-defined whatever their type (gpt-oss).
const ALWAYS_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// How a vocabulary piece is matched in the text before BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AddedKind {
    /// Not matched: BPE produces it (or never does).
    None,
    /// Matched only when special text is parsed (control, unknown).
    Special,
    /// Always matched (user-defined).
    Plain,
}

/// llama.cpp's rule: pieces of `token_type` control or unknown, and
/// control-looking texts (`control`, see [`CONTROL_LOOKING`]), are matched
/// only when special text is parsed; user-defined pieces always.
fn added_token_kind(token_type: i32, control: bool, text: &str) -> AddedKind {
    if ALWAYS_USER_DEFINED.contains(&text) {
        AddedKind::Plain
    } else if control || token_type == TYPE_CONTROL || token_type == TYPE_UNKNOWN {
        AddedKind::Special
    } else if token_type == TYPE_USER_DEFINED {
        AddedKind::Plain
    } else {
        AddedKind::None
    }
}

/// Where a prefix of `text` of about `cut` bytes ends: the whole text if
/// it is no longer (`whole`); else the last whitespace in the second half
/// of the first `cut` bytes (a pre-token boundary: `at_whitespace`), or,
/// when there is none there, the last character boundary at or before
/// `cut` (inside a word). A whitespace near the start alone must not
/// shrink every prefix to a few bytes: the doubling would then run on to
/// the whole text.
struct PrefixEnd {
    end: usize,
    whole: bool,
    at_whitespace: bool,
}

fn prefix_end(text: &str, cut: usize) -> PrefixEnd {
    if cut >= text.len() {
        return PrefixEnd {
            end: text.len(),
            whole: true,
            at_whitespace: true,
        };
    }
    let mut end = cut;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    match text[..end].rfind(char::is_whitespace) {
        Some(i) if i > 0 && i >= end / 2 => PrefixEnd {
            end: i,
            whole: false,
            at_whitespace: true,
        },
        _ => PrefixEnd {
            end,
            whole: false,
            at_whitespace: false,
        },
    }
}

/// [`Tokenizer::encode_limited`]'s prefixes: `encode` runs on prefixes of
/// `text` until one proves it longer than `limit` tokens or the whole text
/// is encoded; `max_piece_bytes` is the vocabulary's longest piece.
fn encode_prefixes(
    text: &str,
    limit: usize,
    max_piece_bytes: usize,
    encode: impl Fn(&str) -> Result<Vec<u32>>,
) -> Result<Vec<u32>> {
    let too_long = |at_least| TokenizerError::TooLong { at_least, limit };
    let most_bytes = limit.saturating_mul(max_piece_bytes).saturating_mul(4);
    if text.len() > most_bytes {
        let per_token = max_piece_bytes.saturating_mul(4);
        return Err(too_long(text.len().div_ceil(per_token).max(limit + 1)));
    }
    let mut cut = limit.max(1024);
    loop {
        let prefix = prefix_end(text, cut);
        let ids = encode(&text[..prefix.end])?;
        if prefix.whole {
            return if ids.len() > limit {
                Err(too_long(ids.len()))
            } else {
                Ok(ids)
            };
        }
        // A prefix cut at whitespace has no more tokens than the text
        // (pre-tokens end there). Cut inside a word, only the last
        // word's tokens can differ from the whole text's: it is
        // refused with twice the limit of room for that (work still
        // bounded by the limit).
        if prefix.at_whitespace && ids.len() > limit {
            return Err(too_long(ids.len()));
        }
        if !prefix.at_whitespace && ids.len() > 2 * limit + 64 {
            return Err(too_long((ids.len() - 64) / 2));
        }
        cut = cut.saturating_mul(2);
    }
}

fn tok_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizer(e.to_string())
}

/// A text <-> token-id tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    /// Splits special (control) tokens out of the text.
    parse_special: tokenizers::Tokenizer,
    /// The same, with special-token text treated as plain text: a copy of
    /// `parse_special` made on first use (a 262k-token vocabulary costs
    /// ~50 MB per copy, and generation never needs this one).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Vocabulary size with added tokens (computed once: `tokenizers`
    /// copies the whole vocabulary to count it).
    vocab_size: usize,
    /// The largest id of the vocabulary with added tokens.
    max_token_id: Option<u32>,
    kind: String,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    /// The model's Jinja chat template if it ships one, or why the one it
    /// ships could not be read (reported when a chat prompt is encoded, so
    /// a bad template never blocks raw prompts).
    chat_template: std::result::Result<Option<String>, String>,
    /// The texts chat templates get as `bos_token` and `eos_token`.
    chat_bos: String,
    chat_eos: String,
    /// The longest piece of the vocabulary, in UTF-8 bytes: no token
    /// stands for more bytes of text (a bound for [`Tokenizer::encode_limited`]).
    max_piece_bytes: usize,
    /// Finds special tokens' texts (for [`crate::content`]).
    specials: crate::content::SpecialTexts,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// Errors: [`TokenizerError::Config`] naming a missing or mistyped key,
    /// [`TokenizerError::Tokenizer`] for an unsupported `model` or `pre` value.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let model = file.get_str("tokenizer.ggml.model")?;
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let types = match file.metadata("tokenizer.ggml.token_type") {
            Some(_) => file.get_i32_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::Config {
                field: "tokenizer.ggml.token_type".into(),
                reason: format!("{} entries for {} tokens", types.len(), tokens.len()),
            });
        }
        let opt_u32 = |key: &str| file.metadata(key).map(|_| file.get_u32(key)).transpose();
        let opt_bool = |key: &str| file.metadata(key).map(|_| file.get_bool(key)).transpose();
        let bos_id = opt_u32("tokenizer.ggml.bos_token_id")?;
        let vocab = vocab_map(&tokens);
        // Every added token below is one of `tokens`, so the vocabulary
        // with added tokens is `vocab`: counted here, before it moves.
        let stats = VocabStats::of(&vocab);

        let (mut inner, kind, default_add_bos) = match model {
            "gpt2" => {
                let merges = file
                    .get_str_array("tokenizer.ggml.merges")?
                    .iter()
                    .map(|m| {
                        m.split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                            .ok_or_else(|| TokenizerError::Config {
                                field: "tokenizer.ggml.merges".into(),
                                reason: format!(
                                    "merge `{m}` is not two pieces separated by a space"
                                ),
                            })
                    })
                    .collect::<Result<Vec<_>>>()?;
                // llama.cpp splits as `default` when the key is absent.
                let pre_name = match file.metadata("tokenizer.ggml.pre") {
                    Some(_) => file.get_str("tokenizer.ggml.pre")?,
                    None => "default",
                };
                let pre = gpt2_pre(pre_name)?;
                let inner = gpt2_tokenizer(vocab, merges, pre).map_err(|e| match e {
                    TokenizerError::Tokenizer(reason) => TokenizerError::Config {
                        field: "tokenizer.ggml.merges".into(),
                        reason: format!("{}: {reason}", file.path().display()),
                    },
                    other => other,
                })?;
                (
                    inner,
                    format!("gpt2 byte-level BPE (pre: {pre_name})"),
                    pre.add_bos,
                )
            }
            "llama" => {
                let scores = file.get_f32_array("tokenizer.ggml.scores")?;
                if scores.len() != tokens.len() {
                    return Err(TokenizerError::Config {
                        field: "tokenizer.ggml.scores".into(),
                        reason: format!("{} entries for {} tokens", scores.len(), tokens.len()),
                    });
                }
                let add_space_prefix = opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let merges = sentencepiece_merges(&tokens, &scores, &vocab);
                (
                    sentencepiece_tokenizer(vocab, merges, add_space_prefix)?,
                    "SentencePiece BPE with byte fallback".to_string(),
                    true,
                )
            }
            other => {
                return Err(TokenizerError::Tokenizer(format!(
                    "unsupported tokenizer.ggml.model `{other}` (supported: gpt2, llama)"
                )))
            }
        };

        let control_lists = CONTROL_LOOKING
            .iter()
            .filter(|list| list.keys.iter().all(|k| file.metadata(k).is_none()))
            .collect::<Vec<_>>();
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter_map(|(&text, &t)| {
                let control = control_lists.iter().any(|list| list.texts.contains(&text));
                match added_token_kind(t, control, text) {
                    AddedKind::None => None,
                    kind => {
                        Some(AddedToken::from(text, kind == AddedKind::Special).normalized(false))
                    }
                }
            })
            .collect();
        inner.add_tokens(&added);

        let add_bos = opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        if add_bos {
            let bos = bos_id.ok_or_else(|| TokenizerError::Config {
                field: "tokenizer.ggml.bos_token_id".into(),
                reason: "missing, but add_bos_token is true".into(),
            })?;
            let bos_text = tokens
                .get(bos as usize)
                .ok_or_else(|| TokenizerError::Config {
                    field: "tokenizer.ggml.bos_token_id".into(),
                    reason: format!("{bos} is outside the vocabulary of {}", tokens.len()),
                })?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos_text} $A"))
                .and_then(|b| b.try_pair(format!("{bos_text} $A {bos_text} $B")))
                .map_err(tok_err)?
                .special_tokens(vec![(bos_text.to_string(), bos)])
                .build()
                .map_err(tok_err)?;
            inner.with_post_processor(Some(template));
        }

        let primary_eos = opt_u32("tokenizer.ggml.eos_token_id")?;
        // llama.cpp's end-of-generation set: the ids of these keys, and
        // the end-of-generation texts of `CONTROL_LOOKING` (whatever their
        // type), less gpt-oss's `<|end|>`.
        let mut eos_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        ] {
            if let Some(id) = opt_u32(key)? {
                eos_ids.push(id);
            }
        }
        let mut end_id = None;
        let mut eog_texts = Vec::new();
        for (id, &text) in tokens.iter().enumerate() {
            if control_lists
                .iter()
                .any(|list| list.end_of_generation && list.texts.contains(&text))
            {
                eos_ids.push(id as u32);
                eog_texts.push(text);
                if text == "<|end|>" {
                    end_id = Some(id as u32);
                }
            }
        }
        let has = |t: &str| eog_texts.contains(&t);
        if has("<|end|>")
            && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")))
        {
            eos_ids.retain(|&id| Some(id) != end_id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let mut t = Self::with_inner(inner, stats, kind, bos_id, eos_ids);
        t.chat_template = match file.metadata("tokenizer.chat_template") {
            None => Ok(None),
            Some(_) => file
                .get_str("tokenizer.chat_template")
                .map(|s| Some(s.to_string()))
                .map_err(|e| e.to_string()),
        };
        t.chat_eos = t.text_of(primary_eos);
        Ok(t)
    }

    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS ids come from
    /// `generation_config.json` or `config.json` next to it when present
    /// (`bos_token_id`, `eos_token_id`: an id or a list), else from the
    /// special tokens' texts (`<bos>`, `<s>`, `<|endoftext|>`, ...). The
    /// chat template comes from `tokenizer_config.json` next to it
    /// (`chat_template`: a string, or a list of `{name, template}` of
    /// which the one named `default` is taken).
    ///
    /// Errors: [`TokenizerError::Io`] when unreadable, [`TokenizerError::Tokenizer`]
    /// when not a valid `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let text = std::fs::read_to_string(path).map_err(|error| TokenizerError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| TokenizerError::Tokenizer(format!("{}: {e}", path.display())))?;
        check_added_token_ids(path, &text, &inner)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut bos_id = None;
        let mut eos_ids: Vec<u32> = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            let Some(json) = read_optional_json(&dir.join(name))? else {
                continue;
            };
            if bos_id.is_none() {
                bos_id = json["bos_token_id"].as_u64().map(|v| v as u32);
            }
            if eos_ids.is_empty() {
                match &json["eos_token_id"] {
                    serde_json::Value::Number(n) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
                    serde_json::Value::Array(a) => {
                        eos_ids.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
                    }
                    _ => {}
                }
            }
        }
        if bos_id.is_none() {
            bos_id = ["<bos>", "<s>", "<|begin_of_text|>"]
                .iter()
                .find_map(|t| inner.token_to_id(t));
        }
        if eos_ids.is_empty() {
            eos_ids = END_OF_GENERATION_TEXTS
                .iter()
                .filter_map(|t| inner.token_to_id(t))
                .collect();
        }
        let primary_eos = eos_ids.first().copied();
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let kind = format!("tokenizer.json ({})", model_type(&inner));
        let stats = VocabStats::of(&inner.get_vocab(true));
        let mut t = Self::with_inner(inner, stats, kind, bos_id, eos_ids);
        t.chat_eos = t.text_of(primary_eos);
        let config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        // bos_token / eos_token of tokenizer_config.json win, as in
        // Hugging Face (a string or `{"content": ...}`).
        if let Some(json) = &config {
            let text = |v: &serde_json::Value| {
                v.as_str()
                    .or_else(|| v["content"].as_str())
                    .map(str::to_string)
            };
            if let Some(bos) = text(&json["bos_token"]) {
                t.chat_bos = bos;
            }
            if let Some(eos) = text(&json["eos_token"]) {
                t.chat_eos = eos;
            }
        }
        t.chat_template = chat_template_of(dir, config)?;
        Ok(t)
    }

    /// A byte tokenizer for a model that ships none (random-weight models,
    /// te-models' `random`): each UTF-8 byte of the text is one token, at the
    /// first 256 ids of `0..vocab_size` that are not BOS or EOS
    /// ([`byte_token_ids`]); BOS (`<bos>`) is prepended when
    /// there is one; EOS ids are special tokens `<eos>` (further ones
    /// `<eos_ID>`); every other id decodes as the text `<ID>`.
    ///
    /// Errors: [`TokenizerError::Config`] naming `vocab_size` when it cannot
    /// hold 256 bytes beside the special tokens, or a special id outside it.
    pub fn bytes(vocab_size: usize, bos_id: Option<u32>, eos_ids: &[u32]) -> Result<Tokenizer> {
        let mut specials: Vec<(u32, String)> =
            bos_id.map(|b| (b, "<bos>".into())).into_iter().collect();
        for &id in eos_ids {
            if !specials.iter().any(|(s, _)| *s == id) {
                let n = specials.len() - usize::from(bos_id.is_some());
                let text = if n == 0 {
                    "<eos>".into()
                } else {
                    format!("<eos_{id}>")
                };
                specials.push((id, text));
            }
        }
        let bad = |reason: String| TokenizerError::Config {
            field: "vocab_size".into(),
            reason,
        };
        if let Some((id, _)) = specials.iter().find(|(id, _)| *id as usize >= vocab_size) {
            return Err(bad(format!(
                "{vocab_size} does not hold special token id {id}"
            )));
        }
        let special_ids: Vec<u32> = specials.iter().map(|(id, _)| *id).collect();
        let byte_ids = byte_token_ids(vocab_size, &special_ids).ok_or_else(|| {
            bad(format!(
                "{vocab_size} cannot hold 256 byte tokens beside {} special tokens",
                specials.len()
            ))
        })?;
        let mut pieces: Vec<Option<String>> = vec![None; vocab_size];
        for (byte, &id) in byte_level_chars().into_iter().zip(&byte_ids) {
            pieces[id as usize] = Some(byte.to_string());
        }
        for (id, text) in &specials {
            pieces[*id as usize] = Some(text.clone());
        }
        let mut vocab = Vocab::with_capacity(vocab_size);
        for (id, piece) in pieces.into_iter().enumerate() {
            vocab.insert(piece.unwrap_or_else(|| format!("<{id}>")), id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, false)));
        inner.with_decoder(Some(ByteLevel::new(false, true, false)));
        let added: Vec<AddedToken> = specials
            .iter()
            .map(|(_, text)| AddedToken::from(text.clone(), true).normalized(false))
            .collect();
        inner.add_special_tokens(&added);
        if let Some(bos) = bos_id {
            let template = TemplateProcessing::builder()
                .try_single("<bos> $A")
                .and_then(|b| b.try_pair("<bos> $A <bos> $B"))
                .map_err(tok_err)?
                .special_tokens(vec![("<bos>".to_string(), bos)])
                .build()
                .map_err(tok_err)?;
            inner.with_post_processor(Some(template));
        }
        let mut eos: Vec<u32> = eos_ids.to_vec();
        eos.sort_unstable();
        eos.dedup();
        let primary_eos = eos_ids.first().copied();
        let stats = VocabStats::of(&inner.get_vocab(true));
        let mut t = Self::with_inner(
            inner,
            stats,
            "bytes (one token per UTF-8 byte; other ids decode as <ID>)".into(),
            bos_id,
            eos,
        );
        t.chat_eos = t.text_of(primary_eos);
        Ok(t)
    }

    fn with_inner(
        inner: tokenizers::Tokenizer,
        stats: VocabStats,
        kind: String,
        bos_id: Option<u32>,
        eos_ids: Vec<u32>,
    ) -> Tokenizer {
        let specials = crate::content::SpecialTexts::new(
            inner
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, t)| t.special)
                .map(|(id, t)| (t.content, id)),
        );
        let mut t = Tokenizer {
            vocab_size: stats.size,
            max_token_id: stats.max_id,
            max_piece_bytes: stats.max_piece_bytes,
            specials,
            parse_special: inner,
            plain: std::sync::OnceLock::new(),
            kind,
            chat_bos: String::new(),
            chat_eos: String::new(),
            bos_id,
            eos_ids,
            chat_template: Ok(None),
        };
        t.chat_bos = t.text_of(bos_id);
        t
    }

    /// The text of token `id`, or "" when there is none.
    fn text_of(&self, id: Option<u32>) -> String {
        id.and_then(|id| self.token_text(id)).unwrap_or_default()
    }

    /// The model's Jinja chat template (see [`crate::chat`]), if it ships
    /// one that could be read.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_ref().ok().and_then(|t| t.as_deref())
    }

    /// The text of token `id` (e.g. `"<bos>"`), if in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.parse_special.id_to_token(id)
    }

    /// Encodes `text` to token ids, adding BOS when the model says so.
    ///
    /// `parse_special`: when true, the text of special tokens (`<bos>`,
    /// `<|im_start|>`) becomes their id; when false it is tokenized as plain
    /// text (user-defined pieces are matched either way).
    ///
    /// Errors: [`TokenizerError::Tokenizer`] if the tokenizer fails.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let inner = if parse_special {
            &self.parse_special
        } else {
            self.plain()
        };
        let encoding = inner.encode_fast(text, true).map_err(tok_err)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The tokenizer that reads special-token text as plain text.
    fn plain(&self) -> &tokenizers::Tokenizer {
        self.plain.get_or_init(|| {
            let mut plain = self.parse_special.clone();
            plain.set_encode_special_tokens(true);
            plain
        })
    }

    /// [`Tokenizer::encode`], refusing a text of more than `limit` tokens
    /// (BOS included) without encoding all of it: a text longer than
    /// `limit` times the longest piece (x4, for normalizers that shrink
    /// text) is refused unread; otherwise prefixes of `limit` bytes,
    /// twice that, and so on, cut before whitespace (or inside a word when
    /// the prefix's second half has none), are encoded until one has more
    /// than `limit` tokens (twice that when cut inside a word: refused) or
    /// the whole text is. The work is bounded by the limit, not by the
    /// text.
    ///
    /// Errors: [`TokenizerError::TooLong`]; as [`Tokenizer::encode`].
    pub fn encode_limited(
        &self,
        text: &str,
        parse_special: bool,
        limit: usize,
    ) -> Result<Vec<u32>> {
        self.limited(text, limit, |t| self.encode(t, parse_special))
    }

    /// Runs `encode` on prefixes of `text` (see [`Tokenizer::encode_limited`]).
    pub(crate) fn limited(
        &self,
        text: &str,
        limit: usize,
        encode: impl Fn(&str) -> Result<Vec<u32>>,
    ) -> Result<Vec<u32>> {
        encode_prefixes(text, limit, self.max_piece_bytes, encode)
    }

    /// Renders `messages` with the model's chat template
    /// ([`crate::chat::apply_chat_template`], the generation prompt
    /// appended), listing `tools` (function specs) when given.
    ///
    /// Errors: [`TokenizerError::Input`] when the model has no chat
    /// template, when `tools` are given to a template that does not read
    /// them ([`crate::chat::template_supports_tools`]), or when the
    /// template renders nothing; [`TokenizerError::Config`] when the
    /// model's template could not be read; [`TokenizerError::Tokenizer`]
    /// when rendering fails.
    pub fn render_chat(
        &self,
        messages: &[crate::chat::ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String> {
        let template = self.chat_template_source()?;
        if tools.is_some() && !crate::chat::template_supports_tools(template) {
            return Err(TokenizerError::Input(
                "this model's chat template does not support tools".into(),
            ));
        }
        let text = crate::chat::apply_chat_template(
            template,
            &crate::chat::ChatTemplateArgs {
                messages,
                tools,
                add_generation_prompt: true,
                bos_token: &self.chat_bos,
                eos_token: &self.chat_eos,
            },
        )?;
        if text.is_empty() {
            return Err(TokenizerError::Input(
                "the model's chat template rendered nothing".into(),
            ));
        }
        Ok(text)
    }

    /// [`Tokenizer::render_chat`] without tools, encoded with the
    /// template's special tokens parsed and the messages' content as text
    /// ([`crate::content`]); BOS only where the template writes it
    /// (Hugging Face `apply_chat_template` with `tokenize=True`).
    ///
    /// Errors: as [`Tokenizer::encode_chat_limited`].
    pub fn encode_chat(&self, messages: &[crate::chat::ChatMessage]) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None)
    }

    /// [`Tokenizer::encode_chat`] with `tools`.
    ///
    /// Errors: as [`Tokenizer::encode_chat_limited`].
    pub fn encode_chat_with_tools(
        &self,
        messages: &[crate::chat::ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<Vec<u32>> {
        self.encode_chat_limited(messages, tools, usize::MAX)
    }

    /// [`Tokenizer::encode_chat_with_tools`], refusing a prompt of more
    /// than `limit` tokens without encoding all of it (as
    /// [`Tokenizer::encode_limited`]).
    ///
    /// Errors: as [`Tokenizer::render_chat`]; [`TokenizerError::TooLong`];
    /// [`TokenizerError::Input`] when content holding special-token text
    /// meets a template that rewrites content ([`crate::content`]);
    /// [`TokenizerError::Tokenizer`] when encoding fails.
    pub fn encode_chat_limited(
        &self,
        messages: &[crate::chat::ChatMessage],
        tools: Option<&[serde_json::Value]>,
        limit: usize,
    ) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, tools)?;
        let forged = messages.iter().any(|m| {
            m.content
                .as_deref()
                .is_some_and(|c| self.specials.any_in(c))
        });
        if !forged {
            return self.limited(&text, limit, |t| {
                let encoding = self.parse_special.encode_fast(t, false).map_err(tok_err)?;
                Ok(encoding.get_ids().to_vec())
            });
        }
        let skeleton = self.render_chat(&crate::content::with_placeholders(messages), tools)?;
        let pieces = crate::content::pieces(&text, &skeleton, messages, &self.specials)?;
        let mut ids = Vec::new();
        for piece in pieces {
            let left = limit.saturating_sub(ids.len());
            match piece {
                crate::content::Piece::Special(id) if left > 0 => ids.push(id),
                crate::content::Piece::Special(_) => {
                    return Err(TokenizerError::TooLong {
                        at_least: ids.len() + 1,
                        limit,
                    })
                }
                crate::content::Piece::Text(t) => {
                    let part = self
                        .limited(&t, left, |t| {
                            let encoding = self.plain().encode_fast(t, false).map_err(tok_err)?;
                            Ok(encoding.get_ids().to_vec())
                        })
                        .map_err(|e| match e {
                            TokenizerError::TooLong { at_least, .. } => TokenizerError::TooLong {
                                at_least: ids.len() + at_least,
                                limit,
                            },
                            e => e,
                        })?;
                    ids.extend(part);
                }
            }
        }
        Ok(ids)
    }

    /// Whether the model has a chat template that reads `tools`
    /// ([`crate::chat::template_supports_tools`]); false without one.
    pub fn chat_template_supports_tools(&self) -> bool {
        self.chat_template()
            .is_some_and(crate::chat::template_supports_tools)
    }

    /// The chat template, or why there is none usable.
    fn chat_template_source(&self) -> Result<&str> {
        match &self.chat_template {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(TokenizerError::Input(
                "this model has no chat template (GGUF tokenizer.chat_template, or a \
                 Hugging Face chat_template.jinja / tokenizer_config.json chat_template); \
                 give a raw prompt instead"
                    .into(),
            )),
            Err(reason) => Err(TokenizerError::Config {
                field: "chat_template".into(),
                reason: reason.clone(),
            }),
        }
    }

    /// Decodes token ids to text. `skip_special`: leave out special tokens
    /// (BOS, EOS, chat markers). Incomplete UTF-8 at the end becomes U+FFFD.
    ///
    /// Errors: [`TokenizerError::Tokenizer`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let vocab_size = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(TokenizerError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab_size}"
            )));
        }
        self.parse_special
            .decode(ids, skip_special)
            .map_err(tok_err)
    }

    /// The vocabulary piece of `id` as stored (e.g. `Ġthe`, `▁the`,
    /// `<0x0A>`), or `None` outside the vocabulary.
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        self.parse_special.id_to_token(id)
    }

    /// The id of a vocabulary piece, if present.
    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.parse_special.token_to_id(piece)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The largest token id the tokenizer knows (added tokens included);
    /// `None` for an empty vocabulary. Loading checks it against the
    /// model's vocabulary (te-models' validation).
    pub fn max_token_id(&self) -> Option<u32> {
        self.max_token_id
    }

    /// The BOS id, if the model has one (whether or not it is added).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation, sorted. From GGUF, llama.cpp's set: the
    /// `eos`, `eot`, `eom` and FIM pad/repo/separator token ids, and the
    /// tokens whose text is one of llama.cpp's end-of-generation texts
    /// (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, `<|eot_id|>`,
    /// Qwen's `<|fim_pad|>`, `<|repo_name|>`, `<|file_sep|>`, ...). From
    /// `tokenizer.json`: `eos_token_id` of the configs, else end-of-turn
    /// texts.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// A short description for `te inspect` (`"gpt2 byte-level BPE (pre: smollm)"`).
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The tokenizer as a Hugging Face `tokenizer.json` string (for `te convert`).
    ///
    /// Errors: [`TokenizerError::Tokenizer`] if serialization fails.
    pub fn to_json(&self) -> Result<String> {
        self.parse_special.to_string(false).map_err(tok_err)
    }

    /// A streaming decoder for generated tokens (see [`DecodeStream`]).
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream {
            tokenizer: self,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }
}

/// Turns tokens appended one at a time into text increments.
///
/// Decodes a short window of recent tokens and returns only the new text;
/// while the window ends in an incomplete UTF-8 sequence (a character split
/// across byte tokens) it returns `None` and waits for the next token.
/// Concatenating every returned piece gives `decode(all ids)` (up to a
/// trailing incomplete character).
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the window that gives context to the next decode.
    prefix_offset: usize,
    /// End of the text already returned.
    read_offset: usize,
}

impl DecodeStream<'_> {
    /// Appends `id`; returns the text it completes, if any.
    ///
    /// Errors: [`TokenizerError::Tokenizer`] for an id outside the vocabulary.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = self.tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new_text) = full
            .get(prefix.len()..)
            .filter(|_| full.starts_with(&prefix))
        else {
            // The decoder rewrote earlier text (should not happen with the
            // decoders used here): restart the window at this token.
            self.prefix_offset = self.ids.len() - 1;
            self.read_offset = self.prefix_offset;
            return self.retry_last();
        };
        let out = new_text.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(out))
    }

    fn retry_last(&mut self) -> Result<Option<String>> {
        let text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if text.is_empty() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        self.read_offset = self.ids.len();
        Ok(Some(text))
    }
}

/// The characters byte-level BPE writes bytes 0..=255 as, in byte order
/// (GPT-2's alphabet): printable Latin-1 bytes stand for themselves, the
/// others take the code points from U+0100 on, in order.
fn byte_level_chars() -> Vec<char> {
    let mut next = 0x100u32;
    (0u8..=255)
        .map(|b| {
            if matches!(b, 33..=126 | 161..=172 | 174..=255) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
                next += 1;
                c
            }
        })
        .collect()
}

/// What [`Tokenizer`] keeps of its vocabulary with added tokens: counted
/// once, since `tokenizers` copies the whole vocabulary to list it.
struct VocabStats {
    size: usize,
    max_id: Option<u32>,
    /// The longest piece in UTF-8 bytes, at least 1.
    max_piece_bytes: usize,
}

impl VocabStats {
    fn of<'a, S: std::hash::BuildHasher + 'a>(
        vocab: &'a std::collections::HashMap<String, u32, S>,
    ) -> VocabStats {
        VocabStats {
            size: vocab.len(),
            max_id: vocab.values().copied().max(),
            max_piece_bytes: vocab.keys().map(String::len).max().unwrap_or(1).max(1),
        }
    }
}

/// Piece -> id, keeping the first id of a duplicated piece.
fn vocab_map(tokens: &[&str]) -> Vocab {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, &t) in tokens.iter().enumerate() {
        vocab.entry(t.to_string()).or_insert(id as u32);
    }
    vocab
}

fn model_type(t: &tokenizers::Tokenizer) -> &'static str {
    match t.get_model() {
        tokenizers::ModelWrapper::BPE(_) => "BPE",
        tokenizers::ModelWrapper::Unigram(_) => "Unigram",
        tokenizers::ModelWrapper::WordPiece(_) => "WordPiece",
        tokenizers::ModelWrapper::WordLevel(_) => "WordLevel",
    }
}

/// llama.cpp's split of a `gpt2` vocabulary's text before BPE, chosen by
/// GGUF `tokenizer.ggml.pre` (llama.cpp `llama-vocab.cpp`: the pre-type of
/// each name and the regexes of each pre-type).
#[derive(Clone, Copy, Debug)]
struct Gpt2Pre {
    /// Regexes applied in order: each splits every piece into its matches
    /// and the text between them (all kept), as llama.cpp's
    /// `unicode_regex_split` does; then bytes map to the byte-level alphabet.
    regexes: &'static [&'static str],
    /// A piece that is itself a vocabulary entry becomes that token without
    /// merging (llama.cpp `ignore_merges`, Hugging Face `ignore_merges`).
    ignore_merges: bool,
    /// Whether BOS is added when `tokenizer.ggml.add_bos_token` is absent.
    add_bos: bool,
}

/// GPT-2's split.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's split (tokenizer.json's `(?i:'s|...)` spelled out by case, as
/// llama.cpp does): runs of up to 3 digits.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with one digit per piece.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 3.5's split: Qwen2's with combining marks (`\p{M}`) kept with letters.
const QWEN35_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` names of `gpt2` vocabularies and llama.cpp's split
/// for each. Names llama.cpp knows but whose vocabularies need more than a
/// split (a SEP token, per-token strip rules, other regex dialects) are
/// left out, so they fail loudly instead of tokenizing differently.
const GPT2_PRES: &[(&[&str], Gpt2Pre)] = &[
    (
        // llama.cpp's `default`, also what it uses when the key is absent.
        &["default"],
        Gpt2Pre {
            regexes: &[
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_REGEX,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        // `gpt2` is te's own older name for `gpt-2`.
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        Gpt2Pre {
            regexes: &[GPT2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        Gpt2Pre {
            regexes: &[r"\p{N}", GPT2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        Gpt2Pre {
            regexes: &[LLAMA3_REGEX],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        &["dbrx", "smaug-bpe"],
        Gpt2Pre {
            regexes: &[LLAMA3_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "kormo",
            "f2llmv2",
        ],
        Gpt2Pre {
            regexes: &[QWEN2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["qwen35"],
        Gpt2Pre {
            regexes: &[QWEN35_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
];

/// llama.cpp's split for `tokenizer.ggml.pre` = `name`.
///
/// Errors: [`TokenizerError::Config`] naming `tokenizer.ggml.pre` for a
/// name not in [`GPT2_PRES`], listing the supported ones.
fn gpt2_pre(name: &str) -> Result<Gpt2Pre> {
    GPT2_PRES
        .iter()
        .find(|(names, _)| names.contains(&name))
        .map(|(_, pre)| *pre)
        .ok_or_else(|| TokenizerError::Config {
            field: "tokenizer.ggml.pre".into(),
            reason: format!(
                "unsupported pre-tokenizer `{name}` for a gpt2 vocabulary (supported: {})",
                supported_gpt2_pres().join(", ")
            ),
        })
}

/// Every `tokenizer.ggml.pre` name a `gpt2` vocabulary may have here.
pub fn supported_gpt2_pres() -> Vec<&'static str> {
    GPT2_PRES
        .iter()
        .flat_map(|(names, _)| names.iter().copied())
        .collect()
}

/// Byte-level BPE split as llama.cpp splits for `pre` (see [`Gpt2Pre`]).
fn gpt2_tokenizer(
    vocab: Vocab,
    merges: Vec<(String, String)>,
    pre: Gpt2Pre,
) -> Result<tokenizers::Tokenizer> {
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut steps = pre
        .regexes
        .iter()
        .map(|re| {
            Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(PreTokenizerWrapper::from)
            .map_err(tok_err)
        })
        .collect::<Result<Vec<_>>>()?;
    // Bytes to the byte-level alphabet only: the split is done above.
    steps.push(ByteLevel::new(false, true, false).into());
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(PreSequence::new(steps)));
    t.with_decoder(Some(ByteLevel::new(false, true, true)));
    Ok(t)
}

/// Merges that make Hugging Face BPE reproduce SentencePiece BPE: every
/// split of a piece into two pieces of the vocabulary, ranked by the merged
/// piece's score, descending (ties: lower merged id first; one piece's
/// splits left to right).
///
/// A 262k-piece vocabulary (Gemma 3) has ~515k merges, and the first token
/// waits for them: the ranked pieces are split, then the splits copied
/// into the exactly sized list, each on two threads.
fn sentencepiece_merges(tokens: &[&str], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    // Only the first id of a duplicated piece can ever be produced.
    let mut ranked: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&id| vocab.get(tokens[id as usize]) == Some(&id))
        .collect();
    ranked.sort_unstable_by(|&a, &b| {
        scores[b as usize]
            .total_cmp(&scores[a as usize])
            .then(a.cmp(&b))
    });
    let splits = |ids: &[u32]| {
        let mut pairs = Vec::new();
        for &id in ids {
            let piece = tokens[id as usize];
            for (split, _) in piece.char_indices().skip(1) {
                let (left, right) = piece.split_at(split);
                if vocab.contains_key(left) && vocab.contains_key(right) {
                    pairs.push((left, right));
                }
            }
        }
        pairs
    };
    let (first, second) = ranked.split_at(ranked.len() / 2);
    let (first, second) = on_two_threads(|| splits(first), || splits(second));
    let mut merges = vec![(String::new(), String::new()); first.len() + second.len()];
    let (into_first, into_second) = merges.split_at_mut(first.len());
    let copy = |into: &mut [(String, String)], pairs: &[(&str, &str)]| {
        for (m, (l, r)) in into.iter_mut().zip(pairs) {
            *m = (l.to_string(), r.to_string());
        }
    };
    on_two_threads(|| copy(into_first, &first), || copy(into_second, &second));
    merges
}

/// `a()` on this thread and `b()` on a second one, both results.
fn on_two_threads<A, B>(a: impl FnOnce() -> A, b: impl FnOnce() -> B + Send) -> (A, B)
where
    B: Send,
{
    std::thread::scope(|s| {
        let b = s.spawn(b);
        let a = a();
        let b = b
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (a, b)
    })
}

/// SentencePiece-style BPE: spaces as `▁`, byte fallback, no pre-tokenizer.
fn sentencepiece_tokenizer(
    vocab: Vocab,
    merges: Vec<(String, String)>,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .build()
        .map_err(tok_err)?;
    let replace_space: NormalizerWrapper = Replace::new(" ", "▁").map_err(tok_err)?.into();
    let normalizer: NormalizerWrapper = if add_space_prefix {
        tokenizers::normalizers::Sequence::new(vec![Prepend::new("▁".into()).into(), replace_space])
            .into()
    } else {
        replace_space
    };
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_normalizer(Some(normalizer));
    t.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(t)
}

/// A JSON file next to `tokenizer.json` (`tokenizer_config.json`,
/// `generation_config.json`, `config.json`); `None` when absent.
///
/// Errors: a file that is there but cannot be read or is not JSON
/// ([`TokenizerError::Io`] / [`TokenizerError::Format`] naming it): a broken file
/// is never taken for a missing one.
fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                error,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::Format {
            path: path.to_path_buf(),
            reason: format!("not JSON: {e}"),
        })
}

/// Checks that every entry of `tokenizer.json`'s `added_tokens` got the id
/// the file gives it (`tokenizers` silently renumbers an added token whose
/// id is out of place, e.g. 10^9 becomes the next free id).
fn check_added_token_ids(path: &Path, text: &str, inner: &tokenizers::Tokenizer) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Added {
        id: u64,
        content: String,
    }
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let file: File = serde_json::from_str(text)
        .map_err(|e| TokenizerError::Tokenizer(format!("{}: {e}", path.display())))?;
    for a in &file.added_tokens {
        let got = inner.token_to_id(&a.content);
        if got.map(u64::from) != Some(a.id) {
            return Err(TokenizerError::Tokenizer(format!(
                "{}: added token `{}` has id {} in added_tokens, but the vocabulary gives it {}",
                path.display(),
                a.content,
                a.id,
                got.map_or("no id".to_string(), |g| format!("id {g}"))
            )));
        }
    }
    Ok(())
}

/// The chat template of a Hugging Face directory: `chat_template.jinja`
/// if present (newer `transformers`), else `chat_template` of
/// `tokenizer_config.json` (`config`): a string, or a list of `{name,
/// template}` of which `default` is taken. `Ok(Ok(None))` when there is
/// none; the inner `Err` says what is wrong with the one in
/// `tokenizer_config.json` (reported when a chat prompt is encoded, so it
/// never blocks raw prompts).
///
/// Errors: a `chat_template.jinja` that is there but cannot be read.
fn chat_template_of(
    dir: &Path,
    config: Option<serde_json::Value>,
) -> Result<std::result::Result<Option<String>, String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(|t| Ok(Some(t)))
            .map_err(|error| TokenizerError::Io { path: jinja, error });
    }
    let Some(json) = config else {
        return Ok(Ok(None));
    };
    let bad = |reason: &str| {
        format!(
            "{}: chat_template: {reason}",
            dir.join("tokenizer_config.json").display()
        )
    };
    Ok(match &json["chat_template"] {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(t) => Ok(Some(t.clone())),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(|t| Some(t.to_string()))
            .ok_or_else(|| bad("a list without a template named `default`")),
        other => Err(bad(&format!("expected a string, got {other}"))),
    })
}

/// The 256 byte tokens' ids for a vocabulary of `vocab_size` whose
/// `specials` (BOS, EOS) keep their ids: the first 256 ids not special,
/// in byte order. `None` when the vocabulary is too small.
pub fn byte_token_ids(vocab_size: usize, specials: &[u32]) -> Option<Vec<u32>> {
    let specials: std::collections::HashSet<u32> = specials.iter().copied().collect();
    let ids: Vec<u32> = (0..vocab_size as u32)
        .filter(|id| !specials.contains(id))
        .take(256)
        .collect();
    (ids.len() == 256).then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level stand-in encoder (one token per byte) that adds up the
    /// bytes it was given.
    fn counting(work: &std::cell::Cell<usize>) -> impl Fn(&str) -> Result<Vec<u32>> + '_ {
        move |t: &str| {
            work.set(work.get() + t.len());
            Ok(t.bytes().map(u32::from).collect())
        }
    }

    #[test]
    fn long_texts_are_refused_after_work_bounded_by_the_limit() {
        let limit = 4096;
        // Whitespace only near the start (once a prefix cut there
        // encoded the whole text), none at all, and words.
        let texts = [
            format!("hi {}", "7".repeat(3 << 20)),
            "7".repeat(3 << 20),
            "word ".repeat(600_000),
        ];
        for text in &texts {
            let work = std::cell::Cell::new(0);
            let got = encode_prefixes(text, limit, 1 << 20, counting(&work));
            match got {
                Err(TokenizerError::TooLong { at_least, .. }) => {
                    assert!(at_least > limit && at_least <= text.len())
                }
                other => panic!("{other:?}"),
            }
            // Prefixes double from the limit up to past twice it (+64).
            assert!(
                work.get() <= 16 * limit + 256,
                "{} bytes encoded",
                work.get()
            );
        }
        // Within the limit, the text is encoded whole.
        let text = format!("hi {}", "7".repeat(limit - 3));
        let work = std::cell::Cell::new(0);
        assert_eq!(
            encode_prefixes(&text, limit, 1, counting(&work))
                .unwrap()
                .len(),
            limit
        );
    }

    /// Ranks by hand: `bc` (score 2) first, then the score-1 pieces by id
    /// (`ab` 3, `abc` 5 with its splits left to right, `ca` 7); the
    /// duplicate `ab` (id 6, score 5) is never produced, so it ranks
    /// nothing. The ranked pieces are split in two halves, both seen here.
    #[test]
    fn sentencepiece_merges_rank_by_score_then_id_then_split() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc", "ab", "ca"];
        let scores = [0.0, 0.0, 0.0, 1.0, 2.0, 1.0, 5.0, 1.0];
        let merges = sentencepiece_merges(&tokens, &scores, &vocab_map(&tokens));
        let want = [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c"), ("c", "a")];
        let got: Vec<(&str, &str)> = merges
            .iter()
            .map(|(l, r)| (l.as_str(), r.as_str()))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn byte_level_chars_are_the_byte_level_alphabet() {
        let mut ours = byte_level_chars();
        ours.sort_unstable();
        ours.dedup();
        let mut theirs: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        theirs.sort_unstable();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, theirs);
    }

    /// Gemma 3's ids: eos 1 and 106, bos 2, so bytes take 0, 3..=105 and
    /// 107..=259.
    #[test]
    fn byte_tokenizer_round_trips_bytes() {
        let t = Tokenizer::bytes(300, Some(2), &[1, 106]).unwrap();
        let byte_id = |b: u8| match b as u32 {
            0 => 0,
            b if b + 2 < 106 => b + 2,
            b => b + 3,
        };
        let text = "hé <bos>x";
        let mut want = vec![2];
        want.extend("hé ".bytes().map(byte_id));
        want.push(2);
        want.push(byte_id(b'x'));
        assert_eq!(t.encode(text, true).unwrap(), want);
        // As plain text the marker is bytes.
        assert_eq!(t.encode("<bos>", false).unwrap().len(), 6);
        assert_eq!(t.decode(&want, false).unwrap(), format!("<bos>{text}"));
        assert_eq!(
            t.decode(&[byte_id(b'a'), 299, 1, 106], true).unwrap(),
            "a<299>"
        );
        assert_eq!(t.decode(&[1, 106], false).unwrap(), "<eos><eos_106>");
        assert_eq!((t.vocab_size(), t.max_token_id()), (300, Some(299)));
        assert_eq!(t.eos_ids(), &[1, 106]);
        let e = Tokenizer::bytes(257, Some(2), &[1])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vocab_size") && e.contains("256 byte tokens"),
            "{e}"
        );
        let e = Tokenizer::bytes(300, Some(300), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("special token id 300"), "{e}");
    }

    /// The pieces `pre` splits `text` into, bytes in the byte-level alphabet.
    fn split(pre: &str, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let vocab: Vocab = byte_level_chars()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let t = gpt2_tokenizer(vocab, Vec::new(), gpt2_pre(pre).unwrap()).unwrap();
        let mut pts = PreTokenizedString::from(text);
        t.get_pre_tokenizer()
            .unwrap()
            .pre_tokenize(&mut pts)
            .unwrap();
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    #[test]
    fn pre_tokenizers_split_as_llama_cpp() {
        let text = "I'LL pay 1234567 for it!!\n\n  x\ty";
        assert_eq!(
            split("qwen2", text),
            [
                "I", "'LL", "Ġpay", "Ġ", "1", "2", "3", "4", "5", "6", "7", "Ġfor", "Ġit", "!!ĊĊ",
                "Ġ", "Ġx", "ĉy"
            ]
        );
        assert_eq!(
            split("llama-bpe", text),
            [
                "I", "'LL", "Ġpay", "Ġ", "123", "456", "7", "Ġfor", "Ġit", "!!ĊĊ", "Ġ", "Ġx", "ĉy"
            ]
        );
        // GPT-2's split keeps `'LL` as letters (its contractions are lower
        // case) and digit runs whole; smollm splits every digit first.
        assert_eq!(
            split("gpt-2", "I'LL pay 1234567\n\n  x"),
            ["I", "'", "LL", "Ġpay", "Ġ1234567", "ĊĊĠ", "Ġx"]
        );
        assert_eq!(split("smollm", "pay 123"), ["pay", "Ġ", "1", "2", "3"]);
        // llama.cpp's `default`: punctuation runs, then GPT-2's split,
        // then digit runs cut in threes.
        assert_eq!(
            split("default", "a+b 12345"),
            ["a", "+", "b", "Ġ", "123", "45"]
        );
        let e = gpt2_pre("nope").unwrap_err().to_string();
        assert!(
            e.contains("tokenizer.ggml.pre") && e.contains("`nope`") && e.contains("qwen2, "),
            "{e}"
        );
        assert!(gpt2_pre("deepseek-r1-qwen").is_ok() && gpt2_pre("llama3").is_ok());
        assert!(!gpt2_pre("qwen2").unwrap().add_bos && gpt2_pre("llama-bpe").unwrap().add_bos);
    }

    #[test]
    fn control_looking_and_user_defined_tokens() {
        use AddedKind::*;
        assert_eq!(
            added_token_kind(TYPE_USER_DEFINED, false, "<tool_call>"),
            Plain
        );
        assert_eq!(
            added_token_kind(TYPE_USER_DEFINED, true, "<|fim_prefix|>"),
            Special
        );
        assert_eq!(
            added_token_kind(TYPE_CONTROL, false, "<|im_start|>"),
            Special
        );
        assert_eq!(added_token_kind(1, false, "hello"), None);
        assert_eq!(added_token_kind(TYPE_CONTROL, false, "<|channel|>"), Plain);
    }

    #[test]
    fn chat_template_from_tokenizer_config_forms() {
        let dir = std::env::temp_dir().join(format!("te-chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer_config.json");
        let of = || {
            read_optional_json(&path)
                .map_err(|e| e.to_string())
                .and_then(|c| chat_template_of(&dir, c).map_err(|e| e.to_string())?)
        };
        assert_eq!(of(), Ok(None), "no file");
        for (json, want) in [
            (&br#"{"bos_token": "<s>"}"#[..], Ok(None)),
            (br#"{"chat_template": "{{ x }}"}"#, Ok(Some("{{ x }}"))),
            (
                br#"{"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]}"#,
                Ok(Some("d")),
            ),
            (
                br#"{"chat_template": [{"name": "tool_use", "template": "t"}]}"#,
                Err("default"),
            ),
            (br#"{"chat_template": 3}"#, Err("expected a string")),
            // A present but broken file is an error naming it, never
            // "no chat template".
            (b"not json", Err("tokenizer_config.json: not JSON")),
            (b"\xff\xfe\x00garbage", Err("tokenizer_config.json")),
        ] {
            std::fs::write(&path, json).unwrap();
            let shown = String::from_utf8_lossy(json);
            match (of(), want) {
                (Ok(got), Ok(want)) => assert_eq!(got.as_deref(), want, "{shown}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{shown}: {e}"),
                (got, want) => panic!("{shown}: {got:?} vs {want:?}"),
            }
        }
        // chat_template.jinja wins over tokenizer_config.json.
        std::fs::write(&path, "{}").unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "{{ y }}").unwrap();
        assert_eq!(of(), Ok(Some("{{ y }}".to_string())));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
