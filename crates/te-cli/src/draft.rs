//! The speculative decoding flags shared by `te generate`, `te bench` and
//! `te serve` (`--draft-ngram`, `--model-draft`, `--kv-cache-tokens-draft`,
//! `--draft-max`, `--draft-min`), the draft model's vocabulary check, the
//! engine with or without a draft model, and the draft counters of
//! `--stats`.

use te_engine::speculative::{DraftSource, SpeculativeConfig};
use te_engine::{Engine, EngineConfig, EngineStats};
use te_models::loader::LoadedModel;
use te_models::model::Model;
use te_tokenizer::Tokenizer;

/// Speculative decoding by prompt lookup or a draft model (see
/// docs/ARCHITECTURE.md, "Speculative decoding"): greedy output is
/// bit-identical to plain decoding, sampled output keeps its
/// distribution.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct DraftArgs {
    /// Prompt lookup: draft the tokens that followed an earlier
    /// occurrence of the latest N tokens (prompt and output so far), the
    /// one whose match reaches furthest back (then the latest), and
    /// verify them in one step.
    #[arg(long, value_name = "N", conflicts_with = "model_draft")]
    pub draft_ngram: Option<usize>,
    /// A draft model: its greedy tokens are verified
    /// in one step. Its vocabulary must equal the target's (every token).
    #[arg(long, value_name = "MODEL")]
    pub model_draft: Option<String>,
    /// KV cache of the draft model, in tokens (default: --kv-cache-tokens).
    #[arg(long, value_name = "N", requires = "model_draft")]
    pub kv_cache_tokens_draft: Option<usize>,
    /// Draft exactly K tokens whenever the source has them (default: an
    /// adaptive length, up to 16 for prompt lookup and 4 for a draft
    /// model, that backs off when drafts are rejected and does not draft
    /// where it would not pay).
    #[arg(long, value_name = "K")]
    pub draft_max: Option<usize>,
    /// Verify no draft shorter than this.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub draft_min: usize,
}

impl DraftArgs {
    /// The engine setting (`None` without `--draft-ngram` or
    /// `--model-draft`).
    ///
    /// Errors: a value out of range, naming the flag; --draft-max without
    /// a draft source.
    pub fn config(&self) -> anyhow::Result<Option<SpeculativeConfig>> {
        let source = match (self.draft_ngram, &self.model_draft) {
            (Some(n), _) => DraftSource::Ngram(n),
            (None, Some(_)) => DraftSource::Model,
            (None, None) => {
                if self.draft_max.is_some() || self.draft_min != 1 {
                    anyhow::bail!("--draft-max/--draft-min need --draft-ngram or --model-draft");
                }
                return Ok(None);
            }
        };
        let config = SpeculativeConfig {
            source,
            draft_max: self.draft_max,
            draft_min: self.draft_min,
        };
        if let Err(te_engine::EngineError::Setting { setting, reason }) = config.validate() {
            anyhow::bail!("--{}: {reason}", setting.replace('_', "-"));
        }
        Ok(Some(config))
    }

    /// The setting and the draft model ([`load_draft`]) for `target`.
    ///
    /// Errors: those of [`config`](Self::config) and [`load_draft`].
    pub fn load(&self, target: &LoadedModel) -> anyhow::Result<Drafting> {
        Ok(Drafting {
            config: self.config()?,
            model: load_draft(self, target)?,
            kv_cache_tokens: self.kv_cache_tokens_draft,
        })
    }
}

/// Loads `--model-draft`, if given (in the target's `--precision`), and checks that its vocabulary is
/// `target`'s: the same size in the model and the tokenizer, and every
/// token the same piece.
///
/// Errors: loading fails; a vocabulary differs (naming the first token
/// that does).
pub fn load_draft(args: &DraftArgs, target: &LoadedModel) -> anyhow::Result<Option<LoadedModel>> {
    let Some(spec) = &args.model_draft else {
        return Ok(None);
    };
    // The draft model multiplies in the target's precision.
    let draft = crate::load(spec, target.model.weights.embed_tokens.precision)?;
    let (v, dv) = (
        target.model.config.vocab_size,
        draft.model.config.vocab_size,
    );
    if v != dv {
        anyhow::bail!(
            "--model-draft {spec}: its vocabulary has {dv} tokens, the target's {v}; \
             a draft model needs the target's vocabulary"
        );
    }
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    if t.vocab_size() != d.vocab_size() {
        anyhow::bail!(
            "--model-draft {spec}: its tokenizer has {} tokens, the target's {}",
            d.vocab_size(),
            t.vocab_size()
        );
    }
    if let Some(id) =
        (0..t.vocab_size() as u32).find(|&id| t.token_to_piece(id) != d.token_to_piece(id))
    {
        anyhow::bail!(
            "--model-draft {spec}: token {id} is {:?} in the draft's vocabulary and {:?} in the \
             target's; a draft model needs the target's vocabulary",
            d.token_to_piece(id),
            t.token_to_piece(id)
        );
    }
    Ok(Some(draft))
}

/// A command's speculative decoding: the engine setting and the loaded
/// draft model, if any ([`DraftArgs::load`]).
pub struct Drafting {
    /// The engine setting (`None`: plain decoding).
    pub config: Option<SpeculativeConfig>,
    /// `--model-draft`, loaded and checked against the target.
    pub model: Option<LoadedModel>,
    /// `--kv-cache-tokens-draft`.
    pub kv_cache_tokens: Option<usize>,
}

impl Drafting {
    /// The engine over `target` with this drafting (`config.speculative`
    /// is replaced): with the draft model, if any, in a pool of its own.
    ///
    /// Errors: those of [`Engine::new`] and [`Engine::with_draft_model`].
    pub fn engine<'m>(
        &'m self,
        target: &'m Model,
        tokenizer: Option<&'m Tokenizer>,
        config: EngineConfig,
    ) -> anyhow::Result<Engine<'m>> {
        let config = EngineConfig {
            speculative: self.config,
            ..config
        };
        Ok(match &self.model {
            Some(d) => {
                Engine::with_draft_model(target, tokenizer, config, &d.model, self.kv_cache_tokens)?
            }
            None => Engine::new(target, tokenizer, config)?,
        })
    }
}

/// The draft counters as JSON fields: `draft_tokens`, `accepted_tokens`,
/// `acceptance_rate`, `mean_accepted_length` (accepted drafted tokens per
/// verification).
pub fn stats_json(s: &EngineStats) -> serde_json::Value {
    serde_json::json!({
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": s.acceptance_rate(),
        "mean_accepted_length": s.mean_accepted_length(),
    })
}
