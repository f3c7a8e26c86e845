//! The sampling flags of `te generate` and `te chat` (`--temperature`,
//! `--top-k`, `--top-p`, `--min-p`, `--repeat-penalty`, `--seed`), and the
//! fresh seed a sampled run draws when `--seed` is not given.

use std::hash::{BuildHasher, Hasher};

use te_engine::sampling::SamplingParams;

/// Sampling flags; each command supplies its own defaults
/// ([`SamplingArgs::params`]).
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy (default: 0 in generate, 0.7 in chat).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens; 0 = all (default: 0).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold; 1 = off (default: 1 in generate, 0.9 in chat).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below min_p times the best one's probability; 0 = off
    /// (default: 0).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repetition penalty; 1 = off (default: 1 in generate, 1.1 in chat).
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// RNG seed for sampling. Without it a sampled run draws a fresh seed
    /// and reports it (--stats, --json); with it the text is reproducible,
    /// alone or inside any batch.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The settings: each flag given, else its value in `defaults`; the
    /// seed is `--seed`, else [`fresh_seed`].
    ///
    /// Errors: settings out of range ([`SamplingParams::validate`]).
    pub fn params(&self, defaults: &SamplingParams) -> anyhow::Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repeat_penalty.unwrap_or(defaults.repetition_penalty),
            seed: self.seed.unwrap_or_else(fresh_seed),
            ..defaults.clone()
        };
        params.validate().map_err(anyhow::Error::msg)?;
        Ok(params)
    }
}

/// A seed that differs from run to run: the standard library's randomly
/// keyed hasher (seeded from the operating system) over the clock.
pub fn fresh_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}
