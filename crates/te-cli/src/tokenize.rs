//! `te tokenize`: text to token ids.

use std::io::Write;

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name.
    #[arg(long)]
    model: String,
    /// The text to tokenize.
    #[arg(long)]
    text: String,
    /// Print `{"text": str, "ids": [int]}`.
    #[arg(long)]
    json: bool,
    /// Treat special-token text such as `<bos>` as plain text.
    #[arg(long)]
    no_parse_special: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let source = te_models::source::resolve_model(&args.model)?;
    let tokenizer = te_models::loader::load_tokenizer(&source)?;
    let ids = tokenizer
        .encode(&args.text, !args.no_parse_special)
        .with_context(|| format!("tokenizing {:?}", args.text))?;
    let mut out = crate::stdout();
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "text": args.text, "ids": ids })
        )?;
    } else {
        let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "{}", ids.join(" "))?;
    }
    out.flush()?;
    Ok(())
}
