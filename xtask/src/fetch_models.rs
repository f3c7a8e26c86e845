//! `cargo xtask fetch-models [NAME...]`: download and verify known test
//! models into `$TE_HOME` (default `~/.cache/te`) with `te_formats::hub`.
//! Without names it fetches every model of `hub::KNOWN_MODELS`; with names,
//! only those (an unknown name is an error listing the known ones).

use anyhow::Context;
use te_formats::hub;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(flag) = args.iter().find(|a| a.starts_with('-')) {
        anyhow::bail!("fetch-models takes model names, not options (got `{flag}`)");
    }
    if args.is_empty() {
        let all: Vec<&str> = hub::KNOWN_MODELS.iter().map(|m| m.name).collect();
        return fetch(&all);
    }
    let names: Vec<&str> = args.iter().map(String::as_str).collect();
    fetch(&names)
}

/// Fetches (or finds cached) the known models called `names`, in order,
/// printing `<name>: <path>` for each.
pub fn fetch(names: &[&str]) -> anyhow::Result<()> {
    // Every name is checked before the first (slow) download starts.
    let models = names
        .iter()
        .map(|name| hub::known_model(name))
        .collect::<Result<Vec<_>, _>>()?;
    for model in models {
        let path = hub::fetch_model(model).with_context(|| format!("fetching {}", model.name))?;
        println!("{}: {}", model.name, path.display());
    }
    Ok(())
}
