//! `te perplexity`: perplexity of a model over a text file, in windows of
//! `--ctx` tokens scored on their second half, as llama.cpp's
//! `llama-perplexity` (see `te_engine::perplexity` for the exact method).

use std::io::Write;

use anyhow::Context;
use te_engine::perplexity::{default_batch_windows, perplexity, PerplexityParams};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name.
    #[arg(long)]
    model: String,
    /// The text file.
    #[arg(long)]
    file: std::path::PathBuf,
    /// Window length in tokens (default 512, or the model's context if smaller).
    #[arg(long)]
    ctx: Option<usize>,
    /// Windows per forward step (default: as many as keep the logits near 512 MiB).
    #[arg(long)]
    batch_windows: Option<usize>,
    /// Score only the first N windows (llama-perplexity's `--chunks`; default: all).
    #[arg(long)]
    chunks: Option<std::num::NonZeroUsize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: crate::Threads,
    #[command(flatten)]
    precision: crate::PrecisionArg,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.threads.init()?;
    let mut out = crate::stdout();
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let loaded = crate::load(&args.model, args.precision.precision)?;
    let model = &loaded.model;
    // Plain text: special-token text is not parsed (llama.cpp does the same).
    let tokens = loaded
        .tokenizer
        .encode(&text, false)
        .with_context(|| format!("tokenizing {}", args.file.display()))?;
    // The model adds BOS iff the tokenized text starts with it.
    let bos = loaded
        .tokenizer
        .bos_id()
        .filter(|&b| tokens.first() == Some(&b));
    let ctx = args
        .ctx
        .unwrap_or(512.min(model.config.max_position_embeddings));
    let params = PerplexityParams {
        ctx,
        bos,
        batch_windows: args
            .batch_windows
            .unwrap_or_else(|| default_batch_windows(ctx, model.config.vocab_size)),
    };
    // Windows are independent and start at multiples of ctx, so the first
    // N windows are those of the text's first N * ctx tokens.
    let scored = match args.chunks {
        Some(n) => &tokens[..tokens.len().min(n.get().saturating_mul(ctx))],
        None => &tokens[..],
    };
    let bar = indicatif::ProgressBar::new((scored.len() / ctx.max(1)) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} windows {msg} [{elapsed}<{eta}]",
        )
        .expect("valid template"),
    );
    let mut running = String::new();
    let result = perplexity(model, scored, &params, |done, _, ppl| {
        bar.set_position(done as u64);
        bar.set_message(format!("ppl {ppl:.4}"));
        running.push_str(&format!("[{done}]{ppl:.4},"));
    });
    bar.finish_and_clear();
    let result = result?;
    if args.json {
        let line = serde_json::json!({
            "model": args.model,
            "file": args.file,
            "ctx": ctx,
            "tokens": tokens.len(),
            "windows": result.windows,
            "scored_tokens": result.scored_tokens,
            "nll_mean": result.nll_mean,
            "ppl": result.ppl,
            "running_ppl": result.running_ppl,
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(out, "{}", running.trim_end_matches(','))?;
        writeln!(
        out,
            "Final estimate: PPL = {:.4} ({} windows of {ctx} tokens, {} tokens scored, mean NLL {:.6})",
            result.ppl, result.windows, result.scored_tokens, result.nll_mean
        )?;
    }
    Ok(())
}
