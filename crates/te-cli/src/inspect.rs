//! `te inspect`: what a model is, without loading its weights.

use std::io::Write;

use te_models::inspect::{config_json, inspect};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name.
    #[arg(long)]
    model: String,
    /// Print one JSON object (`te_models::inspect::ModelInfo::to_json`).
    #[arg(long)]
    json: bool,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut out = crate::stdout();
    let source = te_models::source::resolve_model(&args.model)?;
    let info = inspect(&source)?;
    // What `te generate` would refuse: printed after the description,
    // and the exit status is 1.
    let refused = || -> anyhow::Result<()> {
        if info.problems.is_empty() {
            return Ok(());
        }
        Err(te_models::ModelError::Invalid {
            path: source.path().to_path_buf(),
            problems: info.problems.clone(),
        }
        .into())
    };
    if args.json {
        writeln!(out, "{}", info.to_json())?;
        out.flush()?;
        return refused();
    }
    writeln!(out, "model:        {}", args.model)?;
    writeln!(out, "architecture: {}", info.config.architecture.name())?;
    writeln!(out, "format:       {}", info.format)?;
    writeln!(out, "parameters:   {}", info.parameters)?;
    let dtypes: Vec<String> = info
        .tensor_dtypes
        .iter()
        .map(|(t, n)| format!("{t} x{n}"))
        .collect();
    writeln!(out, "tensors:      {}", dtypes.join(", "))?;
    writeln!(
        out,
        "tokenizer:    {} (vocab {}{})",
        info.tokenizer_kind,
        info.tokenizer_vocab_size,
        if info.chat_template {
            ", chat template"
        } else {
            ""
        }
    )?;
    if !info.chat_template {
        writeln!(
            out,
            "note:         no chat template: a base model, which continues text (te chat runs \
             it in raw-completion mode; te serve's /v1/chat/completions refuses it)"
        )?;
    }
    writeln!(
        out,
        "memory:       weights {} stored, {} as f32; KV cache {:.1} KiB per token (f32, all layers)",
        mib(info.weights_stored_bytes),
        mib(info.weights_f32_bytes),
        info.kv_cache_bytes_per_token as f64 / 1024.0,
    )?;
    writeln!(out, "config:")?;
    if let serde_json::Value::Object(fields) = config_json(&info.config) {
        for (k, v) in fields {
            writeln!(out, "  {k}: {v}")?;
        }
    }
    out.flush()?;
    refused()
}
