//! The speculative decoding flags shared by `te generate`, `te bench` and
//! `te serve` (`--draft-ngram`, `--draft-max`, `--draft-min`), and the
//! draft counters of `--stats` and `/metrics`.

use te_engine::speculative::{DraftSource, SpeculativeConfig};
use te_engine::EngineStats;

/// Speculative decoding by prompt lookup (see docs/ARCHITECTURE.md,
/// "Speculative decoding"): greedy output is bit-identical to plain
/// decoding, sampled output keeps its distribution.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct DraftArgs {
    /// Prompt lookup: draft the tokens that followed the last earlier
    /// occurrence of the latest N tokens (prompt and output so far) and
    /// verify them in one step.
    #[arg(long, value_name = "N")]
    pub draft_ngram: Option<usize>,
    /// Draft exactly K tokens whenever the lookup has them (default: an
    /// adaptive length, up to 16, that backs off when drafts are rejected
    /// and does not draft where it would not pay).
    #[arg(long, value_name = "K", requires = "draft_ngram")]
    pub draft_max: Option<usize>,
    /// Verify no draft shorter than this.
    #[arg(long, value_name = "K", default_value_t = 1, requires = "draft_ngram")]
    pub draft_min: usize,
}

impl DraftArgs {
    /// The engine setting (`None` without `--draft-ngram`).
    ///
    /// Errors: a value out of range, naming the flag.
    pub fn config(&self) -> anyhow::Result<Option<SpeculativeConfig>> {
        let Some(n) = self.draft_ngram else {
            return Ok(None);
        };
        let config = SpeculativeConfig {
            source: DraftSource::Ngram(n),
            draft_max: self.draft_max,
            draft_min: self.draft_min,
        };
        if let Err(te_engine::EngineError::Setting { setting, reason }) = config.validate() {
            anyhow::bail!("--{}: {reason}", setting.replace('_', "-"));
        }
        Ok(Some(config))
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
