//! `cargo xtask fetch-models`: download and verify every known test model
//! into `$TE_HOME` (default `~/.cache/te`) with `te_formats::hub`.

use anyhow::Context;
use te_formats::hub;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(arg) = args.first() {
        anyhow::bail!("fetch-models takes no arguments, got `{arg}`");
    }
    for model in hub::KNOWN_MODELS {
        let path = hub::fetch_model(model).with_context(|| format!("fetching {}", model.name))?;
        println!("{}: {}", model.name, path.display());
    }
    Ok(())
}
