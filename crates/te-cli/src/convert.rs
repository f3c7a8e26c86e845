//! `te convert`: a GGUF file to a Hugging Face model directory.

use anyhow::bail;
use te_models::convert::{convert_gguf_to_hf, OutputDtype};
use te_models::source::ModelSource;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file or known model name.
    #[arg(long)]
    model: String,
    /// Output directory (created if missing).
    #[arg(long)]
    out: std::path::PathBuf,
    /// Replace the model files (config.json, model.safetensors, ...) of an
    /// existing output directory.
    #[arg(long)]
    force: bool,
    /// Weight dtype: f32 keeps the dequantized weights exactly (same greedy
    /// tokens as the GGUF); bf16 halves the size but rounds every weight.
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

/// The files `te convert` writes.
const OUTPUT_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

pub fn run(args: Args) -> anyhow::Result<()> {
    let existing: Vec<&str> = OUTPUT_FILES
        .into_iter()
        .filter(|f| args.out.join(f).exists())
        .collect();
    if !existing.is_empty() && !args.force {
        bail!(
            "--out {} already holds {}; pass --force to replace them",
            args.out.display(),
            existing.join(", ")
        );
    }
    let path = match te_models::source::resolve_model(&args.model)? {
        ModelSource::Gguf(path) => path,
        ModelSource::HfDir(dir) => bail!(
            "--model {} is already a Hugging Face directory; te convert reads GGUF files",
            dir.display()
        ),
        ModelSource::Random(r) => bail!(
            "--model {} is a random-weight model; te convert reads GGUF files",
            r.spec
        ),
    };
    let dtype = match args.dtype {
        Dtype::F32 => OutputDtype::F32,
        Dtype::Bf16 => OutputDtype::Bf16,
    };
    let start = std::time::Instant::now();
    let s = convert_gguf_to_hf(&path, &args.out, dtype)?;
    crate::note(format_args!(
        "wrote {} ({} tensors, {} parameters, {}{}{}) in {:.1} s",
        args.out.display(),
        s.tensors,
        s.parameters,
        dtype.torch_name(),
        if s.unpermuted_qk {
            ", Q/K rows un-permuted"
        } else {
            ""
        },
        if s.shifted_norms {
            ", norms minus 1"
        } else {
            ""
        },
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}
